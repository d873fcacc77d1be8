"""Two Turnstile replicas behind nginx (configs/nginx-replicas.conf) on loopback.

nginx hashes on the rollout id, so every call of a rollout reaches one replica; each
replica names its shards with its writer id and keeps its own manifest, and the reader
merges the replicas' outputs into one view with every rollout exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.unit.test_crash_recovery import _port, backend_url  # noqa: F401  (fixture)
from turnstile.reader import MANIFEST_DIR, open_output

NGINX = "/usr/sbin/nginx"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "nginx-replicas.conf"
ROLLOUTS = 20
TURNS = 3
WRITERS = ("replica-1", "replica-2")
# A replica starts in a few seconds; a loaded 2-core machine may need much longer.
START_TIMEOUT_S = 90.0
# One proxied call against the fake backend takes milliseconds.
CALL_TIMEOUT_S = 30.0
# SIGTERM drains the recorder and publishes the last shards.
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1


def _render_config(prefix: Path, listen: int, upstreams: tuple[int, int]) -> Path:
    text = CONFIG.read_text()
    for old, new in (
        ("127.0.0.1:8100", f"127.0.0.1:{listen}"),
        ("127.0.0.1:8101", f"127.0.0.1:{upstreams[0]}"),
        ("127.0.0.1:8102", f"127.0.0.1:{upstreams[1]}"),
        ("worker_processes auto;", "worker_processes 1;"),
    ):
        assert text.count(old) == 1, f"{CONFIG} no longer contains {old!r}"
        text = text.replace(old, new)
    conf = prefix / "nginx.conf"
    conf.write_text(text)
    return conf


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(url, timeout=CALL_TIMEOUT_S).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert all(p.poll() is None for p in procs), "a process exited during start-up"
        assert time.monotonic() < deadline, f"{url} not healthy in {START_TIMEOUT_S} s"
        time.sleep(POLL_S)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT_S)
        return -9


def test_two_replicas_behind_nginx_keep_every_rollout_on_one_replica(
    backend_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    ports = (_port(), _port())
    listen = _port()
    outs = [tmp_path / w for w in WRITERS]
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    conf = _render_config(prefix, listen, ports)
    env = {**os.environ, "TURNSTILE_SHARD_MAX_AGE_S": "0.5"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    codes: list[int] = []
    try:
        for writer, port, out in zip(WRITERS, ports, outs, strict=True):
            log = (tmp_path / f"{writer}.log").open("wb")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "turnstile",
                        "serve",
                        "--backend",
                        backend_url,
                        "--output",
                        str(out),
                        "--port",
                        str(port),
                        "--writer-id",
                        writer,
                        "--log-level",
                        "warning",
                    ],
                    env=env,
                    stdout=log,
                    stderr=log,
                )
            )
        nginx = subprocess.Popen(
            [NGINX, "-c", str(conf), "-p", f"{prefix}/", "-e", str(prefix / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(nginx)
        for port in ports:
            _wait_healthy(f"http://127.0.0.1:{port}/health", procs)
        base = f"http://127.0.0.1:{listen}"
        _wait_healthy(base + "/health", procs)
        rollouts = [f"rollout-{n:02d}" for n in range(ROLLOUTS)]
        with httpx.Client(base_url=base, timeout=CALL_TIMEOUT_S) as client:
            for rid in rollouts:
                head = {"X-Turnstile-Rollout": rid}
                created = client.post("/rollouts", json={"rollout_id": rid}, headers=head)
                assert created.status_code in (200, 201), created.text
                messages = [{"role": "user", "content": f"task {rid}"}]
                for turn in range(TURNS):
                    body = {"model": "m", "messages": messages}
                    if turn == 1:  # the path instead of the header
                        resp = client.post(f"/rollouts/{rid}/v1/chat/completions", json=body)
                    else:
                        resp = client.post("/v1/chat/completions", json=body, headers=head)
                    assert resp.status_code == 200, resp.text
                    reply = resp.json()["choices"][0]["message"]["content"]
                    messages += [
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": f"more {turn}"},
                    ]
                finished = client.post(f"/rollouts/{rid}/finish", headers=head)
                assert finished.status_code == 200, finished.text
                assert finished.json()["num_turns"] == TURNS, finished.json()
    finally:
        for proc in reversed(procs):  # nginx first, then the replicas publish and exit
            codes.append(_stop(proc))
        for log in logs:
            log.close()
    for writer, code in zip(WRITERS, reversed(codes[1:]), strict=True):
        assert code == 0, (tmp_path / f"{writer}.log").read_text()[-3000:]

    # Every rollout's turns are in one writer's shards; both writers got rollouts.
    owner: dict[str, set[str]] = {}
    names: list[str] = []
    for writer, out in zip(WRITERS, outs, strict=True):
        reader = open_output(out)
        for table in ("turns", "samples", "rollouts"):
            files = reader.files(table)
            names += [f"{table}/{p.name}" for p in files]
            assert all(f"-{writer}-" in p.name for p in files), files
            assert {m["turnstile.writer"] for m in reader.metadata(table)} <= {writer}
        for row in reader.turns(columns=["rollout_id"]).to_pylist():
            owner.setdefault(row["rollout_id"], set()).add(writer)
        manifest = json.loads((out / MANIFEST_DIR / f"{writer}.json").read_text())
        assert manifest["writer_id"] == writer
        assert sorted(f"{e['table']}/{e['name']}" for e in manifest["shards"]) == sorted(
            n for n in names if f"-{writer}-" in n
        ), "the manifest lists exactly the replica's published shards"
        assert [p.name for p in (out / MANIFEST_DIR).iterdir()] == [f"{writer}.json"]
    assert len(names) == len(set(names)), "shard names collide"
    assert sorted(owner) == rollouts
    assert all(len(w) == 1 for w in owner.values()), owner
    assert {w for ws in owner.values() for w in ws} == set(WRITERS), "one replica got all"

    merged = open_output(outs)
    turns = merged.turns(columns=["rollout_id", "turn_index"]).to_pylist()
    assert sorted((t["rollout_id"], t["turn_index"]) for t in turns) == sorted(
        (r, i) for r in rollouts for i in range(TURNS)
    ), "every turn exactly once"
    rows = merged.rollouts(columns=["rollout_id", "num_turns", "status"]).to_pylist()
    assert sorted(r["rollout_id"] for r in rows) == rollouts
    assert all(r["num_turns"] == TURNS and r["status"] == "finished" for r in rows), rows
    samples = merged.samples(columns=["rollout_id", "num_turns"]).to_pylist()
    assert sorted(s["rollout_id"] for s in samples) == rollouts
    assert all(s["num_turns"] == TURNS for s in samples), "a rollout split over replicas"
