"""`turnstile bench`: Turnstile against the bare backend and nginx, side by side.

One fake backend serves everything (`turnstile.bench.backend`); nginx (when installed)
and Turnstile (recording into a temp dir) stand in front of it. A second set, whose
backend paces tokens, serves the paced-streaming scenario. For each scenario the rounds
are interleaved across targets (`direct`, `nginx`, `turnstile`), the order rotated each
round; each round is one run of `turnstile.bench.loadgen` in its own process. Around the
measured phase of a round the CPU time of the target's processes is read from /proc
(utime+stime of /proc/PID/stat, which counts every thread of the process) and divided
by the completed requests and, for streams, by the events (completion tokens). The
CPU of Turnstile's `ts-writer` and `ts-journal` threads, read per thread from
/proc/PID/task/TID, is its recording cost. At concurrency 1 every process is pinned to
one CPU. Medians and (min, max) over rounds are reported, with the machine's CPU model
and foreign load.

The long-context scenarios (`--long-context 32000,128000`) run the concurrency-1
scenarios again against backends whose answers carry that many prompt ids (as vLLM
returns a long agent context on every call), each with its own stack, so that CPU per
request can be read against prompt length; the writer's cost per turn at those lengths
(journal frame and Parquet row, `turnstile.bench.writer`) is measured beside them.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from turnstile.bench import descendants, free_port, healthy, stop_group, wait_until
from turnstile.bench.granian_serve import granian_installed
from turnstile.bench.nginx import Nginx, find_nginx, nginx_version, start_nginx
from turnstile.bench.report import derived, format_report
from turnstile.bench.writer import measure as measure_writer

TARGETS: Final[tuple[str, ...]] = ("direct", "nginx", "turnstile", "turnstile-2w")
# Turnstile targets and their worker processes (`turnstile serve --workers N`).
TURNSTILE_WORKERS: Final[dict[str, int]] = {"turnstile": 1, "turnstile-2w": 2}
# The HTTP servers Turnstile can run under: `turnstile serve --server uvicorn|raw`, and
# granian (`turnstile.bench.granian_serve`, measured only). With `--servers`, each
# Turnstile target runs once per server: `turnstile` under uvicorn (the default),
# `turnstile-raw`, `turnstile-granian`, ... (granian serves one worker only).
SERVERS: Final[tuple[str, ...]] = ("uvicorn", "raw", "granian")
DEFAULT_SERVER: Final[str] = "uvicorn"
ONE_WORKER_SERVERS: Final[frozenset[str]] = frozenset({"granian"})
# Resident memory of the soak's Turnstile is sampled this often.
SOAK_SAMPLE_S: Final[float] = 10.0
RECORDING_THREADS: Final[frozenset[str]] = frozenset({"ts-writer", "ts-journal"})
CLK_TCK: Final[int] = os.sysconf("SC_CLK_TCK")
# The backend builds its answers on the first request; it is up in well under a second.
BACKEND_START_TIMEOUT_S: Final[float] = 30.0
# Turnstile imports FastAPI, pyarrow and friends and replays its journal: ~1-2 s idle,
# much longer on a loaded machine.
TURNSTILE_START_TIMEOUT_S: Final[float] = 90.0
# Warm-up is one request per worker: 256 of them through a slow proxy take seconds.
WARMUP_TIMEOUT_S: Final[float] = 60.0
# After its measured phase a round lets the requests in flight finish: at most one
# stream per worker (~1-2 s at c=256 back to back through a slow proxy).
DRAIN_ALLOWANCE_S: Final[float] = 30.0
# A paced round may take this many times the ideal stream time before it is cut short
# (the slowest Python proxies measured reach ~2.5x at 256 x 50 tokens/s).
PACED_SLOWDOWN_ALLOWED: Final[float] = 4.0
# Streams per worker in a paced round: every worker runs one, all starting together.
PACED_STREAMS_PER_WORKER: Final[int] = 1
# The loadgen's own watchdog fires 5 s past its deadline; the runner waits a bit longer.
LOADGEN_EXIT_SLACK_S: Final[float] = 15.0
# Rows per writer measurement of a long-context length: 128k-token turns are ~0.5 MB each.
LONG_CONTEXT_WRITER_ROWS: Final[int] = 64
# Worker counts the long-context scenarios compare (the 2-worker figures add nothing there).
LONG_CONTEXT_TARGETS: Final[frozenset[str]] = frozenset({"direct", "nginx", "turnstile"})
# After a scenario, time for Turnstile's writer to finish what the last round queued,
# so the recording cost counts all of it.
RECORD_SETTLE_S: Final[float] = 0.5
QUICK: Final[dict[str, Any]] = {
    "rounds": 2,
    "duration_s": 1.0,
    "concurrency": [1, 32],
    "paced_streams": 32,
    "paced_tokens": 20,
    "long_context": [],
}


@dataclass
class BenchConfig:
    rounds: int = 5
    duration_s: float = 3.0
    prompt_tokens: int = 2000
    completion_tokens: int = 500
    paced_tokens: int = 200
    paced_rate: float = 50.0
    paced_streams: int = 256
    concurrency: list[int] = field(default_factory=lambda: [1, 32, 256])
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    keep: bool = False
    quick: bool = False
    soak_s: float = 0.0  # after the scenarios: paced streams for this long, RSS sampled
    long_context: list[int] = field(default_factory=list)  # prompt lengths, c=1 scenarios
    servers: list[str] = field(default_factory=lambda: [DEFAULT_SERVER])


def server_target(base: str, server: str) -> str:
    """The target name of Turnstile target `base` run under `server`."""
    return base if server == DEFAULT_SERVER else f"{base}-{server}"


def base_target(target: str) -> str:
    """`turnstile-2w-raw` -> `turnstile-2w`: the target a server variant stands for."""
    for server in SERVERS:
        if server != DEFAULT_SERVER and target.endswith(f"-{server}"):
            return target[: -len(server) - 1]
    return target


def expand_targets(targets: list[str], servers: list[str]) -> list[tuple[str, int, str]]:
    """Each target once per server: (name, worker processes, server); `direct` and
    `nginx` have no workers (0) and no server ("")."""
    out: list[tuple[str, int, str]] = []
    for target in targets:
        workers = TURNSTILE_WORKERS.get(target)
        if workers is None:
            out.append((target, 0, ""))
            continue
        for server in servers:
            if workers > 1 and server in ONE_WORKER_SERVERS:
                continue
            out.append((server_target(target, server), workers, server))
    return out


@dataclass(frozen=True)
class Scenario:
    name: str
    stream: bool
    concurrency: int
    paced: bool = False
    prompt_tokens: int | None = None  # a long-context scenario's prompt length

    def events_per_request(self, cfg: BenchConfig) -> int:
        if not self.stream:
            return 0
        return cfg.paced_tokens if self.paced else cfg.completion_tokens


def scenarios(cfg: BenchConfig) -> list[Scenario]:
    out = [Scenario(f"nonstream-c{c}", False, c) for c in cfg.concurrency]
    out += [Scenario(f"stream-c{c}", True, c) for c in cfg.concurrency]
    if cfg.paced_streams > 0:
        out.append(
            Scenario(
                f"paced-{cfg.paced_streams}x{cfg.paced_rate:g}tps",
                True,
                cfg.paced_streams,
                paced=True,
            )
        )
    for n in cfg.long_context:
        out += [
            Scenario(f"long{n}-nonstream-c1", False, 1, prompt_tokens=n),
            Scenario(f"long{n}-stream-c1", True, 1, prompt_tokens=n),
        ]
    return out


def stack_label(sc: Scenario) -> str:
    """The stack a scenario runs against (`start_stacks` names them so)."""
    if sc.prompt_tokens is not None:
        return f"long{sc.prompt_tokens}"
    return "paced" if sc.paced else "main"


# -- /proc ------------------------------------------------------------------------------
def _stat_ticks(path: str) -> int:
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return 0  # the process or thread is gone
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds of the processes, all their threads included."""
    return sum(_stat_ticks(f"/proc/{pid}/stat") for pid in pids) / CLK_TCK


def thread_cpu_s(pid: int, names: frozenset[str]) -> float | None:
    """CPU seconds of the threads of `pid` named one of `names`; None when there are none."""
    total = 0
    found = False
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            if comm in names:
                found = True
                total += _stat_ticks(f"/proc/{pid}/task/{tid}/stat")
    return total / CLK_TCK if found else None


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@contextlib.contextmanager
def pinned(pids: list[int], cpu: int) -> Iterator[None]:
    """Pin every thread of `pids` to `cpu`; restore each thread's mask afterwards
    (threads started meanwhile get their process's original mask)."""
    by_pid: dict[int, set[int]] = {}
    by_tid: dict[int, set[int]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            by_pid[pid] = os.sched_getaffinity(pid)
        for tid in _tids(pid):
            with contextlib.suppress(OSError):
                by_tid[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {cpu})
    try:
        yield
    finally:
        for pid, process_mask in by_pid.items():
            for tid in _tids(pid):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, by_tid.get(tid, process_mask))


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    loadavg = ""
    with contextlib.suppress(OSError):
        loadavg = Path("/proc/loadavg").read_text().strip()
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)),
        "loadavg_before": loadavg,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "clock_ticks_per_s": CLK_TCK,
    }


# -- processes ----------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        if (
            not wait_until(
                lambda: self.proc.poll() is not None or healthy(self.port), timeout_s, 0.1
            )
            or self.proc.poll() is not None
        ):
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{self.name} did not come up (exit {self.proc.poll()}):\n{tail}")


def spawn(name: str, args: list[str], port: int, workdir: Path) -> Server:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    return Server(name, proc, port, log)


@dataclass
class Stack:
    """A backend, and nginx and Turnstile in front of it."""

    label: str
    backend: Server
    nginx: Nginx | None = None
    turnstiles: dict[str, Server] = field(default_factory=dict)  # by target name

    @property
    def turnstile(self) -> Server | None:
        return self.turnstiles.get("turnstile")

    def url(self, target: str) -> str:
        if target == "direct":
            base = self.backend.url
        elif target == "nginx":
            base = self.nginx.url if self.nginx else ""
        else:
            base = self.turnstiles[target].url
        return base + "/v1/chat/completions"

    def target_pids(self, target: str) -> list[int]:
        if target == "nginx" and self.nginx is not None:
            return list(self.nginx.pids)
        if target in self.turnstiles:  # the supervisor and its workers, if any
            return descendants(self.turnstiles[target].proc.pid)
        return []  # direct: no proxy; the backend's CPU is not the target's

    def all_pids(self) -> list[int]:
        pids = [self.backend.proc.pid]
        if self.nginx is not None:
            pids += self.nginx.pids
        for server in self.turnstiles.values():
            pids += descendants(server.proc.pid)
        return pids

    def recording_cpu_s(self) -> float | None:
        if self.turnstile is None:
            return None
        return thread_cpu_s(self.turnstile.proc.pid, RECORDING_THREADS)

    def procs(self) -> list[tuple[subprocess.Popen[bytes], signal.Signals]]:
        """Each process group with its stop signal: Turnstile first, the backend last."""
        out = []
        for server in self.turnstiles.values():
            out.append((server.proc, signal.SIGTERM))
        if self.nginx is not None:
            out.append((self.nginx.proc, signal.SIGQUIT))
        out.append((self.backend.proc, signal.SIGTERM))
        return out


def stop_stacks(stacks: list[Stack]) -> None:
    """Signal every group at once (Turnstile takes a second or two to publish), then wait
    for each, SIGKILLing what lingers."""
    procs = [p for stack in stacks for p in stack.procs()]
    for proc, sig in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, sig)  # start_new_session: the group id is the pid
    for proc, sig in procs:
        stop_group(proc, sig)


def start_stacks(
    specs: list[tuple[str, float, int]],
    cfg: BenchConfig,
    workdir: Path,
    nginx_bin: str | None,
    stacks: list[Stack],
    servers: list[str] | None = None,
) -> None:
    """Start one stack per (label, tokens/s, prompt tokens) spec (tokens/s 0: back to back),
    appending to `stacks` as each backend starts so that the caller's `finally` can stop
    whatever did."""
    for label, rate, prompt_tokens in specs:
        tokens = cfg.paced_tokens if rate else cfg.completion_tokens
        port = free_port()
        args = [
            "-m",
            "turnstile.bench.backend",
            "--port",
            str(port),
            "--prompt-tokens",
            str(prompt_tokens),
            "--completion-tokens",
            str(tokens),
            "--tokens-per-s",
            str(rate),
        ]
        stacks.append(Stack(label, spawn(f"backend-{label}", args, port, workdir)))
    for stack in stacks:
        stack.backend.wait_ready(BACKEND_START_TIMEOUT_S)
    for stack in stacks:
        if nginx_bin is not None:
            stack.nginx = start_nginx(
                nginx_bin, workdir / f"nginx-{stack.label}", free_port(), stack.backend.port
            )
        for target, workers, server in expand_targets(cfg.targets, servers or cfg.servers):
            if not workers:
                continue
            if stack.label.startswith("long") and base_target(target) not in LONG_CONTEXT_TARGETS:
                continue
            port = free_port()
            name = f"{target}-{stack.label}"
            # granian is no `turnstile serve --server`: its own entry serves the same app
            entry = (
                ["turnstile.bench.granian_serve"] if server == "granian" else ["turnstile", "serve"]
            )
            args = [
                "-m",
                *entry,
                "--backend",
                stack.backend.url,
                "--output",
                str(workdir / name),
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--workers",
                str(workers),
            ]
            if server != "granian":
                args += ["--server", server]
            stack.turnstiles[target] = spawn(name, args, port, workdir)
    for stack in stacks:
        for started in stack.turnstiles.values():
            started.wait_ready(TURNSTILE_START_TIMEOUT_S)


# -- rounds -------------------------------------------------------------------------------
def loadgen_args(
    sc: Scenario, cfg: BenchConfig, url: str, out: Path, cpu: int | None
) -> tuple[list[str], float]:
    args = [
        "-m",
        "turnstile.bench.loadgen",
        "--url",
        url,
        "--concurrency",
        str(sc.concurrency),
        "--stream" if sc.stream else "--no-stream",
        "--sync",
        "--json-out",
        str(out),
        "--warmup",
        "1",
    ]
    if sc.paced:
        ideal = cfg.paced_tokens / cfg.paced_rate
        deadline = WARMUP_TIMEOUT_S + ideal * PACED_STREAMS_PER_WORKER * PACED_SLOWDOWN_ALLOWED
        args += ["--requests", str(sc.concurrency * PACED_STREAMS_PER_WORKER), "--warmup-no-stream"]
    else:
        deadline = WARMUP_TIMEOUT_S + cfg.duration_s + DRAIN_ALLOWANCE_S
        args += ["--duration", str(cfg.duration_s)]
    args += ["--deadline", f"{deadline:.1f}"]
    if cpu is not None:
        args += ["--cpu", str(cpu)]
    return args, deadline


def _await_ready(proc: subprocess.Popen[bytes]) -> bool:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], WARMUP_TIMEOUT_S)
    return bool(ready) and proc.stdout.readline().strip() == b"READY"


def run_round(
    stack: Stack, target: str, sc: Scenario, cfg: BenchConfig, workdir: Path, cpu: int | None
) -> dict[str, Any]:
    out = workdir / "round.json"
    out.unlink(missing_ok=True)
    args, deadline = loadgen_args(sc, cfg, stack.url(target), out, cpu)
    err = workdir / "loadgen.log"
    with err.open("wb") as err_f:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err_f,
            start_new_session=True,
        )
    pids = stack.target_pids(target)
    backend = [stack.backend.proc.pid]
    try:
        if not _await_ready(proc):
            raise RuntimeError(f"loadgen did not warm up: {err.read_text(errors='replace')}")
        cpu0, back0, rec0 = process_cpu_s(pids), process_cpu_s(backend), stack.recording_cpu_s()
        assert proc.stdin is not None
        try:
            proc.stdin.write(b"GO\n")
            proc.stdin.flush()
            proc.wait(deadline + LOADGEN_EXIT_SLACK_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"loadgen ran past its deadline of {deadline:.0f} s") from None
        except BrokenPipeError:
            proc.wait(LOADGEN_EXIT_SLACK_S)  # it died after warming up: reported below
        cpu1, back1, rec1 = process_cpu_s(pids), process_cpu_s(backend), stack.recording_cpu_s()
    finally:
        stop_group(proc, grace_s=1.0)
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"loadgen failed ({proc.returncode}): {err.read_text(errors='replace')[-2000:]}"
        )
    res: dict[str, Any] = orjson.loads(out.read_bytes())
    n = res["requests"]
    events = n * sc.events_per_request(cfg)
    proxy = target != "direct"
    res["target"] = target
    res["cpu_us_per_req"] = (cpu1 - cpu0) * 1e6 / n if proxy and n else None
    res["cpu_us_per_event"] = (cpu1 - cpu0) * 1e6 / events if proxy and events else None
    res["backend_cpu_us_per_req"] = (back1 - back0) * 1e6 / n if n else None
    res["loadgen_cpu_us_per_req"] = res["loadgen_cpu_s"] * 1e6 / n if n else None
    res["recording_us_per_turn"] = (
        (rec1 - rec0) * 1e6 / n
        if target == "turnstile" and rec0 is not None and rec1 is not None and n
        else None
    )
    res["events_per_s"] = res["req_per_s"] * sc.events_per_request(cfg)
    return res


METRICS: Final[tuple[str, ...]] = (
    "req_per_s",
    "events_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "ttfb_p50_ms",
    "cpu_us_per_req",
    "cpu_us_per_event",
    "recording_us_per_turn",
    "backend_cpu_us_per_req",
    "loadgen_cpu_us_per_req",
    "errors",
)


def spread(values: list[float | None]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def run_scenario(
    stack: Stack, sc: Scenario, cfg: BenchConfig, targets: list[str], workdir: Path, progress: bool
) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    cpu = max(os.sched_getaffinity(0)) if sc.concurrency == 1 else None
    pin = pinned(stack.all_pids(), cpu) if cpu is not None else contextlib.nullcontext()
    rec_start = stack.recording_cpu_s() if "turnstile" in targets else None
    with pin:
        for r in range(cfg.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for target in order:
                rounds[target].append(run_round(stack, target, sc, cfg, workdir, cpu))
                if progress:
                    res = rounds[target][-1]
                    print(
                        f"  {sc.name} round {r + 1}/{cfg.rounds} {target}: "
                        f"{res['requests']} requests, {res['req_per_s']:.0f}/s",
                        file=sys.stderr,
                        flush=True,
                    )
    result: dict[str, Any] = {
        **asdict(sc),
        "pinned_cpu": cpu,
        "events_per_request": sc.events_per_request(cfg),
        "targets": {},
    }
    for target, rs in rounds.items():
        result["targets"][target] = {
            "summary": {m: spread([r.get(m) for r in rs]) for m in METRICS},
            "requests": sum(r["requests"] for r in rs),
            "rounds": rs,
        }
    if "turnstile" in targets:
        time.sleep(RECORD_SETTLE_S)
        rec_end = stack.recording_cpu_s()
        # every request Turnstile answered is a recorded turn, warm-ups included
        turns = sum(r["requests"] + r["warmup_requests"] for r in rounds["turnstile"])
        result["recording_us_per_turn_total"] = (
            (rec_end - rec_start) * 1e6 / turns
            if rec_start is not None and rec_end is not None and turns
            else None
        )
    return result


# -- entry point --------------------------------------------------------------------------
def resolve_config(cfg: BenchConfig) -> BenchConfig:
    if cfg.quick:
        for key, value in QUICK.items():
            setattr(cfg, key, value)
    unknown = sorted(set(cfg.targets) - set(TARGETS))
    if unknown or not cfg.targets:
        raise ValueError(f"targets must be among {', '.join(TARGETS)}, not {unknown}")
    unknown = sorted(set(cfg.servers) - set(SERVERS))
    if unknown or not cfg.servers:
        raise ValueError(f"servers must be among {', '.join(SERVERS)}, not {unknown}")
    cfg.servers = [s for s in SERVERS if s in cfg.servers]
    if cfg.rounds < 1 or cfg.duration_s <= 0 or any(c < 1 for c in cfg.concurrency):
        raise ValueError("rounds, duration and concurrency must be positive")
    if cfg.paced_rate <= 0 or cfg.paced_tokens < 1 or cfg.completion_tokens < 1:
        raise ValueError("paced rate and token counts must be positive")
    if any(n < 1 for n in cfg.long_context):
        raise ValueError("long-context prompt lengths must be positive")
    cfg.targets = [t for t in TARGETS if t in cfg.targets]
    return cfg


def rss_mb(pids: list[int]) -> float:
    """Resident memory of `pids` together, in MiB (VmRSS from /proc)."""
    total_kb = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


def run_soak(stack: Stack, cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    """Paced streams through Turnstile for `cfg.soak_s`, its resident memory sampled."""
    assert stack.turnstile is not None
    out = workdir / "soak.json"
    deadline = WARMUP_TIMEOUT_S + cfg.soak_s + DRAIN_ALLOWANCE_S
    args = [
        "-m",
        "turnstile.bench.loadgen",
        "--url",
        stack.url("turnstile"),
        "--concurrency",
        str(cfg.paced_streams),
        "--stream",
        "--duration",
        str(cfg.soak_s),
        "--json-out",
        str(out),
        "--warmup",
        "1",
        "--deadline",
        f"{deadline:.1f}",
    ]
    pids = descendants(stack.turnstile.proc.pid)
    samples = [(0.0, rss_mb(pids))]
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while proc.poll() is None and time.monotonic() - start < deadline:
            time.sleep(min(SOAK_SAMPLE_S, max(0.1, cfg.soak_s / 10)))
            samples.append((round(time.monotonic() - start, 1), rss_mb(pids)))
    finally:
        stop_group(proc, grace_s=1.0)
    res: dict[str, Any] = orjson.loads(out.read_bytes()) if out.exists() else {}
    second_half = [mb for t, mb in samples if t >= cfg.soak_s / 2] or [samples[-1][1]]
    return {
        "duration_s": cfg.soak_s,
        "streams": cfg.paced_streams,
        "tokens_per_s": cfg.paced_rate,
        "requests": res.get("requests"),
        "errors": res.get("errors"),
        "rss_mb": samples,
        "rss_start_mb": samples[0][1],
        "rss_max_mb": max(mb for _, mb in samples),
        "rss_end_mb": samples[-1][1],
        "rss_second_half_range_mb": [min(second_half), max(second_half)],
    }


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_bench(
    cfg: BenchConfig, json_path: Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run every scenario; print the table, write `json_path`; returns the report."""
    cfg = resolve_config(cfg)
    started = time.monotonic()
    machine = machine_info()
    skipped: dict[str, str] = {}
    targets = list(cfg.targets)
    nginx_bin = find_nginx() if "nginx" in targets else None
    if "nginx" in targets and nginx_bin is None:
        skipped["nginx"] = "nginx is not installed (apt-get install nginx-light); not measured"
        targets.remove("nginx")
        if not targets:
            raise ValueError(skipped["nginx"] + ", and no other target was asked for")
    servers = list(cfg.servers)
    if "granian" in servers and not granian_installed():
        skipped["granian"] = (
            "granian is not installed (pip install 'turnstile[granian]'); not measured"
        )
        servers.remove("granian")
        if not servers:
            raise ValueError(skipped["granian"] + ", and no other server was asked for")
    targets = [name for name, _, _ in expand_targets(targets, servers)]
    machine["nginx_version"] = (
        ".".join(map(str, nginx_version(nginx_bin) or ())) if nginx_bin else None
    )
    workdir = Path(tempfile.mkdtemp(prefix="turnstile-bench-"))
    stacks: list[Stack] = []
    soak: dict[str, Any] | None = None
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        specs = [("main", 0.0, cfg.prompt_tokens)]
        if cfg.paced_streams > 0:
            specs.append(("paced", cfg.paced_rate, cfg.prompt_tokens))
        specs += [(f"long{n}", 0.0, n) for n in cfg.long_context]
        start_stacks(specs, cfg, workdir, nginx_bin, stacks, servers)
        by_label = {stack.label: stack for stack in stacks}
        results = []
        for sc in scenarios(cfg):
            stack = by_label[stack_label(sc)]
            sc_targets = targets
            if sc.prompt_tokens is not None:
                sc_targets = [t for t in targets if base_target(t) in LONG_CONTEXT_TARGETS]
            if progress:
                print(
                    f"{sc.name}: {cfg.rounds} rounds x {', '.join(sc_targets)}",
                    file=sys.stderr,
                    flush=True,
                )
            results.append(run_scenario(stack, sc, cfg, sc_targets, workdir, progress))
        if cfg.soak_s > 0 and "turnstile" in targets:
            if progress:
                print(
                    f"soak: {cfg.paced_streams} paced streams for {cfg.soak_s:g} s",
                    file=sys.stderr,
                    flush=True,
                )
            soak = run_soak(by_label["paced" if cfg.paced_streams > 0 else "main"], cfg, workdir)
    finally:
        stop_stacks(stacks)
        signal.signal(signal.SIGTERM, old_term)
        if cfg.keep:
            print(f"kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    writer = None
    if cfg.long_context:
        if progress:
            print("writer cost per turn at the long-context lengths", file=sys.stderr, flush=True)
        writer = {
            str(n): asdict(measure_writer(LONG_CONTEXT_WRITER_ROWS, n, cfg.completion_tokens))
            for n in [cfg.prompt_tokens, *cfg.long_context]
        }
    with contextlib.suppress(OSError):
        machine["loadavg_after"] = Path("/proc/loadavg").read_text().strip()
    report = {
        "config": asdict(cfg),
        "machine": machine,
        "skipped": skipped,
        "targets": targets,
        "servers": servers,
        "scenarios": results,
        "derived": derived(results, servers),
        "soak": soak,
        "writer_by_prompt_tokens": writer,
        "elapsed_s": round(time.monotonic() - started, 2),
        "workdir": str(workdir) if cfg.keep else None,
    }
    print(format_report(report))
    if json_path is not None:
        json_path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report
