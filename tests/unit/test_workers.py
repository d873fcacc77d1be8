"""`turnstile serve --workers 2`: one port, two processes, every rollout whole.

Every call goes over a new connection, so the kernel spreads them over both workers;
a rollout's turns, rewards and finish must still meet in the worker that owns it, and
come out as one stitched sample. One worker is killed with SIGKILL halfway: the
supervisor starts it again, it recovers its journal, and nothing acknowledged is lost.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.live import SERVERS
from tests.unit.test_crash_recovery import _cli, _port, backend_url  # noqa: F401  (fixture)
from turnstile.reader import open_output
from turnstile.server.workers import owner_of

START_TIMEOUT_S = 60.0
TURNS = 3
# Each worker bounds the header phase too (turnstile.server.header_phase); small here.
HEADER_READ_TIMEOUT_S = 2.0


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]


def _call(
    method: str, url: str, *, json: object = None, headers: dict[str, str] | None = None
) -> httpx.Response:
    """One call on a fresh connection, retried while a restarted worker comes back."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with httpx.Client(timeout=30) as client:
                resp = client.request(
                    method, url, json=json, headers={"Connection": "close", **(headers or {})}
                )
            if resp.status_code != 503:
                return resp
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{method} {url} kept failing"
        time.sleep(0.1)


def _slow_heads_are_cut_off(port: int) -> None:
    """Connections that never finish their headers get 408 from whichever worker took them."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(6)]
    for sock in socks:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    for sock in socks:
        with sock:
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), answer


@pytest.mark.parametrize("server", SERVERS)
def test_two_workers_keep_every_rollout_whole(
    backend_url: str,  # noqa: F811
    tmp_path: Path,
    server: str,
) -> None:
    port = _port()
    base = f"http://127.0.0.1:{port}"
    out = tmp_path / "out"
    env = {
        **os.environ,
        "TURNSTILE_SERVER": server,
        "TURNSTILE_SHARD_MAX_AGE_S": "0.3",
        "TURNSTILE_HEADER_READ_TIMEOUT_S": str(HEADER_READ_TIMEOUT_S),
    }
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "turnstile",
            "serve",
            "--workers",
            "2",
            "--backend",
            backend_url,
            "--output",
            str(out),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=log,
        stderr=log,
    )
    try:
        assert _call("GET", base + "/health").status_code == 200
        assert (
            _call("POST", base + "/admin/policy_version", json={"policy_version": 3}).status_code
            == 200
        )
        created = _call("POST", base + "/rollouts", json={}).json()["rollout_id"]
        rollouts = [created, *(f"r{n}" for n in range(12))]
        assert {owner_of(r, 2) for r in rollouts} == {0, 1}
        for n, rid in enumerate(rollouts):
            if n == len(rollouts) // 2:  # kill -9 one worker; the supervisor restarts it
                workers = _children(proc.pid)
                assert len(workers) == 2
                os.kill(workers[0], signal.SIGKILL)
            messages = [{"role": "user", "content": f"task {rid}"}]
            for turn in range(TURNS):
                body = {"model": "m", "messages": messages, "stream": turn == 1}
                if turn == 2:  # the header instead of the path
                    resp = _call(
                        "POST",
                        base + "/v1/chat/completions",
                        json=body,
                        headers={"X-Turnstile-Rollout": rid},
                    )
                else:
                    resp = _call("POST", f"{base}/rollouts/{rid}/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
                if turn == 1:
                    text = "".join(
                        line for line in resp.text.split("\n") if line.startswith("data: {")
                    )
                    assert '"content"' in text
                    reply = "word " * 8
                else:
                    reply = resp.json()["choices"][0]["message"]["content"]
                messages += [
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"more {turn}"},
                ]
            assert (
                _call(
                    "POST", f"{base}/rollouts/{rid}/rewards", json={"rewards": {"ok": float(n)}}
                ).status_code
                == 200
            )
            finished = _call("POST", f"{base}/rollouts/{rid}/finish").json()
            assert finished["status"] == "finished" and finished["num_turns"] == TURNS
        assert _call("GET", f"{base}/rollouts/{rollouts[-1]}").json()["num_turns"] == TURNS
        _slow_heads_are_cut_off(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]

    reader = open_output(out)
    turns = reader.turns(columns=["rollout_id", "turn_index", "policy_version"]).to_pylist()
    ours = [t for t in turns if t["rollout_id"] in rollouts]
    assert sorted((t["rollout_id"], t["turn_index"]) for t in ours) == sorted(
        (r, i) for r in rollouts for i in range(TURNS)
    ), "every turn exactly once"
    assert {t["policy_version"] for t in ours} == {3}
    rows = reader.rollouts(columns=["rollout_id", "rewards", "num_turns"]).to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == sorted(rollouts)
    assert all(r["num_turns"] == TURNS for r in rows)
    samples = reader.samples(columns=["rollout_id", "num_turns"]).to_pylist()
    assert sorted(s["rollout_id"] for s in samples) == sorted(rollouts)
    assert all(s["num_turns"] == TURNS for s in samples), "a rollout split over workers"
    writers = {p.name.split("-")[-2] for p in reader.files("turns")}
    assert writers == {"w0", "w1"}, writers
    assert not list((out / "journal").rglob("*.wal")), "journals left after a clean stop"


def test_verify_and_recover_read_every_worker_journal(
    backend_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    port = _port()
    base = f"http://127.0.0.1:{port}"
    out = tmp_path / "out"
    env = {**os.environ, "TURNSTILE_SHARD_MAX_AGE_S": "3600"}  # nothing published in time
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "turnstile",
            "serve",
            "--workers",
            "2",
            "--backend",
            backend_url,
            "--output",
            str(out),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert _call("GET", base + "/health").status_code == 200
        rollouts = [f"k{n}" for n in range(8)]
        assert {owner_of(r, 2) for r in rollouts} == {0, 1}
        for rid in rollouts:
            body = {"model": "m", "messages": [{"role": "user", "content": rid}]}
            assert (
                _call("POST", f"{base}/rollouts/{rid}/v1/chat/completions", json=body).status_code
                == 200
            )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and both workers at once
        proc.wait(30)

    before = _cli("verify", str(out))
    assert before.returncode == 1 and "8 journaled turns are not in published shards" in (
        before.stdout
    ), before.stdout
    assert _cli("recover", str(out)).returncode == 0
    after = _cli("verify", str(out))
    assert after.returncode == 0, after.stdout
    turns = open_output(out).turns(columns=["rollout_id"]).to_pylist()
    assert sorted(t["rollout_id"] for t in turns) == sorted(rollouts)
