"""Advantage estimators on numpy alone: GRPO, GDPO and MRTPO.

* **GRPO** (Shao et al., DeepSeekMath, arXiv:2402.03300): the named rewards of a response
  are summed (optionally weighted) and normalised within its group,
  ``A_i = (r_i - mean(r)) / (std(r) + eps)``; every token of the response gets ``A_i``.
* **GDPO** (Liu et al., arXiv:2601.05242, exactly as NVlabs/GDPO): every reward is
  normalised within the group on its own, ``A_k = (r_k - mean r_k) / (std r_k + 1e-4)``,
  the weighted sum ``A_sum = sum_k w_k A_k`` is then normalised over the whole batch with
  the same epsilon. ``std`` is the unbiased (N-1) form; NaN rewards count as 0; a reward
  that is constant within a group contributes 0.
* **MRTPO** is implemented from the reading of its published abstract given in Turnstile's
  method notes (the paper itself was not available): each reward's GDPO advantage is
  redistributed over the response's tokens in proportion to that reward's per-token
  relevance ``d_{k,t}`` (the JSD between the next-token distributions with and without the
  reward's verifier information, see ``turnstile.train.rescore``), with the total preserved:
  ``w_{k,t} = d_{k,t} / (mean_s d_{k,s} + eps)``, optionally floored
  ``w <- (1 - lambda) + lambda * w`` and tempered, and ``A_t = sum_k w_k A_k w_{k,t}``.

All standard deviations use N-1. A group of one response has no spread: its advantages
are 0. Per-token advantages are laid out along a sample's ``input_ids`` and are 0 wherever
``loss_mask`` is 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# NVlabs/GDPO adds 1e-4 to every standard deviation (per reward and over the batch).
GDPO_EPS: Final[float] = 1e-4
# GRPO implementations add a small epsilon so that a group with identical rewards gives
# 0 rather than 0/0; verl and TRL use 1e-6 and 1e-4, and any value this small keeps the
# reference numbers within 1e-3.
GRPO_EPS: Final[float] = 1e-6
# Below this mean relevance a reward has no token signal at all (e.g. the verifier
# information did not change a single next-token distribution): its weights are uniform.
MRTPO_MIN_MEAN_RELEVANCE: Final[float] = 1e-12
# The notes' eps in w = d / (mean d + eps). 0 keeps sum_t w_t = T exact; relevance with no
# signal at all is handled by MRTPO_MIN_MEAN_RELEVANCE instead.
MRTPO_EPS: Final[float] = 0.0


def _group_index(group_ids: Sequence[Hashable]) -> tuple[npt.NDArray[np.int64], int]:
    """Dense group numbers (0..G-1, in order of first appearance) and the group count."""
    numbers: dict[Hashable, int] = {}
    index = np.fromiter(
        (numbers.setdefault(g, len(numbers)) for g in group_ids),
        dtype=np.int64,
        count=len(group_ids),
    )
    return index, len(numbers)


def group_normalize(values: npt.ArrayLike, group_ids: Sequence[Hashable], eps: float) -> FloatArray:
    """``(x - mean_group x) / (std_group x + eps)`` with the N-1 std; NaN counts as 0.

    A group of one has no spread and gets 0.
    """
    x = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    if x.ndim != 1 or x.shape[0] != len(group_ids):
        raise ValueError(f"expected {len(group_ids)} values, got shape {x.shape}")
    index, count = _group_index(group_ids)
    sizes = np.bincount(index, minlength=count).astype(np.float64)
    means = np.bincount(index, weights=x, minlength=count) / sizes
    centred = x - means[index]
    squares = np.bincount(index, weights=centred * centred, minlength=count)
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.sqrt(squares / (sizes - 1.0))
    std = np.nan_to_num(std, nan=0.0, posinf=0.0)
    out = centred / (std[index] + eps)
    out[sizes[index] < 2] = 0.0
    return np.asarray(out, dtype=np.float64)


def batch_normalize(values: npt.ArrayLike, eps: float = GDPO_EPS) -> FloatArray:
    """``(x - mean x) / (std x + eps)`` over the whole batch, N-1 std (0 for one value)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return np.zeros_like(x)
    return np.asarray((x - x.mean()) / (x.std(ddof=1) + eps), dtype=np.float64)


def reward_matrix(
    rewards: Sequence[Mapping[str, float]], names: Sequence[str] | None = None
) -> tuple[FloatArray, list[str]]:
    """``(N, K)`` rewards from per-response ``{name: value}`` dicts; missing is NaN.

    ``names`` fixes the column order (default: sorted union of all names).
    """
    keys = sorted({k for r in rewards for k in r}) if names is None else list(names)
    matrix = np.full((len(rewards), len(keys)), np.nan, dtype=np.float64)
    for i, r in enumerate(rewards):
        for j, k in enumerate(keys):
            if k in r:
                matrix[i, j] = r[k]
    return matrix, keys


def _weights(k: int, weights: Sequence[float] | npt.NDArray[np.float64] | None) -> FloatArray:
    if weights is None:
        return np.ones(k, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (k,):
        raise ValueError(f"expected {k} reward weights, got {w.shape}")
    return w


def _as_matrix(rewards: npt.ArrayLike) -> FloatArray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim == 1:
        r = r[:, None]
    if r.ndim != 2:
        raise ValueError(f"rewards must be (N,) or (N, K), got shape {r.shape}")
    return r


def grpo_advantages(
    rewards: npt.ArrayLike,
    group_ids: Sequence[Hashable],
    weights: Sequence[float] | None = None,
    eps: float = GRPO_EPS,
) -> FloatArray:
    """GRPO: per-response advantages of the (weighted) reward sum, normalised per group.

    ``rewards`` is ``(N,)`` or ``(N, K)`` (one column per named reward; NaN counts as 0).
    """
    r = np.nan_to_num(_as_matrix(rewards), nan=0.0)
    total = r @ _weights(r.shape[1], weights)
    return group_normalize(total, group_ids, eps)


def gdpo_reward_advantages(
    rewards: npt.ArrayLike, group_ids: Sequence[Hashable], eps: float = GDPO_EPS
) -> FloatArray:
    """GDPO step 1: ``(N, K)`` per-reward advantages, each normalised within its group."""
    r = _as_matrix(rewards)
    return np.stack([group_normalize(r[:, k], group_ids, eps) for k in range(r.shape[1])], 1)


def gdpo_advantages(
    rewards: npt.ArrayLike,
    group_ids: Sequence[Hashable],
    weights: Sequence[float] | None = None,
    eps: float = GDPO_EPS,
    normalize_batch: bool = True,
) -> FloatArray:
    """GDPO: per-reward group normalisation, weighted sum, then batch normalisation."""
    per_reward = gdpo_reward_advantages(rewards, group_ids, eps)
    total = per_reward @ _weights(per_reward.shape[1], weights)
    return batch_normalize(total, eps) if normalize_batch else total


def mrtpo_token_weights(
    relevance: npt.ArrayLike,
    floor: float = 1.0,
    temperature: float = 1.0,
    eps: float = MRTPO_EPS,
) -> FloatArray:
    """MRTPO token weights of one reward over one response's ``T`` tokens (sum ``T``).

    Implemented from the reading of MRTPO's abstract in the method notes:
    ``w_t = d_t / (mean_s d_s + eps)``. ``temperature`` tempers the relevance first
    (``d_t ** (1 / temperature)``: above 1 flattens, below 1 sharpens, 1 leaves it);
    ``floor`` is lambda in ``w <- (1 - lambda) + lambda * w`` (1: pure relevance,
    0: uniform, as GDPO). Both keep ``sum_t w_t = T``. NaN relevance counts as 0; with no
    relevance at all the weights are uniform.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor (lambda) must be in [0, 1], not {floor}")
    d = np.clip(np.nan_to_num(np.asarray(relevance, dtype=np.float64), nan=0.0), 0.0, None)
    if d.size == 0:
        return d
    if temperature != 1.0:
        d = d ** (1.0 / temperature)
    mean = float(d.mean())
    w = np.ones_like(d) if mean < MRTPO_MIN_MEAN_RELEVANCE else d / (mean + eps)
    return np.asarray((1.0 - floor) + floor * w, dtype=np.float64)


def mrtpo_token_advantages(
    reward_advantages: Sequence[float],
    relevance: Sequence[npt.ArrayLike | None],
    weights: Sequence[float] | npt.NDArray[np.float64] | None = None,
    floor: float = 1.0,
    temperature: float = 1.0,
    num_tokens: int | None = None,
) -> FloatArray:
    """MRTPO per-token advantages ``A_t = sum_k w_k A_k w_{k,t}`` of one response.

    ``reward_advantages`` are the response's GDPO per-reward advantages ``A_k`` (before
    batch normalisation); ``relevance[k]`` is ``d_{k,t}`` over its ``T`` response tokens, or
    None for a reward without verifier information (its advantage is spread uniformly, as
    in GDPO). Implemented from the reading of MRTPO's abstract in the method notes.
    """
    a = np.asarray(reward_advantages, dtype=np.float64)
    if len(relevance) != a.shape[0]:
        raise ValueError(f"{a.shape[0]} reward advantages but {len(relevance)} relevances")
    lengths = {np.asarray(d).shape[0] for d in relevance if d is not None}
    if num_tokens is not None:
        lengths.add(num_tokens)
    if len(lengths) != 1:
        raise ValueError(f"relevance lengths disagree or are unknown: {sorted(lengths)}")
    t = lengths.pop()
    omega = _weights(a.shape[0], weights)
    out = np.zeros(t, dtype=np.float64)
    for k, d in enumerate(relevance):
        w = np.ones(t) if d is None else mrtpo_token_weights(d, floor, temperature)
        out += omega[k] * a[k] * w
    return out


def spread_over_mask(values: npt.ArrayLike, loss_mask: npt.ArrayLike) -> FloatArray:
    """Place per-response-token values on a sample's ``input_ids`` layout (0 off the mask).

    ``values`` is a scalar (the same for every masked token, as GRPO/GDPO) or one value per
    masked token, in order.
    """
    mask = np.asarray(loss_mask).astype(bool)
    out = np.zeros(mask.shape[0], dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if v.ndim == 0:
        out[mask] = float(v)
        return out
    if v.shape[0] != int(mask.sum()):
        raise ValueError(f"{v.shape[0]} token values for {int(mask.sum())} masked tokens")
    out[mask] = v
    return out


def mrtpo_batch(
    reward_advantages: npt.ArrayLike,
    relevance: Sequence[Sequence[npt.ArrayLike | None]],
    weights: Sequence[float] | None = None,
    floor: float = 1.0,
    temperature: float = 1.0,
    num_tokens: Sequence[int] | None = None,
    normalize_batch: bool = True,
    eps: float = GDPO_EPS,
) -> list[FloatArray]:
    """MRTPO over a batch: per-response token advantages, optionally batch-normalised.

    ``reward_advantages`` is GDPO's ``(N, K)`` per-reward matrix. With
    ``normalize_batch`` the token advantages are shifted and scaled by the batch mean and
    std of the response-level sums ``sum_k w_k A_k`` (GDPO's step 3), so that with constant
    relevance the result equals GDPO's exactly. Implemented from the reading of MRTPO's
    abstract in the method notes.
    """
    a = _as_matrix(reward_advantages)
    omega = _weights(a.shape[1], weights)
    tokens = [
        mrtpo_token_advantages(
            a[i],
            relevance[i],
            omega,
            floor,
            temperature,
            None if num_tokens is None else num_tokens[i],
        )
        for i in range(a.shape[0])
    ]
    if not normalize_batch:
        return tokens
    totals = a @ omega
    if totals.size < 2:
        return [np.zeros_like(t) for t in tokens]
    mean, std = float(totals.mean()), float(totals.std(ddof=1))
    return [(t - mean) / (std + eps) for t in tokens]
