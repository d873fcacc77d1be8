"""The MRTPO replay: prompts, prompt_logprobs scoring, the replays table, the CLI."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.test_train_batches import group_records, write_shard
from turnstile.cli.main import main as cli_main
from turnstile.train import advantages as adv
from turnstile.train import jsd, rescore, rescore_torch
from turnstile.train.dataset import ShardFollower

VOCAB = 16
INFO_TOKENS = [14, 15]  # what the fake backend's /tokenize returns


def distribution(prompt: list[int], position: int) -> np.ndarray:
    """The fake policy's next-token distribution: depends on the context it sees."""
    seed = (sum(prompt[:position]) * 31 + position) % 997
    logits = np.random.default_rng(seed).normal(size=VOCAB)
    e = np.exp(logits - logits.max())
    return np.asarray(e / e.sum())


class FakeVLLM(BaseHTTPRequestHandler):
    top_k_seen: list[int] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self._send({"tokens": INFO_TOKENS})
            return
        k = int(body["prompt_logprobs"])
        FakeVLLM.top_k_seen.append(k)
        choices = []
        for i, prompt in enumerate(body["prompt"]):
            entries: list[dict[str, dict[str, float]] | None] = [None]
            for t in range(1, len(prompt)):
                p = distribution(prompt, t)
                top = set(np.argsort(-p)[:k].tolist()) | {prompt[t]}
                entries.append({str(j): {"logprob": math.log(p[j]), "rank": 1} for j in top})
            choices.append({"index": i, "text": "", "prompt_logprobs": entries})
        self._send({"choices": choices})


@pytest.fixture
def backend() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_jobs_insert_the_info_before_the_response(tmp_path: Path) -> None:
    write_shard(tmp_path, group_records("g", [(1, 0)], lengths=[3]))
    sample = next(iter(ShardFollower(tmp_path)))
    jobs = list(rescore.build_jobs([sample], lambda text: [7, 8, 9]))
    assert len(jobs) == 1  # only `correct` has verifier info
    job = jobs[0]
    assert job.reward_name == "correct"
    assert job.positions.tolist() == [2, 3, 4]
    assert job.info_prompt == [1, 2, 7, 8, 9, 10, 11, 12]
    assert (
        list(rescore.build_jobs([sample], lambda t: [7], done=frozenset({("g-0", 0, "correct")})))
        == []
    )
    assert rescore.render_info("a", "b") == rescore.DEFAULT_INFO_TEMPLATE.format(name="a", info="b")


def test_backend_rescore_writes_bounded_jsd_and_resumes(tmp_path: Path, backend: str) -> None:
    write_shard(tmp_path, group_records("g", [(1, 0), (0, 1), (1, 1)], lengths=[3, 4, 2]))
    written = rescore.rescore_backend(tmp_path, backend, top_k=3, progress=False)
    assert written == 3
    table = rescore.read_replays(tmp_path)
    assert table.schema.equals(rescore.REPLAYS_SCHEMA, check_metadata=False)
    samples = {s.rollout_id: s for s in ShardFollower(tmp_path)}
    for row in table.to_pylist():
        assert row["method"] == "prompt_logprobs" and row["top_k"] == 3
        sample = samples[row["rollout_id"]]
        base = [int(t) for t in sample.input_ids]
        info = base[:2] + INFO_TOKENS + base[2:]
        for i, t in enumerate(row["positions"]):
            full = float(jsd.jsd(distribution(base, t), distribution(info, t + 2)))
            assert row["jsd"][i] - 1e-6 <= full <= row["jsd_upper"][i] + 1e-6
            expected = 0.5 * (row["tail_base"][i] + row["tail_info"][i]) * math.log(2)
            assert row["jsd_upper"][i] == pytest.approx(
                min(math.log(2), row["jsd"][i] + expected), abs=1e-5
            )
            assert row["logprobs_base"][i] == pytest.approx(
                math.log(distribution(base, t)[base[t]]), abs=1e-5
            )
    # already re-scored: nothing new
    assert rescore.rescore_backend(tmp_path, backend, top_k=3, progress=False) == 0
    rel = rescore.read_relevance(tmp_path)
    assert set(rel) == {("g-0", 0, "correct"), ("g-1", 0, "correct"), ("g-2", 0, "correct")}
    laid = rescore.relevance_for(list(samples.values()), rel)
    assert laid[("g-1", 0, "correct")].shape == (4,)
    # the tiny vocabulary's top-3 leave most of the mass out: every token is unknown
    assert np.isnan(rel[("g-1", 0, "correct")]).all()
    lower = rescore.read_relevance(tmp_path, max_tail=1.0)
    mid = rescore.read_relevance(tmp_path, use="mid", max_tail=1.0)
    assert (lower[("g-1", 0, "correct")] <= mid[("g-1", 0, "correct")] + 1e-9).all()


def test_default_relevance_is_the_lower_bound_with_the_tail_explicit() -> None:
    # Token A: the verifier info changes nothing, but its top-k cover only 70% of the mass
    # (JSD interval [0, 0.5 * 0.6 * ln 2]); token B: a real JSD of 0.051, fully covered.
    lower, upper = [0.0, 0.051], [0.3 * math.log(2), 0.051]
    tails = [0.3, 0.0]
    mid = rescore.relevance_from_bounds(lower, upper, tails, tails, use="mid")
    # the midpoint ranks A first: weights [1.35, 0.65] (0.104 and 0.051 over their mean)
    np.testing.assert_allclose(
        adv.mrtpo_token_weights(mid, floor=1.0, max_weight=None), [1.3419, 0.6581], atol=1e-4
    )
    # the default (lower bound) gives the exact weights [0, 2]
    d = rescore.relevance_from_bounds(lower, upper, tails, tails)
    np.testing.assert_allclose(adv.mrtpo_token_weights(d, floor=1.0, max_weight=None), [0, 2])
    # a token whose top-k miss more than half of the mass is unknown (NaN, weight 1)
    wide = rescore.relevance_from_bounds([0.0, 0.05], [0.6, 0.05], [0.8, 0.0], [0.9, 0.0])
    assert np.isnan(wide[0]) and wide[1] == 0.05
    with pytest.raises(ValueError):
        rescore.relevance_from_bounds(lower, upper, tails, tails, use="max")


@pytest.mark.parametrize("command", ["rescore", "replay"])
def test_cli_rescore_through_a_backend(
    tmp_path: Path, backend: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write_shard(tmp_path, group_records("g", [(1, 0), (0, 1)]))
    assert (
        cli_main(
            [command, str(tmp_path), "--backend", backend + "/v1", "--top-k", "2", "--no-progress"]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "rescored 2 responses" in out.out
    assert ("deprecated" in out.err) == (command == "replay")
    assert FakeVLLM.top_k_seen[-1] == 2
    assert cli_main([command, str(tmp_path / "missing"), "--backend", backend]) == 2
    assert cli_main([command, str(tmp_path), "--backend", "http://127.0.0.1:9"]) == 1


class TinyLM(torch.nn.Module):
    """A causal toy LM: logits from the sum of the tokens so far."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(200, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        h = torch.cumsum(self.embed(input_ids), dim=1)
        out: torch.Tensor = self.head(torch.tanh(h))
        return out


def test_exact_rescore_from_full_logits(tmp_path: Path) -> None:
    write_shard(tmp_path, group_records("g", [(1, 0), (0, 1)], lengths=[3, 2]))
    model = TinyLM()
    assert rescore_torch.rescore_model(tmp_path, model, lambda t: [150, 151], progress=False) == 2
    rows = rescore.read_replays(tmp_path, rescore.METHOD_LOGITS).to_pylist()
    sample = next(iter(ShardFollower(tmp_path)))
    row = next(r for r in rows if r["rollout_id"] == sample.rollout_id)
    base = torch.tensor([[int(t) for t in sample.input_ids]])
    info = torch.tensor([[1, 2, 150, 151, *base[0, 2:].tolist()]])
    with torch.no_grad():
        lb, li = model(base).double(), model(info).double()
    for i, t in enumerate(row["positions"]):
        expected = jsd.jsd_from_logits(lb[0, t - 1].numpy(), li[0, t + 1].numpy())
        assert row["jsd"][i] == pytest.approx(float(expected), abs=1e-5)
        assert row["jsd_upper"][i] == row["jsd"][i]
        assert row["tail_base"][i] == 0.0
    assert rescore_torch.rescore_model(tmp_path, model, lambda t: [150], progress=False) == 0


def test_token_logprobs_align_with_input_ids() -> None:
    from turnstile.train.policy import next_token_logprobs, token_logprobs

    model = TinyLM()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        lp = token_logprobs(model, ids)
        full = torch.log_softmax(model(ids).float(), -1)
    assert lp[0, 0] == 0
    assert float(lp[0, 2]) == pytest.approx(float(full[0, 1, 7]))
    with torch.no_grad():
        assert float(next_token_logprobs(model, ids)[0, 2, 7]) == pytest.approx(float(lp[0, 2]))
