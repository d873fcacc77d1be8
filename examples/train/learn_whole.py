"""The whole tiny model learns with the trainer library: GRPO, GDPO, MRTPO, Proximal KL.

Where ``learn.py`` shows the plumbing (vLLM, the proxy, shards, weight reloads), this example
is the evidence that the estimators train a model: everything runs in one process, with
the same ``turnstile.train`` calls a trainer makes on recorded samples.

* **Model**: a Qwen3 of the tiny model's shape (hidden 128, 2 layers, tied embeddings) with a
  vocabulary of 32 instead of 151,936, from a random initialisation, all parameters trained
  with AdamW at learning rate 1e-3. (With the 151,936-token vocabulary a random policy never
  samples a rewarded token, so there would be nothing to learn from.)
* **Task**: the prompt is three filler tokens, a key token ``k`` (one of 0..7) and a
  separator; the policy answers with 4 tokens. Two verifiable rewards: ``copy``, the share
  of answer tokens equal to ``k`` (its verifier information is ``k`` itself: it depends on
  the context, so MRTPO's relevance is not uniform), and ``small``, the share of answer
  tokens below 16.
* **Estimators**: GRPO, GDPO and MRTPO (relevance replayed exactly with the verifier's token
  inserted before the answer) on fresh rollouts, one AdamW step each on the token-TIS
  Proximal KL loss with beta 0; and **Proximal KL** with stale rollouts (sampled by the
  policy one step behind, ``mu != pi_old``) and ``beta > 0`` against the frozen initial
  model, on GRPO advantages.
* **Controls**: learning rate 0, and rewards shuffled within each group; every run with 3
  seeds.

Prints, and writes as JSON with ``--json``, the mean reward (``copy + small``, at most 2) and
the mean ``copy`` per step for every run (the rewards of the rollouts sampled before that
step's update; shuffled runs report the true rewards).

    .venv/bin/python examples/train/learn_whole.py --steps 40 --json curves.json
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from turnstile.train import batches, losses, policy, rescore, rescore_torch

VOCAB: Final[int] = 32
KEYS: Final[int] = 8  # key tokens 0..7
SMALL_LIMIT: Final[int] = 16  # `small` rewards answer tokens below this
SEPARATOR: Final[int] = VOCAB - 1
FILLER: Final[tuple[int, int]] = (KEYS, VOCAB - 1)  # filler tokens 8..30
ANSWER_TOKENS: Final[int] = 4
GROUP_SIZE: Final[int] = 8
GROUPS_PER_STEP: Final[int] = 8
LEARNING_RATE: Final[float] = 1e-3
PROXIMAL_BETA: Final[float] = 0.02
STALENESS: Final[int] = 1
SEEDS: Final[tuple[int, ...]] = (0, 1, 2)
ESTIMATORS: Final[tuple[str, ...]] = ("grpo", "gdpo", "mrtpo", "proximal_kl")
CONTROLS: Final[tuple[str, ...]] = ("grpo_lr0", "grpo_shuffled")
# The model is so small that more threads only add synchronisation: one thread runs a
# forward pass in about 15 ms here, two threads on a busy machine a hundred times slower.
TORCH_THREADS: Final[int] = 1


def make_model(seed: int) -> Any:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model: Any = Qwen3ForCausalLM(config)
    return model.float()


@torch.no_grad()
def sample(model: Any, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Answers of ``ANSWER_TOKENS`` tokens sampled at temperature 1; ``(B, P + A)``."""
    ids = prompts
    for _ in range(ANSWER_TOKENS):
        logits = model(input_ids=ids).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt], 1)
    return ids


def rewards_of(key: int, answer: Sequence[int]) -> dict[str, float]:
    return {
        "copy": float(np.mean([t == key for t in answer])),
        "small": float(np.mean([t < SMALL_LIMIT for t in answer])),
    }


def make_samples(
    ids: torch.Tensor, logp: torch.Tensor, keys: Sequence[int], step: int
) -> list[batches.TrainSample]:
    prompt_len = ids.shape[1] - ANSWER_TOKENS
    out: list[batches.TrainSample] = []
    for i in range(ids.shape[0]):
        answer = [int(t) for t in ids[i, prompt_len:]]
        mask = np.array([0] * prompt_len + [1] * ANSWER_TOKENS, dtype=np.int8)
        out.append(
            batches.TrainSample(
                rollout_id=f"s{step}-{i}",
                sample_index=0,
                group_id=f"s{step}-g{i // GROUP_SIZE}",
                task_id=None,
                rollout_status="finished",
                input_ids=ids[i].numpy().astype(np.int32),
                loss_mask=mask,
                behavior_logprobs=np.where(mask > 0, logp[i].numpy(), np.nan).astype(np.float32),
                rewards=rewards_of(keys[i], answer),
                reward_info={"copy": str(keys[i]), "small": None},
                policy_versions=np.array([step], dtype=np.int64),
                min_policy_version=step,
                max_policy_version=step,
            )
        )
    return out


def shuffle_rewards(samples: Sequence[batches.TrainSample], rng: np.random.Generator) -> None:
    """The control: rewards permuted within each group."""
    for g in range(0, len(samples), GROUP_SIZE):
        group = samples[g : g + GROUP_SIZE]
        permuted = [group[j].rewards for j in rng.permutation(len(group))]
        for s, r in zip(group, permuted, strict=True):
            s.rewards = r


def mrtpo_relevance(model: Any, samples: Sequence[batches.TrainSample]) -> dict[Any, Any]:
    """Exact relevance of ``copy``: the verifier's token inserted before the answer."""
    rows = {}
    for s in samples:
        job = rescore.RescoreJob(
            s, "copy", [int(s.reward_info["copy"] or 0)], rescore.response_positions(s.loss_mask)
        )
        rows[(s.rollout_id, s.sample_index, "copy")] = rescore_torch.score_model(model, job).jsd
    return rescore.relevance_for(samples, rows)


@dataclass
class Run:
    name: str
    seed: int
    mean_reward: list[float]  # copy + small, per step (before that step's update)
    mean_copy: list[float]


def train(name: str, seed: int, steps: int) -> Run:
    model = make_model(seed)
    reference = copy.deepcopy(model).eval()
    behaviour = copy.deepcopy(model).eval()  # the sampler, STALENESS steps behind (proximal)
    lr = 0.0 if name == "grpo_lr0" else LEARNING_RATE
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1000 + seed)
    rng = np.random.default_rng(seed)
    estimator = name.split("_")[0] if name != "proximal_kl" else "grpo"
    history: list[dict[str, torch.Tensor]] = []
    curve: list[float] = []
    copies: list[float] = []
    for step in range(steps + 1):
        keys = rng.integers(0, KEYS, GROUPS_PER_STEP).repeat(GROUP_SIZE).tolist()
        filler = rng.integers(*FILLER, (GROUPS_PER_STEP, 3)).repeat(GROUP_SIZE, 0)
        prompts = torch.tensor(
            [[*f, k, SEPARATOR] for f, k in zip(filler.tolist(), keys, strict=True)]
        )
        sampler = behaviour if name == "proximal_kl" else model
        sampler.eval()
        ids = sample(sampler, prompts, generator)
        with torch.no_grad():
            mu = policy.token_logprobs(sampler, ids)
        samples = make_samples(ids, mu, keys, step)
        curve.append(float(np.mean([sum(s.rewards.values()) for s in samples])))
        copies.append(float(np.mean([s.rewards["copy"] for s in samples])))
        if step == steps:
            break
        if name == "grpo_shuffled":  # the true reward is reported, the shuffled one trained on
            shuffle_rewards(samples, rng)
        if estimator == "gdpo":
            batches.assign_gdpo(samples)
        elif estimator == "mrtpo":
            batches.assign_mrtpo(samples, mrtpo_relevance(model, samples))
        else:
            batches.assign_grpo(samples)
        batch = batches.to_torch(batches.pad_batch(samples))
        model.train()
        logp = policy.token_logprobs(model, batch["input_ids"])
        with torch.no_grad():
            ref = policy.token_logprobs(reference, batch["input_ids"])
        cfg = losses.ProximalKLConfig(beta=PROXIMAL_BETA if name == "proximal_kl" else 0.0)
        out = losses.proximal_kl_loss(
            logp,
            logp.detach(),
            batch["behavior_logprobs"],
            ref,
            batch["advantages"],
            batch["loss_mask"],
            cfg,
        )
        optimizer.zero_grad()
        torch.autograd.backward(out.loss)
        optimizer.step()
        # the behaviour policy lags STALENESS steps behind the trained one
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if len(history) > STALENESS:
            behaviour.load_state_dict(history.pop(0))
    return Run(name, seed, curve, copies)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    parser.add_argument("--runs", nargs="*", default=[*ESTIMATORS, *CONTROLS])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(TORCH_THREADS)
    result: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name in args.runs:
        for seed in args.seeds:
            run = train(name, seed, args.steps)
            result.setdefault(name, {})[str(seed)] = {
                "mean_reward": run.mean_reward,
                "mean_copy": run.mean_copy,
            }
            first, last = np.mean(run.mean_reward[:3]), np.mean(run.mean_reward[-3:])
            c0, c1 = np.mean(run.mean_copy[:3]), np.mean(run.mean_copy[-3:])
            print(
                f"{name:14s} seed {seed}: reward {first:.3f} -> {last:.3f}, "
                f"copy {c0:.3f} -> {c1:.3f}",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
