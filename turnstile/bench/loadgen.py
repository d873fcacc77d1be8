"""A bounded HTTP/1.1 load generator for `turnstile bench`, run as its own process.

Each of `--concurrency` workers holds one keep-alive connection (raw
`asyncio.open_connection`) and sends the same pre-encoded Chat Completions request
over and over, so every target sees identical bytes. A minimal response reader handles
`Content-Length` and chunked bodies (an SSE stream ends with its 0-length chunk) and
records, per request, the total latency and the time to the first body byte (TTFB).
Bodies are checked, not kept: a stream must end with `data: [DONE]`.

Warm-up requests (per worker, before the measured phase) are not counted. With `--sync`
the generator prints `READY` after warming up and waits for a line on stdin before
measuring, so a caller can sample CPU counters around exactly the measured phase.
A duration run stops starting requests after `--duration` seconds and lets those in
flight finish (they are counted); a hard deadline ends the process in any case.
Only loopback targets are accepted.

    python -m turnstile.bench.loadgen --url http://127.0.0.1:8100/v1/chat/completions \\
        --concurrency 32 --duration 3 --stream --json-out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import orjson

LOOPBACK_HOSTS: Final[frozenset[str]] = frozenset({"127.0.0.1", "::1", "localhost"})
DEFAULT_PATH: Final[str] = "/v1/chat/completions"
# Bytes asked of the socket per read: a 60 KB body or a burst of SSE events in one or two.
READ_SIZE: Final[int] = 256 * 1024
# A response head larger than this is not from a chat-completions server.
MAX_HEAD_BYTES: Final[int] = 64 * 1024
# Consumed bytes are dropped from the read buffer once this many have piled up, so a
# long stream does not grow it without bound.
COMPACT_BYTES: Final[int] = 1024 * 1024
# After a failed request a worker waits this long before reconnecting, so a dead
# target costs a few hundred attempts per second rather than a spinning core.
ERROR_BACKOFF_S: Final[float] = 0.01
# Time allowed, beyond the measured phase, for warm-up and for requests in flight to
# finish; past it the run is cut short and what was in flight counts as errors.
DEADLINE_MARGIN_S: Final[float] = 30.0
# A `--requests` run has no duration to derive a deadline from; this is its default.
DEFAULT_REQUESTS_DEADLINE_S: Final[float] = 120.0
# How long `--sync` waits for the go-ahead on stdin before giving up.
SYNC_WAIT_S: Final[float] = 60.0
# Once the hard deadline has passed, the process exits this much later even if the
# event loop is stuck (a watchdog thread calls os._exit).
WATCHDOG_GRACE_S: Final[float] = 5.0
# Distinct error messages kept in the output, to say what went wrong without flooding it.
MAX_ERROR_KINDS: Final[int] = 10
DONE_TAIL: Final[bytes] = b"data: [DONE]\n\n"
DEFAULT_CONTENT: Final[str] = "Write a short story about a lighthouse keeper."


class BenchError(Exception):
    """A request failed (bad status, malformed or truncated response)."""


class LoopbackOnly(ValueError):
    """The target is not on this machine's loopback interface."""


@dataclass(frozen=True, slots=True)
class Target:
    host: str  # what to connect to
    port: int
    path: str
    host_header: str


def parse_target(url: str) -> Target:
    """Split `url`; refuse anything but plain HTTP on 127.0.0.1, ::1 or localhost."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise LoopbackOnly(f"only http:// URLs are supported, not {url!r}")
    host = parts.hostname or ""
    if host not in LOOPBACK_HOSTS:
        raise LoopbackOnly(f"the load generator only targets loopback, not {host!r}")
    port = parts.port or 80
    connect = "127.0.0.1" if host == "localhost" else host
    header_host = f"[{host}]" if ":" in host else host
    return Target(connect, port, parts.path or DEFAULT_PATH, f"{header_host}:{port}")


def request_body(stream: bool, content: str = DEFAULT_CONTENT) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "logprobs": True,
            "return_token_ids": True,
            "stream": stream,
        }
    )


def encode_request(target: Target, body: bytes) -> bytes:
    head = (
        f"POST {target.path} HTTP/1.1\r\n"
        f"Host: {target.host_header}\r\n"
        "Content-Type: application/json\r\n"
        "Accept: */*\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


@dataclass(slots=True)
class Response:
    status: int
    body_bytes: int
    first_byte_at: float
    keep_alive: bool
    tail: bytes


class Connection:
    """One keep-alive HTTP/1.1 connection with a hand-rolled response reader."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.pos = 0

    @classmethod
    async def open(cls, target: Target) -> Connection:
        reader, writer = await asyncio.open_connection(target.host, target.port)
        return cls(reader, writer)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    async def _fill(self) -> None:
        if self.pos >= COMPACT_BYTES:
            del self.buf[: self.pos]
            self.pos = 0
        data = await self.reader.read(READ_SIZE)
        if not data:
            raise BenchError("connection closed by the server mid-response")
        self.buf += data

    async def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n", self.pos)) < 0:
            if len(self.buf) - self.pos > MAX_HEAD_BYTES:
                raise BenchError("a header or chunk-size line is too long")
            await self._fill()
        line = bytes(self.buf[self.pos : end])
        self.pos = end + 2
        return line

    async def request(self, data: bytes) -> Response:
        self.writer.write(data)
        await self.writer.drain()
        # head
        while (end := self.buf.find(b"\r\n\r\n", self.pos)) < 0:
            if len(self.buf) - self.pos > MAX_HEAD_BYTES:
                raise BenchError("the response head is too long")
            await self._fill()
        head = bytes(self.buf[self.pos : end]).decode("latin-1")
        self.pos = end + 4
        lines = head.split("\r\n")
        status_parts = lines[0].split(" ", 2)
        if len(status_parts) < 2 or not status_parts[0].startswith("HTTP/1."):
            raise BenchError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(status_parts[1])
        length: int | None = None
        chunked = False
        keep_alive = status_parts[0] == "HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "connection":
                keep_alive = "close" not in value
        if len(self.buf) == self.pos and (chunked or length):
            await self._fill()
        first_byte_at = time.perf_counter()
        if chunked:
            size, tail = await self._chunked_body()
        elif length is not None:
            size, tail = await self._sized_body(length)
        else:
            raise BenchError("a response with neither Content-Length nor chunked encoding")
        if self.pos == len(self.buf):
            self.buf.clear()
            self.pos = 0
        return Response(status, size, first_byte_at, keep_alive, tail)

    async def _sized_body(self, length: int) -> tuple[int, bytes]:
        while len(self.buf) - self.pos < length:
            await self._fill()
        tail = bytes(
            self.buf[max(self.pos, self.pos + length - len(DONE_TAIL)) : self.pos + length]
        )
        self.pos += length
        return length, tail

    async def _chunked_body(self) -> tuple[int, bytes]:
        total = 0
        tail = b""
        while True:
            size_line = await self._line()
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BenchError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while await self._line():  # trailers, up to the empty line
                    pass
                return total, tail
            while len(self.buf) - self.pos < size + 2:
                await self._fill()
            end = self.pos + size
            if self.buf[end : end + 2] != b"\r\n":
                raise BenchError("a chunk is not followed by CRLF")
            tail = (tail + bytes(self.buf[max(self.pos, end - len(DONE_TAIL)) : end]))[
                -len(DONE_TAIL) :
            ]
            total += size
            self.pos = end + 2


@dataclass(slots=True)
class Stats:
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    body_bytes: int = 0
    last_done: float = 0.0

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        kind = f"{type(exc).__name__}: {exc}"[:200]
        if kind in self.error_kinds or len(self.error_kinds) < MAX_ERROR_KINDS:
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


@dataclass(slots=True)
class Plan:
    target: Target
    request: bytes
    warmup_request: bytes
    stream: bool
    concurrency: int
    warmup: int
    duration_s: float | None
    requests: int | None
    # set when the measured phase starts
    stop_at: float = float("inf")
    remaining: int = 0


def make_plan(
    target: Target,
    *,
    stream: bool,
    concurrency: int,
    warmup: int = 1,
    duration_s: float | None = None,
    requests: int | None = None,
    warmup_no_stream: bool = False,
    content: str = DEFAULT_CONTENT,
) -> Plan:
    """A run of `requests` requests in all, or of `duration_s` seconds."""
    if (duration_s is None) == (requests is None):
        raise ValueError("give exactly one of duration_s and requests")
    return Plan(
        target=target,
        request=encode_request(target, request_body(stream, content)),
        warmup_request=encode_request(
            target, request_body(stream and not warmup_no_stream, content)
        ),
        stream=stream,
        concurrency=concurrency,
        warmup=warmup,
        duration_s=duration_s,
        requests=requests,
    )


async def _one(conn: Connection, plan: Plan, *, warm: bool = False) -> Response:
    data = plan.warmup_request if warm else plan.request
    resp = await conn.request(data)
    if resp.status != 200:
        raise BenchError(f"HTTP status {resp.status}")
    if not warm and plan.stream and resp.tail != DONE_TAIL:
        raise BenchError("the stream did not end with data: [DONE]")
    return resp


class Worker:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.conn: Connection | None = None
        self.in_flight = False

    async def _conn(self) -> Connection:
        if self.conn is None:
            self.conn = await Connection.open(self.plan.target)
        return self.conn

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    async def warm_up(self, stats: Stats) -> None:
        for _ in range(self.plan.warmup):
            start = time.perf_counter()
            try:
                resp = await _one(await self._conn(), self.plan, warm=True)
            except (OSError, BenchError, ValueError, asyncio.IncompleteReadError) as exc:
                stats.error(exc)
                self._drop()
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            stats.latencies.append(time.perf_counter() - start)
            if not resp.keep_alive:
                self._drop()

    def _may_start(self) -> bool:
        plan = self.plan
        if plan.requests is not None:
            if plan.remaining <= 0:
                return False
            plan.remaining -= 1
            return True
        return time.perf_counter() < plan.stop_at

    async def run(self, stats: Stats) -> None:
        while self._may_start():
            self.in_flight = True
            start = time.perf_counter()
            try:
                resp = await _one(await self._conn(), self.plan)
            except (OSError, BenchError, ValueError, asyncio.IncompleteReadError) as exc:
                self.in_flight = False
                stats.error(exc)
                self._drop()
                await asyncio.sleep(ERROR_BACKOFF_S)
                continue
            done = time.perf_counter()
            self.in_flight = False
            stats.latencies.append(done - start)
            stats.ttfbs.append(resp.first_byte_at - start)
            stats.body_bytes += resp.body_bytes
            stats.last_done = done
            if not resp.keep_alive:
                self._drop()

    def close(self) -> None:
        self._drop()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 4)


def summarize(
    stats: Stats, plan: Plan, started: float, timed_out: bool, cpu_s: float
) -> dict[str, Any]:
    end = stats.last_done if stats.last_done > started else time.perf_counter()
    duration = max(end - started, 1e-9)
    n = len(stats.latencies)
    return {
        "requests": n,
        "loadgen_cpu_s": round(cpu_s, 6),
        "errors": stats.errors,
        "error_kinds": stats.error_kinds,
        "timed_out": timed_out,
        "duration_s": round(duration, 6),
        "req_per_s": round(n / duration, 3),
        "latency_p50_ms": _ms(percentile(stats.latencies, 50)),
        "latency_p90_ms": _ms(percentile(stats.latencies, 90)),
        "latency_p99_ms": _ms(percentile(stats.latencies, 99)),
        "ttfb_p50_ms": _ms(percentile(stats.ttfbs, 50)),
        "ttfb_p99_ms": _ms(percentile(stats.ttfbs, 99)),
        "body_bytes": stats.body_bytes,
        "concurrency": plan.concurrency,
        "stream": plan.stream,
        "warmup_per_worker": plan.warmup,
    }


async def _wait_for_go() -> None:
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    line = await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), SYNC_WAIT_S)
    if not line:
        raise BenchError("stdin closed before the go-ahead")


async def run_load(plan: Plan, *, deadline_s: float, sync: bool = False) -> dict[str, Any]:
    """Warm up, then run the measured phase; returns the summary (see `summarize`)."""
    workers = [Worker(plan) for _ in range(plan.concurrency)]
    warm = Stats()
    stats = Stats()
    started = time.perf_counter()
    cpu_start = time.process_time()
    timed_out = False
    try:
        async with asyncio.timeout(deadline_s):
            if plan.warmup:
                await asyncio.gather(*(w.warm_up(warm) for w in workers))
            if sync:
                await _wait_for_go()
            started = time.perf_counter()
            cpu_start = time.process_time()
            if plan.duration_s is not None:
                plan.stop_at = started + plan.duration_s
            plan.remaining = plan.requests or 0
            await asyncio.gather(*(w.run(stats) for w in workers))
    except TimeoutError:
        timed_out = True
        for w in workers:
            if w.in_flight:
                stats.error(BenchError("cut short by the hard deadline"))
    finally:
        for w in workers:
            w.close()
    summary = summarize(stats, plan, started, timed_out, time.process_time() - cpu_start)
    summary["warmup_requests"] = len(warm.latencies)
    summary["warmup_errors"] = warm.errors
    return summary


def _watchdog(seconds: float) -> None:
    """Exit the process `seconds` from now, whatever the event loop is doing."""
    timer = threading.Timer(seconds, lambda: os._exit(3))
    timer.daemon = True
    timer.start()


def run_fast(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """Run `coro` on uvloop where it is installed, else on the asyncio default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m turnstile.bench.loadgen", description=__doc__.split("\n")[0]
    )
    p.add_argument("--url", required=True, help="http://127.0.0.1:PORT[/path] (loopback only)")
    p.add_argument("--concurrency", type=int, default=1, help="workers, one connection each")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--duration", type=float, help="seconds of measured load")
    how.add_argument("--requests", type=int, help="measured requests in all")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per worker")
    p.add_argument(
        "--warmup-no-stream",
        action="store_true",
        help="send the warm-up requests non-streaming (opens the connections "
        "without waiting for paced streams)",
    )
    p.add_argument("--deadline", type=float, help="hard limit on the whole run, seconds")
    p.add_argument("--content", default=DEFAULT_CONTENT, help="the user message")
    p.add_argument("--cpu", type=int, help="pin this process to one CPU")
    p.add_argument(
        "--sync", action="store_true", help="print READY after warm-up and wait for a line on stdin"
    )
    p.add_argument("--json-out", help="write the summary here (default: stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        target = parse_target(args.url)
    except LoopbackOnly as exc:
        parser.error(str(exc))
    if args.concurrency < 1 or args.warmup < 0:
        parser.error("--concurrency must be at least 1 and --warmup at least 0")
    if (args.duration is not None and args.duration <= 0) or (
        args.requests is not None and args.requests < 1
    ):
        parser.error("--duration must be positive and --requests at least 1")
    if args.deadline is not None:
        deadline = float(args.deadline)
    elif args.duration is not None:
        deadline = args.duration + DEADLINE_MARGIN_S
    else:
        deadline = DEFAULT_REQUESTS_DEADLINE_S
    if args.sync:
        deadline += SYNC_WAIT_S
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    _watchdog(deadline + WATCHDOG_GRACE_S)
    plan = make_plan(
        target,
        stream=args.stream,
        concurrency=args.concurrency,
        warmup=args.warmup,
        duration_s=args.duration,
        requests=args.requests,
        warmup_no_stream=args.warmup_no_stream,
        content=args.content,
    )
    summary = run_fast(run_load(plan, deadline_s=deadline, sync=args.sync))
    out = orjson.dumps(summary, option=orjson.OPT_INDENT_2)
    if args.json_out:
        with open(args.json_out, "wb") as f:
            f.write(out)
    else:
        sys.stdout.buffer.write(out + b"\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
