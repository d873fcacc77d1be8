"""TRL's GRPO trainer trains the tiny model from what Turnstile recorded, on the CPU vLLM.

A harness (the ``openai`` client, chat completions) runs each rollout through Turnstile;
``turnstile.train.integrations.trl`` gives TRL the recorded token ids and behaviour
logprobs, and pushes the trained weights to vLLM between steps, fenced by Turnstile's
pause and resume. The test checks what TRL's loss saw against the Parquet output, that
the parameters moved, and that the second step's rollouts were sampled by the pushed
weights (their behaviour logprobs are the trained model's, not the initial one's).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.grpo_config import GRPOConfig
from trl.trainer.grpo_trainer import GRPOTrainer

from tests.live import TurnstileServer
from turnstile.reader import open_output
from turnstile.train import policy
from turnstile.train.batches import samples_from_batch
from turnstile.train.integrations.trl import (
    TurnstileRollouts,
    VLLMWeightSync,
    recorded_reward,
)

pytestmark = [
    pytest.mark.integration,
    # TRL 1.16 itself still calls this transformers API, deprecated in transformers 5.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

MODEL = "tiny-qwen3"
STEPS = 2
GROUP_SIZE = 4
MAX_TOKENS = 12
# Adam with this rate moves the tiny model's weights (scale 0.02) enough in one step
# that its token logprobs change by far more than vLLM's bfloat16 rounding.
LEARNING_RATE = 5e-3
# vLLM samples in bfloat16, the trainer scores in float32: the same weights give token
# logprobs this close on average; the initial weights, after one step, are far off it.
SAME_WEIGHTS_MEAN_ABS = 0.05
PUSH_TIMEOUT_S = 300.0


def _harness(client: openai.OpenAI, prompt: Any) -> dict[str, float]:
    reply = client.chat.completions.create(
        model=MODEL, messages=prompt, max_tokens=MAX_TOKENS, temperature=1.0
    )
    text = reply.choices[0].message.content or ""
    # Any reward that differs within a group gives GRPO a gradient.
    return {"length": len(text) / 100.0}


def _restore(proxy: str, vllm: str, model_dir: Path) -> None:
    """Put the original weights back into the shared vLLM."""
    httpx.post(f"{proxy}/admin/pause", json={"mode": "pause"}, timeout=PUSH_TIMEOUT_S)
    try:
        restore = httpx.post(
            f"{vllm}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}},
            timeout=PUSH_TIMEOUT_S,
        )
        assert restore.status_code == 200, restore.text
        httpx.post(f"{vllm}/reset_prefix_cache", timeout=60)
    finally:
        httpx.post(f"{proxy}/admin/resume", json={}, timeout=60)


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [
        tuple(int(t) for t, m in zip(row, keep, strict=True) if m)
        for row, keep in zip(ids, mask, strict=True)
    ]


def _completion_logprobs(
    model: Any, ids: torch.Tensor, attention: torch.Tensor, width: int
) -> torch.Tensor:
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return policy.token_logprobs(model, ids, attention, positions)[:, -width:]


def test_trl_grpo_trains_from_turnstile_recorded_samples(
    vllm_server: Any,
    tiny_model_dir: Path,
    qwen3_tokenizer_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    vllm = vllm_server.base_url
    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, local_files_only=True
    )
    initial_model = copy.deepcopy(model)
    initial_model.train(False)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": text}]
                for text in ("Count to three.", "Name a colour.")
            ]
        }
    )
    config = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=GROUP_SIZE,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_TOKENS,
        max_steps=STEPS,
        learning_rate=LEARNING_RATE,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        activation_checkpointing=False,
    )
    out = tmp_path / "out"
    seen: list[dict[str, Any]] = []
    with TurnstileServer(vllm, out, qwen3_tokenizer_dir, backend_pause=True) as server:
        sync = VLLMWeightSync(server.url, vllm, tmp_path / "pushed")
        rollouts = TurnstileRollouts(server.url, out, _harness, weight_sync=sync)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[recorded_reward("length")],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollouts,
        )
        compute_loss = trainer._compute_loss

        def spy(m: Any, inputs: dict[str, Any]) -> Any:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            width = inputs["completion_ids"].size(1)
            with torch.no_grad():
                now = _completion_logprobs(m, ids, attention, width)
                before = _completion_logprobs(initial_model, ids, attention, width)
            seen.append(
                {
                    **{
                        k: v.detach().clone()
                        for k, v in inputs.items()
                        if isinstance(v, torch.Tensor)
                    },
                    "now": now,
                    "before": before,
                }
            )
            return compute_loss(m, inputs)  # type: ignore[no-untyped-call]

        trainer._compute_loss = spy  # type: ignore[method-assign]
        try:
            trainer.train()
        finally:
            _restore(server.url, vllm, tiny_model_dir)

    assert len(seen) == STEPS
    assert sync.pushes == [1]  # before the second step's rollouts
    recorded = list(samples_from_batch(open_output(out).samples()))
    assert len(recorded) == STEPS * GROUP_SIZE
    by_tokens = {
        (
            tuple(int(t) for t in s.input_ids[: int(np.flatnonzero(s.loss_mask)[0])]),
            tuple(int(t) for t in s.input_ids[int(np.flatnonzero(s.loss_mask)[0]) :]),
        ): s
        for s in recorded
    }
    for step, batch in enumerate(seen):
        prompts = _rows(batch["prompt_ids"], batch["prompt_mask"])
        completions = _rows(batch["completion_ids"], batch["completion_mask"])
        for row, key in enumerate(zip(prompts, completions, strict=True)):
            # Exactly the recorded tokens, and the recorded behaviour logprobs.
            assert key in by_tokens, (step, row)
            sample = by_tokens.pop(key)
            assert list(sample.policy_versions) == [step]
            n = len(key[1])
            np.testing.assert_allclose(
                batch["sampling_per_token_logps"][row, :n].numpy(),
                sample.behavior_logprobs[-n:],
                rtol=0,
                atol=1e-6,
            )
        mask = batch["completion_mask"].bool()
        behaviour = batch["sampling_per_token_logps"][mask]
        now = float((batch["now"][mask] - behaviour).abs().mean())
        before = float((batch["before"][mask] - behaviour).abs().mean())
        assert now < SAME_WEIGHTS_MEAN_ABS, (step, now)
        if step > 0:  # sampled by the pushed weights, not the initial ones
            assert before > 2 * SAME_WEIGHTS_MEAN_ABS, (step, before)
    assert not by_tokens
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), initial[n])]
    assert "model.embed_tokens.weight" in changed and len(changed) >= len(initial) // 2
