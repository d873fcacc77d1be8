"""kill -9 at random moments: every acknowledged turn survives exactly once.

`turnstile serve` runs as a subprocess in front of a scripted vLLM-shaped HTTP backend.
Concurrent multi-turn rollouts (streaming and not) run against it while it is killed
with SIGKILL and restarted, again and again, and a hostile client interleaves calls with
bad headers, bad bodies, bad ids and backend garbage: each is refused (4xx/502), and none
costs a well-behaved client anything. A turn counts as acknowledged when its client got
the whole JSON body or the stream's `[DONE]`.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from tests.fakes_backend import FakeVLLM, Reply
from tests.live import aiohttp_server
from turnstile.reader import check_shard, open_output

KILLS = 20
WORKERS = 6
TURNS_PER_ROLLOUT = 3
# Each life of the proxy runs this long (randomised) before it is killed.
LIFE_S = (0.4, 1.2)
# Under load (two cores shared with other suites) a start that rebuilds from the journal
# and reads every published shard has taken over 30 s.
START_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 10.0
POLICY = "X-Turnstile-Policy-Version"


# Models the scripted backend misbehaves for (any other model is answered normally).
GARBAGE = "hostile-garbage"  # an HTML page instead of JSON
BAD_TOKENS = "hostile-bad-tokens"  # token ids past int32, whole and streamed


def _model_of(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed.get("model") if isinstance(parsed, dict) else None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def backend_url() -> Iterator[str]:
    """The fake vLLM behind a real HTTP server on loopback."""
    fake = FakeVLLM(lambda body: Reply(text="word " * 8, event_delay_s=0.002))

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        model = _model_of(body)
        if model == GARBAGE:
            return web.Response(body=b"<html>oops</html>", content_type="text/html")
        resp = await fake.request(request.method, request.path, body or None, {})
        out = web.StreamResponse(status=resp.status, headers=dict(resp.headers))
        await out.prepare(request)
        try:
            async for chunk in resp.iter_chunks():
                if model == BAD_TOKENS:  # ids past int32: no column can hold them
                    chunk = chunk.replace(b'token_ids":[', b'token_ids":[1099511627776,')
                await out.write(chunk)
            await out.write_eof()
        except ConnectionError:  # the proxy was killed mid-stream
            resp.close()
        return out

    with aiohttp_server(handle) as url:
        yield url


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


_DEEP = b"[" * 300 + b'"x"' + b"]" * 300  # deeper than a JSON column can hold
_CHAT = '{"model": "m", "messages": [{"role": "user", "content": %s}]}'


@dataclass(frozen=True)
class Hostile:
    """One hostile call: how it is made and the statuses it may be answered with."""

    name: str
    method: str
    path: str  # `{n}` is the call's number
    body: bytes | None
    headers: dict[str, str]
    allowed: frozenset[int]


def _hostile_calls() -> list[Hostile]:
    chat = "/rollouts/h{n}/v1/chat/completions"
    json_type = {"Content-Type": "application/json"}
    plain = _CHAT.encode() % b'"hi"'

    def call(name: str, body: bytes | None, allowed: set[int], **kw: Any) -> Hostile:
        path = kw.pop("path", chat)
        headers = {**json_type, **kw.pop("headers", {})}
        return Hostile(name, kw.pop("method", "POST"), path, body, headers, frozenset(allowed))

    def stream(model: str) -> bytes:
        return json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": True}
        ).encode()

    return [
        call("policy 2**63", plain, {400}, headers={POLICY: str(2**63)}),
        call("policy -2**63-1", plain, {400}, headers={POLICY: str(-(2**63) - 1)}),
        call("policy 1.0", plain, {400}, headers={POLICY: "1.0"}),
        call("deep content", _CHAT.encode() % _DEEP, {422}),
        call("deep tools", plain[:-1] + b', "tools": ' + _DEEP + b"}", {422}),
        call("id with newline", plain, {400}, path="/rollouts/h%0A/v1/chat/completions"),
        call("id too long", plain, {400}, path="/rollouts/" + "h" * 200 + "/v1/chat/completions"),
        call("lone surrogate", _CHAT.encode() % b'"\\ud800"', {400}),
        call(
            "lone surrogate metadata",
            b'{"rollout_id": "hm{n}", "metadata": {"k": "\\udfff"}}',
            {422},
            path="/rollouts",
        ),
        call(
            "nan reward", b'{"rewards": {"x": NaN}}', {400, 404, 422}, path="/rollouts/h{n}/rewards"
        ),
        call("wrong types", b'{"model": "m", "messages": "hi", "n": "2"}', {422}),
        call("truncated json", plain[:-7], {400}),
        call("150 headers", plain, {431}, headers={f"x-h{i}": "1" for i in range(150)}),
        call("70 KiB header", plain, {431}, headers={"x-big": "a" * 70 * 1024}),
        call(
            "backend garbage",
            _CHAT.encode().replace(b'"m"', f'"{GARBAGE}"'.encode()) % b'"x"',
            {502},
        ),
        call(
            "backend int32",
            _CHAT.encode().replace(b'"m"', f'"{BAD_TOKENS}"'.encode()) % b'"x"',
            {502},
        ),
        call("backend int32 streamed", stream(BAD_TOKENS), {200}),
    ]


class HostileClient:
    """Makes hostile calls in a loop; counts them and the answers that were not allowed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.calls = 0  # sent to a listening proxy
        self.answered = 0  # answered (the others were cut by a kill)
        self.wrong: list[str] = []  # answered with a status not allowed, or a 500

    def run(self, stop: threading.Event) -> None:
        calls = _hostile_calls()
        n = 0
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as client:
            while not stop.is_set():
                hostile = calls[n % len(calls)]
                try:
                    resp = client.request(
                        hostile.method,
                        hostile.path.replace("{n}", str(n)),
                        content=None
                        if hostile.body is None
                        else hostile.body.replace(b"{n}", str(n).encode()),
                        headers=hostile.headers,
                    )
                except httpx.ConnectError:
                    time.sleep(0.1)  # the proxy is restarting: nothing was sent
                    continue
                except httpx.HTTPError:
                    self.calls += 1  # sent, then cut by a kill
                    n += 1
                    continue
                self.calls += 1
                self.answered += 1
                # 503: starting or draining; a streamed refusal ends in an error event.
                ok = resp.status_code in hostile.allowed or resp.status_code == 503
                if resp.status_code == 200 and '"error"' not in resp.text:
                    ok = False
                if not ok:
                    self.wrong.append(f"{hostile.name}: {resp.status_code} {resp.text[:200]}")
                if hostile.path.startswith("/rollouts/h{n}/v1"):
                    with contextlib.suppress(httpx.HTTPError):
                        client.post(f"/rollouts/h{n}/finish")
                n += 1
                time.sleep(0.05)


def _quarantined(output: Path) -> int:
    """Rows under OUTPUT/quarantine/ (0 when there is no such directory)."""
    root = output / "quarantine"
    if not root.is_dir():
        return 0
    rows = 0
    for path in root.rglob("*"):
        if path.suffix == ".parquet":
            rows += pq.read_metadata(path).num_rows
        elif path.is_file():
            rows += sum(1 for line in path.read_bytes().splitlines() if line.strip())
    return rows


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

    hostile = HostileClient(proxy.url)
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    threads.append(threading.Thread(target=hostile.run, args=(stop,)))
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
    samples = reader.samples(columns=["rollout_id", "sample_index"]).to_pylist()
    sample_keys = [(r["rollout_id"], r["sample_index"]) for r in samples]
    rollout_ids = reader.rollouts(columns=["rollout_id"])["rollout_id"].to_pylist()
    print(
        f"crash test: {KILLS} kills, {hostile.calls} hostile calls ({hostile.answered} "
        f"answered, {len(hostile.wrong)} wrongly, the rest cut by kills), "
        f"{rollouts_done[0]} rollouts, {len(acked)} turns acknowledged, "
        f"{sum(1 for k in acked if k in recorded)} recovered, "
        f"{_quarantined(out)} quarantined, {len(missing)} lost, "
        f"{len(doubled)} duplicated, "
        f"{len(recorded) - len(acked & recorded.keys())} unacknowledged turns also kept, "
        f"{len(sample_keys) - len(set(sample_keys))} duplicated samples, "
        f"{len(rollout_ids) - len(set(rollout_ids))} duplicated rollout rows, "
        f"{removed} journal segments removed while running"
    )
    assert not missing, f"acknowledged turns lost: {sorted(missing)[:10]}"
    assert not doubled, f"acknowledged turns recorded twice: {doubled[:10]}"
    assert not hostile.wrong, hostile.wrong[:10]
    assert hostile.answered > KILLS, "too few hostile calls were answered to count"
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
