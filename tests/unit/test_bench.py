"""`turnstile bench`: the load generator, the nginx config and one real quick run."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest

from turnstile.bench import free_port, healthy, runner, stop_group, wait_until
from turnstile.bench.granian_serve import granian_installed
from turnstile.bench.loadgen import (
    DONE_TAIL,
    LoopbackOnly,
    make_plan,
    parse_target,
    percentile,
    run_load,
)
from turnstile.bench.nginx import check_config, find_nginx, render_config, start_nginx
from turnstile.bench.runner import (
    BenchConfig,
    base_target,
    expand_targets,
    pinned,
    resolve_config,
    run_bench,
    scenarios,
    thread_cpu_s,
)
from turnstile.runtime import name_thread

ROOT = Path(__file__).resolve().parents[2]
NGINX = find_nginx()
NO_NGINX = "nginx is not installed (Debian: apt-get install nginx-light)"
# The fake backend starts in well under a second; this allows for a loaded machine.
BACKEND_START_TIMEOUT_S = 20.0
# A loadgen subprocess run here makes a handful of requests.
LOADGEN_TIMEOUT_S = 60.0
# `turnstile bench --quick` takes ~40 s with all three targets on 2 vCPUs.
QUICK_BENCH_TIMEOUT_S = 150.0
# The events of the test server's stream, and the pieces it writes them in: 7 bytes
# at a time, so chunk-size lines, CRLFs and events are split across reads.
SSE_EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [DONE_TAIL]
PIECE = 7


def _chunked(events: list[bytes]) -> bytes:
    out = b""
    for i, event in enumerate(events):
        ext = b";ext=1" if i % 2 else b""
        out += b"%x%s\r\n%s\r\n" % (len(event), ext, event)
    return out + b"0\r\nx-trailer: yes\r\n\r\n"


CL_BODY = b'{"ok": true, "pad": "' + b"x" * 70_000 + b'"}'
CHUNKED_BODY = _chunked(SSE_EVENTS)
NODONE_BODY = _chunked(SSE_EVENTS[:-1])


class TinyServer:
    """A keep-alive HTTP/1.1 server answering by path; counts what it served."""

    def __init__(self) -> None:
        self.served: Counter[str] = Counter()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                path = head.split(" ", 2)[1]
                length = next(
                    int(line.split(":", 1)[1])
                    for line in head.split("\r\n")
                    if line.lower().startswith("content-length:")
                )
                body = orjson.loads(await reader.readexactly(length))
                assert body["logprobs"] is True and body["return_token_ids"] is True
                self.served[path] += 1
                if path == "/close":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
                    )
                    await writer.drain()
                    return
                if path == "/status":
                    writer.write(b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\n\r\n{}")
                elif path == "/cl":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(CL_BODY))
                    writer.write(CL_BODY)
                else:
                    data = CHUNKED_BODY if path == "/chunked" else NODONE_BODY
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    for i in range(0, len(data), PIECE):
                        writer.write(data[i : i + PIECE])
                        await writer.drain()
                        await asyncio.sleep(0.0005)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def tiny() -> AsyncIterator[TinyServer]:
    server = TinyServer()
    await server.start()
    yield server
    await server.stop()


# -- loadgen --------------------------------------------------------------------------------
async def test_loadgen_counts_content_length(tiny: TinyServer) -> None:
    plan = make_plan(parse_target(tiny.url("/cl")), stream=False, concurrency=4, requests=40)
    res = await run_load(plan, deadline_s=30)
    assert (res["requests"], res["errors"], res["timed_out"]) == (40, 0, False)
    assert tiny.served["/cl"] == 40 + 4  # one warm-up per worker, not counted
    assert res["body_bytes"] == 40 * len(CL_BODY)
    assert 0 < res["ttfb_p50_ms"] <= res["latency_p50_ms"] <= res["latency_p99_ms"]
    assert res["req_per_s"] > 0


async def test_loadgen_parses_chunked_sse_split_anywhere(tiny: TinyServer) -> None:
    plan = make_plan(
        parse_target(tiny.url("/chunked")), stream=True, concurrency=2, requests=6, warmup=0
    )
    res = await run_load(plan, deadline_s=30)
    assert (res["requests"], res["errors"]) == (6, 0)
    assert tiny.served["/chunked"] == 6
    assert res["body_bytes"] == 6 * sum(len(e) for e in SSE_EVENTS)
    # the stream is ~100 writes 0.5 ms apart: the first byte comes well before the end
    assert res["ttfb_p50_ms"] < res["latency_p50_ms"]


async def test_loadgen_counts_bad_streams_and_statuses_as_errors(tiny: TinyServer) -> None:
    for path, stream in (("/nodone", True), ("/status", False)):
        plan = make_plan(
            parse_target(tiny.url(path)), stream=stream, concurrency=1, requests=3, warmup=0
        )
        res = await run_load(plan, deadline_s=30)
        assert (res["requests"], res["errors"]) == (0, 3), path
        assert res["latency_p50_ms"] is None
        assert res["error_kinds"]


async def test_loadgen_reconnects_after_connection_close(tiny: TinyServer) -> None:
    plan = make_plan(
        parse_target(tiny.url("/close")), stream=False, concurrency=2, requests=10, warmup=0
    )
    res = await run_load(plan, deadline_s=30)
    assert (res["requests"], res["errors"]) == (10, 0)


async def test_loadgen_duration_mode_and_hard_deadline(tiny: TinyServer) -> None:
    plan = make_plan(parse_target(tiny.url("/cl")), stream=False, concurrency=2, duration_s=0.3)
    res = await run_load(plan, deadline_s=30)
    assert res["requests"] > 0 and res["errors"] == 0 and 0.3 <= res["duration_s"] < 5
    # a stream longer than the deadline is cut short and counted as an error
    plan = make_plan(
        parse_target(tiny.url("/chunked")), stream=True, concurrency=1, duration_s=30, warmup=0
    )
    started = time.monotonic()
    res = await run_load(plan, deadline_s=0.02)
    assert res["timed_out"] and res["errors"] >= 1 and time.monotonic() - started < 5


def test_loadgen_refuses_anything_but_loopback() -> None:
    for url in (
        "http://10.0.0.1:80/v1",
        "http://example.com/",
        "https://127.0.0.1:1/",
        "http://0.0.0.0:8000/",
    ):
        with pytest.raises(LoopbackOnly):
            parse_target(url)
    assert parse_target("http://localhost:9/").host == "127.0.0.1"
    assert parse_target("http://[::1]:9").path == "/v1/chat/completions"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnstile.bench.loadgen",
            "--url",
            "http://192.0.2.1:80/",
            "--requests",
            "1",
        ],
        capture_output=True,
        timeout=LOADGEN_TIMEOUT_S,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 2 and b"loopback" in out.stderr


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile([5.0], 99) == 5.0


# -- /proc helpers --------------------------------------------------------------------------
def test_thread_cpu_and_pinning() -> None:
    stop = threading.Event()
    burned = threading.Event()

    def burn() -> None:
        name_thread("ts-test-burn")
        end = time.process_time() + 0.1
        while time.process_time() < end:
            pass
        burned.set()
        stop.wait(10)

    t = threading.Thread(target=burn)
    t.start()
    try:
        assert burned.wait(10)
        cpu = thread_cpu_s(os.getpid(), frozenset({"ts-test-burn"}))
        assert cpu is not None and cpu > 0
        assert thread_cpu_s(os.getpid(), frozenset({"no-such-thread"})) is None
    finally:
        stop.set()
        t.join()
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        before = os.sched_getaffinity(sleeper.pid)
        cpu_id = max(os.sched_getaffinity(0))
        with pinned([sleeper.pid], cpu_id):
            assert os.sched_getaffinity(sleeper.pid) == {cpu_id}
        assert os.sched_getaffinity(sleeper.pid) == before
    finally:
        stop_group(sleeper, grace_s=1)


# -- nginx ----------------------------------------------------------------------------------
def test_nginx_config_renders(tmp_path: Path) -> None:
    text = render_config(tmp_path, 18080, 18081)
    for needle in (
        "daemon off;",
        "worker_processes 1;",
        "keepalive 256;",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
        "proxy_buffering off;",
        "access_log off;",
        "listen 127.0.0.1:18080;",
        "server 127.0.0.1:18081;",
        f"pid {tmp_path.resolve()}/nginx.pid;",
        f"error_log {tmp_path.resolve()}/error.log",
    ):
        assert needle in text, needle
    for line in text.splitlines():
        if "_temp_path" in line:
            assert str(tmp_path.resolve()) in line
    if NGINX is None:
        pytest.skip(f"`nginx -t` not run: {NO_NGINX}")
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    ok, output = check_config(NGINX, conf, tmp_path)
    assert ok, output


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "turnstile.bench.backend",
            "--port",
            str(port),
            "--prompt-tokens",
            "20",
            "--completion-tokens",
            "10",
        ],
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: healthy(port), BACKEND_START_TIMEOUT_S)
        yield port
    finally:
        stop_group(proc, grace_s=5)


@pytest.mark.skipif(NGINX is None, reason=f"proxied request through nginx: {NO_NGINX}")
def test_nginx_proxies_streams(tmp_path: Path, backend: int) -> None:
    assert NGINX is not None
    server = start_nginx(NGINX, tmp_path / "nginx", free_port(), backend)
    try:
        assert len(server.pids) == 2 and all(Path(f"/proc/{p}").exists() for p in server.pids)
        for stream in ("--stream", "--no-stream"):
            out = tmp_path / "res.json"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "turnstile.bench.loadgen",
                    "--url",
                    server.url,
                    "--concurrency",
                    "4",
                    "--requests",
                    "20",
                    stream,
                    "--json-out",
                    str(out),
                ],
                cwd=ROOT,
                timeout=LOADGEN_TIMEOUT_S,
                check=True,
            )
            res = orjson.loads(out.read_bytes())
            assert (res["requests"], res["errors"]) == (20, 0), res
    finally:
        server.stop()
    assert server.proc.returncode is not None
    assert not any(Path(f"/proc/{p}").exists() for p in server.pids[1:])


# -- the whole bench ------------------------------------------------------------------------
def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    targets = ["direct", "turnstile"] + (["nginx"] if NGINX else [])
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "turnstile",
            "bench",
            "--quick",
            "--keep",
            "--json",
            str(out),
            "--targets",
            ",".join(targets),
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=QUICK_BENCH_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    report = orjson.loads(out.read_bytes())
    workdir = report["workdir"]
    try:
        assert workdir and not _processes_mentioning(workdir), "processes left running"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert b"nonstream-c1" in proc.stdout and b"derived" in proc.stdout
    expected = [s.name for s in scenarios(resolve_config(BenchConfig(quick=True)))]
    assert [s["name"] for s in report["scenarios"]] == expected
    assert len(expected) == 5 and any(s["paced"] for s in report["scenarios"])
    assert sorted(report["targets"]) == sorted(targets)
    assert report["machine"]["loadavg_before"] and report["machine"]["cpu_count"] >= 1
    for sc in report["scenarios"]:
        assert (sc["pinned_cpu"] is not None) == (sc["concurrency"] == 1)
        for target in targets:
            t = sc["targets"][target]
            summary = t["summary"]
            assert len(t["rounds"]) == 2 and t["requests"] > 0, (sc["name"], target)
            assert summary["errors"]["max"] == 0, (sc["name"], target, t["rounds"])
            for metric in ("req_per_s", "latency_p50_ms", "latency_p99_ms", "ttfb_p50_ms"):
                assert summary[metric]["median"] > 0, (sc["name"], target, metric)
            proxy = target != "direct"
            assert (summary["cpu_us_per_req"] is not None) == proxy
            if proxy:
                # /proc counts CPU in 10 ms ticks: the quick paced rounds (640 events) may
                # cost nginx less than one, so only the other scenarios must show some
                floor = 0.0 if sc["paced"] else 1e-9
                assert summary["cpu_us_per_req"]["median"] >= floor
                if sc["stream"]:
                    assert summary["cpu_us_per_event"]["median"] >= floor
        rec = sc["recording_us_per_turn_total"]
        assert rec is None or rec >= 0
    derived = report["derived"]
    assert derived["added_p50_ms_c1_turnstile"] is not None
    assert derived["added_ttfb_p50_ms_c1_stream_turnstile"] is not None
    assert derived["paced_throughput_turnstile_over_direct"] > 0
    assert derived["paced_p99_stream_time_turnstile_over_direct"] > 0
    if NGINX:
        assert derived["cpu_ratio_turnstile_over_nginx"]["nonstream-c1"] > 0


def test_bench_without_nginx_skips_it_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "find_nginx", lambda: None)
    with pytest.raises(ValueError, match="not installed"):
        run_bench(BenchConfig(targets=["nginx"]), progress=False)
    cfg = BenchConfig(
        rounds=1, duration_s=0.2, concurrency=[1], paced_streams=0, targets=["direct", "nginx"]
    )
    report = run_bench(cfg, progress=False)
    assert "not installed" in report["skipped"]["nginx"]
    assert report["targets"] == ["direct"]
    assert [s["name"] for s in report["scenarios"]] == ["nonstream-c1", "stream-c1"]
    assert all(list(s["targets"]) == ["direct"] for s in report["scenarios"])


def test_long_context_scenarios_report_cpu_by_prompt_length() -> None:
    cfg = BenchConfig(
        rounds=1,
        duration_s=0.3,
        concurrency=[1],
        paced_streams=0,
        targets=["direct", "turnstile", "turnstile-2w"],
        long_context=[6000],
    )
    report = run_bench(cfg, progress=False)
    names = [s["name"] for s in report["scenarios"]]
    assert names == ["nonstream-c1", "stream-c1", "long6000-nonstream-c1", "long6000-stream-c1"]
    long_sc = report["scenarios"][2]
    assert long_sc["prompt_tokens"] == 6000
    assert list(long_sc["targets"]) == ["direct", "turnstile"]  # no 2-worker figures there
    assert long_sc["targets"]["turnstile"]["summary"]["errors"]["max"] == 0
    by_length = report["derived"]["cpu_us_per_req_c1_nonstream_turnstile_by_prompt_tokens"]
    assert set(by_length) == {"default", "6000"} and by_length["6000"] > 0
    writer = report["writer_by_prompt_tokens"]
    assert set(writer) == {"2000", "6000"}
    assert writer["6000"]["prompt_tokens"] == 6000 and writer["6000"]["shard_write_us_per_row"] > 0


def test_decode_bench_times_every_way_of_reading_an_answer() -> None:
    from turnstile.bench import decode

    result = decode.measure(prompt_tokens=50, completion_tokens=10, runs=3)
    names = {"msgspec", "pyarrow", "orjson", "strip-orjson"}
    if result["compiled"]:
        names |= {"scan", "strip-scan"}
    assert set(result["us"]) == names
    assert all(v["median"] > 0 and v["min"] <= v["median"] for v in result["us"].values())
    assert result["body_bytes"] > 0


# -- the serving layer: each Turnstile target under each server -----------------------------
def test_servers_name_one_target_per_server() -> None:
    expanded = expand_targets(
        ["direct", "turnstile", "turnstile-2w"], ["uvicorn", "raw", "granian"]
    )
    assert expanded == [
        ("direct", 0, ""),
        ("turnstile", 1, "uvicorn"),
        ("turnstile-raw", 1, "raw"),
        ("turnstile-granian", 1, "granian"),
        ("turnstile-2w", 2, "uvicorn"),
        ("turnstile-2w-raw", 2, "raw"),  # granian serves one worker only
    ]
    assert [base_target(name) for name, _, _ in expanded] == [
        "direct",
        "turnstile",
        "turnstile",
        "turnstile",
        "turnstile-2w",
        "turnstile-2w",
    ]
    assert resolve_config(BenchConfig(servers=["raw", "uvicorn"])).servers == ["uvicorn", "raw"]
    with pytest.raises(ValueError, match="servers must be among"):
        resolve_config(BenchConfig(servers=["hypercorn"]))
    with pytest.raises(ValueError, match="servers must be among"):
        resolve_config(BenchConfig(servers=[]))


def test_bench_flag_servers() -> None:
    import argparse

    from turnstile.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).servers == ["uvicorn"]
    assert parser.parse_args(["--servers", "uvicorn, raw,granian"]).servers == [
        "uvicorn",
        "raw",
        "granian",
    ]


def _scenario(name: str, stream: bool, medians: dict[str, dict[str, float]]) -> dict[str, object]:
    return {
        "name": name,
        "stream": stream,
        "paced": False,
        "concurrency": 1,
        "prompt_tokens": None,
        "targets": {
            t: {"summary": {m: {"median": v, "min": v, "max": v} for m, v in ms.items()}}
            for t, ms in medians.items()
        },
    }


def test_derived_compares_each_server_with_uvicorn() -> None:
    from turnstile.bench.report import derived

    results = [
        _scenario(
            "nonstream-c1",
            False,
            {
                "direct": {"latency_p50_ms": 1.0, "req_per_s": 1000.0},
                "nginx": {"cpu_us_per_req": 100.0, "latency_p50_ms": 1.1},
                "turnstile": {"cpu_us_per_req": 1000.0, "req_per_s": 200.0, "latency_p50_ms": 2.0},
                "turnstile-raw": {
                    "cpu_us_per_req": 800.0,
                    "req_per_s": 250.0,
                    "latency_p50_ms": 1.5,
                },
            },
        ),
        _scenario(
            "stream-c1",
            True,
            {
                "direct": {"ttfb_p50_ms": 0.5},
                "turnstile": {"cpu_us_per_event": 10.0, "ttfb_p50_ms": 3.0},
                "turnstile-raw": {"cpu_us_per_event": 12.0, "ttfb_p50_ms": 2.5},
            },
        ),
    ]
    out = derived(results, ["uvicorn", "raw"])
    assert out["cpu_ratio_turnstile-raw_over_turnstile"] == {"nonstream-c1": 0.8, "stream-c1": 1.2}
    assert out["throughput_ratio_turnstile-raw_over_turnstile"]["nonstream-c1"] == 1.25
    assert out["cpu_ratio_turnstile-raw_over_nginx"]["nonstream-c1"] == 8.0
    assert out["added_p50_ms_c1_turnstile-raw"] == 0.5
    assert out["added_ttfb_p50_ms_c1_stream_turnstile-raw"] == 2.0
    assert not any("granian" in key for key in out)
    assert not any("turnstile-raw" in key for key in derived(results))


def test_bench_runs_turnstile_under_each_server_interleaved() -> None:
    servers = ["uvicorn", "raw"] + (["granian"] if granian_installed() else [])
    cfg = BenchConfig(
        rounds=1,
        duration_s=0.3,
        concurrency=[1],
        paced_streams=0,
        targets=["direct", "turnstile"],
        servers=servers,
    )
    report = run_bench(cfg, progress=False)
    named = ["direct", "turnstile", *(f"turnstile-{s}" for s in servers[1:])]
    assert report["targets"] == named and report["servers"] == servers
    for sc in report["scenarios"]:
        assert list(sc["targets"]) == named
        for target in named[1:]:
            summary = sc["targets"][target]["summary"]
            assert summary["errors"]["max"] == 0, (sc["name"], target)
            assert summary["req_per_s"]["median"] > 0
            metric = "cpu_us_per_event" if sc["stream"] else "cpu_us_per_req"
            assert summary[metric]["median"] > 0, (sc["name"], target)
    ratios = report["derived"]["cpu_ratio_turnstile-raw_over_turnstile"]
    assert set(ratios) == {"nonstream-c1", "stream-c1"} and all(r > 0 for r in ratios.values())
    assert report["derived"]["added_ttfb_p50_ms_c1_stream_turnstile-raw"] is not None
