"""Weight-update fences: what happens to calls while the trainer pushes new weights.

Around a weight push the trainer calls `POST /admin/pause {"mode": ...}`, pushes the
weights to the backend, then `POST /admin/resume {"policy_version": N}`:

- `pause`: new calls wait at the fence; calls in flight finish under the old weights;
  `/admin/pause` answers once none is in flight, so no turn mixes two versions.
- `abort`: new calls wait; calls in flight are cut at once. A stream's partial tokens
  are recorded as an `aborted` turn and the harness gets an error event it can retry; a
  whole answer not yet read is recorded `aborted` and the client gets 503 with
  Retry-After.
- `keep` (`POST /admin/policy_version`, no fence): nothing waits; calls in flight go
  on, and the tokens a stream receives after the switch carry the new version (the
  turn's `policy_version_spans`; a whole call is flagged `policy_switch_unlocated`).

`POST /admin/policy_version {"policy_version": N, "mode": "pause"|"abort"}` is the
one-call form of a fence: close it, wait for the calls in flight (or cut them), switch,
open it. It brackets no weight push, so it fits a push the backend applies between
requests on its own; a trainer that pushes the weights itself uses the around-the-push
form (`/admin/pause`, push, `/admin/resume`), the only one where no token is sampled by
weights other than its recorded version.

With `backend_pause` set, the proxy also drives the engines' own pause and resume
(`turnstile.backends.control`: vLLM's `/pause` and `/resume`, SGLang's
`/pause_generation` and `/continue_generation`, every replica of a pool), so the engines
themselves stop between the fence and the resume.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final, Literal

from turnstile.errors import Conflict, Overloaded

FenceMode = Literal["pause", "abort"]
# `POST /admin/policy_version`'s modes: `keep` (no fence) or a fence's, in one call.
SwitchMode = Literal["keep", "pause", "abort"]

# A new call waits this long at a closed fence, then gets 503 with Retry-After: longer
# than a weight push (seconds to a few minutes), shorter than the clients' own timeouts.
FENCE_WAIT_TIMEOUT_S: Final[float] = 600.0
# `pause`: calls in flight get this long to finish before /admin/pause answers 503 (the
# fence stays closed; the trainer may ask again or resume).
FENCE_DRAIN_TIMEOUT_S: Final[float] = 300.0
# A cut or refused call is retried after this long: the push is then usually done.
FENCE_RETRY_AFTER_S: Final[int] = 5


class Fence:
    """Open (calls pass) or closed for a weight update (calls wait)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.mode: FenceMode | None = None
        self.closed_at: float | None = None  # time.monotonic()
        self.waiting = 0  # calls waiting at the fence now
        self.aborted = 0  # calls cut by `abort` fences, in all

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    def close(self, mode: FenceMode) -> None:
        if self.closed:
            if mode != self.mode:
                raise Conflict(
                    f"a weight update in mode {self.mode!r} is under way: POST /admin/resume first",
                    param="mode",
                )
            return
        self.mode, self.closed_at = mode, time.monotonic()
        self._open.clear()

    def open(self) -> float:
        """Let calls through again; how long the fence was closed."""
        if not self.closed:
            raise Conflict("no weight update is under way (POST /admin/pause starts one)")
        assert self.closed_at is not None
        held = time.monotonic() - self.closed_at
        self.mode = self.closed_at = None
        self._open.set()
        return held

    async def pass_through(self) -> None:
        """Return at once while open; else wait (bounded) for the resume."""
        if not self.closed:
            return
        self.waiting += 1
        try:
            await asyncio.wait_for(self._open.wait(), FENCE_WAIT_TIMEOUT_S)
        except TimeoutError:
            raise Overloaded(
                f"the weights are being updated and the update took over "
                f"{FENCE_WAIT_TIMEOUT_S:.0f} s; retry shortly",
                retry_after_s=FENCE_RETRY_AFTER_S,
            ) from None
        finally:
            self.waiting -= 1

    def summary(self) -> dict[str, object]:
        return {
            "closed": self.closed,
            "mode": self.mode,
            "closed_for_s": None if self.closed_at is None else time.monotonic() - self.closed_at,
            "waiting": self.waiting,
            "aborted": self.aborted,
        }
