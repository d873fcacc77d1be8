"""Many backends behind the `Backend` seam: sticky routing, health checks, fail-over.

`BackendPool` holds one or more groups of backends, one group per served model name
(plus a default group for requests naming no configured model). Within a group:

- **Affinity.** A call that belongs to a rollout (`affinity`, by default the rollout id
  the proxy puts in `turnstile.backends.protocol.ROLLOUT_AFFINITY`) goes to
  the backend that consistent hashing on the rollout id picks, so every turn of a
  rollout lands on the engine whose prefix cache already holds its history, and adding
  or losing one backend moves only that backend's share of rollouts. The first backend
  that serves a rollout is remembered (its *home*); later turns go there as long as it
  is up, even after an ejected backend comes back and takes its hash range again.
- **Health.** Every backend's `/health` is probed every `HEALTH_INTERVAL_S`;
  `EJECT_AFTER_FAILURES` failed probes in a row eject it, `RETURN_AFTER_SUCCESSES`
  good ones bring it back. A connection that cannot be opened (`BackendUnreachable`)
  ejects the backend at once.
- **Fail-over only on death.** A call moves to another backend only when its backend is
  ejected or cannot be connected to, never because it is slow, answered an error
  status, or broke mid-response (the generation may have happened: a retry would
  sample twice). A moved call is recorded with the backend it left
  (`BackendResponse.failover_from`), and the rollout's home becomes the new backend.

When every backend of a group is ejected, they are still tried in ring order (health
checks can lag behind a recovery); only when none can be connected to does the call
fail with `BackendUnreachable`.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass

import orjson

from turnstile.backends.protocol import ROLLOUT_AFFINITY, Backend, BackendResponse
from turnstile.errors import BackendUnreachable, TurnstileError

log = logging.getLogger("turnstile.pool")

# A probe every 2 s notices a dead engine within a few seconds without adding load
# worth measuring (one tiny GET per backend).
HEALTH_INTERVAL_S = 2.0
# vLLM and SGLang answer /health in milliseconds even under full load; 2 s of silence
# means the server is gone or wedged.
HEALTH_TIMEOUT_S = 2.0
# Two failures in a row: one lost probe (a GC pause, a full accept queue) is not death.
EJECT_AFTER_FAILURES = 2
# Two good probes in a row before traffic returns, so a crash-looping engine is not
# handed rollouts between crashes.
RETURN_AFTER_SUCCESSES = 2
# Points per backend on the hash ring: with 64, shares stay within about 20% of even
# for a handful of backends, and a lookup is one bisect over a few hundred points.
RING_POINTS_PER_BACKEND = 64
# Rollout homes remembered (least recently used dropped first); a forgotten rollout
# falls back to its hash, which is its home unless a backend died meanwhile.
MAX_REMEMBERED_ROLLOUTS = 200_000
HEALTH_PATH = "/health"


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(slots=True)
class Member:
    """One backend of a group and what the pool knows about its health."""

    backend: Backend
    url: str
    healthy: bool = True
    failures: int = 0
    successes: int = 0
    ejections: int = 0

    def eject(self, reason: str) -> None:
        if self.healthy:
            self.healthy = False
            self.ejections += 1
            log.warning("backend %s ejected: %s", self.url, reason)
        self.failures = max(self.failures, EJECT_AFTER_FAILURES)
        self.successes = 0

    def probe_result(self, ok: bool, reason: str = "") -> None:
        if ok:
            self.failures = 0
            self.successes += 1
            if not self.healthy and self.successes >= RETURN_AFTER_SUCCESSES:
                self.healthy = True
                log.info("backend %s is healthy again: returned to the pool", self.url)
        else:
            self.successes = 0
            self.failures += 1
            if self.failures >= EJECT_AFTER_FAILURES:
                self.eject(reason or f"{self.failures} failed health checks")


class HashRing:
    """Consistent hashing of keys onto members."""

    def __init__(self, members: Sequence[Member]) -> None:
        points = sorted(
            (_point(f"{m.url}#{i}"), n)
            for n, m in enumerate(members)
            for i in range(RING_POINTS_PER_BACKEND)
        )
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self._members = list(members)

    def order(self, key: str) -> list[Member]:
        """Every member once, in ring order from `key`'s position."""
        start = bisect.bisect(self._keys, _point(key)) % len(self._keys)
        seen: list[int] = []
        for owner in itertools.chain(self._owners[start:], self._owners[:start]):
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self._members):
                    break
        return [self._members[n] for n in seen]


class Group:
    """The backends serving one model name."""

    def __init__(self, name: str | None, backends: Sequence[Backend]) -> None:
        if not backends:
            raise ValueError(f"backend group {name!r} has no backends")
        self.name = name
        self.members = [Member(b, b.base_url) for b in backends]
        self.ring = HashRing(self.members)
        self.homes: OrderedDict[str, Member] = OrderedDict()
        self._next = itertools.count()

    def candidates(self, affinity: str | None) -> tuple[list[Member], Member | None]:
        """Members to try, in order, and the rollout's remembered home (if any)."""
        if affinity is None:
            n = next(self._next) % len(self.members)
            order = self.members[n:] + self.members[:n]
            home = None
        else:
            order = self.ring.order(affinity)
            home = self.homes.get(affinity)
            if home is not None:
                self.homes.move_to_end(affinity)
                order = [home] + [m for m in order if m is not home]
        healthy = [m for m in order if m.healthy]
        return healthy + [m for m in order if not m.healthy], home

    def remember(self, affinity: str, member: Member) -> None:
        self.homes[affinity] = member
        self.homes.move_to_end(affinity)
        while len(self.homes) > MAX_REMEMBERED_ROLLOUTS:
            self.homes.popitem(last=False)


class PoolResponse:
    """A backend's response, with which backend served it and which one it left."""

    def __init__(self, inner: BackendResponse, served_by: str, failover_from: str | None) -> None:
        self._inner = inner
        self.status = inner.status
        self.headers: Mapping[str, str] = inner.headers
        self.served_by: str | None = served_by
        self.failover_from: str | None = failover_from

    async def read(self) -> bytes:
        return await self._inner.read()

    def iter_chunks(self) -> AsyncIterator[bytes]:
        return self._inner.iter_chunks()

    def close(self) -> None:
        self._inner.close()


class BackendPool:
    """Routes each call to one backend of the group serving its model."""

    def __init__(
        self,
        groups: Mapping[str | None, Sequence[Backend]],
        *,
        health_interval_s: float = HEALTH_INTERVAL_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
    ) -> None:
        if not groups:
            raise ValueError("a backend pool needs at least one backend")
        self.groups = {name: Group(name, backends) for name, backends in groups.items()}
        self.default = self.groups.get(None) or next(iter(self.groups.values()))
        self.base_url = self.default.members[0].url
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.failovers = 0
        self._health: asyncio.Task[None] | None = None

    def members(self) -> Iterator[Member]:
        for group in self.groups.values():
            yield from group.members

    def _group(self, body: bytes | None) -> Group:
        if len(self.groups) == 1 or not body:
            return self.default
        try:
            model = orjson.loads(body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            return self.default
        return self.groups.get(model, self.default) if isinstance(model, str) else self.default

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        affinity: str | None = None,
    ) -> BackendResponse:
        if affinity is None:
            affinity = ROLLOUT_AFFINITY.get()
        group = self._group(body)
        order, home = group.candidates(affinity)
        errors: list[str] = []
        for member in order:
            try:
                resp = await member.backend.request(method, path, body, headers)
            except BackendUnreachable as exc:
                member.eject(exc.message)
                errors.append(exc.message)
                continue
            left = home.url if home is not None and home is not member else None
            if left is not None:
                self.failovers += 1
                log.warning(
                    "rollout %s moved from dead backend %s to %s", affinity, left, member.url
                )
            if affinity is not None:
                group.remember(affinity, member)
            return PoolResponse(resp, member.url, left)
        which = f"model {group.name!r}" if group.name else "the default group"
        raise BackendUnreachable(f"no backend of {which} can be reached: {'; '.join(errors)}")

    # -- health --------------------------------------------------------------------
    async def check_once(self) -> None:
        """Probe every backend once (concurrently) and update its health."""
        await asyncio.gather(*(self._probe(m) for m in self.members()))

    async def _probe(self, member: Member) -> None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.health_timeout_s):
                resp = await member.backend.request("GET", HEALTH_PATH, None, {})
                try:
                    await resp.read()
                finally:
                    resp.close()
            ok, reason = resp.status < 400, f"/health answered {resp.status}"
        except TimeoutError:
            ok, reason = False, f"/health did not answer within {self.health_timeout_s:g} s"
        except TurnstileError as exc:
            ok, reason = False, exc.message
        log.debug("probed %s in %.3f s: %s", member.url, time.monotonic() - started, ok)
        member.probe_result(ok, reason)

    async def _health_loop(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.health_interval_s)

    def start(self) -> None:
        """Start the health checks (inside the running event loop)."""
        if self._health is None:
            self._health = asyncio.ensure_future(self._health_loop())

    def stats(self) -> dict[str, object]:
        return {
            "failovers": self.failovers,
            "backends": {
                m.url: {"healthy": m.healthy, "ejections": m.ejections} for m in self.members()
            },
        }

    async def aclose(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
            self._health = None
        for member in self.members():
            await member.backend.aclose()
