"""TRL's GRPO trainer, trained from what Turnstile recorded.

``TurnstileRollouts`` is a ``rollout_func`` for ``trl.GRPOTrainer`` (TRL 1.16): for each
prompt TRL hands it, it opens a rollout on the proxy (one group of ``num_generations``
rollouts per prompt, ``group_size`` declared), runs the user's harness with an
``openai.OpenAI`` client bound to that rollout, finishes the rollout with the rewards the
harness returns, waits until the groups are published (``ShardReader.wait_for``) and
gives TRL each rollout's recorded sample: the prompt token ids, the completion token ids
(every token after the prompt, with ``env_mask`` 0 on tokens the policy did not sample,
such as tool results in a multi-turn rollout) and the behaviour logprobs. TRL therefore
trains on exactly the tokens the backend consumed and sampled, never a re-tokenization
of the text. The recorded rewards reach TRL's reward functions as the ``turnstile_rewards``
column; ``recorded_reward(name)`` is such a reward function.

TRL puts the behaviour logprobs in its batch as ``sampling_per_token_logps``: its
off-policy sequence mask (``off_policy_mask_threshold``) and its ``vespo`` loss use them.
Its vLLM importance-sampling correction runs only in TRL's own vLLM mode, which this
rollout function replaces.

``VLLMWeightSync`` pushes the trainer's weights to a vLLM backend between steps, fenced
by Turnstile: ``POST /admin/pause`` (calls in flight finish, new ones wait), the weights
written as a safetensors checkpoint and reloaded with vLLM's ``POST /collective_rpc
{"method": "reload_weights"}`` (vLLM started with ``VLLM_SERVER_DEV_MODE=1``; the
checkpoint directory must be readable by the vLLM server), ``POST /reset_prefix_cache``,
then ``POST /admin/resume {"policy_version": step}``. Given to ``TurnstileRollouts``,
it runs before the first generation of every new optimizer step, so each recorded turn
carries the step whose weights sampled it.

    rollouts = TurnstileRollouts(proxy_url, output_dir, harness, weight_sync=sync)
    trainer = GRPOTrainer(model, reward_funcs=[recorded_reward("correct")],
                          args=config, train_dataset=dataset, rollout_func=rollouts)
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx
import numpy as np
import openai
import torch
from safetensors.torch import save_file

from turnstile.reader import open_output
from turnstile.train.batches import TrainSample, samples_from_batch

# A harness gets a client bound to one rollout and TRL's prompt (a list of chat messages
# or a string) and returns the rollout's rewards (name -> value).
Harness = Callable[[openai.OpenAI, Any], Mapping[str, float]]

# Harness calls in flight at once: vLLM batches them; more only queue at the backend.
DEFAULT_CONCURRENCY: Final[int] = 8
# A group is published within the proxy's publish_delay_s (0.5 s by default) of its last
# finish; 120 s only bounds the wait on a badly overloaded machine.
DEFAULT_WAIT_TIMEOUT_S: Final[float] = 120.0
# Turnstile's control routes (create, finish, pause, resume) answer within milliseconds;
# a pause waits for the calls in flight to finish, which a long generation can take
# minutes to do.
CONTROL_TIMEOUT_S: Final[float] = 60.0
PAUSE_TIMEOUT_S: Final[float] = 600.0
# A harness call may wait at the fence of a weight push, then generate: as long as a
# pause may take.
HARNESS_CALL_TIMEOUT_S: Final[float] = 600.0
# Reloading the weights of a small model takes seconds; a large one from a slow disk,
# minutes.
RELOAD_TIMEOUT_S: Final[float] = 600.0
# The recorded rewards of each rollout, as the extra column TRL gives reward functions.
REWARDS_COLUMN: Final[str] = "turnstile_rewards"


class RolloutShapeError(ValueError):
    """A rollout's recorded samples cannot be given to TRL as one prompt and completion."""


@dataclass(frozen=True)
class TRLSample:
    """One recorded sample in TRL's rollout layout."""

    rollout_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    rewards: dict[str, float]
    policy_versions: list[int]


def to_trl_sample(sample: TrainSample) -> TRLSample:
    """Split a recorded sample at its first sampled token: the tokens before it are the
    prompt, the rest the completion, with ``env_mask`` 1 exactly on sampled tokens and the
    behaviour logprob of each (0.0 where the policy did not sample)."""
    sampled = np.flatnonzero(sample.loss_mask)
    if sampled.size == 0:
        raise RolloutShapeError(
            f"rollout {sample.rollout_id} sample {sample.sample_index} has no sampled token"
        )
    start = int(sampled[0])
    mask = sample.loss_mask[start:].astype(np.int64)
    logprobs = np.where(mask == 1, sample.behavior_logprobs[start:], 0.0)
    return TRLSample(
        rollout_id=sample.rollout_id,
        prompt_ids=sample.input_ids[:start].astype(np.int64).tolist(),
        completion_ids=sample.input_ids[start:].astype(np.int64).tolist(),
        logprobs=logprobs.astype(np.float64).tolist(),
        env_mask=mask.tolist(),
        rewards=dict(sample.rewards),
        policy_versions=[int(v) for v in sample.policy_versions],
    )


def recorded_reward(name: str) -> Callable[..., list[float | None]]:
    """A TRL reward function that returns the reward ``name`` Turnstile recorded for each
    completion (``None`` where the rollout has none: TRL leaves that completion out)."""

    def reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        recorded: Sequence[Mapping[str, float]] = kwargs[REWARDS_COLUMN]
        return [r.get(name) for r in recorded]

    reward.__name__ = name
    return reward


@dataclass
class VLLMWeightSync:
    """Pushes a model's weights to a vLLM backend, fenced by Turnstile's pause/resume."""

    proxy_url: str
    backend_url: str
    checkpoint_dir: Path
    # `pause`: calls in flight finish under the old weights; `abort`: they are cut and
    # recorded aborted (the harness retries).
    mode: Literal["pause", "abort"] = "pause"
    # The dtype vLLM serves: the checkpoint is written in it.
    dtype: torch.dtype = torch.bfloat16
    api_key: str | None = None
    pushes: list[int] = field(default_factory=list, init=False)  # versions pushed

    def push(self, model: Any, policy_version: int) -> None:
        """Write ``model``'s weights, reload them into vLLM between Turnstile's pause and
        resume, and make ``policy_version`` the version of every later turn."""
        self.save(model)
        headers = _auth(self.api_key)
        with httpx.Client(timeout=CONTROL_TIMEOUT_S, headers=headers) as proxy:
            _ok(
                proxy.post(
                    f"{self.proxy_url}/admin/pause",
                    json={"mode": self.mode},
                    timeout=PAUSE_TIMEOUT_S,
                )
            )
            resumed_version: int | None = None
            try:
                with httpx.Client(timeout=RELOAD_TIMEOUT_S) as backend:
                    _ok(
                        backend.post(
                            f"{self.backend_url}/collective_rpc",
                            json={
                                "method": "reload_weights",
                                "kwargs": {"weights_path": str(self.checkpoint_dir)},
                            },
                        )
                    )
                    _ok(backend.post(f"{self.backend_url}/reset_prefix_cache"))
                resumed_version = policy_version
            finally:
                # On a failed reload the proxy resumes under the old version.
                body = {} if resumed_version is None else {"policy_version": resumed_version}
                _ok(proxy.post(f"{self.proxy_url}/admin/resume", json=body))
        self.pushes.append(policy_version)

    def save(self, model: Any) -> None:
        """``model``'s weights as ``model.safetensors`` (tied output layer left out, as in
        the checkpoints vLLM loads) next to its ``config.json``."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        tensors = {
            name: t.detach().to(self.dtype).contiguous()
            for name, t in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        staged = self.checkpoint_dir / "model.safetensors.partial"
        save_file(tensors, str(staged), metadata={"format": "pt"})
        staged.replace(self.checkpoint_dir / "model.safetensors")
        model.config.to_json_file(str(self.checkpoint_dir / "config.json"))


@dataclass
class TurnstileRollouts:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that records every rollout in Turnstile
    and gives TRL the recorded tokens.

    ``proxy_url`` is the Turnstile proxy, ``output`` the output it publishes to (a local
    directory or an object-store URI ``open_output`` reads), ``harness`` runs one rollout.
    """

    proxy_url: str
    output: str | Path
    harness: Harness
    weight_sync: VLLMWeightSync | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    api_key: str | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    # What was given to TRL, per call (for logging and checks).
    history: list[list[TRLSample]] = field(default_factory=list, init=False)
    _version: int = field(default=0, init=False)
    _calls: itertools.count[int] = field(default_factory=itertools.count, init=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {self.concurrency}")
        if self.wait_timeout_s <= 0:
            raise ValueError(f"wait_timeout_s must be positive, not {self.wait_timeout_s}")

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        step = int(trainer.state.global_step)
        if self.weight_sync is not None and step != self._version:
            self.weight_sync.push(trainer.accelerator.unwrap_model(trainer.model), step)
            self._version = step
        size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        samples = self.generate(prompts, int(size))
        self.history.append(samples)
        return {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "env_mask": [s.env_mask for s in samples],
            REWARDS_COLUMN: [s.rewards for s in samples],
            "rollout_id": [s.rollout_id for s in samples],
            "policy_versions": [s.policy_versions for s in samples],
        }

    def generate(self, prompts: Sequence[Any], group_size: int) -> list[TRLSample]:
        """Run the harness once per prompt through Turnstile (consecutive runs of
        ``group_size`` prompts form a group) and read back what was recorded."""
        if group_size < 1 or len(prompts) % group_size:
            raise ValueError(f"{len(prompts)} prompts do not make whole groups of {group_size}")
        call = next(self._calls)
        groups = [f"{self.run_id}-c{call}-g{g}" for g in range(len(prompts) // group_size)]
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            jobs = [
                pool.submit(self._rollout, prompt, groups[i // group_size], group_size, i)
                for i, prompt in enumerate(prompts)
            ]
            rollout_ids = [job.result() for job in jobs]
        table = open_output(self.output).wait_for(group_ids=groups, timeout_s=self.wait_timeout_s)
        by_rollout: dict[str, list[TrainSample]] = {}
        for sample in samples_from_batch(table):
            by_rollout.setdefault(sample.rollout_id, []).append(sample)
        out = []
        for rid in rollout_ids:
            found = by_rollout.get(rid, [])
            if len(found) != 1:
                raise RolloutShapeError(
                    f"rollout {rid} was recorded as {len(found)} samples; TRL takes one "
                    "prompt and completion per rollout (a rollout whose history was "
                    "rewritten or re-rendered splits into several)"
                )
            out.append(to_trl_sample(found[0]))
        return out

    def _rollout(self, prompt: Any, group_id: str, group_size: int, index: int) -> str:
        headers = _auth(self.api_key)
        with httpx.Client(timeout=CONTROL_TIMEOUT_S, headers=headers) as http:
            created = _ok(
                http.post(
                    f"{self.proxy_url}/rollouts",
                    json={
                        "rollout_id": f"{group_id}-r{index % group_size}",
                        "group_id": group_id,
                        "group_size": group_size,
                    },
                )
            )
            rid = str(created["rollout_id"])
            client = openai.OpenAI(
                base_url=created["base_url"],
                api_key=created.get("api_key") or self.api_key or "unused",
                timeout=HARNESS_CALL_TIMEOUT_S,
            )
            rewards: Mapping[str, float] = {}
            try:
                rewards = self.harness(client, prompt)
            finally:
                client.close()
                _ok(
                    http.post(
                        f"{self.proxy_url}/rollouts/{rid}/finish",
                        json={"rewards": {k: float(v) for k, v in rewards.items()}},
                    )
                )
        return rid


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _ok(response: httpx.Response) -> Any:
    """The JSON body of a successful answer (None if empty); the status and body of any
    other answer as an ``httpx.HTTPStatusError``."""
    if response.is_error:
        raise httpx.HTTPStatusError(
            f"{response.request.method} {response.request.url}: {response.status_code} "
            f"{response.text[:500]}",
            request=response.request,
            response=response,
        )
    return json.loads(response.content) if response.content else None
