"""The serving logic: forward a completion call to the backend, relay its answer, record it.

`Proxy.complete` takes a client's raw request body, injects the recording fields,
forwards it, and returns either a whole body (`Relay`) or an async iterator of SSE bytes
(`StreamRelay`) that relays each backend event as it arrives. Every call ends in exactly
one recorded turn per choice, with status `ok`, `aborted` (stream cut: backend died,
client left, shutdown) or `error` (refused, unreachable, timed out). A turn is handed to
the recorder before the client gets the end of the response (the JSON body or `[DONE]`).

Everything the proxy works with comes in through its constructor: the backend (TITO mode
and pools are `Backend` wrappers around the real one), the recorder, the journal
(`TurnJournal`), the id factory of rollouts the client did not name, and the observers
told of each finished call (`on_turn`, the metrics) and of each sealed rollout
(`on_seal`). State changes from outside go through named methods: `restore` (what the
journal held at start-up), `set_policy_version` and `start_draining`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from turnstile.backends.control import EngineControl
from turnstile.backends.protocol import ROLLOUT_AFFINITY, Backend, BackendResponse, read_error
from turnstile.errors import (
    BackendError,
    BackendValueError,
    BadRequest,
    Conflict,
    Overloaded,
    TurnstileError,
    Unprocessable,
)
from turnstile.journal.codec import PolicyVersionSet
from turnstile.journal.rebuild import Rebuilt
from turnstile.journal.turns import TurnJournal
from turnstile.journal.wal import JournalError
from turnstile.jsontext import json_text
from turnstile.limits import MAX_JSON_DEPTH, MAX_OPEN_ROLLOUT_BYTES, MAX_ROLLOUT_BYTES
from turnstile.output.recorder import Recorder, SealJob
from turnstile.output.stitch import RolloutInfo
from turnstile.proxy.admission import Admission
from turnstile.proxy.assemble import WholeAnswer
from turnstile.proxy.capture import (
    CHAT,
    CapturePlan,
    ResponseCapture,
    plan_request,
    sampling_params,
)
from turnstile.proxy.capture import validate_request as validate
from turnstile.proxy.fencing import (
    FENCE_DRAIN_TIMEOUT_S,
    FENCE_RETRY_AFTER_S,
    Fence,
    FenceMode,
    SwitchMode,
)
from turnstile.proxy.media import MediaPolicy, RequestImages, collect_images, locate_images
from turnstile.proxy.retries import Answer, AnswerCache, answer_key, is_retry
from turnstile.proxy.rollouts import Rollout, RolloutRegistry
from turnstile.proxy.sse import DONE, SSEError, SSEEvent, SSEParser, encode_data
from turnstile.proxy.tokens import read_answer, scan, scan_chunk
from turnstile.records import (
    MediaBlob,
    RolloutStatus,
    Timings,
    TokenSource,
    TurnRecord,
    TurnStatus,
)

log = logging.getLogger("turnstile.proxy")

PATHS = {CHAT: "/v1/chat/completions", "completions": "/v1/completions"}
_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)
_SSE_TYPE = "text/event-stream"
_JSON = "application/json"

# Told the records of each finished call (one per choice), e.g. to count them.
TurnObserver = Callable[[Sequence[TurnRecord]], None]
# Told the id of each rollout handed over sealed, e.g. to drop state kept for it.
SealObserver = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Relay:
    """A whole response body for the client."""

    status: int
    content_type: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StreamRelay:
    """A streamed response: bytes to send as they come."""

    status: int
    content_type: str
    chunks: AsyncIterator[bytes]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Call:
    """One backend call in progress."""

    turn_id: str
    endpoint: str
    rollout: Rollout
    turn_index: int
    policy_version: int
    request: dict[str, Any]
    plan: CapturePlan
    received_at: float
    t0: float
    t_sent: float | None = None
    t_first: float | None = None
    done: bool = False
    answer_key: str | None = None
    seq: int = 0  # journal frame of the call's last record
    journal_error: JournalError | None = None
    served_by: str | None = None  # the backend of a pool that answered
    failover_from: str | None = None  # the dead backend the rollout was moved from
    context_faithful: bool | None = None  # TITO: the prompt is the template's rendering
    aborted: str | None = None  # why a weight-update fence cut the call
    capture: ResponseCapture | None = None
    images: RequestImages | None = None  # the request's images (chat calls with any)
    streamed: bool = False  # the backend streams (the client's stream, or stream_whole_calls)
    own_version: bool = False  # the client named the call's policy version itself
    # Policy switches while the call was in flight: (new version, tokens each choice had
    # received by then); a whole call cannot place them (`policy_switch_unlocated`).
    switches: list[tuple[int, dict[int, int]]] = field(default_factory=list)

    def note_switch(self, version: int) -> None:
        """The policy version changed now: tokens received from now on carry `version`."""
        if self.own_version or version == (
            self.switches[-1][0] if self.switches else self.policy_version
        ):
            return
        choices = {} if self.capture is None else self.capture.choices
        self.switches.append((version, {i: len(c.token_ids) for i, c in choices.items()}))

    def version_spans(self, choice: int, n_tokens: int) -> list[tuple[int, int]]:
        """(first token, version) runs of one choice's `n_tokens` completion tokens: a
        stream's tokens received after a switch carry its version; a whole call's all
        carry the version it began with."""
        spans = [(0, self.policy_version)]
        if not self.streamed:
            return spans
        for version, counts in self.switches:
            start = counts.get(choice, 0)
            if start >= n_tokens:
                break  # no token arrived after this switch (nor after any later one)
            if spans[-1][0] == start:
                spans[-1] = (start, version)  # no token under the previous version
            else:
                spans.append((start, version))
        merged = spans[:1]
        for start, version in spans[1:]:
            if version != merged[-1][1]:
                merged.append((start, version))
        return merged

    @property
    def headers(self) -> dict[str, str]:
        return {
            "X-Turnstile-Rollout": self.rollout.rollout_id,
            "X-Turnstile-Turn": str(self.turn_index),
        }


def _json_or_none(value: Any) -> str | None:
    return None if value is None else json_text(value)


class Proxy:
    def __init__(
        self,
        backend: Backend,
        recorder: Recorder,
        *,
        top_logprobs: int,
        policy_version: int,
        idle_timeout_s: float,
        journal: TurnJournal | None = None,
        new_rollout_id: Callable[[], str] | None = None,
        on_turn: TurnObserver | None = None,
        on_seal: SealObserver | None = None,
        max_rollout_bytes: int = MAX_ROLLOUT_BYTES,
        max_open_rollout_bytes: int = MAX_OPEN_ROLLOUT_BYTES,
        admission: Admission | None = None,
        engine: EngineControl | None = None,
        stream_whole_calls: bool = False,
        media: MediaPolicy | None = None,
    ) -> None:
        self.backend = backend
        self.media = media or MediaPolicy()
        self.fence = Fence()
        # The backend engines' own pause and resume (`backend_pause`), around a fence.
        self._engine = engine
        # Whole calls go upstream as streams (`turnstile.proxy.assemble`): a policy switch
        # then falls between two of their tokens.
        self._stream_whole_calls = stream_whole_calls
        self._live: dict[str, tuple[_Call, BackendResponse]] = {}  # calls being relayed
        self._calls: dict[str, _Call] = {}  # every call in flight, from admission to record
        self.admission = admission or Admission(None, 0, policy_version)
        self.recorder = recorder
        self.top_logprobs = top_logprobs
        self.journal = journal if journal is not None else TurnJournal()
        self._policy_version = policy_version
        self._policy_seq = 0  # the journal frame holding the policy version (0: none)
        self._on_turn = on_turn
        self._on_seal = on_seal
        self.registry = RolloutRegistry(
            self._hand_over_sealed,
            idle_timeout_s,
            self.journal.append,
            new_id=new_rollout_id,
            max_rollout_bytes=max_rollout_bytes,
            max_open_bytes=max_open_rollout_bytes,
            admit=self.admission.admit,
        )
        self._draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no call is in flight (nor work held back)
        self.idle.set()
        # Work for the recorder held back until the journal frame it comes from is written
        # (write-ahead order), oldest first: (that frame, the work's pin, the hand-over).
        self._unjournaled: deque[tuple[int, int | None, Callable[[], None]]] = deque()
        self._unjournaled_task: asyncio.Task[None] | None = None
        self._held_back = self._handed_over = 0  # work held back, and handed over since
        self._handed = asyncio.Condition()  # notified as held-back work is handed over
        self.answers = AnswerCache()

    # -- state ----------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The policy version of new turns (unless a call names its own)."""
        return self._policy_version

    @property
    def policy_seq(self) -> int:
        """The journal frame holding the policy version (0: none)."""
        return self._policy_seq

    @property
    def draining(self) -> bool:
        """True once shutting down: new calls are refused with 503."""
        return self._draining

    def start_draining(self) -> None:
        """Refuse new calls from now on; calls in flight finish (`idle` is set after)."""
        self._draining = True

    def restore(self, rebuilt: Rebuilt, *, restore_open: bool = True) -> None:
        """Take over what the journal held at start-up and the shards did not.

        Unpublished turns go to the recorder, sealed rollouts are stitched again, open
        rollouts are restored (or, with `restore_open` off, sealed as interrupted).
        Called before the journal is attached, so none of this is journaled again.
        """
        if not rebuilt.frames:
            return
        if rebuilt.policy_version is not None:
            self._policy_version, self._policy_seq = rebuilt.policy_version, rebuilt.policy_seq
            self.admission.restart_at(rebuilt.policy_version)
        if rebuilt.unpublished_turns:
            self.recorder.submit_turns(rebuilt.unpublished_turns, pin=rebuilt.unpublished_first_seq)
        for state in rebuilt.open_rollouts:
            self.registry.restore(state.rollout())
        if not restore_open:
            self.registry.seal_all(RolloutStatus.INTERRUPTED)
        for state in rebuilt.sealed_rollouts:
            self.hand_over(
                state.rollout(),
                skip_samples=rebuilt.published_samples_of(state.rollout_id),
                skip_rollout=state.rollout_id in rebuilt.published_rollouts,
            )
        log.info("%s", rebuilt.summary())

    # -- durability -------------------------------------------------------------------
    async def set_policy_version(self, version: int) -> int:
        """Make `version` the policy version of new turns, durably (it survives a crash).

        Calls in flight go on: the tokens a stream receives from now on carry `version`
        (`policy_version_spans`). Returns how many calls were in flight.
        """
        for call in self._calls.values():
            call.note_switch(version)
        in_flight = len(self._calls)
        seq = self.journal.append(PolicyVersionSet(version, time.time()))
        self._policy_version, self._policy_seq = version, seq
        self.admission.version_changed(version)
        await self.journal.durable(seq)
        return in_flight

    async def switch_policy_version(self, version: int, mode: SwitchMode) -> dict[str, Any]:
        """`POST /admin/policy_version`: switch to `version` in one call, in `mode`
        (`turnstile.proxy.fencing`): `keep` switches at once; `pause` and `abort` close
        the fence as `pause` does, switch, and open it again."""
        if mode == "keep":
            in_flight = await self.set_policy_version(version)
            log.info("policy version set to %d (keep, %d in flight)", version, in_flight)
            return {
                "policy_version": self.policy_version,
                "mode": mode,
                "in_flight_at_switch": in_flight,
                "aborted": 0,
                "drain_s": 0.0,
            }
        if self.fence.closed:
            raise Conflict(
                f"a weight update in mode {self.fence.mode!r} is under way "
                "(POST /admin/pause): end it with POST /admin/resume {policy_version}",
                param="mode",
            )
        paused = await self.pause(mode)
        resumed = await self.resume(version)
        return {
            "policy_version": resumed["policy_version"],
            "mode": mode,
            "in_flight_at_switch": paused["in_flight_at_pause"],
            "aborted": paused["aborted"],
            "drain_s": paused["drain_s"],
        }

    # -- weight updates ------------------------------------------------------------------
    async def pause(self, mode: FenceMode) -> dict[str, Any]:
        """Close the fence for a weight update (`turnstile.proxy.fencing`); returns once
        no call is in flight: the old weights have finished what they started."""
        started = time.monotonic()
        in_flight = self.in_flight
        self.fence.close(mode)
        cut = 0
        if mode == "abort":
            reason = "cut by a weight update (mode abort); retry the call"
            for call, resp in list(self._live.values()):
                if call.aborted is None:
                    call.aborted = reason
                    resp.close()
                    cut += 1
            self.fence.aborted += cut
        # `abort` stops the backend's generation at once (the calls were cut above);
        # `pause` lets Turnstile's own calls finish first, then pauses the engine for the
        # push, so that no call of ours can be left waiting inside a paused engine.
        if self._engine is not None and mode == "abort":
            await self._engine.pause(mode)
        try:
            await asyncio.wait_for(self.idle.wait(), FENCE_DRAIN_TIMEOUT_S)
        except TimeoutError:
            raise Overloaded(
                f"{self.in_flight} calls are still in flight after "
                f"{FENCE_DRAIN_TIMEOUT_S:.0f} s; the fence stays closed: ask again, or "
                "POST /admin/resume",
                retry_after_s=FENCE_RETRY_AFTER_S,
            ) from None
        if self._engine is not None and mode != "abort":
            await self._engine.pause(mode)
        log.info("paused for a weight update (%s): %d in flight, %d cut", mode, in_flight, cut)
        return {
            "paused": True,
            "mode": mode,
            "in_flight_at_pause": in_flight,
            "aborted": cut,
            "drain_s": time.monotonic() - started,
        }

    async def resume(self, version: int | None) -> dict[str, Any]:
        """Switch to `version` (if given), resume the backend, open the fence."""
        if not self.fence.closed:
            self.fence.open()  # raises Conflict: nothing to resume
        if version is not None:
            await self.set_policy_version(version)
        if self._engine is not None:
            await self._engine.resume()
        held = self.fence.open()
        log.info("resumed at policy version %d after %.2f s", self.policy_version, held)
        return {"policy_version": self.policy_version, "paused_s": held}

    def retention_floor(self) -> int:
        """The oldest journal frame still needed: by an open rollout, by work the writer
        has not published yet, or (past everything) the next frame to be appended."""
        floors = [self.journal.next_seq, self.registry.oldest_seq(), self.recorder.oldest_pin]
        floors += [pin for _, pin, _ in self._unjournaled]
        return min(f for f in floors if f is not None)

    async def _acknowledge(self, call: _Call) -> None:
        if call.journal_error is not None:
            raise call.journal_error
        await self.journal.durable(call.seq)

    # -- rollout hand-over -------------------------------------------------------------
    def _hand_over_sealed(self, rollout: Rollout) -> None:
        if self._on_seal is not None:
            self._on_seal(rollout.rollout_id)
        self.hand_over(rollout)

    def hand_over(
        self,
        rollout: Rollout,
        *,
        skip_samples: frozenset[int] = frozenset(),
        skip_rollout: bool = False,
    ) -> None:
        """Give a sealed rollout to the writer to stitch and publish."""
        info = RolloutInfo(
            rollout.rollout_id,
            rollout.group_id,
            rollout.task_id,
            rollout.status,
            list(rollout.rewards.values()),
        )
        group = self.registry.group_of(rollout)
        job = SealJob(
            info=info,
            metadata_json=_json_or_none(rollout.metadata),
            turns=list(rollout.turns),
            num_calls=rollout.num_turns,
            created_at=rollout.created_at,
            sealed_at=rollout.sealed_at or time.time(),
            skip_samples=skip_samples,
            skip_rollout=skip_rollout,
            group_size=rollout.group_size if group is None else group.size,
            # Publish soon: a rollout on its own, or the last of its group (a trainer
            # waits for whole groups); a group of unknown size at each seal.
            publish=group is None or group.size is None or group.complete,
        )
        pin = rollout.first_seq
        if self._draining:
            # Shutdown seals what is left and stops the writer right after, without waiting
            # on the event loop: handed over at once (the seal frame is written within ms).
            self.recorder.submit_seal(job, pin=pin)
            return
        seal_seq = self.journal.next_seq - 1  # the seal frame, the latest appended
        self._when_journaled(seal_seq, pin, lambda: self.recorder.submit_seal(job, pin=pin))

    def _when_journaled(self, seq: int, pin: int | None, submit: Callable[[], None]) -> None:
        """Run `submit` (hand work to the recorder) once journal frame `seq` is written or
        has failed. The writer publishes within milliseconds; a shard holding a turn the
        journal does not hold yet would, after a crash at that moment, let the restart
        reuse its turn index (and stitch its rollout again)."""
        if seq <= 0 and not self._unjournaled:  # no journal (detached): nothing to wait on
            submit()
            return
        self._unjournaled.append((seq, pin, submit))
        self._held_back += 1
        if self._unjournaled_task is None:
            self.idle.clear()
            self._unjournaled_task = asyncio.get_running_loop().create_task(
                self._submit_journaled()
            )

    async def _submit_journaled(self) -> None:
        try:
            while self._unjournaled:
                seq, _, submit = self._unjournaled[0]
                if seq > 0:
                    with contextlib.suppress(JournalError):  # failed: submitted all the same
                        await self.journal.durable(seq)
                self._unjournaled.popleft()
                submit()
                self._handed_over += 1
                async with self._handed:
                    self._handed.notify_all()
        finally:
            self._unjournaled_task = None
            self._settle_idle()

    async def writer_has_everything(self) -> None:
        """Wait until the work held back for its journal frame now is handed to the
        writer (milliseconds): what `/admin/flush` publishes must include it."""
        target = self._held_back
        async with self._handed:
            await self._handed.wait_for(lambda: self._handed_over >= target)

    def _settle_idle(self) -> None:
        if self.in_flight == 0 and not self._unjournaled:
            self.idle.set()

    # -- completion calls ----------------------------------------------------------------
    async def complete(
        self,
        endpoint: str,
        raw: bytes,
        *,
        rollout_id: str | None,
        policy_version: int | None = None,
        idempotency_key: str | None = None,
        retry_count: str | None = None,
    ) -> Relay | StreamRelay:
        received_at, t0 = time.time(), time.perf_counter()
        key = answer_key(rollout_id, endpoint, raw, idempotency_key, retry_count)
        if key is not None and is_retry(retry_count, idempotency_key):
            answer = await self.answers.lookup(key)
            if answer is not None:
                log.info("re-sent the answer to a retried call of rollout %s", rollout_id)
                return _resend(answer)
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None
        body = validate(endpoint, parsed)
        if self._draining:
            raise Overloaded("Turnstile is shutting down", retry_after_s=5)
        self.recorder.admit()
        # Images are checked, hashed and (remote ones, if so set) fetched before anything
        # else happens to the call; the recorded messages refer to them by hash.
        images = await collect_images(body, self.media) if endpoint == CHAT else None
        request = dict(body)  # the client's request, before the recording fields are added
        if images is not None:
            request["messages"] = images.recorded_messages
        plan = plan_request(endpoint, body, self.top_logprobs)
        assembled = self._stream_whole_calls and not plan.stream
        if assembled:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}  # the whole answer's usage
        try:  # what the backend gets; also proves the request can be recorded as JSON
            payload = orjson.dumps(body)
        except orjson.JSONEncodeError as exc:
            raise Unprocessable(
                f"the request cannot be recorded: {exc} (JSON nested deeper than "
                f"{MAX_JSON_DEPTH} levels)"
            ) from None
        if rollout_id is None or not self.registry.known(rollout_id):
            await self.admission.wait_for_room()  # a new rollout: admission control
        await self.fence.pass_through()  # waits while the weights are being updated
        rollout, turn_index = self.registry.begin_turn(rollout_id)
        call = _Call(
            turn_id=uuid.uuid4().hex,
            endpoint=endpoint,
            rollout=rollout,
            turn_index=turn_index,
            policy_version=self.policy_version if policy_version is None else policy_version,
            request=request,
            plan=plan,
            received_at=received_at,
            t0=t0,
            own_version=policy_version is not None,
            streamed=plan.stream or assembled,
            images=images,
        )
        self.in_flight += 1
        self.idle.clear()
        if key is not None:
            call.answer_key = key
            self.answers.begin(key)
        capture = call.capture = ResponseCapture(plan)
        self._calls[call.turn_id] = call
        try:
            call.t_sent = time.perf_counter()
            affinity = ROLLOUT_AFFINITY.set(rollout.rollout_id)  # a pool routes on it
            try:
                resp = await self.backend.request(
                    "POST", PATHS[endpoint], payload, {"Content-Type": _JSON}
                )
            finally:
                ROLLOUT_AFFINITY.reset(affinity)
            call.served_by, call.failover_from = resp.served_by, resp.failover_from
            # TITO answers say whether the context was faithful (other backends do not)
            call.context_faithful = getattr(resp, "context_faithful", None)
            if resp.status >= 400:
                raise await read_error(resp)
            self._live[call.turn_id] = (call, resp)
        except TurnstileError as exc:
            self._finish(call, capture, TurnStatus.ERROR, exc.message, exc.status)
            raise
        except Exception as exc:  # a bug below the Backend seam: recorded as what it is
            self._finish(call, capture, TurnStatus.ERROR, _internal(exc), 500)
            raise
        except BaseException:  # cancelled: the client went away, or the server is stopping
            self._finish(call, capture, TurnStatus.ABORTED, "request cancelled", 499)
            raise
        if plan.stream:
            return StreamRelay(
                resp.status,
                _stream_type(resp),
                self._relay_stream(call, capture, resp),
                call.headers,
            )
        if assembled:
            return await self._relay_assembled(call, capture, resp)
        return await self._relay_whole(call, capture, resp)

    async def _relay_assembled(
        self, call: _Call, capture: ResponseCapture, resp: BackendResponse
    ) -> Relay:
        """A whole call streamed upstream (`stream_whole_calls`): read the stream, record
        it, answer the assembled whole body."""
        parser = SSEParser()
        whole = WholeAnswer(call.endpoint)
        done = False
        try:
            async for chunk in resp.iter_chunks():
                for event in parser.feed(chunk):
                    data = event.data
                    if data is None:
                        continue
                    if data.strip() == DONE:
                        done = True
                        break
                    try:
                        obj = orjson.loads(data)
                    except orjson.JSONDecodeError as exc:
                        raise BackendValueError(
                            f"the backend sent a stream event that is not JSON: {exc}"
                        ) from None
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj and not obj.get("choices"):
                        raise BackendError(f"the backend's stream failed: {_error_message(obj)}")
                    capture.add(obj, chunk=True)
                    whole.add(obj)
                    if call.t_first is None and any(c.token_ids for c in capture.choices.values()):
                        call.t_first = time.perf_counter()
                if done:
                    break
            if not done and call.aborted is None:
                raise BackendError("the backend closed the stream before [DONE]")
        except (BackendError, SSEError) as exc:
            if call.aborted is None:
                message = exc.message if isinstance(exc, BackendError) else str(exc)
                self._finish(call, capture, TurnStatus.ERROR, message, 502)
                raise BackendError(message) from None
        except Exception as exc:
            self._finish(call, capture, TurnStatus.ERROR, _internal(exc), 500)
            raise
        except BaseException:
            self._finish(call, capture, TurnStatus.ABORTED, "request cancelled", 499)
            raise
        finally:
            resp.close()
        if not done:  # a weight-update fence cut it: its tokens so far are kept
            reason = call.aborted or "cut by a weight update"
            self._finish(call, capture, TurnStatus.ABORTED, reason, Overloaded.status)
            raise Overloaded(reason, retry_after_s=FENCE_RETRY_AFTER_S)
        obj = whole.answer(capture)
        if call.plan.needs_strip:
            call.plan.strip(obj)
        raw = orjson.dumps(obj)
        answer = Answer(resp.status, _JSON, [raw], call.headers)
        self._finish(call, capture, TurnStatus.OK, None, resp.status, answer)
        await self._acknowledge(call)  # acknowledged means journaled
        return Relay(resp.status, _JSON, raw, call.headers)

    async def _relay_whole(
        self, call: _Call, capture: ResponseCapture, resp: BackendResponse
    ) -> Relay:
        raw: bytes | None = None
        try:
            raw = await resp.read()
        except TurnstileError as exc:
            if call.aborted is None:
                self._finish(call, capture, TurnStatus.ERROR, exc.message, exc.status)
                raise
        except Exception as exc:
            self._finish(call, capture, TurnStatus.ERROR, _internal(exc), 500)
            raise
        except BaseException:
            self._finish(call, capture, TurnStatus.ABORTED, "request cancelled", 499)
            raise
        finally:
            resp.close()
        if raw is None or (call.aborted is not None and not raw):
            # A weight-update fence cut it before it was read (a whole answer that did
            # arrive is recorded as usual, under the version it began with).
            reason = call.aborted or "cut by a weight update"
            self._finish(call, capture, TurnStatus.ABORTED, reason, Overloaded.status)
            raise Overloaded(reason, retry_after_s=FENCE_RETRY_AFTER_S)
        call.t_first = time.perf_counter()
        body = None
        plan = call.plan
        stripped: bytes | None = None
        try:
            completions = plan.endpoint != CHAT
            if not plan.needs_strip:  # the bytes go out unchanged: read what is recorded
                # None for unexpected shapes: the full decode below tells what is wrong
                body = read_answer(raw, completions, plan.tokens_as_ids)
            else:  # what the client did not ask for is spliced out of the scanned bytes
                body = scan(raw, completions, plan.tokens_as_ids)
                if body is not None:
                    stripped = body.strip(raw, plan.client_token_ids, plan.client_logprobs)
            if body is not None:
                capture.add_answer(body)
            else:
                try:
                    obj = orjson.loads(raw)
                    if not isinstance(obj, dict):
                        raise TypeError("response is not a JSON object")
                except (orjson.JSONDecodeError, TypeError) as exc:
                    raise BackendError(
                        f"the backend's response is not a JSON object: {exc}"
                    ) from None
                capture.add(obj, chunk=False)
        except BackendError as err:  # recorded as an error turn; the client gets a 502
            self._finish(call, capture, TurnStatus.ERROR, err.message, err.status)
            raise
        if stripped is not None:
            raw = stripped
        elif body is None and call.plan.needs_strip:
            call.plan.strip(obj)
            raw = orjson.dumps(obj)
        content_type = resp.headers.get("Content-Type", _JSON)
        answer = Answer(resp.status, content_type, [raw], call.headers)
        self._finish(call, capture, TurnStatus.OK, None, resp.status, answer)
        await self._acknowledge(call)  # acknowledged means journaled
        return Relay(resp.status, content_type, raw, call.headers)

    async def _relay_stream(
        self, call: _Call, capture: ResponseCapture, resp: BackendResponse
    ) -> AsyncIterator[bytes]:
        parser = SSEParser()
        events = _EventRelay(call, capture)
        kept: list[bytes] | None = [] if call.answer_key is not None else None
        error: str | None = None
        unrecordable = False  # the backend sent a value no column can hold
        try:
            async for chunk in resp.iter_chunks():
                ready = parser.feed(chunk)
                if not events.sent_any and len(ready) > 1:
                    # The first event goes out before the rest of its read is decoded.
                    piece = events.relay(ready[:1])
                    ready = ready[1:]
                    if piece:
                        if kept is not None:
                            kept.append(piece)
                        yield piece
                # The events of one read go out together, as one send.
                piece = events.relay(ready) if not events.saw_done else b""
                if piece:
                    if kept is not None:
                        kept.append(piece)
                    yield piece
                if events.saw_done:
                    break
            else:
                piece = events.relay(parser.finish())
                if piece:
                    if kept is not None:
                        kept.append(piece)
                    yield piece
            if not events.saw_done:
                error = "the backend closed the stream before [DONE]"
        except (BackendError, SSEError) as exc:
            error = str(exc)
            unrecordable = isinstance(exc, BackendValueError)
        finally:
            resp.close()
            saw_done, stream_error = events.saw_done, events.stream_error
            if not call.done and not (saw_done or error):
                # The client went away (or the server is stopping) mid-stream.
                self._finish(call, capture, TurnStatus.ABORTED, "client disconnected", 499)
        if saw_done and stream_error is None:
            answer = None
            if kept is not None:
                kept.append(encode_data(DONE))
                content_type = _stream_type(resp)
                answer = Answer(resp.status, content_type, kept, call.headers, stream=True)
            self._finish(call, capture, TurnStatus.OK, None, resp.status, answer)
            try:
                await self._acknowledge(call)  # [DONE] means journaled
            except JournalError as exc:
                yield encode_data(exc.body_bytes())
                return
            yield encode_data(DONE)
            return
        if stream_error is not None and error is None:
            self._finish(call, capture, TurnStatus.ERROR, stream_error, resp.status)
            yield encode_data(DONE)
            return
        if call.aborted is not None:  # a weight-update fence cut it: partial tokens kept
            self._finish(call, capture, TurnStatus.ABORTED, call.aborted, Overloaded.status)
            cut_by = Overloaded(call.aborted, retry_after_s=FENCE_RETRY_AFTER_S)
            yield encode_data(cut_by.body_bytes())
            yield encode_data(DONE)
            return
        cut = capture.choices and not unrecordable
        status = TurnStatus.ABORTED if cut else TurnStatus.ERROR
        self._finish(call, capture, status, error, 502)
        log.warning(
            "stream of rollout %s turn %d cut: %s",
            call.rollout.rollout_id,
            call.turn_index,
            error,
        )
        err = BackendError(f"the backend stream failed: {error}")
        yield encode_data(err.body_bytes())
        yield encode_data(DONE)

    # -- recording -------------------------------------------------------------------
    def _finish(
        self,
        call: _Call,
        capture: ResponseCapture,
        status: TurnStatus,
        error: str | None,
        http_status: int,
        answer: Answer | None = None,
    ) -> None:
        """Record the call's turns exactly once and release its rollout slot."""
        if call.done:
            return
        call.done = True
        self._live.pop(call.turn_id, None)
        self._calls.pop(call.turn_id, None)
        if call.answer_key is not None:
            self.answers.complete(call.answer_key, answer if status is TurnStatus.OK else None)
        self.in_flight -= 1
        records = self._records(call, capture, status, error, http_status)
        first: int | None = None
        try:
            for record in records:
                call.seq = self.journal.append(record)
                first = first or call.seq or None
        except JournalError as exc:  # not acknowledged; still recorded and released
            call.journal_error = exc
            log.error("journal append failed for rollout %s: %s", call.rollout.rollout_id, exc)
        self._when_journaled(
            call.seq, first, lambda: self.recorder.submit_turns(records, pin=first)
        )
        self.registry.end_turn(call.rollout, records)
        self._settle_idle()
        if self._on_turn is not None:
            self._on_turn(records)

    def _records(
        self,
        call: _Call,
        capture: ResponseCapture,
        status: TurnStatus,
        error: str | None,
        http_status: int,
    ) -> list[TurnRecord]:
        now = time.perf_counter()
        timings = Timings(
            received_at=call.received_at,
            queue_s=(call.t_sent or now) - call.t0,
            ttft_s=None if call.t_first is None or not call.plan.stream else call.t_first - call.t0,
            total_s=now - call.t0,
        )
        req = call.request
        is_chat = call.endpoint == CHAT
        common: dict[str, Any] = dict(
            turn_id=call.turn_id,
            rollout_id=call.rollout.rollout_id,
            group_id=call.rollout.group_id,
            turn_index=call.turn_index,
            endpoint=call.endpoint,
            policy_version=call.policy_version,
            status=status,
            sampling_params_json=json_text(sampling_params(req)),
            request_messages_json=_json_or_none(req.get("messages")) if is_chat else None,
            request_tools_json=_json_or_none(req.get("tools")) if is_chat else None,
            request_prompt_json=None if is_chat else _json_or_none(req.get("prompt")),
            timings=timings,
            http_status=http_status,
            error=error,
            backend=call.served_by,
            backend_failover_from=call.failover_from,
            policy_switch_unlocated=bool(call.switches) and not call.streamed,
            tito_context_faithful=call.context_faithful,
        )
        model = capture.model or str(req.get("model") or "")
        images = call.images
        if images is not None:
            common["processor_digest"] = self.media.processor_digest
        if not capture.choices:
            return [
                TurnRecord(
                    choice_index=0,
                    model=model,
                    token_source=TokenSource.NONE,
                    prompt_token_ids=_EMPTY_I32,
                    completion_token_ids=_EMPTY_I32,
                    behavior_logprobs=_EMPTY_F32,
                    finish_reason=None,
                    stop_reason=None,
                    response_message_json=None,
                    response_text=None,
                    policy_version_spans=[(0, call.policy_version)],
                    images=[] if images is None else list(images.refs),
                    media=self._new_media(call),
                    **common,
                )
            ]
        records: list[TurnRecord] = []
        for index in sorted(capture.choices):
            cap = capture.choices[index]
            prompt = capture.prompt_ids_for(cap)
            prompt_ids = _EMPTY_I32 if prompt is None else np.asarray(prompt, dtype=np.int32)
            ids, lps = cap.completion_arrays(call.plan.echo)
            exact = prompt is not None and cap.saw_token_ids
            top_ids, top_values = cap.top_k(len(ids), call.plan.echo)
            records.append(
                TurnRecord(
                    choice_index=index,
                    model=model,
                    token_source=TokenSource.BACKEND if exact else TokenSource.NONE,
                    prompt_token_ids=prompt_ids,
                    completion_token_ids=ids,
                    behavior_logprobs=lps,
                    finish_reason=cap.finish_reason,
                    stop_reason=None if cap.stop_reason is None else str(cap.stop_reason),
                    response_message_json=orjson.dumps(cap.message()).decode() if is_chat else None,
                    response_text=None if is_chat else cap.text(),
                    top_logprob_ids=top_ids,
                    top_logprob_values=top_values,
                    policy_version_spans=call.version_spans(index, len(ids)),
                    images=[]
                    if images is None
                    else locate_images(images.refs, prompt_ids, self.media.image_token_id),
                    media=self._new_media(call) if not records else [],
                    **common,
                )
            )
        return records

    @staticmethod
    def _new_media(call: _Call) -> list[MediaBlob]:
        """The bytes of the call's images its rollout has not journaled before: each
        rollout's journal frames then hold every image its turns refer to."""
        if call.images is None or not call.images.blobs:
            return []
        sent = {b.sha256 for turn in call.rollout.turns for b in turn.media}
        return [b for h, b in call.images.blobs.items() if h not in sent]

    # -- anything else ----------------------------------------------------------------
    async def passthrough(
        self, method: str, path: str, body: bytes | None, content_type: str | None
    ) -> StreamRelay:
        headers = {"Content-Type": content_type} if content_type else {}
        resp = await self.backend.request(method, path, body, headers)
        return StreamRelay(
            resp.status,
            resp.headers.get("Content-Type", _JSON),
            _passthrough_chunks(resp),
        )


async def _passthrough_chunks(resp: BackendResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.iter_chunks():
            yield chunk
    finally:
        resp.close()


class _EventRelay:
    """Records each SSE event of a stream and rewrites it for the client."""

    __slots__ = ("call", "capture", "saw_done", "sent_any", "stream_error")

    def __init__(self, call: _Call, capture: ResponseCapture) -> None:
        self.call = call
        self.capture = capture
        self.saw_done = False
        self.sent_any = False  # some bytes of the stream have been handed out
        self.stream_error: str | None = None  # an error event sent by the backend itself

    def relay(self, events: list[SSEEvent]) -> bytes:
        """The bytes to send for `events` (stopping at `[DONE]`, which is sent later)."""
        out: list[bytes] = []
        plan, capture = self.call.plan, self.capture
        chat, as_ids = plan.endpoint == CHAT, plan.tokens_as_ids
        for event in events:
            data = event.data
            if data is None:
                out.append(event.raw)
                continue
            if data.strip() == DONE:
                self.saw_done = True
                break
            scanned = None if plan.needs_strip else scan_chunk(data, not chat, as_ids)
            if scanned is not None:  # the bytes go out unchanged: read only what is recorded
                if scanned.error is not None and not scanned.choices:
                    self.stream_error = _error_message({"error": scanned.value(scanned.error)})
                else:
                    capture.add_scanned_chunk(scanned)
                    self._note_first_token()
                out.append(event.raw)
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                # Its tokens could not be recorded: relaying it would break the record.
                raise BackendValueError(
                    f"the backend sent a stream event that is not JSON: {exc}"
                ) from None
            if not isinstance(obj, dict):
                out.append(event.raw)
                continue
            if "error" in obj and not obj.get("choices"):
                self.stream_error = _error_message(obj)
                out.append(event.raw)
                continue
            capture.add(obj, chunk=True)
            self._note_first_token()
            if plan.needs_strip:
                plan.strip(obj)
                if not plan.carries_nothing(obj):
                    out.append(encode_data(orjson.dumps(obj)))
            else:
                out.append(event.raw)
        if out:
            self.sent_any = True
        return b"".join(out)

    def _note_first_token(self) -> None:
        if self.call.t_first is None and any(
            c.token_ids or c.content for c in self.capture.choices.values()
        ):
            self.call.t_first = time.perf_counter()


def _stream_type(resp: BackendResponse) -> str:
    """The content type a relayed stream goes out with: the backend's when it is SSE, else
    SSE all the same, since Turnstile writes SSE events (its error events included) into it
    whatever the backend said (a proxy in front of it may answer `text/html`)."""
    declared = resp.headers.get("Content-Type", "")
    return declared if declared.startswith(_SSE_TYPE) else _SSE_TYPE


def _resend(answer: Answer) -> Relay | StreamRelay:
    """The remembered answer of a call, for its retry (marked as re-sent)."""
    headers = {**answer.headers, "X-Turnstile-Replayed": "true"}
    if not answer.stream:
        return Relay(answer.status, answer.content_type, answer.chunks[0], headers)
    return StreamRelay(answer.status, answer.content_type, _chunks_of(answer.chunks), headers)


async def _chunks_of(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _internal(exc: Exception) -> str:
    """The recorded error of a call ended by an unexpected exception (a bug, not a cancel)."""
    return f"internal error: {type(exc).__name__}: {str(exc)[:200]}"


def _error_message(obj: dict[str, Any]) -> str:
    err = obj.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    return str(err)
