"""Off-policy corrections and KL estimators, on numpy arrays or torch tensors.

The rollouts were sampled by a behaviour policy ``mu`` (the inference engine, recorded as
``behavior_logprobs``); the trainer's old policy is ``pi_old``. Following verl's
``rollout_corr_helper`` (and the TIS and MIS write-ups), everything is computed in log
space from ``log rho_t = log pi_old(y_t) - log mu(y_t)``, clamped to ``[-20, 20]`` before
exponentiating, and (for torch tensors) detached:

* token TIS: ``w_t = min(rho_t, C)``;
* sequence TIS: ``w = min(prod_t rho_t, C)`` for every token of the sequence;
* IcePop: ``w_t = rho_t`` inside ``[low, high]`` and 0 outside (the token is dropped);
* sequence MIS: a sequence is kept (weight 1) only if ``C_low <= prod_t rho_t <= C_high``;
  geometric MIS uses ``rho_geo = exp(mean_t log rho_t)`` instead of the product;
* veto: a sequence with any ``rho_t < 1e-4`` is rejected.

Rejections are returned as a keep-mask, so the caller can drop those tokens from the loss
denominator as well. Arrays are ``(..., T)`` with a ``(..., T)`` loss mask; masked-out
positions may hold NaN and are ignored.

KL estimators (Schulman's k1/k2/k3) of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``,
with ``lr = log pi_ref - log pi``: ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = e^lr - 1 - lr``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Final

import numpy as np

# verl clamps log-ratios to +-20 before exp: e^20 ~ 5e8 keeps float32 finite.
LOG_RATIO_CLAMP: Final[float] = 20.0
# verl's default veto threshold: a token this unlikely under pi_old marks a broken sample.
VETO_THRESHOLD: Final[float] = 1e-4
# Truncation cap C for TIS; 2 is the value the TIS write-up and verl use by default.
DEFAULT_TIS_CAP: Final[float] = 2.0

Array = Any  # a numpy array or a torch tensor


def _xp(x: Array) -> ModuleType:
    if type(x).__module__.startswith("torch"):
        import torch

        return torch
    return np


def _detach(x: Array) -> Array:
    return x.detach() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)


def log_ratio(logp_old: Array, logp_behavior: Array, mask: Array) -> Array:
    """``log pi_old - log mu``, clamped to +-20, 0 where ``mask`` is 0 (detached)."""
    xp = _xp(logp_old)
    lr = xp.nan_to_num(_detach(logp_old) - _detach(logp_behavior), nan=0.0)
    lr = xp.where(mask > 0, lr, 0.0 * lr)
    return xp.clip(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _masked_sum(x: Array, mask: Array) -> Array:
    return (x * (mask > 0)).sum(-1)


def token_tis(
    logp_old: Array, logp_behavior: Array, mask: Array, cap: float = DEFAULT_TIS_CAP
) -> Array:
    """Token-level truncated importance sampling weights ``min(rho_t, C)`` (0 off mask)."""
    xp = _xp(logp_old)
    rho = xp.exp(log_ratio(logp_old, logp_behavior, mask))
    return xp.clip(rho, None, cap) * (mask > 0)


def sequence_log_ratio(logp_old: Array, logp_behavior: Array, mask: Array) -> Array:
    """``log prod_t rho_t`` per sequence, clamped to +-20."""
    xp = _xp(logp_old)
    total = _masked_sum(log_ratio(logp_old, logp_behavior, mask), mask)
    return xp.clip(total, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def geometric_log_ratio(logp_old: Array, logp_behavior: Array, mask: Array) -> Array:
    """``mean_t log rho_t`` per sequence (``log rho_geo``); 0 for an empty mask."""
    xp = _xp(logp_old)
    count = (mask > 0).sum(-1)
    total = _masked_sum(log_ratio(logp_old, logp_behavior, mask), mask)
    safe = xp.where(count > 0, count, 1 + 0 * count)
    return xp.clip(total / safe, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_tis(
    logp_old: Array, logp_behavior: Array, mask: Array, cap: float = DEFAULT_TIS_CAP
) -> Array:
    """Sequence-level TIS: ``min(prod_t rho_t, C)`` broadcast over the sequence's tokens."""
    xp = _xp(logp_old)
    w = xp.clip(xp.exp(sequence_log_ratio(logp_old, logp_behavior, mask)), None, cap)
    return w[..., None] * (mask > 0)


def icepop(
    logp_old: Array, logp_behavior: Array, mask: Array, low: float = 0.5, high: float = 2.0
) -> Array:
    """IcePop: ``rho_t`` where ``low <= rho_t <= high``, else 0 (the token is dropped)."""
    xp = _xp(logp_old)
    rho = xp.exp(log_ratio(logp_old, logp_behavior, mask))
    keep = (rho >= low) & (rho <= high) & (mask > 0)
    return xp.where(keep, rho, 0.0 * rho)


def sequence_mis(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    low: float = 0.5,
    high: float = 2.0,
    geometric: bool = False,
) -> Array:
    """Sequence masked importance sampling: a per-sequence keep-mask (bool).

    A sequence is kept when ``low <= ratio <= high``, with ``ratio = prod_t rho_t`` or,
    with ``geometric``, ``rho_geo = exp(mean_t log rho_t)``.
    """
    xp = _xp(logp_old)
    if geometric:
        ratio = xp.exp(geometric_log_ratio(logp_old, logp_behavior, mask))
    else:
        ratio = xp.exp(sequence_log_ratio(logp_old, logp_behavior, mask))
    return (ratio >= low) & (ratio <= high)


def veto(
    logp_old: Array, logp_behavior: Array, mask: Array, threshold: float = VETO_THRESHOLD
) -> Array:
    """Per-sequence keep-mask: False when any masked token has ``rho_t < threshold``."""
    xp = _xp(logp_old)
    rho = xp.exp(log_ratio(logp_old, logp_behavior, mask))
    bad = (rho < threshold) & (mask > 0)
    return ~bad.any(-1)


def kl_k1(logp: Array, logp_ref: Array) -> Array:
    """k1 = ``-lr = log pi - log pi_ref``: unbiased for KL(pi || pi_ref), high variance."""
    return logp - logp_ref


def kl_k2(logp: Array, logp_ref: Array) -> Array:
    """k2 = ``lr^2 / 2``: low variance, biased."""
    lr = logp_ref - logp
    return 0.5 * lr * lr


def kl_k3(logp: Array, logp_ref: Array) -> Array:
    """k3 = ``e^lr - 1 - lr`` (``lr = log pi_ref - log pi``): unbiased, non-negative."""
    xp = _xp(logp)
    lr = xp.clip(logp_ref - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return xp.exp(lr) - 1.0 - lr


KL_ESTIMATORS: Final = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
