"""Reward and batch shaping before the advantages, as DAPO and verl name it.

* **Overlong reward shaping** (DAPO; verl's ``DAPORewardManager`` with
  ``overlong_buffer.len`` and ``overlong_buffer.penalty_factor``): a response longer than
  ``max_response_length - overlong_buffer_len`` gets
  ``min(-(length - expected) / overlong_buffer_len * penalty_factor, 0)``, a linear ramp to
  ``-penalty_factor`` at the maximum length.
* **Overlong filtering** (DAPO): truncated rollouts leave the batch.
* **Dynamic sampling** (DAPO; verl's ``algorithm.filter_groups``): groups whose rollouts all
  have the same reward carry no GRPO signal and leave the batch (a group of one stays, as
  in verl).
* **KL in the reward** (verl's ``use_kl_in_reward``, ``apply_kl_penalty``): the token-level
  reward becomes ``score - beta * kl_t`` with ``kl_t`` an estimate of ``KL(pi_old ||
  pi_ref)`` per token; for an outcome reward this is ``reward - beta * sum_t kl_t``. The
  alternative, ``use_kl_loss``, is ``turnstile.train.losses.kl_loss``.

A rollout split into several samples is one response throughout (its length and KL are
summed over its samples). Numpy only.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from turnstile.train import advantages as adv
from turnstile.train import corrections
from turnstile.train.batches import Rollouts, TrainSample, group_keys


def overlong_penalty(
    response_lengths: npt.ArrayLike,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> npt.NDArray[np.float64]:
    """DAPO's soft overlong punishment per response (0 up to the buffer, then a ramp)."""
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError("overlong_buffer_len must be positive and at most max_response_length")
    lengths = np.asarray(response_lengths, dtype=np.float64)
    exceed = lengths - (max_response_length - overlong_buffer_len)
    return np.asarray(
        np.minimum(-exceed / overlong_buffer_len * penalty_factor, 0.0), dtype=np.float64
    )


def add_overlong_reward(
    samples: Sequence[TrainSample],
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
    name: str = "overlong",
) -> npt.NDArray[np.float64]:
    """Add the overlong penalty as the reward ``name`` to every sample; per rollout.

    A rollout's response length is its loss tokens over all its samples. Returns the
    penalty per rollout (in order of first appearance).
    """
    rollouts = Rollouts.of(samples)
    penalty = overlong_penalty(
        rollouts.loss_tokens(samples), max_response_length, overlong_buffer_len, penalty_factor
    )
    for r, members in enumerate(rollouts.members):
        for i in members:
            samples[i].rewards[name] = float(penalty[r])
    return penalty


def overlong_filter(
    samples: Sequence[TrainSample], truncated: Collection[str]
) -> list[TrainSample]:
    """Overlong filtering: the samples whose rollout is not in ``truncated``.

    ``truncated`` holds the rollout ids cut at the maximum length (e.g. a turn with
    ``finish_reason == "length"`` in the ``turns`` table).
    """
    return [s for s in samples if s.rollout_id not in truncated]


def dynamic_sampling(
    samples: Sequence[TrainSample],
    reward_names: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
) -> list[TrainSample]:
    """The samples of groups whose rollouts' (weighted) reward sums are not all equal.

    As verl's ``filter_groups``: a group is kept when the N-1 std of its metric is above 0,
    or when it has a single rollout. Missing rewards count as 0.
    """
    rollouts = Rollouts.of(samples)
    firsts = rollouts.firsts(samples)
    rewards, _ = adv.reward_matrix([s.rewards for s in firsts], reward_names)
    r = np.nan_to_num(rewards, nan=0.0)
    omega = np.ones(r.shape[1]) if weights is None else np.asarray(weights, dtype=np.float64)
    metric = r @ omega
    groups = group_keys(firsts)
    index, count = adv._group_index(groups)
    keep_group = np.zeros(count, dtype=bool)
    for g in range(count):
        values = metric[index == g]
        keep_group[g] = values.size == 1 or float(np.std(values, ddof=1)) > 0
    keep_rollout = keep_group[index]
    return [s for i, s in enumerate(samples) if keep_rollout[rollouts.of_sample[i]]]


def kl_reward_penalty(
    logp_old: Any, logp_ref: Any, mask: Any, kl_penalty: str = "kl"
) -> npt.NDArray[np.float64]:
    """Per row: ``sum_t m_t kl_t(pi_old, pi_ref)`` with verl's ``kl_penalty`` estimator.

    ``logp_old``/``logp_ref``/``mask`` are ``(B, T)`` numpy arrays or torch tensors.
    """
    if kl_penalty not in corrections.KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kl_penalty!r}")
    old = np.nan_to_num(_numpy(logp_old), nan=0.0)
    ref = np.nan_to_num(_numpy(logp_ref), nan=0.0)
    on = _numpy(mask) > 0
    kl = corrections.KL_ESTIMATORS[kl_penalty](old, ref)
    return np.asarray(np.where(on, kl, 0.0).sum(-1), dtype=np.float64)


def _numpy(x: Any) -> npt.NDArray[Any]:
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy(), dtype=np.float64)
    return np.asarray(x, dtype=np.float64)


def add_kl_reward(
    samples: Sequence[TrainSample],
    penalties: Mapping[tuple[str, int], float],
    beta: float,
    name: str = "kl_penalty",
) -> npt.NDArray[np.float64]:
    """KL in the reward: add ``-beta * (the KL of the rollout's samples)`` as reward ``name``.

    ``penalties[(rollout_id, sample_index)]`` comes from ``kl_reward_penalty``; a rollout's
    samples are summed. Returns the added reward per rollout.
    """
    rollouts = Rollouts.of(samples)
    out = np.zeros(len(rollouts.members))
    for r, members in enumerate(rollouts.members):
        total = sum(float(penalties[samples[i].key]) for i in members)
        out[r] = -beta * total
        for i in members:
            samples[i].rewards[name] = float(out[r])
    return out
