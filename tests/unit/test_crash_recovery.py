"""kill -9 at random moments: every acknowledged turn survives exactly once.

`turnstile serve` runs as a subprocess in front of a scripted vLLM-shaped HTTP backend.
Concurrent multi-turn rollouts (streaming and not) run against it while it is killed
with SIGKILL and restarted, again and again. A turn counts as acknowledged when its
client got the whole JSON body or the stream's `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.fakes_backend import FakeVLLM, Reply
from turnstile.reader import check_shard, open_output

KILLS = 20
WORKERS = 6
TURNS_PER_ROLLOUT = 3
# Each life of the proxy runs this long (randomised) before it is killed.
LIFE_S = (0.4, 1.2)
START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 10.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def backend_url() -> Iterator[str]:
    """The fake vLLM behind a real HTTP server on loopback."""
    fake = FakeVLLM(lambda body: Reply(text="word " * 8, event_delay_s=0.002))
    port = _port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        resp = await fake.request(request.method, request.path, body or None, {})
        out = web.StreamResponse(status=resp.status, headers=dict(resp.headers))
        await out.prepare(request)
        try:
            async for chunk in resp.iter_chunks():
                await out.write(chunk)
            await out.write_eof()
        except ConnectionError:  # the proxy was killed mid-stream
            resp.close()
        return out

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(serve())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


class Proxy:
    def __init__(self, backend: str, output: Path) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "turnstile",
            "serve",
            "--backend",
            backend,
            "--output",
            str(output),
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]
        # Small segments and frequent retention: segments are removed during every life.
        self.env = {
            **os.environ,
            "TURNSTILE_SHARD_MAX_AGE_S": "0.3",
            "TURNSTILE_JOURNAL_SEGMENT_BYTES": "65536",
            "TURNSTILE_JOURNAL_RETENTION_INTERVAL_S": "0.1",
        }
        self.log_path = output.parent / "proxy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=log
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.log_path.read_text(errors="replace")
                raise AssertionError(f"turnstile serve did not start: {err[-3000:]}")
            time.sleep(0.05)

    def segments_removed(self) -> int:
        """Journal segments this life has removed so far (0 if it does not answer)."""
        try:
            return int(
                httpx.get(self.url + "/stats", timeout=1).json()["journal"]["segments_removed"]
            )
        except (httpx.HTTPError, KeyError, ValueError):
            return 0

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        return self.proc.returncode


def _turn(url: str, rollout: str, messages: list[dict[str, Any]], stream: bool) -> tuple[int, str]:
    """One chat turn; returns (turn index, text) only if fully acknowledged."""
    body = {"model": "m", "messages": messages, "stream": stream}
    path = f"{url}/rollouts/{rollout}/v1/chat/completions"
    if not stream:
        resp = httpx.post(path, json=body, timeout=REQUEST_TIMEOUT_S)
        resp.raise_for_status()
        text = resp.json()["choices"][0]["message"]["content"]
        return int(resp.headers["X-Turnstile-Turn"]), text
    parts, done = [], False
    with httpx.stream("POST", path, json=body, timeout=REQUEST_TIMEOUT_S) as resp:
        resp.raise_for_status()
        index = int(resp.headers["X-Turnstile-Turn"])
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise httpx.ReadError("stream failed")
                parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
    if not done:
        raise httpx.ReadError("stream cut before [DONE]")
    return index, "".join(parts)


def test_kill_9_loses_no_acknowledged_turn(backend_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proxy = Proxy(backend_url, out)
    proxy.start()
    acked: set[tuple[str, int]] = set()
    lock = threading.Lock()
    stop = threading.Event()
    rollouts_done = [0]

    def worker(w: int) -> None:
        n = 0
        rng = random.Random(w)
        while not stop.is_set():
            rid, messages, turns = f"w{w}-r{n}", [{"role": "user", "content": f"task {w}"}], 0
            while turns < TURNS_PER_ROLLOUT and not stop.is_set():
                try:
                    index, text = _turn(proxy.url, rid, messages, stream=rng.random() < 0.5)
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(0.05)
                    continue
                with lock:
                    acked.add((rid, index))
                turns += 1
                messages = [
                    *messages,
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"more {turns}"},
                ]
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{proxy.url}/rollouts/{rid}/finish", timeout=REQUEST_TIMEOUT_S)
            with lock:
                rollouts_done[0] += 1
            n += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    rng = random.Random(1234)
    removed = 0
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(*LIFE_S))
            removed += proxy.segments_removed()
            proxy.kill()
            proxy.start()
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        code = proxy.stop()
    assert code == 0

    reader = open_output(out)
    for table in ("turns", "samples", "rollouts"):
        for path in reader.files(table):
            check_shard(path, table)
    turns = reader.turns(
        columns=["turn_id", "choice_index", "rollout_id", "turn_index", "status"]
    ).to_pylist()
    keys = [(t["turn_id"], t["choice_index"]) for t in turns]
    assert len(keys) == len(set(keys)), "a turn was written twice"
    recorded: dict[tuple[str, int], int] = {}
    for t in turns:
        if t["status"] == "ok":
            k = (t["rollout_id"], t["turn_index"])
            recorded[k] = recorded.get(k, 0) + 1
    missing = acked - recorded.keys()
    doubled = [k for k in acked if recorded.get(k, 0) > 1]
    print(
        f"crash test: {KILLS} kills, {rollouts_done[0]} rollouts, {len(acked)} turns "
        f"acknowledged, {sum(1 for k in acked if k in recorded)} recovered, "
        f"{len(doubled)} duplicated, {len(missing)} missing, "
        f"{len(recorded) - len(acked & recorded.keys())} unacknowledged turns also kept, "
        f"{removed} journal segments removed while running"
    )
    assert not missing, f"acknowledged turns lost: {sorted(missing)[:10]}"
    assert not doubled, f"acknowledged turns recorded twice: {doubled[:10]}"
    assert len(acked) > KILLS * 5
    assert removed > 0, "retention never ran: the test would not cover it"
    assert not list((out / "journal").glob("*.wal")), "journal left after a clean stop"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstile", *args], capture_output=True, text=True, timeout=120
    )


def test_verify_and_recover_commands(backend_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proxy = Proxy(backend_url, out)
    proxy.env["TURNSTILE_SHARD_MAX_AGE_S"] = "3600"  # nothing published before the kill
    proxy.start()
    acked = [
        _turn(proxy.url, "v1", [{"role": "user", "content": "x"}], stream=s)[0]
        for s in (False, True, False)
    ]
    proxy.kill()
    before = _cli("verify", str(out))
    assert before.returncode == 1 and "3 journaled turns are not in published shards" in (
        before.stdout
    ), before.stdout
    assert _cli("recover", str(out)).returncode == 0
    after = _cli("verify", str(out))
    assert after.returncode == 0, after.stdout
    assert "turns: 1 shards, 3 rows" in after.stdout
    turns = open_output(out).turns(columns=["turn_index", "status"]).to_pylist()
    assert sorted(t["turn_index"] for t in turns) == acked
    (rollout,) = open_output(out).rollouts(columns=["status"]).to_pylist()
    assert rollout["status"] == "interrupted"
    shard = next((out / "turns").glob("part-*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-20])
    broken = _cli("verify", str(out))
    assert broken.returncode == 1 and "PROBLEM" in broken.stdout
