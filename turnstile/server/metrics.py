"""Prometheus metrics: `GET /metrics` in the text exposition format.

Two kinds of metric live here. Events on the request path (HTTP requests, finished
turns, their tokens, latency and time to first token) are counted as they happen: the
ASGI middleware `HTTPMetrics` counts every request by route class and status, and
`EventMetrics.observe` is the proxy's `on_turn` observer, called once per finished call.
Everything that is state rather than an event (open rollouts, in-flight calls, the
writer's queue, journal lag, stitching breaks, recorder health, backend health) is read
from the serving state (`ServingState`: the proxy, its recorder and journal) when
Prometheus scrapes, so it costs nothing between scrapes.

Each app gets its own `CollectorRegistry` (several apps in one process, as in tests, do
not share counters). With `--workers N` every worker process serves its own numbers;
scrape each worker or sum them in Prometheus.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnstile.errors import TurnstileError
from turnstile.records import BreakKind, TurnRecord

if TYPE_CHECKING:
    from turnstile.backends.protocol import Backend
    from turnstile.journal.turns import TurnJournal
    from turnstile.output.recorder import Recorder
    from turnstile.proxy.admission import Admission
    from turnstile.proxy.rollouts import RolloutRegistry

CONTENT_TYPE: Final[str] = CONTENT_TYPE_LATEST
METRICS_PATH: Final[str] = "/metrics"

# Latency buckets (seconds): agent turns range from tens of milliseconds (cached, short)
# to many minutes (long reasoning on a loaded server), so the buckets span both.
LATENCY_BUCKETS: Final[tuple[float, ...]] = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    900.0,
)
# Time to first token is bounded by queueing and prefill: finer at the low end.
TTFT_BUCKETS: Final[tuple[float, ...]] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
# A scrape probes the backend's /health, but must answer well inside Prometheus' default
# 10 s scrape timeout even when the backend hangs.
BACKEND_PROBE_TIMEOUT_S: Final[float] = 2.0
# Scrapes closer together than this reuse the last probe: several Prometheus servers (or
# a dashboard refreshing) must not turn into a probe storm on the backend.
BACKEND_PROBE_CACHE_S: Final[float] = 5.0

# Route classes for the `route` label: a fixed, small set (never raw paths, which carry
# rollout ids and would make the label unbounded).
_ROUTES: Final[tuple[tuple[re.Pattern[str], str], ...]] = (
    (re.compile(r"^(/rollouts/[^/]+)?/v1/chat/completions$"), "chat_completions"),
    (re.compile(r"^(/rollouts/[^/]+)?/v1/completions$"), "completions"),
    (re.compile(r"^/rollouts/[^/]+/rewards$"), "rewards"),
    (re.compile(r"^/rollouts/[^/]+/finish$"), "finish"),
    (re.compile(r"^/rollouts(/[^/]+)?$"), "rollouts"),
    (re.compile(r"^/admin(/|$)"), "admin"),
    (re.compile(r"^/health$"), "health"),
    (re.compile(r"^/stats$"), "stats"),
    (re.compile(r"^/metrics$"), "metrics"),
    (re.compile(r"^(/v1/|/tokenize$|/detokenize$|/version$)"), "passthrough"),
)


def route_class(path: str) -> str:
    """The `route` label of a request path."""
    for pattern, name in _ROUTES:
        if pattern.match(path):
            return name
    return "other"


class ServingState(Protocol):
    """What a scrape reads: the proxy's live state, its recorder and its journal."""

    @property
    def recorder(self) -> Recorder: ...

    @property
    def registry(self) -> RolloutRegistry: ...

    @property
    def journal(self) -> TurnJournal: ...

    @property
    def admission(self) -> Admission: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def policy_version(self) -> int: ...

    @property
    def draining(self) -> bool: ...

    def retention_floor(self) -> int: ...


class EventMetrics:
    """The counters of events on the request path: HTTP requests and finished calls."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "turnstile_http_requests",
            "HTTP requests answered, by route class and status.",
            ["route", "status"],
            registry=r,
        )
        self.turns = Counter(
            "turnstile_turns",
            "Recorded turns (one per choice), by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.calls = Counter(
            "turnstile_calls",
            "Completion calls that reached the backend stage, by endpoint and HTTP status.",
            ["endpoint", "http_status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "turnstile_prompt_tokens",
            "Prompt tokens the backend consumed (recorded).",
            ["endpoint"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "turnstile_completion_tokens",
            "Completion tokens the backend sampled (recorded).",
            ["endpoint"],
            registry=r,
        )
        self.latency = Histogram(
            "turnstile_call_duration_seconds",
            "Seconds from receipt until a call ended.",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "turnstile_time_to_first_token_seconds",
            "Seconds from receipt until the first completion byte of a streamed call.",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )

    def observe(self, records: Sequence[TurnRecord]) -> None:
        """Count one finished call (all its choices share the call's timings)."""
        if not records:
            return
        first = records[0]
        endpoint = first.endpoint
        self.calls.labels(endpoint, str(first.http_status)).inc()
        prompt = completion = 0
        for record in records:
            self.turns.labels(endpoint, record.status.value).inc()
            completion += len(record.completion_token_ids)
            prompt = max(prompt, len(record.prompt_token_ids))  # choices share the prompt
        self.prompt_tokens.labels(endpoint).inc(prompt)
        self.completion_tokens.labels(endpoint).inc(completion)
        timings = first.timings
        stream = "true" if timings.ttft_s is not None else "false"
        self.latency.labels(endpoint, stream).observe(timings.total_s)
        if timings.ttft_s is not None:
            self.ttft.labels(endpoint).observe(timings.ttft_s)


class TurnstileMetrics:
    """The metrics of one app: its event counters plus a collector over live state."""

    def __init__(
        self, events: EventMetrics, state: ServingState, backend: Backend | None = None
    ) -> None:
        self.events = events
        self.state = state
        self.backend = backend
        self.backend_up: float | None = None
        self._probed_at = -BACKEND_PROBE_CACHE_S
        self._probe_lock = asyncio.Lock()
        events.registry.register(_StateCollector(self))

    async def probe_backend(self) -> None:
        """Refresh `backend_up` from the backend's `/health` (cached between scrapes)."""
        if self.backend is None:
            return
        async with self._probe_lock:
            now = time.monotonic()
            if now - self._probed_at < BACKEND_PROBE_CACHE_S:
                return
            self._probed_at = now
            self.backend_up = 1.0 if await _healthy(self.backend) else 0.0

    async def exposition(self) -> bytes:
        """The text exposition of every metric, after a (cached) backend probe."""
        await self.probe_backend()
        return generate_latest(self.events.registry)


async def _healthy(backend: Backend) -> bool:
    try:
        async with asyncio.timeout(BACKEND_PROBE_TIMEOUT_S):
            resp = await backend.request("GET", "/health", None, {})
            try:
                await resp.read()
            finally:
                resp.close()
    except (TurnstileError, TimeoutError, OSError):
        return False
    return resp.status < 400


class _StateCollector(Collector):
    """Reads gauges and cumulative counters from the serving state at scrape time."""

    def __init__(self, metrics: TurnstileMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []  # the families are produced at collect time only

    def collect(self) -> Iterable[Metric]:
        state = self._metrics.state
        recorder = state.recorder
        stats = recorder.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge(
            "turnstile_open_rollouts", "Rollouts open (not yet sealed).", state.registry.open_count
        )
        yield gauge(
            "turnstile_open_rollout_bytes",
            "Bytes of turns held by open rollouts.",
            state.registry.held_bytes,
        )
        yield gauge("turnstile_in_flight_calls", "Completion calls in flight.", state.in_flight)
        yield gauge(
            "turnstile_policy_version", "Policy version of new turns.", state.policy_version
        )
        yield gauge("turnstile_draining", "1 while shutting down.", float(state.draining))
        yield gauge(
            "turnstile_recorder_queue_depth",
            "Work items queued for the writer thread.",
            recorder.backlog,
        )
        yield gauge(
            "turnstile_writer_lag_turns",
            "Turns received but not yet written to a shard buffer.",
            max(0, stats.turns_received - stats.turns_written),
        )
        yield gauge(
            "turnstile_recorder_healthy",
            "1 while the recorder writes without error.",
            float(recorder.healthy),
        )
        yield counter(
            "turnstile_turns_received", "Turns handed to the recorder.", stats.turns_received
        )
        yield counter(
            "turnstile_turns_written", "Turns written by the recorder.", stats.turns_written
        )
        yield counter(
            "turnstile_samples_written", "Training samples written.", stats.samples_written
        )
        yield counter("turnstile_rollouts_written", "Rollout rows written.", stats.rollouts_written)
        yield counter(
            "turnstile_retokenized_turns",
            "Turns the backend returned no token IDs for.",
            stats.retokenized_turns,
        )
        yield counter(
            "turnstile_dropped", "Work dropped (stays 0: work is refused up front).", stats.dropped
        )
        admission = state.admission
        if admission.ahead is not None:
            yield gauge(
                "turnstile_admission_ahead_versions",
                "Versions of data the harness is ahead of the trainer (admission control).",
                admission.ahead,
            )
        yield counter(
            "turnstile_admission_refused",
            "New rollouts refused with 429 by admission control.",
            admission.refused,
        )
        yield counter(
            "turnstile_recorder_errors",
            "Failures of the writer thread (each also an incident until acknowledged).",
            stats.errors_total,
        )
        yield gauge(
            "turnstile_recorder_incident",
            "1 while a recorder failure or quarantine is unacknowledged "
            "(POST /admin/recorder/ack clears it).",
            float(recorder.incident is not None),
        )
        held = CounterMetricFamily(
            "turnstile_quarantined_rows",
            "Rows written to the quarantine table instead of their own, by that table.",
            labels=["table"],
        )
        quarantined = recorder.quarantined
        for table in sorted({"turns", "samples", "rollouts"} | set(quarantined)):
            held.add_metric([table], quarantined.get(table, 0))
        yield held
        breaks = CounterMetricFamily(
            "turnstile_stitch_breaks",
            "Samples that start at a stitching break, by kind.",
            labels=["kind"],
        )
        counts = dict(stats.breaks_by_kind)
        # Every kind from the start (zero until seen), so rates and alerts have a series.
        for kind in sorted({k.value for k in BreakKind if k is not BreakKind.FIRST} | set(counts)):
            breaks.add_metric([kind], counts.get(kind, 0))
        yield breaks
        yield from _journal_families(state)
        up = self._metrics.backend_up
        if up is not None:
            yield gauge(
                "turnstile_backend_up",
                "1 when the backend's /health answered at the last probe.",
                up,
            )


def _journal_families(state: ServingState) -> Iterable[Metric]:
    journal = state.journal
    if not journal.attached:
        return
    segments = journal.segments()
    yield GaugeMetricFamily(
        "turnstile_journal_healthy", "1 while the journal appends.", value=float(journal.healthy)
    )
    yield GaugeMetricFamily(
        "turnstile_journal_segments", "Journal segment files kept.", value=len(segments)
    )
    yield GaugeMetricFamily(
        "turnstile_journal_bytes",
        "Bytes of journal segments kept.",
        value=sum(s.size_bytes for s in segments),
    )
    yield CounterMetricFamily(
        "turnstile_journal_segments_removed",
        "Journal segments removed once published.",
        value=journal.segments_removed,
    )
    # Frames appended but still needed: by open rollouts or by unpublished writer work.
    lag = journal.next_seq - state.retention_floor()
    yield GaugeMetricFamily(
        "turnstile_journal_lag_frames",
        "Journal frames not yet covered by published shards.",
        value=max(0, lag),
    )


class HTTPMetrics:
    """Pure ASGI middleware: counts every HTTP request by route class and status."""

    def __init__(self, app: ASGIApp, events: EventMetrics) -> None:
        self.app = app
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an app that raises before answering is a 500 to the client

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.events.http_requests.labels(route_class(scope["path"]), str(status)).inc()


def add_metrics_route(app: Starlette, metrics: TurnstileMetrics) -> None:
    """Serve `GET /metrics` from `app`."""

    async def scrape(request: Request) -> Response:
        return Response(await metrics.exposition(), media_type=CONTENT_TYPE)

    app.add_route(METRICS_PATH, scrape, methods=["GET"], include_in_schema=False)
