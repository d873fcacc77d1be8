"""Several worker processes on one port, each rollout owned by exactly one of them.

`turnstile serve --workers N` runs N processes (`turnstile.server.supervisor`) that all accept
on the same port (SO_REUSEPORT: the kernel spreads connections over them). Rollout
state (turns waiting to be stitched, rewards, seals) lives in one process: worker
`owner_of(rollout_id, N)`, a stable hash. `WorkerRouter`, the outermost ASGI layer of
each worker, sends every request that names a rollout owned by another worker to that
worker over its Unix socket, unchanged (the owner authenticates it), and relays the
answer back, streams included. Rollouts created without an id, and the one-call
rollouts of requests that name none, get ids this worker owns, so they never move.
`POST /admin/policy_version` is applied here and then on every other worker.

Each worker journals to `<output>/journal/w<i>` and writes shards with writer id
`<writer_id>-w<i>`, so workers never share a file. `/health` and `/stats` describe the
worker that answers (`worker` says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnstile.backends.aiohttp_client import AiohttpBackend
from turnstile.backends.protocol import Backend, BackendResponse, Timeouts
from turnstile.errors import Overloaded, TurnstileError
from turnstile.server.asgi import read_body, send_error

log = logging.getLogger("turnstile.workers")

# Environment of a worker process, set by the supervisor (not user settings).
ENV_INDEX: Final[str] = "TURNSTILE_WORKER_INDEX"
ENV_RUNDIR: Final[str] = "TURNSTILE_WORKER_RUNDIR"
# Connections kept open to each peer worker: one per concurrently forwarded call.
PEER_POOL_SIZE: Final[int] = 1024
# A peer that does not accept within this long is down (the supervisor restarts it).
PEER_CONNECT_TIMEOUT_S: Final[float] = 2.0
# Broadcasting the policy version to a peer: a local call that answers in milliseconds.
BROADCAST_TIMEOUT_S: Final[float] = 10.0

_ROLLOUT_PATH: Final[re.Pattern[str]] = re.compile(r"^/rollouts/(?P<id>[^/]+)(?:/.*)?$")
_HOP_BY_HOP: Final[frozenset[bytes]] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
_ROLLOUT_HEADER: Final[bytes] = b"x-turnstile-rollout"
# Set on the copies of a policy-version change sent to the other workers.
_BROADCAST_HEADER: Final[str] = "x-turnstile-worker-broadcast"


def owner_of(rollout_id: str, workers: int) -> int:
    """The worker that owns a rollout: stable across processes and restarts."""
    digest = hashlib.blake2b(rollout_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % workers


def id_factory(index: int, workers: int) -> Callable[[], str]:
    """New rollout ids that worker `index` owns (N tries on average)."""

    def new_id() -> str:
        while True:
            rid = uuid.uuid4().hex
            if owner_of(rid, workers) == index:
                return rid

    return new_id


def socket_path(rundir: Path, index: int) -> Path:
    return rundir / f"w{index}.sock"


def peer_clients(spec: WorkerSpec, timeouts: Timeouts) -> dict[int, Backend]:
    """HTTP clients for the other workers' Unix sockets (the owner closes them)."""
    peer_timeouts = Timeouts(
        min(PEER_CONNECT_TIMEOUT_S, timeouts.connect_s),
        timeouts.first_byte_s,
        timeouts.idle_s,
        timeouts.total_s,
    )
    return {
        i: AiohttpBackend(
            f"http://turnstile-worker-{i}",
            peer_timeouts,
            pool_size=PEER_POOL_SIZE,
            unix_socket=str(socket_path(spec.rundir, i)),
        )
        for i in range(spec.count)
        if i != spec.index
    }


class WorkerRouter:
    """Forwards requests for rollouts owned by other workers (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, *, spec: WorkerSpec, peers: dict[int, Backend], max_body: int
    ) -> None:
        self.app = app
        self.index = spec.index
        self.workers = spec.count
        self.peers = peers
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path == "/rollouts":
            await self._create(scope, receive, send)
            return
        if (
            method == "POST"
            and path == "/admin/policy_version"
            and not any(name == _BROADCAST_HEADER.encode() for name, _ in scope["headers"])
        ):
            await self._broadcast(scope, receive, send)
            return
        owner = self._owner(scope)
        if owner is None or owner == self.index:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._body(scope, receive)
        except TurnstileError as exc:
            await send_error(send, exc)
            return
        await self._forward(owner, scope, body, receive, send)

    def _owner(self, scope: Scope) -> int | None:
        match = _ROLLOUT_PATH.match(scope["path"])
        if match is not None:
            return owner_of(match["id"], self.workers)
        if scope["path"].startswith("/v1/"):
            for name, value in scope["headers"]:
                if name == _ROLLOUT_HEADER:
                    return owner_of(value.decode("latin-1"), self.workers)
        return None

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
        return await read_body(receive, declared, self.max_body)

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._body(scope, receive)
        except TurnstileError as exc:
            await send_error(send, exc)
            return
        rid = None
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(body) if body else None
            if isinstance(parsed, dict) and isinstance(parsed.get("rollout_id"), str):
                rid = parsed["rollout_id"]
        owner = owner_of(rid, self.workers) if rid else self.index
        if owner != self.index:
            await self._forward(owner, scope, body, receive, send)
        else:
            await self.app(scope, _refeed(body, receive), send)

    async def _broadcast(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._body(scope, receive)
        except TurnstileError as exc:
            await send_error(send, exc)
            return
        started: list[Message] = []  # this worker's answer, held until the peers have it
        pending: list[Message] = []

        async def hold(message: Message) -> None:
            (started if message["type"] == "http.response.start" else pending).append(message)

        await self.app(scope, _refeed(body, receive), hold)
        ok = bool(started) and started[0]["status"] < 300
        if ok:
            headers = {**_forward_headers(scope), _BROADCAST_HEADER: "1"}
            for i, peer in self.peers.items():
                try:
                    async with asyncio.timeout(BROADCAST_TIMEOUT_S):
                        resp = await peer.request("POST", "/admin/policy_version", body, headers)
                        await resp.read()
                        resp.close()
                except (TurnstileError, TimeoutError) as exc:
                    err = Overloaded(
                        f"the policy version was set on worker {self.index} but worker {i} "
                        f"did not take it ({exc}); retry",
                        retry_after_s=1,
                    )
                    await send_error(send, err)
                    return
                if resp.status >= 300:
                    log.error("worker %d refused the policy version: %d", i, resp.status)
        for message in started + pending:
            await send(message)

    async def _forward(
        self, owner: int, scope: Scope, body: bytes, receive: Receive, send: Send
    ) -> None:
        path = scope["path"] + (
            ("?" + scope["query_string"].decode("latin-1")) if scope.get("query_string") else ""
        )
        try:
            resp = await self.peers[owner].request(
                scope["method"], path, body or None, _forward_headers(scope)
            )
        except TurnstileError as exc:
            await send_error(
                send,
                Overloaded(
                    f"worker {owner}, which owns this rollout, is unavailable: {exc.message}",
                    retry_after_s=1,
                ),
            )
            return
        relay = asyncio.ensure_future(self._relay(resp, send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if relay not in done:
                relay.cancel()  # the client went away: closing cancels it at the owner too
            with contextlib.suppress(asyncio.CancelledError, OSError, TurnstileError):
                await relay
        finally:
            watcher.cancel()
            resp.close()

    @staticmethod
    async def _relay(resp: BackendResponse, send: Send) -> None:
        headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1"))
            for k, v in resp.headers.items()
            if k.lower().encode("latin-1") not in _HOP_BY_HOP
        ]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        async for chunk in resp.iter_chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _forward_headers(scope: Scope) -> dict[str, str]:
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in scope["headers"]
        if name not in _HOP_BY_HOP
    }


def _refeed(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields `body` once, then waits on the real one (disconnects)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Which worker this process is, of how many, and where their sockets are."""

    index: int
    count: int
    rundir: Path

    @property
    def suffix(self) -> str:
        return f"w{self.index}"


def worker_env(count: int) -> WorkerSpec | None:
    """This process's place when the supervisor started it as one of `count` workers."""
    index, rundir = os.environ.get(ENV_INDEX), os.environ.get(ENV_RUNDIR)
    if index is None or rundir is None:
        return None
    return WorkerSpec(int(index), count, Path(rundir))
