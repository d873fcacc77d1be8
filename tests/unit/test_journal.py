"""The write-ahead journal: framing, recovery, fsync policies, failures, and its codecs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from turnstile.errors import Overloaded
from turnstile.journal import wal as journal_mod
from turnstile.journal.codec import (
    CodecError,
    EventKind,
    PolicyVersionSet,
    RewardsPosted,
    RolloutCreated,
    RolloutSealed,
    decode_event,
    decode_turn,
    encode_event,
    encode_turn,
)
from turnstile.journal.wal import (
    HEADER_BYTES,
    FileJournal,
    Frame,
    JournalError,
    encode_frame,
    list_segments,
    read_frames,
    read_journal,
    repair,
    segment_name,
)
from turnstile.records import RolloutStatus, Timings, TokenSource, TurnRecord, TurnStatus

REPO_ROOT = Path(__file__).resolve().parents[2]


def payload_for(seq: int, size: int) -> bytes:
    return (seq.to_bytes(8, "little") * (size // 8 + 1))[:size]


def fill(directory: Path, sizes: list[int], **kwargs: Any) -> list[tuple[int, int, bytes]]:
    """Append frames of the given payload sizes, commit them, close; return them."""
    written = []
    with FileJournal(directory, **kwargs) as j:
        for n, size in enumerate(sizes):
            payload = os.urandom(size)
            written.append((j.append(n % 7, payload), n % 7, payload))
        j.commit(j.last_seq)
    return written


def triples(frames: Iterator[Frame]) -> list[tuple[int, int, bytes]]:
    return [(f.seq, f.kind, f.payload) for f in frames]


# --- framing and segments ----------------------------------------------------------------
def test_round_trip_across_segments(tmp_path: Path) -> None:
    rng = random.Random(1)
    sizes = [rng.choice([0, 1, 17, 500, 5000, 60_000]) for _ in range(300)]
    written = fill(tmp_path, sizes, fsync="never", segment_bytes=64 * 1024)
    segments = list_segments(tmp_path)
    assert len(segments) > 10
    assert triples(read_journal(tmp_path)) == written
    assert sum(len(list(read_frames(p))) for _, p in segments) == len(written)
    report = repair(tmp_path)
    assert (report.frames, report.corrupt_frames, report.truncated_bytes) == (300, 0, 0)
    assert (report.first_seq, report.last_seq) == (1, 300)
    with FileJournal(tmp_path, fsync="never") as j:
        assert triples(j.frames()) == written
        infos = j.segments()
        assert [i.segment_id for i in infos] == [s for s, _ in segments]
        for info, nxt in itertools.pairwise(infos):
            assert info.end_seq == nxt.segment_id
        assert j.append(1, b"after reopen") == 301
        j.commit(301)
    assert triples(read_journal(tmp_path))[-1] == (301, 1, b"after reopen")


def test_segment_names_hold_their_first_seq(tmp_path: Path) -> None:
    fill(tmp_path, [40_000] * 6, fsync="never", segment_bytes=50_000)
    for segment_id, path in list_segments(tmp_path):
        assert path.name == segment_name(segment_id)
        assert next(read_frames(path)).seq == segment_id


def test_remove_through_keeps_active_segment(tmp_path: Path) -> None:
    with FileJournal(tmp_path, fsync="never", segment_bytes=10_000) as j:
        for _ in range(10):
            j.commit(j.append(1, b"x" * 6000))
        infos = j.segments()
        assert infos[-1].active and infos[-1].end_seq is None
        with pytest.raises(ValueError):
            j.remove_through(infos[-1].segment_id)
        assert j.remove_through(infos[-2].segment_id) == len(infos) - 1
        assert [i.segment_id for i in j.segments()] == [infos[-1].segment_id]
    assert [f.seq for f in read_journal(tmp_path)] == [10]


def test_second_writer_is_refused(tmp_path: Path) -> None:
    with FileJournal(tmp_path, fsync="never"):
        with pytest.raises(JournalError):
            FileJournal(tmp_path, fsync="never")
        with pytest.raises(JournalError):
            repair(tmp_path)


# --- fsync policies and durability ordering ----------------------------------------------
class FsyncSpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[float] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        real = os.fsync

        def fsync(fd: int) -> None:
            self.entered.set()
            self.gate.wait(10)
            real(fd)
            self.calls.append(time.monotonic())

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
async def test_policy_fsyncs(
    policy: journal_mod.FsyncPolicy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    with FileJournal(tmp_path, fsync=policy, interval_s=0.02) as j:
        baseline = len(spy.calls)
        for _ in range(5):  # one at a time: each durable before the next
            await j.wait_durable(j.append(1, b"one"))
        serial = len(spy.calls) - baseline
        seqs = [j.append(2, b"burst") for _ in range(200)]
        await asyncio.gather(*(j.wait_durable(s) for s in seqs))
        burst = len(spy.calls) - baseline - serial
    if policy == "never":
        assert spy.calls == []
    elif policy == "always":
        assert serial >= 5  # every acknowledgement waited for its own fsync
        assert 1 <= burst < 50  # concurrent appends share fsyncs (group commit)
    else:
        assert serial + burst < 50  # fsyncs run per window, not per frame
    assert [f.seq for f in read_journal(tmp_path)] == list(range(1, 206))


async def test_interval_acknowledges_on_write_and_fsyncs_within_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    with FileJournal(tmp_path, fsync="interval", interval_s=0.2) as j:
        await j.wait_durable(j.append(1, b"warm up"))  # creates the segment
        await asyncio.sleep(0.3)
        synced = len(spy.calls)
        spy.gate.clear()  # an fsync now would block: acknowledgements must not wait
        spy.entered.clear()
        start = time.monotonic()
        for _ in range(20):
            await j.wait_durable(j.append(1, b"frame"))
        assert time.monotonic() - start < 0.15, "interval acknowledges after the write"
        assert len(spy.calls) == synced  # nothing fsynced yet ...
        assert await asyncio.to_thread(spy.entered.wait, 2)  # ... until the window ends
        spy.gate.set()
        await asyncio.sleep(0.1)
        assert len(spy.calls) == synced + 1  # all 20 frames share one fsync
        assert [f.payload for f in read_journal(tmp_path)][-20:] == [b"frame"] * 20


async def test_wait_durable_resolves_only_after_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    with FileJournal(tmp_path, fsync="always") as j:
        await j.wait_durable(j.append(1, b"warm up"))  # creates the segment
        spy.gate.clear()
        spy.entered.clear()
        before = len(spy.calls)
        seq = j.append(1, b"payload")
        waiter = asyncio.ensure_future(j.wait_durable(seq))
        assert await asyncio.to_thread(spy.entered.wait, 5)
        await asyncio.sleep(0.05)
        assert not waiter.done()  # written, fsync in progress: not yet durable
        assert len(spy.calls) == before
        spy.gate.set()
        await asyncio.wait_for(waiter, 5)
        assert len(spy.calls) == before + 1


async def test_full_write_buffer_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = FsyncSpy(monkeypatch)
    with FileJournal(tmp_path, fsync="always", max_pending_bytes=10_000) as j:
        await j.wait_durable(j.append(1, b"warm up"))
        spy.gate.clear()
        spy.entered.clear()
        held = j.append(1, b"x")  # the committer now blocks in its fsync
        assert await asyncio.to_thread(spy.entered.wait, 5)
        queued = j.append(1, b"y" * 6000)
        with pytest.raises(JournalError) as caught:
            j.append(1, b"z" * 6000)
        assert caught.value.status == 503 and "Retry-After" in caught.value.headers()
        spy.gate.set()
        await j.wait_durable(held)
        await j.wait_durable(queued)


# --- torn and corrupt tails ------------------------------------------------------------
def _segment_bytes(tmp_path: Path, count: int) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    src = tmp_path / "src"
    rng = random.Random(7)
    written = fill(src, [rng.randrange(0, 300) for _ in range(count)], fsync="never")
    ((_, path),) = list_segments(src)
    return path.read_bytes(), written


def _repair_bytes(data: bytes, directory: Path) -> tuple[Any, list[Any], Path]:
    directory.mkdir()
    (directory / segment_name(1)).write_bytes(data)
    report = repair(directory)
    return report, triples(read_journal(directory)), directory


def test_truncation_at_every_offset_of_the_last_frame(tmp_path: Path) -> None:
    data, written = _segment_bytes(tmp_path, 8)
    last_start = len(data) - HEADER_BYTES - len(written[-1][2])
    for cut in range(last_start, len(data)):
        report, frames, directory = _repair_bytes(data[:cut], tmp_path / f"cut{cut}")
        assert frames == written[:-1]
        assert report.truncated_bytes == cut - last_start
        assert report.corrupt_frames == 0
        assert (directory / segment_name(1)).stat().st_size == last_start
        with FileJournal(directory, fsync="never") as j:
            j.commit(j.append(3, b"next"))
        assert triples(read_journal(directory)) == [*written[:-1], (j.last_seq, 3, b"next")]
    report, frames, _ = _repair_bytes(data, tmp_path / "whole")
    assert frames == written and report.truncated_bytes == 0


def test_bit_flips_are_detected(tmp_path: Path) -> None:
    data, written = _segment_bytes(tmp_path, 5)
    starts = []
    pos = 0
    for _, _, payload in written:
        starts.append(pos)
        pos += HEADER_BYTES + len(payload)
    rng = random.Random(3)
    for offset in range(len(data)):
        flipped = bytearray(data)
        flipped[offset] ^= 1 << rng.randrange(8)
        report, frames, _ = _repair_bytes(bytes(flipped), tmp_path / f"flip{offset}")
        hit = max(i for i, s in enumerate(starts) if s <= offset)
        assert frames == written[:hit]  # everything before the damaged frame, nothing after
        assert report.truncated_bytes == len(data) - starts[hit]


def test_corrupt_earlier_segment_skips_only_its_rest(tmp_path: Path) -> None:
    written = fill(tmp_path, [1000] * 12, fsync="never", segment_bytes=4000)
    segments = list_segments(tmp_path)
    first_path = segments[0][1]
    in_first = len(list(read_frames(first_path)))
    damaged = bytearray(first_path.read_bytes())
    damaged[HEADER_BYTES + 1000 + HEADER_BYTES + 5] ^= 0x40  # the second frame's payload
    first_path.write_bytes(bytes(damaged))
    report = repair(tmp_path)
    assert report.corrupt_frames == 1 and report.truncated_bytes == 0
    assert report.skipped_bytes == len(damaged) - HEADER_BYTES - 1000
    assert triples(read_journal(tmp_path)) == [written[0], *written[in_first:]]


def test_zero_filled_tail_is_truncated(tmp_path: Path) -> None:
    data, written = _segment_bytes(tmp_path, 3)
    report, frames, _ = _repair_bytes(data + bytes(4096), tmp_path / "zeros")
    assert frames == written and report.truncated_bytes == 4096


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000), st.booleans())
def test_repair_survives_arbitrary_bytes(garbage: bytes, after_valid: bool) -> None:
    prefix = encode_frame(1, 2, b"valid") + encode_frame(2, 3, b"") if after_valid else b""
    with tempfile.TemporaryDirectory() as scratch:
        _check_arbitrary(prefix + garbage, garbage, after_valid, Path(scratch) / "j")


def _check_arbitrary(data: bytes, garbage: bytes, after_valid: bool, directory: Path) -> None:
    report, frames, directory = _repair_bytes(data, directory)
    if after_valid:
        assert frames[:2] == [(1, 2, b"valid"), (2, 3, b"")]
    size = (directory / segment_name(1)).stat().st_size
    assert size == sum(HEADER_BYTES + len(p) for _, _, p in frames)
    assert report.frames == len(frames)
    # An earlier, garbled segment never stops a later one from being read.
    (directory / segment_name(1000)).write_bytes(encode_frame(1000, 1, b"later"))
    (directory / segment_name(0)).write_bytes(garbage)
    repair(directory)
    assert triples(read_journal(directory))[-1] == (1000, 1, b"later")


# --- disk full and I/O errors --------------------------------------------------------------
def _failing_write(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    real = os.write

    def write(fd: int, data: Any) -> int:
        if len(data) > 64:
            real(fd, bytes(data[: len(data) // 2]))  # a partial frame reaches the file
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "write", write)


async def test_enospc_on_write_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FileJournal(tmp_path, fsync="always") as j:
        good = [j.append(1, payload_for(n, 300)) for n in range(5)]
        await j.wait_durable(good[-1])
        with monkeypatch.context() as m:
            _failing_write(m, errno.ENOSPC)
            doomed = j.append(1, payload_for(99, 300))
            with pytest.raises(JournalError, match="disk is full") as caught:
                await j.wait_durable(doomed)
            assert isinstance(caught.value, Overloaded) and caught.value.status == 503
            assert caught.value.headers()["Retry-After"]
            assert not j.healthy
            with pytest.raises(JournalError):
                j.commit(doomed)
        later = j.append(1, payload_for(100, 300))  # space is back: the journal goes on
        await j.wait_durable(later)
        assert j.healthy
    report = repair(tmp_path)
    assert report.corrupt_frames == 0 and report.truncated_bytes == 0
    assert [f.seq for f in read_journal(tmp_path)] == [*good, later]


async def test_fsync_failure_fails_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = FileJournal(tmp_path, fsync="always")
    good = j.append(1, b"kept")
    await j.wait_durable(good)

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fsync)
        lost = j.append(1, b"not durable")
        with pytest.raises(JournalError):
            await j.wait_durable(lost)
    assert not j.healthy
    with pytest.raises(JournalError):
        j.append(1, b"refused")
    j.close()
    assert repair(tmp_path).corrupt_frames == 0
    assert next(f.seq for f in read_journal(tmp_path)) == good


# --- kill -9 ---------------------------------------------------------------------------------
CHILD = """
import asyncio, sys
from pathlib import Path
from turnstile.journal.wal import FileJournal

def payload(seq):
    return (seq.to_bytes(8, "little") * (1 + seq % 700))

async def main():
    journal = FileJournal(Path(sys.argv[1]), fsync="always", segment_bytes=200_000)
    async def worker():
        while True:
            seq = journal.append(1, payload(journal.last_seq + 1))
            await journal.wait_durable(seq)
            print(seq, flush=True)
    await asyncio.gather(*(worker() for _ in range(8)))

asyncio.run(main())
"""


def child_payload(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * (1 + seq % 700)


def test_sigkill_keeps_every_acknowledged_frame(tmp_path: Path) -> None:
    rng = random.Random(11)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for run in range(5):
        directory = tmp_path / f"run{run}"
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(directory)],
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO_ROOT,
        )
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.strip(), "the child printed nothing"
        time.sleep(rng.uniform(0.0, 0.3))
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=10)
        acknowledged = [int(x) for x in (first + rest).split()]
        repair(directory)
        frames = list(read_journal(directory))
        seqs = [f.seq for f in frames]
        assert len(seqs) == len(set(seqs))
        assert set(acknowledged) <= set(seqs)
        assert all(f.payload == child_payload(f.seq) for f in frames)


# --- codecs ------------------------------------------------------------------------------
opt_text = st.none() | st.text(max_size=40)
int32s = hnp.arrays(np.int32, st.integers(0, 300))
# Every float32 bit pattern: NaNs with payloads, infinities, subnormals, -0.0.
float32s = hnp.arrays(np.uint32, st.integers(0, 300)).map(lambda a: a.view(np.float32))
any_float = st.floats(allow_nan=True, allow_infinity=True)
ragged_ints = st.lists(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5), max_size=5)
ragged_floats = st.lists(st.lists(any_float, max_size=5), max_size=5)


@st.composite
def turn_records(draw: Callable[..., Any]) -> TurnRecord:
    return TurnRecord(
        turn_id=draw(st.text(max_size=40)),
        rollout_id=draw(st.text(max_size=40)),
        turn_index=draw(st.integers(0, 2**31)),
        choice_index=draw(st.integers(0, 16)),
        endpoint=draw(st.sampled_from(["chat.completions", "completions"])),
        model=draw(st.text(max_size=20)),
        policy_version=draw(st.integers(-(2**63), 2**63 - 1)),
        status=draw(st.sampled_from(TurnStatus)),
        token_source=draw(st.sampled_from(TokenSource)),
        prompt_token_ids=draw(int32s),
        completion_token_ids=draw(int32s),
        behavior_logprobs=draw(float32s),
        finish_reason=draw(opt_text),
        stop_reason=draw(opt_text),
        request_messages_json=draw(opt_text),
        request_tools_json=draw(opt_text),
        request_prompt_json=draw(opt_text),
        response_message_json=draw(opt_text),
        response_text=draw(opt_text),
        sampling_params_json=draw(st.text(max_size=40)),
        timings=Timings(
            draw(any_float), draw(any_float), draw(st.none() | any_float), draw(any_float)
        ),
        http_status=draw(st.integers(100, 599)),
        error=draw(opt_text),
        group_id=draw(opt_text),
        top_logprob_ids=draw(st.none() | ragged_ints),
        top_logprob_values=draw(st.none() | ragged_floats),
        policy_version_spans=draw(
            st.lists(
                st.tuples(st.integers(0, 2**31 - 1), st.integers(-(2**63), 2**63 - 1)),
                max_size=4,
            )
        ),
        policy_switch_unlocated=draw(st.booleans()),
    )


def _float_bits(x: float | None) -> Any:
    return None if x is None else np.float64(x).view(np.uint64)


def assert_same_turn(a: TurnRecord, b: object) -> None:
    assert isinstance(b, TurnRecord)
    for name in (f.name for f in dataclasses.fields(TurnRecord)):
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name  # bit-exact, NaN payloads included
        elif name == "timings":
            assert [_float_bits(v) for v in (x.received_at, x.queue_s, x.ttft_s, x.total_s)] == [
                _float_bits(v) for v in (y.received_at, y.queue_s, y.ttft_s, y.total_s)
            ]
        elif name == "top_logprob_values" and x is not None:
            assert [[_float_bits(v) for v in r] for r in x] == [
                [_float_bits(v) for v in r] for r in y
            ]
        else:
            assert x == y and type(x) is type(y), name


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn_records())
def test_turn_codec_round_trip(record: TurnRecord) -> None:
    decoded = decode_turn(encode_turn(record))
    assert_same_turn(record, decoded)
    assert decoded.behavior_logprobs.flags.writeable
    kind, payload = encode_event(record)
    assert kind == EventKind.TURN
    assert_same_turn(record, decode_event(kind, payload))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=500), st.integers(0, 255))
def test_decoders_refuse_garbage_with_codec_error(data: bytes, kind: int) -> None:
    with contextlib.suppress(CodecError):
        decode_event(kind, data)


def test_decoders_refuse_damaged_turns() -> None:
    payload = encode_turn(_example_turn())
    for cut in range(len(payload)):
        with pytest.raises(CodecError):
            decode_turn(payload[:cut])


def _example_turn() -> TurnRecord:
    return TurnRecord(
        turn_id="t",
        rollout_id="r",
        turn_index=0,
        choice_index=0,
        endpoint="completions",
        model="m",
        policy_version=3,
        status=TurnStatus.OK,
        token_source=TokenSource.BACKEND,
        prompt_token_ids=np.arange(5, dtype=np.int32),
        completion_token_ids=np.arange(3, dtype=np.int32),
        behavior_logprobs=np.array([np.nan, -0.5, -np.inf], dtype=np.float32),
        finish_reason="stop",
        stop_reason=None,
        request_messages_json=None,
        request_tools_json=None,
        request_prompt_json='"hi"',
        response_message_json=None,
        response_text="ok",
        sampling_params_json="{}",
        timings=Timings(1.0, 0.0, None, 2.0),
        http_status=200,
    )


def test_turn_codec_refuses_lossy_arrays() -> None:
    record = _example_turn()
    record.behavior_logprobs = np.zeros(3, dtype=np.float64)
    with pytest.raises(CodecError):
        encode_turn(record)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
events = st.one_of(
    st.builds(
        RolloutCreated,
        st.text(max_size=20),
        opt_text,
        opt_text,
        st.none() | st.dictionaries(st.text(max_size=8), json_values, max_size=4),
        st.booleans(),
        st.floats(allow_nan=False),
    ),
    st.builds(
        RewardsPosted,
        st.text(max_size=20),
        st.dictionaries(st.text(max_size=8), st.floats(allow_nan=False), max_size=4),
        st.dictionaries(st.text(max_size=8), opt_text, max_size=4),
    ),
    st.builds(
        RolloutSealed,
        st.text(max_size=20),
        st.sampled_from(RolloutStatus),
        st.floats(allow_nan=False),
    ),
    st.builds(PolicyVersionSet, st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False)),
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_event_codecs_round_trip(event: Any) -> None:
    kind, payload = encode_event(event)
    assert decode_event(kind, payload) == event


def test_nan_reward_round_trips() -> None:
    event = RewardsPosted("r", {"a": float("nan"), "b": -0.0}, {"a": "info"})
    decoded = decode_event(*encode_event(event))
    assert isinstance(decoded, RewardsPosted)
    assert np.isnan(decoded.rewards["a"]) and str(decoded.rewards["b"]) == "-0.0"


async def test_journal_carries_turns(tmp_path: Path) -> None:
    record = _example_turn()
    with FileJournal(tmp_path, fsync="always") as j:
        await j.wait_durable(j.append(*encode_event(record)))
    (frame,) = read_journal(tmp_path)
    assert_same_turn(record, decode_event(frame.kind, frame.payload))
