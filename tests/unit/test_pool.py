"""Many backends: consistent hashing, stickiness, ejection and return, recorded fail-over.

The backends are real HTTP servers (small aiohttp processes on loopback, answering like
vLLM), and one is killed with SIGKILL in the middle of a run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from tests.fakes_backend import FakeVLLM
from tests.fakes_sink import InMemorySink
from turnstile.backends.pool import RING_POINTS_PER_BACKEND, BackendPool, HashRing, Member
from turnstile.errors import BackendUnreachable
from turnstile.server.app import create_app
from turnstile.settings import load_settings

# Starting a Python process with aiohttp takes about a second on a loaded machine.
SERVER_START_TIMEOUT_S = 30.0
HEALTH_INTERVAL_S = 0.1


def _serve(port: int) -> None:  # pragma: no cover - runs in the backend subprocess
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        ids = [port % 30000, 2]
        return web.json_response(
            {
                "id": "chatcmpl-x",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", "m"),
                "prompt_token_ids": [1, 2, 3],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "token_ids": ids,
                        "message": {"role": "assistant", "content": f"from {port}"},
                        "logprobs": {
                            "content": [
                                {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
                                for _ in ids
                            ]
                        },
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from tests.unit.test_pool import _serve; _serve({self.port})"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"fake backend on {self.port} did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started = [Server(_free_port()) for _ in range(3)]
    for s in started:
        s.start()
    yield started
    for s in started:
        if s.proc is not None and s.proc.poll() is None:
            s.kill()


def _wait(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def test_killed_backend_fails_over_once_and_is_recorded(
    servers: list[Server], tmp_path: Path
) -> None:
    settings = load_settings(
        None,
        {
            "backends": [s.url for s in servers],
            "output": tmp_path / "out",
            "backend_health_interval_s": HEALTH_INTERVAL_S,
        },
        environ={},
    )
    sink = InMemorySink()
    app = create_app(settings, sink=sink)
    pool = app.state.proxy.backend
    assert isinstance(pool, BackendPool)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as client:
        rollouts = [client.post("/rollouts", json={}).json()["rollout_id"] for _ in range(24)]

        def turn(rid: str) -> str:
            resp = client.post(f"/rollouts/{rid}/v1/chat/completions", json=chat)
            assert resp.status_code == 200, resp.text
            return str(resp.json()["choices"][0]["message"]["content"])

        first = {rid: turn(rid) for rid in rollouts}
        spread = Counter(first.values())
        assert len(spread) == 3  # hashing spreads 24 rollouts over all three
        victim = servers[[f"from {s.port}" for s in servers].index(spread.most_common(1)[0][0])]
        victim.kill()
        second = {rid: turn(rid) for rid in rollouts}
        third = {rid: turn(rid) for rid in rollouts}
        stats = pool.stats()
        assert stats["backends"][victim.url]["healthy"] is False  # type: ignore[index]
        victim.start()  # the same port comes back: returned to the pool by health checks
        _wait(lambda: all(m.healthy for m in pool.members()))
        fourth = {rid: turn(rid) for rid in rollouts}
        for rid in rollouts:
            client.post(f"/rollouts/{rid}/finish")
    moved = {rid for rid, who in first.items() if who == f"from {victim.port}"}
    assert moved and all(second[rid] != first[rid] for rid in moved)
    for rid in rollouts:  # nobody else moved; the moved ones stay where they went
        if rid not in moved:
            assert first[rid] == second[rid] == third[rid] == fourth[rid]
        else:
            assert second[rid] == third[rid] == fourth[rid]
    by_rollout: dict[str, list[Any]] = defaultdict(list)
    for t in sink.turns:
        by_rollout[t.rollout_id].append(t)
    for rid, turns in by_rollout.items():
        turns.sort(key=lambda t: t.turn_index)
        assert all(t.backend is not None for t in turns)
        failovers = [t.turn_index for t in turns if t.backend_failover_from is not None]
        if rid in moved:
            assert failovers == [1]
            assert turns[1].backend_failover_from == victim.url != turns[1].backend
        else:
            assert failovers == []
        assert len({t.backend for t in turns[1:]}) == 1
    assert pool.failovers == len(moved)


def test_ring_moves_only_the_lost_members_keys() -> None:
    members = [Member(FakeVLLM(base_url=f"http://b{i}"), f"http://b{i}") for i in range(4)]
    full = HashRing(members)
    without = HashRing(members[:3])
    keys = [f"rollout-{i}" for i in range(2000)]
    owners = Counter(full.order(k)[0].url for k in keys)
    assert min(owners.values()) > 2000 / 4 * 0.6  # a fair share each
    for k in keys:
        before = full.order(k)
        if before[0] is not members[3]:
            assert without.order(k)[0] is before[0]
        else:
            assert without.order(k)[0] is before[1]  # the next on the ring
    assert RING_POINTS_PER_BACKEND >= 16


def test_per_model_groups_and_all_dead() -> None:
    a, b = FakeVLLM(base_url="http://a"), FakeVLLM(base_url="http://b")
    pool = BackendPool({None: [a], "big": [b]})

    async def go() -> None:
        resp = await pool.request(
            "POST",
            "/v1/chat/completions",
            b'{"model": "big", "messages": [{"role": "user", "content": "x"}]}',
            {},
            affinity="r1",
        )
        assert resp.served_by == "http://b"
        resp = await pool.request("GET", "/v1/models", None, {})
        assert resp.served_by == "http://a"

    asyncio.run(go())
    assert b.requests and a.requests

    class Dead(FakeVLLM):
        async def request(self, *args: Any, **kwargs: Any) -> Any:
            raise BackendUnreachable(f"backend {self.base_url} is unreachable: refused")

    dead = BackendPool({None: [Dead(base_url="http://d1"), Dead(base_url="http://d2")]})
    with pytest.raises(BackendUnreachable, match="no backend of the default group"):
        asyncio.run(dead.request("GET", "/v1/models", None, {}, affinity="r"))
    assert not any(m.healthy for m in dead.members())
