"""`turnstile rescore` against the real CPU vLLM, checked against the exact logits path.

The tiny random model spreads its next-token mass over its whole vocabulary (its top-20 hold
about 0.03%), so the top-k bound would be about [0, ln 2] and say nothing. The test serves a
copy whose output concentrates on a few tokens (16 embedding rows scaled by 100: the tied
output layer then gives those tokens logits of tens, varying with the context), in float32,
so that the top-20 cover the mass and the bound is tight.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from turnstile.cli.main import main as cli_main
from turnstile.dev import devstack
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
# The sharpened copy: these many embedding rows (chosen by a fixed seed) scaled this much.
SHARP_ROWS = 16
SHARP_SCALE = 100.0
SHARP_SEED = 0
# What makes the check non-vacuous: for most scored tokens the top-20 leave at most this
# much of the mass (median), and the bound's interval is at most this wide on average
# (measured: median tail 0, mean width 0.002; the plain tiny model: tail about 1, width
# about ln 2).
MAX_MEDIAN_TAIL = 0.01
MAX_MEAN_WIDTH = 0.05


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 copy of the tiny model whose next-token mass sits on a few tokens."""
    target = tmp_path_factory.mktemp("sharp") / "model"
    shutil.copytree(tiny_model_dir, target)
    weights = {k: v.float() for k, v in load_file(str(target / "model.safetensors")).items()}
    generator = torch.Generator().manual_seed(SHARP_SEED)
    rows = torch.randperm(weights["model.embed_tokens.weight"].shape[0], generator=generator)
    weights["model.embed_tokens.weight"][rows[:SHARP_ROWS]] *= SHARP_SCALE
    save_file(weights, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def sharp_server(
    sharp_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[devstack.VLLMServer]:
    """The CPU vLLM serving the sharpened copy in float32."""
    log_path = tmp_path_factory.mktemp("vllm-sharp") / "vllm.log"
    server = devstack.start_vllm(
        sharp_model_dir, devstack.free_port(), extra_args=["--dtype", "float32"], log_path=log_path
    )
    try:
        server.wait_healthy()
    except devstack.DevstackError as exc:
        server.stop()
        pytest.fail(str(exc), pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def recorded(sharp_server: Any, tmp_path: Path) -> Iterator[Path]:
    """Rollouts with two rewards and their verifier info, recorded through the proxy."""
    output = tmp_path / "out"
    proxy = learn.start_proxy(sharp_server.base_url, output, tmp_path / "turnstile.log")
    cfg = learn.Config(max_tokens=6)
    try:
        for g in range(GROUPS):
            for i in range(GROUP_SIZE):
                learn.rollout(proxy.url, 0, g, i, cfg)
    finally:
        proxy.stop()
    yield output


def test_rescore_through_vllm_matches_the_exact_path(
    recorded: Path, sharp_server: Any, sharp_model_dir: Path
) -> None:
    samples = list(ShardFollower(recorded))
    assert len(samples) == GROUPS * GROUP_SIZE
    command = ["rescore", str(recorded), "--backend", sharp_server.base_url, "--no-progress"]
    assert cli_main(command) == 0
    approx = {
        (r["rollout_id"], r["reward_name"]): r
        for r in rescore.read_replays(recorded, rescore.METHOD_PROMPT_LOGPROBS).to_pylist()
    }
    assert len(approx) == 2 * len(samples)

    model, tokenize = rescore_torch.load_hf_model(sharp_model_dir)
    with torch.no_grad():
        written = rescore_torch.rescore_model(recorded, model, tokenize, progress=False)
    assert written == 2 * len(samples)
    exact = {
        (r["rollout_id"], r["reward_name"]): r
        for r in rescore.read_replays(recorded, rescore.METHOD_LOGITS).to_pylist()
    }

    by_id = {s.rollout_id: s for s in samples}
    tails: list[float] = []
    widths: list[float] = []
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
        tails.extend(0.5 * (np.array(row["tail_base"]) + np.array(row["tail_info"])))
        widths.extend(upper - lower)
        # the scored token is the recorded one, at the right offset
        recorded_lp = sample.behavior_logprobs[np.array(row["positions"])]
        np.testing.assert_allclose(row["logprobs_base"], recorded_lp, atol=LOGPROB_TOL)
        np.testing.assert_allclose(row["logprobs_base"], ref["logprobs_base"], atol=LOGPROB_TOL)
        np.testing.assert_allclose(row["logprobs_info"], ref["logprobs_info"], atol=LOGPROB_TOL)
    # the bound says something: the top-20 hold the mass and the interval is narrow
    # (a token whose distribution the info moves off the top-20 has a large tail but a
    # lower bound near ln 2 already, so its interval stays narrow too)
    assert float(np.median(tails)) <= MAX_MEDIAN_TAIL
    assert float(np.mean(widths)) <= MAX_MEAN_WIDTH
    # a second run has nothing left to do
    assert rescore.rescore_backend(recorded, sharp_server.base_url, progress=False) == 0
