"""Advantage estimators on numpy alone: GRPO, GDPO and MRTPO.

* **GRPO** (Shao et al., DeepSeekMath, arXiv:2402.03300): the named rewards of a response
  are summed (optionally weighted) and normalised within its group,
  ``A_i = (r_i - mean(r)) / (std(r) + eps)``; every token of the response gets ``A_i``.
* **GDPO** (Liu et al., arXiv:2601.05242). NVlabs/GDPO ships two forks, both here by name:

  - ``variant="trl"`` (``trl-GDPO``, and TRL's ``multi_objective_aggregation=
    "normalize_then_sum"``): every reward is normalised within the group on its own,
    ``A_k = (r_k - mean r_k) / (std r_k + 1e-4)``, the weighted sum ``A_sum = sum_k w_k A_k``
    is then normalised over the batch's responses with the same epsilon;
  - ``variant="verl"`` (``verl-GDPO``): every reward goes through verl's GRPO
    (``compute_grpo_outcome_advantage``: epsilon 1e-6, a group of one keeps its reward
    over ``1 + 1e-6``), the sum is then whitened over the batch's *tokens*
    (``masked_whiten``: token-weighted mean and N-1 variance, ``rsqrt(var + 1e-8)``).

  ``std`` is the unbiased (N-1) form; a reward constant within a group contributes 0.
  Missing (NaN) rewards are a choice, ``nan=``: ``"zero"`` counts them as 0 (the NVlabs
  TRL fork), ``"ignore"`` leaves them out of the means and deviations and gives a response
  with no reward at all the advantage 0 (current TRL: ``nanmean``/``nanstd``).
* **MRTPO** is implemented from the reading of its published abstract given in Turnstile's
  method notes (the paper itself was not available): each reward's GDPO advantage is
  redistributed over the response's tokens in proportion to that reward's per-token
  relevance ``d_{k,t}`` (the JSD between the next-token distributions with and without the
  reward's verifier information, see ``turnstile.train.rescore``), with the total preserved:
  ``w_{k,t} = d_{k,t} / (mean_s d_{k,s} + eps)``, floored ``w <- (1 - lambda) + lambda * w``
  (lambda 0.5 by default), capped at ``max_weight`` (the excess shared out again so that
  the total stays ``T``), and ``A_t = sum_k w_k A_k w_{k,t}``. A token whose relevance is
  unknown (NaN: e.g. its top-k covered too little of the mass to say) gets the uniform
  weight 1 and the known tokens share the rest.

All standard deviations use N-1. A group of one response has no spread: its advantages
are 0 (except in the verl GDPO variant, as verl). The unit is a *rollout*: a rollout split
into several samples is one response here (``turnstile.train.batches`` lays the advantage
onto each of its samples). Per-token advantages are laid out along a sample's
``input_ids`` and are 0 wherever ``loss_mask`` is 0.
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
# verl's GRPO epsilon (compute_grpo_outcome_advantage) and masked_whiten's variance
# epsilon, for the verl GDPO variant.
VERL_GRPO_EPS: Final[float] = 1e-6
VERL_WHITEN_EPS: Final[float] = 1e-8
# MRTPO's default floor (lambda): half of every weight is the uniform share, so that no
# token's advantage comes only from a relevance estimate.
MRTPO_DEFAULT_FLOOR: Final[float] = 0.5
# MRTPO's default cap on one token's weight (the uniform weight is 1): without it a single
# relevant token among 2,000 would carry about 1,000 times the response's mean.
MRTPO_DEFAULT_MAX_WEIGHT: Final[float] = 10.0
NAN_MODES: Final[tuple[str, ...]] = ("zero", "ignore")
GDPO_VARIANTS: Final[tuple[str, ...]] = ("trl", "verl")
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


def _check_nan_mode(nan: str) -> None:
    if nan not in NAN_MODES:
        raise ValueError(f"nan must be one of {NAN_MODES}, not {nan!r}")


def group_normalize(
    values: npt.ArrayLike, group_ids: Sequence[Hashable], eps: float, nan: str = "zero"
) -> FloatArray:
    """``(x - mean_group x) / (std_group x + eps)`` with the N-1 std.

    ``nan="zero"`` counts NaN as 0; ``nan="ignore"`` leaves NaN out of its group's mean and
    std and returns NaN there. A group of one (known) value has no spread and gets 0.
    """
    _check_nan_mode(nan)
    raw = np.asarray(values, dtype=np.float64)
    if raw.ndim != 1 or raw.shape[0] != len(group_ids):
        raise ValueError(f"expected {len(group_ids)} values, got shape {raw.shape}")
    known = ~np.isnan(raw) if nan == "ignore" else np.ones(raw.shape, dtype=bool)
    x = np.nan_to_num(raw, nan=0.0)
    index, count = _group_index(group_ids)
    sizes = np.bincount(index, weights=known.astype(np.float64), minlength=count)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.bincount(index, weights=x * known, minlength=count) / sizes
        centred = np.where(known, x - means[index], 0.0)
        squares = np.bincount(index, weights=centred * centred, minlength=count)
        std = np.sqrt(squares / (sizes - 1.0))
    std = np.nan_to_num(std, nan=0.0, posinf=0.0)
    out = centred / (std[index] + eps)
    out[sizes[index] < 2] = 0.0
    out[~known] = np.nan
    return np.asarray(out, dtype=np.float64)


def batch_normalize(values: npt.ArrayLike, eps: float = GDPO_EPS) -> FloatArray:
    """``(x - mean x) / (std x + eps)`` over the batch, N-1 std, NaN left out (and kept).

    Fewer than two known values give 0.
    """
    x = np.asarray(values, dtype=np.float64)
    known = ~np.isnan(x)
    if int(known.sum()) < 2:
        return np.where(known, 0.0, np.nan)
    k = x[known]
    return np.asarray((x - k.mean()) / (k.std(ddof=1) + eps), dtype=np.float64)


def token_whiten(
    values: npt.ArrayLike, token_counts: npt.ArrayLike, eps: float = VERL_WHITEN_EPS
) -> FloatArray:
    """verl's ``masked_whiten`` of per-response values repeated over their tokens.

    ``(x - mean) * rsqrt(var + eps)`` with the mean and the N-1 variance taken over all
    tokens (a response of ``n`` tokens counts ``n`` times). Fewer than two tokens give 0.
    """
    x = np.asarray(values, dtype=np.float64)
    n = np.asarray(token_counts, dtype=np.float64)
    if n.shape != x.shape:
        raise ValueError(f"{x.shape[0]} values but token counts of shape {n.shape}")
    total = float(n.sum())
    if total < 2:
        return np.zeros_like(x)
    mean = float((x * n).sum() / total)
    var = float((n * (x - mean) ** 2).sum() / total) * total / (total - 1.0)
    return np.asarray((x - mean) / np.sqrt(var + eps), dtype=np.float64)


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
    nan: str = "zero",
) -> FloatArray:
    """GRPO: per-response advantages of the (weighted) reward sum, normalised per group.

    ``rewards`` is ``(N,)`` or ``(N, K)`` (one column per named reward). ``nan="zero"``
    counts a missing reward as 0; ``nan="ignore"`` sums the known ones (TRL's ``nansum``)
    and leaves a response with none out of its group, with advantage 0.
    """
    _check_nan_mode(nan)
    r = _as_matrix(rewards)
    total = np.nan_to_num(r, nan=0.0) @ _weights(r.shape[1], weights)
    if nan == "ignore":
        total[np.isnan(r).all(axis=1)] = np.nan
    return np.nan_to_num(group_normalize(total, group_ids, eps, nan), nan=0.0)


def gdpo_reward_advantages(
    rewards: npt.ArrayLike,
    group_ids: Sequence[Hashable],
    eps: float = GDPO_EPS,
    nan: str = "zero",
) -> FloatArray:
    """GDPO step 1: ``(N, K)`` per-reward advantages, each normalised within its group.

    With ``nan="ignore"`` a missing reward's entry is NaN (it counts 0 in the sum).
    """
    r = _as_matrix(rewards)
    return np.stack([group_normalize(r[:, k], group_ids, eps, nan) for k in range(r.shape[1])], 1)


def verl_grpo_scores(
    scores: npt.ArrayLike, group_ids: Sequence[Hashable], eps: float = VERL_GRPO_EPS
) -> FloatArray:
    """verl's ``compute_grpo_outcome_advantage`` on per-response scores.

    ``(s - mean) / (std + eps)`` per group (N-1 std); a group of one has mean 0 and std 1,
    so it keeps ``s / (1 + eps)``. NaN counts as 0.
    """
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0)
    out = group_normalize(s, group_ids, eps)
    index, count = _group_index(group_ids)
    alone = np.bincount(index, minlength=count)[index] == 1
    out[alone] = s[alone] / (1.0 + eps)
    return out


def gdpo_advantages(
    rewards: npt.ArrayLike,
    group_ids: Sequence[Hashable],
    weights: Sequence[float] | None = None,
    eps: float = GDPO_EPS,
    normalize_batch: bool = True,
    *,
    variant: str = "trl",
    nan: str = "zero",
    token_counts: npt.ArrayLike | None = None,
) -> FloatArray:
    """GDPO: per-reward group normalisation, weighted sum, then batch normalisation.

    ``variant="trl"`` (NVlabs' TRL fork, TRL's ``normalize_then_sum``) normalises the sum
    over responses with ``eps``; ``variant="verl"`` (NVlabs' verl fork) uses verl's GRPO per
    reward and whitens over tokens: ``token_counts`` gives each response's number of loss
    tokens (default 1 each, i.e. over responses), and ``eps`` is not used. ``nan`` is
    ``"zero"`` or ``"ignore"`` (see the module docstring).
    """
    if variant not in GDPO_VARIANTS:
        raise ValueError(f"variant must be one of {GDPO_VARIANTS}, not {variant!r}")
    _check_nan_mode(nan)
    r = _as_matrix(rewards)
    omega = _weights(r.shape[1], weights)
    if variant == "verl":
        if nan == "ignore":
            raise ValueError("the verl GDPO variant counts missing rewards as 0 (nan='zero')")
        per = np.stack([verl_grpo_scores(r[:, k], group_ids) for k in range(r.shape[1])], 1)
        total = per @ omega
        if not normalize_batch:
            return total
        counts = np.ones(r.shape[0]) if token_counts is None else token_counts
        return token_whiten(total, counts)
    per_reward = gdpo_reward_advantages(r, group_ids, eps, nan)
    total = np.nan_to_num(per_reward, nan=0.0) @ omega
    if nan == "ignore":
        total[np.isnan(r).all(axis=1)] = np.nan
    if normalize_batch:
        total = batch_normalize(total, eps)
    return np.nan_to_num(total, nan=0.0)


def _cap_weights(w: FloatArray, max_weight: float) -> FloatArray:
    """Cap weights at ``max_weight`` and share the excess among the others (sum kept)."""
    total = float(w.sum())
    capped = np.zeros(w.shape, dtype=bool)
    out = w.copy()
    for _ in range(w.size):
        over = (out > max_weight) & ~capped
        if not over.any():
            break
        capped |= over
        free = ~capped
        budget = total - max_weight * int(capped.sum())
        mass = float(w[free].sum())
        out[capped] = max_weight
        if free.any():
            out[free] = w[free] * (budget / mass) if mass > 0 else budget / int(free.sum())
    return out


def mrtpo_token_weights(
    relevance: npt.ArrayLike,
    floor: float = MRTPO_DEFAULT_FLOOR,
    temperature: float = 1.0,
    eps: float = MRTPO_EPS,
    max_weight: float | None = MRTPO_DEFAULT_MAX_WEIGHT,
) -> FloatArray:
    """MRTPO token weights of one reward over one response's ``T`` tokens (sum ``T``).

    Implemented from the reading of MRTPO's abstract in the method notes:
    ``w_t = d_t / (mean_s d_s + eps)``. ``temperature`` tempers the relevance first
    (``d_t ** (1 / temperature)``: above 1 flattens, below 1 sharpens, 1 leaves it);
    ``floor`` is lambda in ``w <- (1 - lambda) + lambda * w`` (1: pure relevance,
    0: uniform, as GDPO); ``max_weight`` caps one token's weight, the excess going to the
    other tokens in proportion to their weights. A NaN relevance is *unknown*: that token
    gets the uniform weight 1 and the known tokens share the rest in proportion to their
    relevance. All of this keeps ``sum_t w_t = T``; with no relevance at all (every known
    ``d`` 0) the weights are uniform.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor (lambda) must be in [0, 1], not {floor}")
    if max_weight is not None and max_weight < 1.0:
        raise ValueError(f"max_weight must be at least 1 (the uniform weight), not {max_weight}")
    raw = np.asarray(relevance, dtype=np.float64)
    w = np.ones(raw.shape, dtype=np.float64)
    known = ~np.isnan(raw)
    if not known.any():
        return w
    d = np.clip(raw[known], 0.0, None)
    if temperature != 1.0:
        d = d ** (1.0 / temperature)
    mean = float(d.mean())
    wk = np.ones_like(d) if mean < MRTPO_MIN_MEAN_RELEVANCE else d / (mean + eps)
    wk = (1.0 - floor) + floor * wk
    if max_weight is not None:
        wk = _cap_weights(wk, max_weight)
    w[known] = wk
    return w


def mrtpo_token_advantages(
    reward_advantages: Sequence[float],
    relevance: Sequence[npt.ArrayLike | None],
    weights: Sequence[float] | npt.NDArray[np.float64] | None = None,
    floor: float = MRTPO_DEFAULT_FLOOR,
    temperature: float = 1.0,
    num_tokens: int | None = None,
    max_weight: float | None = MRTPO_DEFAULT_MAX_WEIGHT,
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
        w = (
            np.ones(t)
            if d is None
            else mrtpo_token_weights(d, floor, temperature, MRTPO_EPS, max_weight)
        )
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
    floor: float = MRTPO_DEFAULT_FLOOR,
    temperature: float = 1.0,
    num_tokens: Sequence[int] | None = None,
    normalize_batch: bool = True,
    eps: float = GDPO_EPS,
    max_weight: float | None = MRTPO_DEFAULT_MAX_WEIGHT,
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
            max_weight,
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
