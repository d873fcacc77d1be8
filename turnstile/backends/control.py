"""Pausing and resuming the inference engines around a weight push: one seam, two dialects.

With `backend_pause` set, the proxy's fence (`turnstile.proxy.fencing`) also stops the
engines themselves, so that nothing, including clients that do not go through
Turnstile, samples while the trainer pushes weights. The engines name this differently:

- vLLM 0.32 (its development routes, `VLLM_SERVER_DEV_MODE=1`): `POST /pause?mode=wait`
  (finish what runs, start nothing new) or `mode=abort` (stop what runs), then
  `POST /resume`;
- SGLang (`http_server.py`): `POST /pause_generation {"mode": "retract"}` (stop sampling;
  running requests go back to the waiting queue and their KV cache may be flushed, so
  they are recomputed with the new weights after the push) or `{"mode": "abort"}`, then
  `POST /continue_generation {}`. Its third mode, `in_place`, keeps the old KV cache and
  makes a cache flush fail, so it is not used for a weight push.

`EngineControl` is the seam; `engine_control(backend)` picks the dialect of each backend
(for `backend_kind: auto`, at the first pause, as the adapter detects it) and, for a
pool, drives every member: a weight push changes every replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final, Literal, Protocol

import orjson

from turnstile.backends.pool import BackendPool
from turnstile.backends.protocol import Backend, read_error
from turnstile.backends.sglang import AutoKindBackend, SGLangBackend
from turnstile.errors import BackendError

# Turnstile's fence modes that stop an engine: `pause` (Turnstile's calls have finished
# when the engine is paused) and `abort` (Turnstile's calls were just cut).
EnginePauseMode = Literal["pause", "abort"]

VLLM_PAUSE_MODES: Final[dict[str, str]] = {"pause": "wait", "abort": "abort"}
SGLANG_PAUSE_MODES: Final[dict[str, str]] = {"pause": "retract", "abort": "abort"}
_JSON: Final[dict[str, str]] = {"Content-Type": "application/json"}


class EngineControl(Protocol):
    """Stops and restarts sampling on the backend's engines."""

    async def pause(self, mode: EnginePauseMode) -> None: ...

    async def resume(self) -> None: ...


async def _post(backend: Backend, path: str, body: bytes, headers: dict[str, str]) -> None:
    """POST a control call; a refusal is the backend's error (502 upward)."""
    resp = await backend.request("POST", path, body, headers)
    try:
        if resp.status >= 400:
            raise await read_error(resp)
        await resp.read()
    finally:
        resp.close()


class VLLMControl:
    """vLLM's `/pause` and `/resume`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def pause(self, mode: EnginePauseMode) -> None:
        await _post(self.backend, f"/pause?mode={VLLM_PAUSE_MODES[mode]}", b"", {})

    async def resume(self) -> None:
        await _post(self.backend, "/resume", b"", {})


class SGLangControl:
    """SGLang's `/pause_generation` and `/continue_generation`."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def pause(self, mode: EnginePauseMode) -> None:
        body = orjson.dumps({"mode": SGLANG_PAUSE_MODES[mode]})
        await _post(self.backend, "/pause_generation", body, _JSON)

    async def resume(self) -> None:
        await _post(self.backend, "/continue_generation", b"{}", _JSON)


class AutoControl:
    """The dialect of a `backend_kind: auto` backend, as its adapter detected it."""

    def __init__(self, backend: AutoKindBackend) -> None:
        self.backend = backend

    async def _control(self) -> EngineControl:
        await self.backend.resolve()
        if self.backend.kind == "sglang":
            return SGLangControl(self.backend.inner)
        return VLLMControl(self.backend.inner)

    async def pause(self, mode: EnginePauseMode) -> None:
        await (await self._control()).pause(mode)

    async def resume(self) -> None:
        await (await self._control()).resume()


class BroadcastControl:
    """Every engine of a pool, driven at once; the first failure is raised once all have
    answered (the others are then paused or resumed all the same)."""

    def __init__(self, controls: Sequence[EngineControl]) -> None:
        self.controls = list(controls)

    async def _all(self, calls: Sequence[asyncio.Future[None]]) -> None:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, BackendError):
                raise failure
        if failures:
            raise failures[0]

    async def pause(self, mode: EnginePauseMode) -> None:
        await self._all([asyncio.ensure_future(c.pause(mode)) for c in self.controls])

    async def resume(self) -> None:
        await self._all([asyncio.ensure_future(c.resume()) for c in self.controls])


def engine_control(backend: Backend) -> EngineControl:
    """The control of `backend`'s engines, in the dialect each speaks."""
    if isinstance(backend, BackendPool):
        return BroadcastControl([engine_control(m.backend) for m in backend.members()])
    if isinstance(backend, SGLangBackend):
        return SGLangControl(backend.inner)
    if isinstance(backend, AutoKindBackend):
        return AutoControl(backend)
    return VLLMControl(backend)
