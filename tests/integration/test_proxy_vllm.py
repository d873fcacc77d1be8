"""End to end: the openai client -> Turnstile -> the real CPU vLLM -> Parquet -> reader.

Checks the promise itself: recorded prompt IDs equal vLLM's own `/tokenize` of the same
messages, recorded completion IDs and logprobs equal what vLLM returned, the harness
sees the response vLLM would have given it, and a stitched sample is exactly the
concatenation of its turns (or is split and flagged where vLLM's re-rendering drifted).
"""

from __future__ import annotations

import json
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
import numpy as np
import openai
import pytest

from tests.live import TurnstileServer
from turnstile.output.schema import SCHEMA_VERSION
from turnstile.reader import open_output

MODEL = "tiny-qwen3"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# Short generations keep the suite fast on two CPU cores.
MAX_TOKENS = 12
# Sampling is seeded so that a direct call and a proxied call sample the same tokens.
SEED = 1234


class Turnstile(TurnstileServer):
    """Turnstile in front of the real vLLM (shards roll every second)."""


@pytest.fixture
def turnstile(vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path) -> Iterator[Turnstile]:
    ts = Turnstile(vllm_server.base_url, tmp_path / "out", qwen3_tokenizer_dir)
    ts.start()
    yield ts
    ts.stop()


def vllm_tokenize(base_url: str, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    resp = httpx.post(
        base_url + "/tokenize",
        json={"model": MODEL, "messages": messages, "tools": tools, "add_generation_prompt": True},
        timeout=30,
    )
    resp.raise_for_status()
    return list(resp.json()["tokens"])


def _strip_volatile(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            k: _strip_volatile(v)
            for k, v in obj.items()
            if k not in ("id", "created", "system_fingerprint")
        }
    if isinstance(obj, list):
        return [_strip_volatile(v) for v in obj]
    return obj


def test_response_shape_is_what_vllm_returns(turnstile: Turnstile, vllm_server: Any) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": MAX_TOKENS,
        "seed": SEED,
        "temperature": 1.0,
    }
    via = httpx.post(turnstile.url + "/v1/chat/completions", json=body, timeout=60).json()
    direct = httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert _strip_volatile(via) == _strip_volatile(direct)

    stream_body = {**body, "stream": True}
    with httpx.stream(
        "POST", turnstile.url + "/v1/chat/completions", json=stream_body, timeout=60
    ) as r:
        via_lines = [line for line in r.iter_lines() if line]
    with httpx.stream(
        "POST", vllm_server.base_url + "/v1/chat/completions", json=stream_body, timeout=60
    ) as r:
        direct_lines = [line for line in r.iter_lines() if line]
    # vLLM groups tokens into chunks by timing, so compare what does not depend on it:
    # the shape of every chunk, the text, the finish reason and the end of the stream.
    assert via_lines[-1] == direct_lines[-1] == "data: [DONE]"
    via_chunks = [json.loads(line[6:]) for line in via_lines[:-1]]
    direct_chunks = [json.loads(line[6:]) for line in direct_lines[:-1]]
    assert _strip_volatile(via_chunks[0]) == _strip_volatile(direct_chunks[0])
    assert _shapes(via_chunks) == _shapes(direct_chunks)
    assert _text(via_chunks) == _text(direct_chunks)
    assert _finish(via_chunks) == _finish(direct_chunks)


def _shapes(chunks: list[dict[str, Any]]) -> set[str]:
    """Every chunk's keys, with their null-ness, as comparable strings."""
    out = set()
    for chunk in chunks:
        top = sorted((k, v is None) for k, v in chunk.items() if k != "choices")
        for choice in chunk["choices"]:
            keys = sorted((k, v is None) for k, v in choice.items() if k != "delta")
            out.add(json.dumps([top, keys, sorted(choice.get("delta", {}))]))
    return out


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])


def _finish(chunks: list[dict[str, Any]]) -> list[Any]:
    return [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]


def _run_rollout(client: openai.OpenAI, stream_pattern: list[bool]) -> list[dict[str, Any]]:
    """Drive a multi-turn conversation; returns what the client saw per turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
    ]
    seen = []
    for i, stream in enumerate(stream_pattern):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            max_tokens=MAX_TOKENS,
            seed=SEED + i,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        if stream:
            ids: list[int] = []
            lps: list[float] = []
            text = []
            prompt_ids = None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                extra = chunk.model_extra or {}
                if extra.get("prompt_token_ids"):
                    prompt_ids = extra["prompt_token_ids"]
                for ch in chunk.choices:
                    ids += (ch.model_extra or {}).get("token_ids") or []
                    if ch.logprobs and ch.logprobs.content:
                        lps += [e.logprob for e in ch.logprobs.content]
                    text.append(ch.delta.content or "")
            content = "".join(text)
        else:
            resp = client.chat.completions.create(**kwargs)
            choice = resp.choices[0]
            content = choice.message.content or ""
            ids = (choice.model_extra or {})["token_ids"]
            lps = [e.logprob for e in (choice.logprobs.content or [])] if choice.logprobs else []
            prompt_ids = (resp.model_extra or {})["prompt_token_ids"]
        seen.append(
            {
                "messages": list(messages),
                "ids": ids,
                "logprobs": lps,
                "prompt_ids": prompt_ids,
                "content": content,
            }
        )
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"Thanks. And tomorrow? ({i})"},
        ]
    return seen


def test_multi_turn_rollouts_are_recorded_exactly(turnstile: Turnstile, vllm_server: Any) -> None:
    created = httpx.post(
        turnstile.url + "/rollouts", json={"group_id": "g0", "task_id": "weather"}
    ).json()
    client = openai.OpenAI(base_url=created["base_url"], api_key="unused", max_retries=0)
    seen = _run_rollout(client, [False, True, False, True])
    rid = created["rollout_id"]
    assert (
        httpx.post(
            f"{turnstile.url}/rollouts/{rid}/rewards",
            json={"rewards": {"correct": 1.0, "format": 0.0}},
        ).status_code
        == 200
    )
    assert httpx.post(f"{turnstile.url}/rollouts/{rid}/finish").status_code == 200
    turnstile.stop()

    out = open_output(turnstile.output)
    turns = sorted(
        (t for t in out.turns().to_pylist() if t["rollout_id"] == rid),
        key=lambda t: t["turn_index"],
    )
    assert len(turns) == len(seen)
    for turn, client_saw in zip(turns, seen, strict=True):
        assert turn["status"] == "ok" and turn["token_source"] == "backend"
        # the prompt is exactly what vLLM tokenized for these messages
        expected_prompt = vllm_tokenize(vllm_server.base_url, client_saw["messages"], TOOLS)
        assert turn["prompt_token_ids"] == expected_prompt
        assert turn["prompt_token_ids"] == client_saw["prompt_ids"]
        # the completion and its logprobs are exactly what vLLM returned
        assert turn["completion_token_ids"] == client_saw["ids"]
        assert np.array_equal(
            np.asarray(turn["behavior_logprobs"], np.float32),
            np.asarray(client_saw["logprobs"], np.float32),
        )

    samples = [s for s in out.samples().to_pylist() if s["rollout_id"] == rid]
    assert samples, "the sealed rollout produced no samples"
    for sample in samples:
        ids = np.asarray(sample["input_ids"])
        mask = np.asarray(sample["loss_mask"])
        for span in sample["turn_spans"]:
            turn = turns[span["turn_index"]]
            # every turn's prompt is the sample's tokens up to its completion
            assert ids[: span["completion_start"]].tolist() == turn["prompt_token_ids"]
            got = ids[span["completion_start"] : span["completion_end"]].tolist()
            assert got == turn["completion_token_ids"]
            assert mask[span["completion_start"] : span["completion_end"]].all()
        assert mask.sum() == sum(
            len(turns[s["turn_index"]]["completion_token_ids"]) for s in sample["turn_spans"]
        )
        if sample["sample_index"] > 0:
            assert sample["break_kind"] not in (None, "first")
            assert sample["break_position"] is not None
    assert sum(len(s["turn_spans"]) for s in samples) == len(turns)
    (rollout,) = [r for r in out.rollouts().to_pylist() if r["rollout_id"] == rid]
    assert rollout["status"] == "finished" and rollout["group_id"] == "g0"
    assert {r["name"]: r["value"] for r in rollout["rewards"]} == {"correct": 1.0, "format": 0.0}


def test_completions_with_token_prompt(turnstile: Turnstile, vllm_server: Any) -> None:
    prompt = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
    client = openai.OpenAI(base_url=turnstile.url + "/rollouts/cmp-1/v1", api_key="x")
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        seed=SEED,
        logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = resp.choices[0]
    httpx.post(turnstile.url + "/rollouts/cmp-1/finish")
    turnstile.stop()
    (turn,) = [
        t for t in open_output(turnstile.output).turns().to_pylist() if t["rollout_id"] == "cmp-1"
    ]
    assert turn["prompt_token_ids"] == prompt
    assert turn["completion_token_ids"] == (choice.model_extra or {})["token_ids"]
    assert choice.logprobs is not None
    assert np.array_equal(
        np.asarray(turn["behavior_logprobs"], np.float32),
        np.asarray(choice.logprobs.token_logprobs, np.float32),
    )


def test_openai_client_sees_what_vllm_returns(turnstile: Turnstile, vllm_server: Any) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour"}],
        max_tokens=MAX_TOKENS,
        seed=SEED,
        tools=TOOLS,
    )
    via = openai.OpenAI(base_url=turnstile.url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=vllm_server.base_url + "/v1", api_key="x", max_retries=0)
    a = via.chat.completions.create(**kwargs).model_dump()
    b = direct.chat.completions.create(**kwargs).model_dump()
    assert _strip_volatile(a) == _strip_volatile(b)
    sa = [c.model_dump() for c in via.chat.completions.create(stream=True, **kwargs)]
    sb = [c.model_dump() for c in direct.chat.completions.create(stream=True, **kwargs)]
    assert _text(sa) == _text(sb) and _finish(sa) == _finish(sb)
    assert _shapes(sa) == _shapes(sb)


def _start_serve(vllm_server: Any, tokenizer: Path, out: Path) -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "turnstile",
        "serve",
        "--backend",
        vllm_server.base_url,
        "--output",
        str(out),
        "--port",
        str(port),
        "--tokenizer",
        str(tokenizer),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("turnstile serve did not start: " + proc.communicate()[0])
        time.sleep(0.2)


# Long enough that the stream is still running while the test checks the draining server.
DRAIN_TOKENS = 400


def test_sigterm_drains_in_flight_streams(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    proc, url = _start_serve(vllm_server, qwen3_tokenizer_dir, tmp_path / "shards")
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": DRAIN_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream(
            "POST", url + "/rollouts/drain/v1/chat/completions", json=body, timeout=120
        ) as resp:
            for line in resp.iter_lines():
                started.set()
                lines.append(line)

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        refused = httpx.post(
            url + "/v1/chat/completions",
            timeout=5,
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        )
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        worker.join(120)
    finally:
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert [line for line in lines if line][-1] == "data: [DONE]"
    turns = open_output(tmp_path / "shards").turns().to_pylist()
    (turn,) = [t for t in turns if t["rollout_id"] == "drain"]
    assert turn["status"] == "ok" and len(turn["completion_token_ids"]) == DRAIN_TOKENS


def test_serve_command_publishes_everything_on_sigterm(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "shards"
    proc, url = _start_serve(vllm_server, qwen3_tokenizer_dir, out)
    try:
        client = openai.OpenAI(base_url=url + "/rollouts/left-open/v1", api_key="x")
        for _ in range(2):
            client.chat.completions.create(
                model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    reader = open_output(out)
    assert len(reader.turns().to_pylist()) == 2
    (rollout,) = reader.rollouts().to_pylist()
    assert rollout["rollout_id"] == "left-open" and rollout["status"] == "interrupted"
    assert not list((out / ".tmp").glob("*")), "a staged file was left behind"
    meta = reader.metadata("turns")[0]
    assert (
        meta["turnstile.schema_version"] == str(SCHEMA_VERSION) and MODEL in meta["turnstile.model"]
    )


def _vllm_metric(base_url: str, name: str, label: str = "") -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_aborts_the_request_in_vllm(
    turnstile: Turnstile, vllm_server: Any
) -> None:
    # 1,500 tokens take vLLM on the CPU about 25 s; a request that stops running within
    # seconds of the disconnect without finishing was aborted by the cancel.
    finished = "vllm:request_success_total"
    before = _vllm_metric(vllm_server.base_url, finished)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "talk"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", turnstile.url + "/rollouts/cut/v1/chat/completions", json=body, timeout=60
    ) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 10:
                break
    cut_at = time.monotonic()
    while _vllm_metric(vllm_server.base_url, "vllm:num_requests_running") > 0:
        assert time.monotonic() - cut_at < 10, "vLLM kept generating after the disconnect"
        time.sleep(0.2)
    assert _vllm_metric(vllm_server.base_url, finished) == before, "the request completed"
    httpx.post(turnstile.url + "/rollouts/cut/finish")
    turnstile.stop()
    (turn,) = [
        t for t in open_output(turnstile.output).turns().to_pylist() if t["rollout_id"] == "cut"
    ]
    assert turn["status"] == "aborted" and turn["error"] == "client disconnected"
    assert 0 < len(turn["completion_token_ids"]) < 1500
    assert len(turn["behavior_logprobs"]) == len(turn["completion_token_ids"])
