"""The TRL adapter's pure parts: recorded samples in TRL's layout, the reward function
that reads recorded rewards, the checkpoint a weight push writes, and what it refuses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request, Response
from safetensors.torch import load_file

from tests.live import LiveServer
from turnstile.train.batches import TrainSample
from turnstile.train.integrations.trl import (
    REWARDS_COLUMN,
    RolloutShapeError,
    TurnstileRollouts,
    VLLMWeightSync,
    recorded_reward,
    to_trl_sample,
)


def _sample(mask: list[int], rollout_id: str = "r") -> TrainSample:
    n = len(mask)
    logp = np.where(np.array(mask) == 1, -0.5 - np.arange(n) / 10, np.nan).astype(np.float32)
    return TrainSample(
        rollout_id=rollout_id,
        sample_index=0,
        group_id="g",
        task_id=None,
        rollout_status="finished",
        input_ids=np.arange(100, 100 + n, dtype=np.int32),
        loss_mask=np.array(mask, dtype=np.int8),
        behavior_logprobs=logp,
        rewards={"correct": 1.0},
        reward_info={"correct": None},
        policy_versions=np.array([3, 4], dtype=np.int64),
        min_policy_version=3,
        max_policy_version=4,
    )


def test_a_multi_turn_sample_splits_at_its_first_sampled_token() -> None:
    # prompt (3), completion (2), tool result (2), completion (1)
    got = to_trl_sample(_sample([0, 0, 0, 1, 1, 0, 0, 1]))
    assert got.prompt_ids == [100, 101, 102]
    assert got.completion_ids == [103, 104, 105, 106, 107]
    assert got.env_mask == [1, 1, 0, 0, 1]
    np.testing.assert_allclose(got.logprobs, [-0.8, -0.9, 0.0, 0.0, -1.2], rtol=0, atol=1e-6)
    assert got.rewards == {"correct": 1.0}
    assert got.policy_versions == [3, 4]


def test_a_sample_without_sampled_tokens_is_refused() -> None:
    with pytest.raises(RolloutShapeError, match="rollout r sample 0 has no sampled token"):
        to_trl_sample(_sample([0, 0, 0]))


def test_recorded_reward_reads_the_recorded_column() -> None:
    reward = recorded_reward("correct")
    assert reward.__name__ == "correct"
    recorded = [{"correct": 1.0}, {"other": 2.0}, {"correct": 0.25}]
    assert reward(["a", "b", "c"], **{REWARDS_COLUMN: recorded}) == [1.0, None, 0.25]


@pytest.mark.parametrize(("prompts", "size"), [(3, 2), (4, 0)])
def test_prompts_must_make_whole_groups(prompts: int, size: int) -> None:
    rollouts = TurnstileRollouts("http://127.0.0.1:9", "out", lambda client, prompt: {})
    with pytest.raises(ValueError, match="do not make whole groups"):
        rollouts.generate(["p"] * prompts, size)


@pytest.mark.parametrize(("field", "value"), [("concurrency", 0), ("wait_timeout_s", 0.0)])
def test_bad_settings_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        TurnstileRollouts("http://127.0.0.1:9", "out", lambda c, p: {}, **{field: value})


class _Tied(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.lm_head = torch.nn.Linear(2, 4, bias=False)
        self.lm_head.weight = self.embed.weight
        saved: dict[str, Any] = {}
        self.config = SimpleNamespace(
            tie_word_embeddings=tied, to_json_file=lambda path: saved.setdefault("path", path)
        )
        self.saved = saved


@pytest.mark.parametrize("tied", [True, False])
def test_the_pushed_checkpoint_leaves_out_a_tied_output_layer(tmp_path: Path, tied: bool) -> None:
    model = _Tied(tied)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    VLLMWeightSync("http://p", "http://b", tmp_path / "ckpt").save(model)
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert ("lm_head.weight" in tensors) is not tied
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["embed.weight"], model.embed.weight.detach().to(torch.bfloat16))
    assert model.saved["path"] == str(tmp_path / "ckpt" / "config.json")
    assert not (tmp_path / "ckpt" / "model.safetensors.partial").exists()


def _fake_servers(reload_status: int) -> tuple[Any, list[tuple[str, Any]]]:
    """One app playing the proxy's fence routes and vLLM's reload routes, logging calls."""
    calls: list[tuple[str, Any]] = []
    app = FastAPI()

    @app.post("/{path:path}")
    async def any_post(path: str, request: Request) -> Response:
        body = await request.body()
        calls.append((path, body.decode() or None))
        status = reload_status if path == "collective_rpc" else 200
        return Response(b"{}", status_code=status, media_type="application/json")

    return app, calls


@pytest.mark.parametrize("reload_status", [200, 500])
def test_a_push_is_fenced_and_a_failed_reload_resumes_the_old_version(
    tmp_path: Path, reload_status: int
) -> None:
    app, calls = _fake_servers(reload_status)
    with LiveServer(app) as server:
        sync = VLLMWeightSync(server.url, server.url, tmp_path / "ckpt", mode="abort")
        if reload_status == 200:
            sync.push(_Tied(True), 7)
            assert sync.pushes == [7]
        else:
            with pytest.raises(httpx.HTTPStatusError, match="collective_rpc: 500"):
                sync.push(_Tied(True), 7)
            assert sync.pushes == []
    paths = [path for path, _ in calls]
    resume = '{"policy_version":7}' if reload_status == 200 else "{}"
    expected: list[tuple[str, str | None]] = [("admin/pause", '{"mode":"abort"}')]
    expected.append(
        (
            "collective_rpc",
            '{"method":"reload_weights","kwargs":{"weights_path":"%s"}}' % (tmp_path / "ckpt"),
        )
    )
    if reload_status == 200:
        expected.append(("reset_prefix_cache", None))
    expected.append(("admin/resume", resume))
    assert [(p, b.replace(" ", "") if b else b) for p, b in calls] == expected, paths
