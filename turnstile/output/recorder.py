"""The recorder: moves finished turns and sealed rollouts off the request path.

The event loop hands over work with `submit_turns` / `submit_seal`, which never block
and never drop. A single writer thread then fills in retokenized IDs where a backend
returned none, stitches sealed rollouts into samples and writes everything to the sink.
Admission control happens before a request is sent to the backend (`admit`): when the
backlog is full the client gets 503 with Retry-After, so nothing is ever accepted and
then dropped. `stop` publishes everything received before returning.

Journal retention: work may carry a *pin*, the sequence number of the oldest journal
frame it needs. A pin is held from `submit_*` until every row the work produced is in
a published shard (`Sink.progress`); `oldest_pin` is what the journal must keep. Work
that fails keeps its pin for the life of the process, so its frames stay for the rebuild
at the next start.

Nothing is dropped: a row that cannot be written (a retokenization that fails, a rollout
that cannot be stitched, a value the sink cannot convert) goes to the quarantine table
with its reason (`turnstile.output.quarantine`), and its neighbours are written as usual.
`error` is the failure in progress (new work is refused while it lasts); `incident` is
the latest failure or quarantine, which stays, with `errors_total` and the quarantine
counts, until an operator acknowledges it (`acknowledge`, `POST /admin/recorder/ack`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from turnstile.errors import Overloaded
from turnstile.limits import MAX_RECORDER_MEDIA_BYTES, PUBLISH_DELAY_S, WRITER_TICK_S
from turnstile.output.quarantine import quarantine
from turnstile.output.shards import Sink, SinkError
from turnstile.output.stitch import RolloutInfo, stitch
from turnstile.output.tokenizer import LocalTokenizer
from turnstile.records import (
    MediaRecord,
    QuarantineRecord,
    RolloutRecord,
    TokenSource,
    TurnRecord,
    TurnStatus,
)
from turnstile.runtime import name_thread

log = logging.getLogger("turnstile.recorder")

# Retokenization warnings are logged in full this many times, then every Nth time.
RETOKENIZE_WARN_FIRST = 10
RETOKENIZE_WARN_EVERY = 1000


@dataclass(frozen=True, slots=True)
class SealJob:
    info: RolloutInfo
    metadata_json: str | None
    turns: list[TurnRecord]
    num_calls: int
    created_at: float
    sealed_at: float
    # after a crash: what of this rollout is already published
    skip_samples: frozenset[int] = frozenset()
    skip_rollout: bool = False
    group_size: int | None = None
    publish: bool = False  # publish within `publish_delay_s` (a finished rollout or group)


@dataclass(slots=True)
class RecorderStats:
    turns_received: int = 0
    turns_written: int = 0
    samples_written: int = 0
    rollouts_written: int = 0
    retokenized_turns: int = 0
    dropped: int = 0  # stays 0: work is refused up front, never dropped
    breaks_by_kind: dict[str, int] = field(default_factory=dict)
    errors_total: int = 0  # failures of the writer (each also an `incident`)


@dataclass(frozen=True, slots=True)
class Incident:
    """The latest failure or quarantine, kept until an operator acknowledges it."""

    message: str
    first_at: float  # when the first unacknowledged incident happened (time.time())
    last_at: float
    count: int  # incidents since the last acknowledgement

    def as_dict(self) -> dict[str, object]:
        return {
            "message": self.message,
            "first_at": self.first_at,
            "last_at": self.last_at,
            "count": self.count,
        }


_STOP = object()


class _Flush:
    """Asks the writer to publish everything handed to it before; `done` is set then."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False


class Recorder:
    def __init__(
        self,
        sink: Sink,
        *,
        max_backlog: int,
        tokenizer: LocalTokenizer | None = None,
        tick_s: float = WRITER_TICK_S,
        publish_delay_s: float = PUBLISH_DELAY_S,
    ) -> None:
        self._sink = sink
        self._publish_delay_s = publish_delay_s
        self._publish_due: float | None = None  # time.monotonic() of the next prompt publish
        self._max_backlog = max_backlog
        self._tokenizer = tokenizer
        self._tick_s = tick_s
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._backlog = 0
        self._backlog_media_bytes = 0  # image bytes in queued turns
        self._lock = threading.Lock()
        self._pins: dict[int, int] = {}  # journal seq -> pieces of work holding it
        self._awaiting: deque[tuple[int, Mapping[str, int]]] = deque()  # writer thread only
        self._thread = threading.Thread(target=self._run, name="turnstile-writer", daemon=True)
        self.stats = RecorderStats()
        self.error: str | None = None
        self._incident: Incident | None = None
        self._quarantined_seen = 0  # rows the sink had quarantined at the last look
        self._sink_quarantined: dict[str, int] = {}  # quarantined by the sink (conversion)
        self._own_quarantined: dict[str, int] = {}  # quarantined here (retokenize, stitch)

    # -- event-loop side -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def backlog(self) -> int:
        return self._backlog

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def incident(self) -> Incident | None:
        """The latest unacknowledged failure or quarantine, if any."""
        return self._incident

    def acknowledge(self) -> Incident | None:
        """An operator has seen the incident: clear it (the counters stay); returns it."""
        with self._lock:
            incident, self._incident = self._incident, None
        return incident

    def _note_incident(self, message: str) -> None:
        now = time.time()
        with self._lock:
            old = self._incident
            self._incident = Incident(
                message,
                first_at=old.first_at if old else now,
                last_at=now,
                count=(old.count if old else 0) + 1,
            )

    def admit(self) -> None:
        """Refuse new work (503) while the writer is behind or failing."""
        if self.error is not None:
            raise Overloaded(f"recording is failing: {self.error}", retry_after_s=5)
        if self._backlog >= self._max_backlog:
            raise Overloaded(
                f"the recorder is {self._backlog} items behind; retry shortly", retry_after_s=1
            )
        if self._backlog_media_bytes >= MAX_RECORDER_MEDIA_BYTES:
            raise Overloaded(
                f"the recorder holds {self._backlog_media_bytes >> 20} MiB of images not yet "
                "written; retry shortly",
                retry_after_s=1,
            )

    def submit_turns(self, records: list[TurnRecord], pin: int | None = None) -> None:
        """Queue turn rows; `pin` is the journal seq of the first of them, if journaled."""
        with self._lock:
            self._backlog += 1
            self._backlog_media_bytes += _media_bytes(records)
            self.stats.turns_received += len(records)
            self._hold(pin)
        self._queue.put((records, pin))

    def submit_seal(self, job: SealJob, pin: int | None = None) -> None:
        """Queue a sealed rollout; `pin` is the journal seq of its first frame."""
        with self._lock:
            self._backlog += 1
            self._hold(pin)
        self._queue.put((job, pin))

    @property
    def oldest_pin(self) -> int | None:
        """The oldest journal frame that queued or unpublished work still needs."""
        with self._lock:
            return min(self._pins) if self._pins else None

    def _hold(self, pin: int | None) -> None:
        if pin is not None:
            self._pins[pin] = self._pins.get(pin, 0) + 1

    def request_flush(self) -> _Flush:
        """Publish everything handed over so far; wait on the result's `done`."""
        flush = _Flush()
        self._queue.put(flush)
        return flush

    def stop(self, timeout_s: float) -> bool:
        """Publish everything received, then close the sink; False if it timed out."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        name_thread("ts-writer")
        try:
            while True:
                try:
                    item = self._queue.get(timeout=self._wait_s())
                except queue.Empty:
                    self._roll()
                    continue
                if item is _STOP:
                    break
                if isinstance(item, _Flush):
                    item.ok = self._guard(self._publish_now, None)
                    item.done.set()
                    continue
                assert isinstance(item, tuple)
                work, pin = item
                if isinstance(work, SealJob):
                    ok = self._guard(self._write_seal, work)
                else:
                    ok = self._guard(self._write_turns, work)
                if pin is not None and ok:
                    self._awaiting.append((pin, self._sink.progress().accepted))
                with self._lock:
                    self._backlog -= 1
                    if not isinstance(work, SealJob):
                        self._backlog_media_bytes -= _media_bytes(work)
                self._roll()
        finally:
            try:
                self._sink.close()
            except Exception as exc:
                self.error = f"closing the sink failed: {exc}"
                log.exception("closing the sink failed")
            else:
                self._release()

    def _wait_s(self) -> float:
        """How long the writer may wait for work: a tick, or until a publish is due."""
        if self._publish_due is None:
            return self._tick_s
        return max(0.0, min(self._tick_s, self._publish_due - time.monotonic()))

    def _roll(self) -> None:
        if self._publish_due is not None and time.monotonic() >= self._publish_due:
            self._guard(self._publish_now, None)
        self._guard(self._sink.maybe_roll, time.time())
        if self._awaiting:
            self._release()

    def _publish_now(self, _: object) -> None:
        """Publish every buffered row now (a finished rollout or group, or a flush)."""
        self._publish_due = None
        self._sink.flush()
        self._release()

    def _check_quarantine(self) -> None:
        """Note the rows the sink quarantined since the last look."""
        progress = self._sink.progress()
        total = sum(progress.quarantined.values())
        if total == self._quarantined_seen:
            return
        new, self._quarantined_seen = total - self._quarantined_seen, total
        for table, count in progress.quarantined.items():
            self._sink_quarantined[table] = count
        self._note_incident(
            f"{new} rows quarantined (see the quarantine table): {progress.quarantine_reason}"
        )

    @property
    def quarantined(self) -> dict[str, int]:
        """Rows quarantined in this run, by the table they were meant for."""
        counts = dict(self._sink_quarantined)
        for table, count in self._own_quarantined.items():
            counts[table] = counts.get(table, 0) + count
        return counts

    def _release(self) -> None:
        """Drop the pins of work whose rows are all published."""
        progress = self._sink.progress()
        released = []
        while self._awaiting and progress.covers(self._awaiting[0][1]):
            released.append(self._awaiting.popleft()[0])
        if released:
            with self._lock:
                for pin in released:
                    if self._pins[pin] == 1:
                        del self._pins[pin]
                    else:
                        self._pins[pin] -= 1

    def _guard(self, fn: Callable[[Any], None], arg: object) -> bool:
        try:
            fn(arg)
        except Exception as exc:
            self.error = str(exc)
            self.stats.errors_total += 1
            self._note_incident(self.error)
            log.exception("recording failed")
            return False
        finally:
            self._check_quarantine()
        if self.error is not None:
            # Writing works again; the incident stays until an operator acknowledges it.
            log.info("recording recovered after: %s", self.error)
            self.error = None
        return True

    def _write_turns(self, records: list[TurnRecord]) -> None:
        kept, held = [], []
        for record in records:
            if record.token_source is TokenSource.NONE and record.status is not TurnStatus.ERROR:
                try:
                    self._retokenize(record)
                except Exception as exc:
                    log.exception("retokenizing turn %s failed", record.turn_id)
                    held.append(quarantine("turns", record, f"cannot retokenize: {exc!r}"))
                    continue
            kept.append(record)
        if held:
            self._quarantine(held)
        now = time.time()
        media = [
            MediaRecord(blob.sha256, blob.mime_type, blob.data, record.rollout_id, now)
            for record in records
            for blob in record.media
        ]
        if media:  # before the turns that refer to them
            self._sink.write_media(media)
        self._sink.write_turns(kept)
        self.stats.turns_written += len(kept)

    def _quarantine(self, held: list[QuarantineRecord]) -> None:
        """Send rows the writer could not make to the quarantine table."""
        self._sink.write_quarantine(held)
        for q in held:
            self._own_quarantined[q.table] = self._own_quarantined.get(q.table, 0) + 1
            log.error("QUARANTINED a %s row of rollout %s: %s", q.table, q.rollout_id, q.reason)
        self._note_incident(f"{len(held)} rows quarantined: {held[-1].table}: {held[-1].reason}")

    def _retokenize(self, record: TurnRecord) -> None:
        tok = self._tokenizer
        n = self.stats.retokenized_turns
        if tok is None:
            if n < RETOKENIZE_WARN_FIRST or n % RETOKENIZE_WARN_EVERY == 0:
                log.warning(
                    "backend returned no token IDs for turn %s of rollout %s and no "
                    "--tokenizer is set: the turn is recorded without tokens",
                    record.turn_index,
                    record.rollout_id,
                )
            self.stats.retokenized_turns += 1
            return
        if record.request_messages_json is not None:
            messages = orjson.loads(record.request_messages_json)
            tools = orjson.loads(record.request_tools_json or "null")
            prompt = tok.render_prompt(messages, tools)
            reply = orjson.loads(record.response_message_json or "null") or {}
            completion = tok.encode(reply.get("content") or "")
        else:
            prompt_value = orjson.loads(record.request_prompt_json or "null")
            prompt = tok.encode(prompt_value) if isinstance(prompt_value, str) else []
            completion = tok.encode(record.response_text or "")
        record.prompt_token_ids = np.asarray(prompt, dtype=np.int32)
        record.completion_token_ids = np.asarray(completion, dtype=np.int32)
        if len(record.behavior_logprobs) != len(completion):
            record.behavior_logprobs = np.full(len(completion), np.nan, dtype=np.float32)
        record.token_source = TokenSource.RETOKENIZED
        self.stats.retokenized_turns += 1
        if n < RETOKENIZE_WARN_FIRST or n % RETOKENIZE_WARN_EVERY == 0:
            log.warning(
                "RETOKENIZED: backend returned no token IDs for turn %s of rollout %s; "
                "Turnstile tokenized it with %s, which may differ from what the model saw "
                "(%d such turns so far)",
                record.turn_index,
                record.rollout_id,
                tok.path,
                n + 1,
            )

    def _write_seal(self, job: SealJob) -> None:
        try:
            samples = stitch(job.info, job.turns, self._tokenizer)
        except Exception as exc:
            # The turns are in the turns table; what is held back is only their stitching.
            log.exception("stitching rollout %s failed", job.info.rollout_id)
            record = {
                "rollout_id": job.info.rollout_id,
                "turns": [[t.turn_id, t.turn_index, t.choice_index] for t in job.turns],
            }
            self._quarantine([quarantine("samples", record, f"cannot stitch: {exc!r}")])
            samples = []
        breaks = 0
        for sample in samples:
            kind = sample.break_kind.value
            if sample.parent_sample_index is not None:
                breaks += 1
                self.stats.breaks_by_kind[kind] = self.stats.breaks_by_kind.get(kind, 0) + 1
        fresh = [x for x in samples if x.sample_index not in job.skip_samples]
        if job.publish and self._publish_due is None:
            self._publish_due = time.monotonic() + self._publish_delay_s
        # The sink buffers rows before it publishes, so a failing publish of the samples
        # (a full disk) must not keep the rollout row from the buffer: both are written,
        # then the first failure is raised (the job keeps its journal pin).
        failed: SinkError | None = None
        if fresh:
            try:
                self._sink.write_samples(fresh)
            except SinkError as exc:
                failed = exc
        self.stats.samples_written += len(fresh)
        if job.skip_rollout:
            if failed is not None:
                raise failed
            return
        self._sink.write_rollouts(
            [
                RolloutRecord(
                    rollout_id=job.info.rollout_id,
                    group_id=job.info.group_id,
                    task_id=job.info.task_id,
                    metadata_json=job.metadata_json,
                    rewards=job.info.rewards,
                    status=job.info.status,
                    num_turns=job.num_calls,
                    num_samples=len(samples),
                    num_breaks=breaks,
                    created_at=job.created_at,
                    sealed_at=job.sealed_at,
                    policy_versions=sorted({t.policy_version for t in job.turns}),
                    group_size=job.group_size,
                )
            ]
        )
        self.stats.rollouts_written += 1
        if failed is not None:
            raise failed


def _media_bytes(records: list[TurnRecord]) -> int:
    return sum(len(blob.data) for record in records for blob in record.media)
