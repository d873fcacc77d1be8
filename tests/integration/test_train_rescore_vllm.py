"""`turnstile rescore` against the real CPU vLLM, checked against the exact logits path."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from turnstile.cli.main import main as cli_main
from turnstile.train import rescore, rescore_torch
from turnstile.train.dataset import ShardFollower

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "train"))
import learn

GROUPS = 2
GROUP_SIZE = 2
# vLLM computes in bfloat16 and the trainer in float32: their log-probabilities of the same
# token differ by a few hundredths on the tiny model, and JSDs by about as much.
LOGPROB_TOL = 0.1
JSD_TOL = 0.03


@pytest.fixture
def recorded(vllm_server: Any, tmp_path: Path) -> Iterator[Path]:
    """Rollouts with two rewards and their verifier info, recorded through the proxy."""
    output = tmp_path / "out"
    proxy = learn.start_proxy(vllm_server.base_url, output, tmp_path / "turnstile.log")
    cfg = learn.Config(max_tokens=6)
    try:
        for g in range(GROUPS):
            for i in range(GROUP_SIZE):
                learn.rollout(proxy.url, 0, g, i, cfg)
    finally:
        proxy.stop()
    yield output


def test_rescore_through_vllm_matches_the_exact_path(
    recorded: Path, vllm_server: Any, tiny_model_dir: Path
) -> None:
    samples = list(ShardFollower(recorded))
    assert len(samples) == GROUPS * GROUP_SIZE
    command = ["rescore", str(recorded), "--backend", vllm_server.base_url, "--no-progress"]
    assert cli_main(command) == 0
    approx = {
        (r["rollout_id"], r["reward_name"]): r
        for r in rescore.read_replays(recorded, rescore.METHOD_PROMPT_LOGPROBS).to_pylist()
    }
    assert len(approx) == 2 * len(samples)

    model, tokenize = rescore_torch.load_hf_model(tiny_model_dir)
    with torch.no_grad():
        written = rescore_torch.rescore_model(recorded, model, tokenize, progress=False)
    assert written == 2 * len(samples)
    exact = {
        (r["rollout_id"], r["reward_name"]): r
        for r in rescore.read_replays(recorded, rescore.METHOD_LOGITS).to_pylist()
    }

    by_id = {s.rollout_id: s for s in samples}
    for key, row in approx.items():
        sample = by_id[key[0]]
        ref = exact[key]
        assert row["positions"] == ref["positions"]
        assert row["info_num_tokens"] == ref["info_num_tokens"] > 0
        lower, upper = np.array(row["jsd"]), np.array(row["jsd_upper"])
        assert (lower <= upper + 1e-6).all() and (upper <= np.log(2) + 1e-6).all()
        # the exact JSD lies within the bound computed from the top-k
        truth = np.array(ref["jsd"])
        assert (truth >= lower - JSD_TOL).all() and (truth <= upper + JSD_TOL).all()
        # the scored token is the recorded one, at the right offset
        recorded_lp = sample.behavior_logprobs[np.array(row["positions"])]
        np.testing.assert_allclose(row["logprobs_base"], recorded_lp, atol=LOGPROB_TOL)
        np.testing.assert_allclose(row["logprobs_base"], ref["logprobs_base"], atol=LOGPROB_TOL)
        np.testing.assert_allclose(row["logprobs_info"], ref["logprobs_info"], atol=LOGPROB_TOL)
    # a second run has nothing left to do
    assert rescore.rescore_backend(recorded, vllm_server.base_url, progress=False) == 0
