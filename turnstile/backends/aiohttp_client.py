"""The real backend client: `Backend` over aiohttp, with every timeout explicit.

aiohttp is used rather than httpx because it costs a fraction of the CPU per request for
this relay job and does not degrade as the pool grows (see the benchmark notes in
docs/). Every aiohttp and socket exception is translated here into the `turnstile.errors`
hierarchy; the four limits are `turnstile.backends.protocol.Timeouts`. A backend URL may
carry credentials (`http://user:password@host`): they are used for the requests only, and
`base_url`, which names the backend in errors, logs, `/stats` and the `backend` column, has
them redacted (`redact_url`).
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping

import aiohttp

from turnstile.backends.protocol import BackendResponse, Timeouts
from turnstile.errors import BackendError, BackendTimeout, BackendUnreachable
from turnstile.limits import MAX_PASSTHROUGH_BODY_BYTES

# Read granularity for streamed bodies: large enough to take a burst of SSE events in
# one read, small enough not to delay a single event.
READ_CHUNK_BYTES = 64 * 1024

# Above this size a body goes through `_BodyInMemory` (aiohttp's threshold for its warning).
_LARGE_BODY_BYTES = aiohttp.payload.TOO_LARGE_BYTES_BODY


class _BodyInMemory(aiohttp.payload.Payload):
    """A request body Turnstile already holds whole, written in one transport write.

    aiohttp's own `BytesPayload` warns (`ResourceWarning`) above 1 MiB that raw bytes
    "might lock the event loop"; a proxy that has the body in memory already loses nothing
    by handing it to the transport, which buffers what the socket does not take at once.
    Screenshot rollouts send tens of MiB of inline images per call, so the warning would
    fire on every one of them (and is an error under `-W error`).
    """

    _value: bytes

    def __init__(self, value: bytes) -> None:
        super().__init__(value, content_type="application/octet-stream")
        self._size = len(value)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self._value.decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self._value

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        await writer.write(self._value)

    async def write_with_length(
        self, writer: aiohttp.abc.AbstractStreamWriter, content_length: int | None
    ) -> None:
        end = len(self._value) if content_length is None else content_length
        await writer.write(self._value[:end])


def _credentials(url: str) -> tuple[str, ...]:
    """What of the URL's credentials must not be shown: the whole user-info part and the
    password, raw and percent-decoded, longest first (the user name alone is no secret)."""
    parts = urllib.parse.urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    found = {v for v in (userinfo, parts.password) if v}
    found |= {urllib.parse.unquote(v) for v in found}
    return tuple(sorted(found, key=len, reverse=True))


def redact_url(url: str) -> str:
    """``url`` with its credentials replaced by ``***`` (``http://***@host:8000``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{host}"))


class _AiohttpResponse:
    __slots__ = (
        "_deadline",
        "_resp",
        "_timeouts",
        "failover_from",
        "headers",
        "served_by",
        "status",
    )

    def __init__(self, resp: aiohttp.ClientResponse, timeouts: Timeouts, deadline: float) -> None:
        self._resp = resp
        self._timeouts = timeouts
        self._deadline = deadline
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers
        self.served_by: str | None = None  # one backend: no pool member to name
        self.failover_from: str | None = None

    def _total_exceeded(self) -> BackendTimeout:
        return BackendTimeout(
            f"backend call exceeded the total timeout of {self._timeouts.total_s:g} s"
        )

    def _budget(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._total_exceeded()
        return min(self._timeouts.idle_s, remaining)

    async def read(self) -> bytes:
        parts: list[bytes] = []
        size = 0
        async for chunk in self.iter_chunks():
            parts.append(chunk)
            size += len(chunk)
            if size > MAX_PASSTHROUGH_BODY_BYTES:
                self.close()
                raise BackendError(f"backend response exceeded {MAX_PASSTHROUGH_BODY_BYTES} bytes")
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        content = self._resp.content
        while True:
            budget = self._budget()
            try:
                async with asyncio.timeout(budget):
                    chunk = await content.readany()
            except TimeoutError as exc:
                if budget < self._timeouts.idle_s:  # the total deadline, not the idle one
                    raise self._total_exceeded() from exc
                raise BackendTimeout(
                    f"backend sent nothing for {budget:g} s (idle timeout)"
                ) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise BackendError(f"backend connection failed mid-response: {exc!r}") from exc
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self._resp.close()


class AiohttpBackend:
    """The real backend client: one keep-alive pool per backend URL."""

    def __init__(
        self,
        base_url: str,
        timeouts: Timeouts,
        *,
        pool_size: int,
        api_key: str | None = None,
        unix_socket: str | None = None,
    ) -> None:
        self._url = base_url.rstrip("/")  # with its credentials, for requests only
        self.base_url = redact_url(self._url)
        self._secrets = _credentials(self._url)
        self._unix_socket = unix_socket  # a local peer (another worker), not TCP
        self._timeouts = timeouts
        self._pool_size = pool_size
        self._auth = f"Bearer {api_key}" if api_key else None
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector: aiohttp.BaseConnector
            if self._unix_socket is not None:
                connector = aiohttp.UnixConnector(self._unix_socket, limit=self._pool_size)
            else:
                connector = aiohttp.TCPConnector(
                    limit=self._pool_size, ttl_dns_cache=300, enable_cleanup_closed=True
                )
            self._session = aiohttp.ClientSession(
                connector=connector,
                # Timeouts are enforced per phase below; aiohttp's own are only a backstop.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeouts.connect_s),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def request(
        self, method: str, path: str, body: bytes | None, headers: Mapping[str, str]
    ) -> BackendResponse:
        url = self._url + path
        out_headers = dict(headers)
        # Answers are relayed and decoded as they come (auto_decompress is off): ask for
        # them uncompressed, unless the caller (a passthrough client) chose an encoding.
        if not any(name.lower() == "accept-encoding" for name in out_headers):
            out_headers["Accept-Encoding"] = "identity"
        if self._auth is not None:
            out_headers["Authorization"] = self._auth
        deadline = time.monotonic() + self._timeouts.total_s
        first_byte = min(self._timeouts.first_byte_s, self._timeouts.total_s)
        session = self._get_session()
        data = body if body is None or len(body) <= _LARGE_BODY_BYTES else _BodyInMemory(body)
        try:
            async with asyncio.timeout(first_byte):
                resp = await session.request(method, url, data=data, headers=out_headers)
        except TimeoutError as exc:
            raise BackendTimeout(
                f"backend {self.base_url} did not answer within {first_byte:g} s"
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise BackendUnreachable(
                f"backend {self.base_url} is unreachable: {exc.os_error}"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            detail = self._scrub(repr(exc))
            raise BackendUnreachable(f"backend {self.base_url} failed: {detail}") from None
        return _AiohttpResponse(resp, self._timeouts, deadline)

    def _scrub(self, text: str) -> str:
        """``text`` (an exception's repr, which may quote the URL) without the credentials."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
