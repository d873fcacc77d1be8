"""A real weight push through the CPU vLLM, fenced by Turnstile, with streams in flight.

The pushed weights are the tiny model's, perturbed, reloaded into the running engine
(`/collective_rpc reload_weights`, a development route): a greedy call gives other
logprobs afterwards, so the push took effect. In `pause` mode the stream in flight
finishes whole under the old version; in `abort` mode it is cut, its tokens so far
recorded as an aborted turn; in both, the calls made during the push wait and are
recorded under the new version. Turnstile drives vLLM's own `/pause` and `/resume`.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.live import TurnstileServer
from turnstile.reader import open_output

pytestmark = pytest.mark.integration

MODEL = "tiny-qwen3"
# Long enough to be in flight while the fence closes: a pause waits for all of it; an
# abort cuts it, so it may be far longer than the test could wait for (the cut must come
# before vLLM has sent its last token, however fast it runs).
STREAM_TOKENS = {"pause": 300, "abort": 4000}
PUSH_TIMEOUT_S = 300.0


def _pushed_checkpoint(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model with every weight scaled: other weights, same shapes."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    scaled = {name: (t.float() * 1.5).to(t.dtype) for name, t in tensors.items()}
    save_file(scaled, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _greedy_logprobs(url: str, rollout: str) -> list[float]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
    }
    resp = httpx.post(f"{url}/rollouts/{rollout}/v1/chat/completions", json=body, timeout=120)
    resp.raise_for_status()
    return [e["logprob"] for e in resp.json()["choices"][0]["logprobs"]["content"]]


def _stream(url: str, rollout: str, tokens: int, out: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.stream(
        "POST", f"{url}/rollouts/{rollout}/v1/chat/completions", json=body, timeout=300
    ) as resp:
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                out["started"] = True
    out["lines"] = lines


@pytest.mark.parametrize("mode", ["pause", "abort"])
def test_a_weight_push_is_fenced(
    vllm_server: Any, tiny_model_dir: Path, qwen3_tokenizer_dir: Path, tmp_path: Path, mode: str
) -> None:
    pushed = _pushed_checkpoint(tiny_model_dir, tmp_path / "pushed")
    vllm = vllm_server.base_url
    with TurnstileServer(vllm, tmp_path / "out", qwen3_tokenizer_dir, backend_pause=True) as server:
        url = server.url
        before = _greedy_logprobs(url, "before")
        out: dict[str, Any] = {}
        streamer = threading.Thread(target=_stream, args=(url, "stream", STREAM_TOKENS[mode], out))
        streamer.start()
        deadline = time.monotonic() + 120
        while not out.get("started"):
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)
        paused = httpx.post(f"{url}/admin/pause", json={"mode": mode}, timeout=PUSH_TIMEOUT_S)
        assert paused.status_code == 200, paused.text
        assert paused.json()["aborted"] == (1 if mode == "abort" else 0)
        assert httpx.get(f"{vllm}/is_paused", timeout=10).json()["is_paused"] is True
        # A call made during the push waits at the fence.
        during: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: during.update(lp=_greedy_logprobs(url, "during")))
        waiter.start()
        push = httpx.post(
            f"{vllm}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(pushed)}},
            timeout=PUSH_TIMEOUT_S,
        )
        assert push.status_code == 200, push.text
        assert "lp" not in during
        resumed = httpx.post(f"{url}/admin/resume", json={"policy_version": 1}, timeout=60)
        assert resumed.status_code == 200, resumed.text
        waiter.join(120)
        streamer.join(300)
        after = _greedy_logprobs(url, "after")
        # The new weights answered the waiting call and the next one.
        assert np.allclose(during["lp"], after, atol=1e-3)
        assert not np.allclose(after, before, atol=1e-3)
        for rid in ("before", "stream", "during", "after"):
            httpx.post(f"{url}/rollouts/{rid}/finish")
        # Put the original weights back for the rest of the suite.
        httpx.post(f"{url}/admin/pause", json={"mode": "pause"}, timeout=PUSH_TIMEOUT_S)
        restore = httpx.post(
            f"{vllm}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}},
            timeout=PUSH_TIMEOUT_S,
        )
        assert restore.status_code == 200, restore.text
        httpx.post(f"{url}/admin/resume", json={"policy_version": 2}, timeout=60)
        assert np.allclose(_greedy_logprobs(url, "restored"), before, atol=1e-3)
    turns = {t["rollout_id"]: t for t in open_output(tmp_path / "out").turns().to_pylist()}
    stream = turns["stream"]
    assert stream["policy_version"] == 0
    if mode == "pause":
        assert stream["status"] == "ok"
        assert stream["num_completion_tokens"] == STREAM_TOKENS["pause"]
        assert out["lines"][-1] == "data: [DONE]"
    else:
        assert stream["status"] == "aborted" and "weight update" in stream["error"]
        assert 0 < stream["num_completion_tokens"] < STREAM_TOKENS["abort"]
        assert len(stream["behavior_logprobs"]) == stream["num_completion_tokens"]
        assert "weight update" in out["lines"][-2]
    assert (turns["during"]["policy_version"], turns["during"]["status"]) == (1, "ok")
    assert turns["before"]["policy_version"] == 0


# -- tokens per version in each mode ---------------------------------------------------------

# Streams in flight at each switch, and their lengths: `keep` streams must outlast the push
# (tokens after it carry the new version); `pause` streams are waited for; `abort` ones are
# cut, so they may be far longer than the test could wait for.
STREAMS = 3
MODE_TOKENS = {"keep": 1000, "pause": 800, "abort": 4000}
# A stream is "in flight" once it has relayed this many events.
STARTED_EVENTS = 3
# A stream cut by `abort` is retried by the harness with this many tokens.
RETRY_TOKENS = 16


def _counted_stream(url: str, rollout: str, tokens: int, out: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"story {rollout}"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    out["events"], lines = 0, []
    with httpx.stream(
        "POST", f"{url}/rollouts/{rollout}/v1/chat/completions", json=body, timeout=600
    ) as resp:
        for line in resp.iter_lines():
            if line:
                lines.append(line)
                out["events"] += 1
    out["lines"] = lines


def _push(vllm: str, weights: Path) -> None:
    push = httpx.post(
        f"{vllm}/collective_rpc",
        json={"method": "reload_weights", "kwargs": {"weights_path": str(weights)}},
        timeout=PUSH_TIMEOUT_S,
    )
    assert push.status_code == 200, push.text


@pytest.mark.parametrize("mode", ["keep", "pause", "abort"])
def test_tokens_per_version_in_each_mode(
    vllm_server: Any, tiny_model_dir: Path, qwen3_tokenizer_dir: Path, tmp_path: Path, mode: str
) -> None:
    """A real weight push while STREAMS streams are in flight; prints the figures of the
    mode (run with `-s`): turns in flight at the switch, tokens per version, tokens lost."""
    pushed = _pushed_checkpoint(tiny_model_dir, tmp_path / "pushed")
    vllm = vllm_server.base_url
    tokens = MODE_TOKENS[mode]
    rollouts = [f"{mode}-{i}" for i in range(STREAMS)]
    with TurnstileServer(vllm, tmp_path / "out", qwen3_tokenizer_dir, backend_pause=True) as server:
        url = server.url
        outs: list[dict[str, Any]] = [{} for _ in rollouts]
        threads = [
            threading.Thread(target=_counted_stream, args=(url, rid, tokens, out))
            for rid, out in zip(rollouts, outs, strict=True)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 300
        while not all(out.get("events", 0) >= STARTED_EVENTS for out in outs):
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        if mode == "keep":  # push under the running streams, then switch in one call
            _push(vllm, pushed)
            switched = httpx.post(
                f"{url}/admin/policy_version", json={"policy_version": 1, "mode": "keep"}
            )
            assert switched.status_code == 200, switched.text
            in_flight = switched.json()["in_flight_at_switch"]
        else:  # around the push: fence, push, resume
            paused = httpx.post(f"{url}/admin/pause", json={"mode": mode}, timeout=PUSH_TIMEOUT_S)
            assert paused.status_code == 200, paused.text
            in_flight = paused.json()["in_flight_at_pause"]
            _push(vllm, pushed)
            resumed = httpx.post(f"{url}/admin/resume", json={"policy_version": 1}, timeout=60)
            assert resumed.status_code == 200, resumed.text
        for thread in threads:
            thread.join(600)
        if mode == "abort":  # the harness retries each cut call under the new weights
            for rid in rollouts:
                retry: dict[str, Any] = {}
                _counted_stream(url, rid, RETRY_TOKENS, retry)
                assert retry["lines"][-1] == "data: [DONE]"
        for rid in rollouts:
            httpx.post(f"{url}/rollouts/{rid}/finish")
        # Put the original weights back (the one-call pause form: nothing is in flight).
        _push(vllm, tiny_model_dir)
        restored = httpx.post(
            f"{url}/admin/policy_version",
            json={"policy_version": 2, "mode": "pause"},
            timeout=PUSH_TIMEOUT_S,
        )
        assert restored.status_code == 200, restored.text
    turns = [t for t in open_output(tmp_path / "out").turns().to_pylist()]
    per_version: dict[int, int] = {}
    lost = 0
    for turn in turns:
        n = turn["num_completion_tokens"]
        spans = turn["policy_version_spans"]
        ends = [s["start"] for s in spans[1:]] + [n]
        for span, end in zip(spans, ends, strict=True):
            per_version[span["version"]] = per_version.get(span["version"], 0) + end - span["start"]
        if turn["status"] != "ok":
            lost += n  # recorded, but out of the loss: decoded for nothing
    first = [t for t in turns if t["turn_index"] == 0]
    print(
        f"\nfencing figures: mode={mode} in_flight_at_switch={in_flight} "
        f"tokens_per_version={dict(sorted(per_version.items()))} tokens_lost={lost}"
    )
    assert in_flight == STREAMS and len(first) == STREAMS
    if mode == "keep":
        assert lost == 0
        for turn, out in zip(sorted(first, key=lambda t: t["rollout_id"]), outs, strict=True):
            assert turn["status"] == "ok" and turn["num_completion_tokens"] == tokens
            assert out["lines"][-1] == "data: [DONE]"
            versions = [s["version"] for s in turn["policy_version_spans"]]
            assert versions in ([0, 1], [1]), turn["policy_version_spans"]
        assert per_version.get(1, 0) > 0 and per_version.get(0, 0) > 0
        assert sum(per_version.values()) == STREAMS * tokens
    elif mode == "pause":
        assert lost == 0
        assert per_version == {0: STREAMS * tokens}  # all under the old weights, whole
        assert all(t["policy_version_spans"] == [{"start": 0, "version": 0}] for t in first)
    else:
        cut = [t for t in first if t["status"] == "aborted"]
        assert len(cut) == STREAMS and 0 < lost < STREAMS * tokens
        assert per_version == {0: lost, 1: STREAMS * RETRY_TOKENS}


def _keys(value: Any) -> Any:
    """The key structure of a JSON value, in order (values left out)."""
    if isinstance(value, dict):
        return [(k, _keys(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [_keys(v) for v in value]
    return None


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count"}]}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "count"}],
                "logprobs": True,
                "top_logprobs": 2,
                "return_token_ids": True,
            },
        ),
        ("/v1/completions", {"prompt": "once upon", "logprobs": 2, "return_token_ids": True}),
        ("/v1/completions", {"prompt": "once upon"}),
    ],
)
def test_stream_whole_calls_answers_as_vllm_does(
    vllm_server: Any, qwen3_tokenizer_dir: Path, tmp_path: Path, path: str, extra: dict[str, Any]
) -> None:
    """A whole call streamed upstream and assembled has the keys, in the order, and the
    values of vLLM's own whole answer (ids and creation times aside)."""
    vllm = vllm_server.base_url
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **extra}
    direct = httpx.post(f"{vllm}{path}", json=body, timeout=120).json()
    with TurnstileServer(
        vllm, tmp_path / "out", qwen3_tokenizer_dir, stream_whole_calls=True
    ) as server:
        through = httpx.post(f"{server.url}{path}", json=body, timeout=120).json()
    for answer in (direct, through):
        answer.pop("id"), answer.pop("created")
    assert _keys(through) == _keys(direct)
    for a, b in zip(through["choices"], direct["choices"], strict=True):
        assert a.get("token_ids") == b.get("token_ids")
        assert a.get("message", a.get("text")) == b.get("message", b.get("text"))
        assert a["finish_reason"] == b["finish_reason"]
    assert through["usage"] == direct["usage"]
    turns = open_output(tmp_path / "out").turns().to_pylist()
    assert [t["status"] for t in turns] == ["ok"] and turns[0]["num_completion_tokens"] == 8
