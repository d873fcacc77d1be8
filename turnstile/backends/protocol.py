"""The backend seam: the small Protocol the proxy depends on to talk to vLLM or SGLang.

`Backend` sends one HTTP request and returns a `BackendResponse` once its headers are in;
implementations translate every foreign exception into the `turnstile.errors` hierarchy.
The real client is `turnstile.backends.aiohttp_client.AiohttpBackend`; the pool, the SGLang
adapter and the test fakes implement the same protocol. `Timeouts` are the four explicit
limits every implementation honours:

- connect: opening the TCP connection;
- first byte: from sending the request until the response headers arrive;
- idle: between two body chunks;
- total: the whole call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from turnstile.errors import BackendError, BackendStatusError

# The rollout id of the completion call being sent (set by the proxy around
# `Backend.request`): the key a `turnstile.backends.pool.BackendPool` routes on. A context
# variable rather than a parameter, so every `Backend` keeps the same small signature.
ROLLOUT_AFFINITY: ContextVar[str | None] = ContextVar("turnstile_rollout_affinity", default=None)


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float
    first_byte_s: float
    idle_s: float
    total_s: float


class BackendResponse(Protocol):
    """An open response from the backend; the caller must `close()` it.

    `served_by` and `failover_from` are set by a pool (`turnstile.backends.pool`): the
    backend that answered, and the dead one the rollout was moved away from; both are
    None for a single backend. Adapters that wrap a response pass them on.
    """

    status: int
    headers: Mapping[str, str]
    served_by: str | None
    failover_from: str | None

    async def read(self) -> bytes:
        """The whole body (bounded by the idle and total timeouts)."""
        ...

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive."""
        ...

    def close(self) -> None:
        """Release the connection; closing before the end cancels the upstream request."""
        ...


class Backend(Protocol):
    """Something that answers OpenAI-compatible HTTP requests."""

    base_url: str

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        """Send a request and return once the response headers are in.

        The rollout a call belongs to is in `ROLLOUT_AFFINITY` while it is sent, so a
        pool of backends can keep a rollout on one engine (`turnstile.backends.pool`).
        Raises BackendUnreachable or BackendTimeout; never an aiohttp exception.
        """
        ...

    async def aclose(self) -> None: ...


async def read_error(resp: BackendResponse) -> BackendStatusError:
    """Read a failed response's body into the error that relays it."""
    try:
        body = await resp.read()
    except BackendError:
        body = b""
    finally:
        resp.close()
    return BackendStatusError(resp.status, body, resp.headers.get("Content-Type"))
