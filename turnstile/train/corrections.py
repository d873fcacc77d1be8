"""Off-policy corrections and KL estimators, on numpy arrays or torch tensors.

The rollouts were sampled by a behaviour policy ``mu`` (the inference engine, recorded as
``behavior_logprobs``); the trainer's old policy is ``pi_old``. As verl's
``verl/trainer/ppo/rollout_corr_helper.py`` (v0.9.1) does, everything is computed in log
space from ``log rho_t = log pi_old(y_t) - log mu(y_t)``, clamped to ``[-20, 20]`` before
exponentiating (a sequence's sum is clamped after summing), and (for torch) detached:

* **token TIS**: ``w_t = min(rho_t, C)`` (verl ``rollout_is="token"``, threshold ``C``);
* **sequence TIS**: ``w = min(prod_t rho_t, C)`` on every token of the sequence (verl
  ``rollout_is="sequence"``);
* **IcePop**: ``w_t = rho_t`` inside ``[low, high]``, else 0 (verl ``rollout_is="token"``
  with threshold ``"low_high"``); its bounds are its own, not the TIS cap;
* **Seq-MIS**: ``w = rho_seq * 1{low <= rho_seq <= C}`` on every token (verl
  ``rollout_is="sequence"`` with threshold ``"low_C"``; the MIS write-up's one-sided form is
  ``low = 0``): a kept sequence keeps its weight ``rho_seq``;
* **Seq-RS** (rejection sampling): a per-sequence keep-mask, ``low <= rho_seq <= high``
  (verl ``rollout_rs="seq_sum_k1"``); **geometric RS** uses ``rho_geo = exp(mean_t log
  rho_t)`` (verl ``seq_mean_k1``). A rejected sequence leaves the loss and its denominator;
* ``rejection_mask``: verl's ``compute_rollout_rejection_mask`` options by their names
  (``token_k1..3``, ``seq_sum_k1..3``, ``seq_mean_k1..3``, ``seq_max_k2..3``);
* **veto**: a sequence with any ``rho_t`` below a threshold is rejected. verl has no veto
  (its rejection options above replace it); 1e-4 is Turnstile's choice, see
  ``VETO_THRESHOLD``.

Arrays are ``(..., T)`` with a ``(..., T)`` loss mask; masked-out positions may hold NaN and
are ignored. Every sequence-level function takes ``cu_seqlens`` for a packed row
(``turnstile.train.batches.pack_batch``): sequences are then never mixed, and per-sequence
results have one entry per sequence.

**Per-token behaviour versions.** A sample's tokens may come from several policy versions
(a stream that straddled a ``keep`` weight update; ``behavior_versions`` from
``turnstile.train.batches``, -1 where no token was sampled). The ratios above stay exact
per token (``mu`` is the recorded logprob of the weights that sampled it); what the version
changes is how far ``mu`` may be from ``pi_old``. ``token_staleness`` gives it per token
(``current_version - behavior_version``, 0 off the mask) and ``fresh_token_mask`` drops the
tokens more than ``max_staleness`` versions old from a loss mask: passed as the ``mask`` of
any function here, they leave every token weight, sequence ratio (the product or mean runs
over the fresh tokens only), rejection statistic and the loss's denominator.
``turnstile.train.losses.proximal_kl_loss`` applies it itself with
``ProximalKLConfig.max_token_staleness``.

KL estimators (Schulman's k1/k2/k3) of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``,
with ``lr = log pi_ref - log pi``: ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = e^lr - 1 - lr``
(verl's ``kl_penalty_forward``: ``kl``/``k1``, ``mse``/``k2``, ``low_var_kl``/``k3``, the
last clamped to ``[-10, 10]``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import numpy as np

from turnstile.train import packing

# verl clamps log-ratios to +-20 before exp: e^20 ~ 5e8 keeps float32 finite.
LOG_RATIO_CLAMP: Final[float] = 20.0
# verl clamps k3 ("low_var_kl") to +-10.
K3_CLAMP: Final[float] = 10.0
# The veto's threshold: a token 10,000 times less likely under pi_old than under the
# sampler marks a broken sample (a tokenizer or weight-sync fault, not drift). Turnstile's
# choice; verl has no veto.
VETO_THRESHOLD: Final[float] = 1e-4
# Truncation cap C for TIS and Seq-MIS; 2 is the TIS write-up's value and verl's default
# rollout_is_threshold.
DEFAULT_TIS_CAP: Final[float] = 2.0
# IcePop's band: verl's decoupled_token_icepop defaults to [0.5, 5.0].
DEFAULT_ICEPOP_LOW: Final[float] = 0.5
DEFAULT_ICEPOP_HIGH: Final[float] = 5.0
# Seq-RS band on rho_seq: verl's decoupled_seq_is_rs defaults to "0.5_2.0".
DEFAULT_RS_LOW: Final[float] = 0.5
DEFAULT_RS_HIGH: Final[float] = 2.0
REJECTION_OPTIONS: Final[tuple[str, ...]] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

Array = Any  # a numpy array or a torch tensor


def _xp(x: Array) -> ModuleType:
    if type(x).__module__.startswith("torch"):
        import torch

        return torch
    return np


def _detach(x: Array) -> Array:
    return x.detach() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)


def _packed(
    fn: Callable[..., Array], cu_seqlens: Array, per_token: bool, *arrays: Array, **kw: Any
) -> Array:
    """Run ``fn`` on the padded form of packed ``arrays``; repack a per-token result."""
    out = fn(*(packing.unpack(a, cu_seqlens) for a in arrays), **kw)
    return packing.repack(out, cu_seqlens, arrays[0]) if per_token else out


def _raw_log_ratio(logp_old: Array, logp_behavior: Array, mask: Array) -> Array:
    """``log pi_old - log mu``, 0 where ``mask`` is 0 (detached, not clamped)."""
    xp = _xp(logp_old)
    lr = xp.nan_to_num(_detach(logp_old) - _detach(logp_behavior), nan=0.0)
    return xp.where(mask > 0, lr, 0.0 * lr)


def log_ratio(logp_old: Array, logp_behavior: Array, mask: Array) -> Array:
    """``log pi_old - log mu``, clamped to +-20, 0 where ``mask`` is 0 (detached)."""
    xp = _xp(logp_old)
    return xp.clip(_raw_log_ratio(logp_old, logp_behavior, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def token_staleness(behavior_versions: Array, current_version: int, mask: Array) -> Array:
    """Versions between each token's sampler and ``current_version`` (0 off ``mask`` and
    where the version is unknown, -1)."""
    xp = _xp(behavior_versions)
    known = (mask > 0) & (behavior_versions >= 0)
    return xp.where(known, current_version - behavior_versions, 0 * behavior_versions)


def fresh_token_mask(
    mask: Array, behavior_versions: Array, current_version: int, max_staleness: int
) -> Array:
    """``mask`` with every token sampled more than ``max_staleness`` versions before
    ``current_version`` set to 0 (same type and dtype as ``mask``)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
    stale = token_staleness(behavior_versions, current_version, mask) > max_staleness
    xp = _xp(mask)
    return xp.where(stale, 0 * mask, mask)


def _masked_sum(x: Array, mask: Array) -> Array:
    return (x * (mask > 0)).sum(-1)


def token_tis(
    logp_old: Array, logp_behavior: Array, mask: Array, cap: float = DEFAULT_TIS_CAP
) -> Array:
    """Token-level truncated importance sampling weights ``min(rho_t, C)`` (0 off mask)."""
    xp = _xp(logp_old)
    rho = xp.exp(log_ratio(logp_old, logp_behavior, mask))
    return xp.clip(rho, None, cap) * (mask > 0)


def sequence_log_ratio(
    logp_old: Array, logp_behavior: Array, mask: Array, *, cu_seqlens: Array = None
) -> Array:
    """``log prod_t rho_t`` per sequence, summed then clamped to +-20 (as verl)."""
    if cu_seqlens is not None:
        return _packed(sequence_log_ratio, cu_seqlens, False, logp_old, logp_behavior, mask)
    xp = _xp(logp_old)
    total = _masked_sum(_raw_log_ratio(logp_old, logp_behavior, mask), mask)
    return xp.clip(total, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def geometric_log_ratio(
    logp_old: Array, logp_behavior: Array, mask: Array, *, cu_seqlens: Array = None
) -> Array:
    """``mean_t log rho_t`` per sequence (``log rho_geo``); 0 for an empty mask."""
    if cu_seqlens is not None:
        return _packed(geometric_log_ratio, cu_seqlens, False, logp_old, logp_behavior, mask)
    xp = _xp(logp_old)
    count = (mask > 0).sum(-1)
    total = _masked_sum(log_ratio(logp_old, logp_behavior, mask), mask)
    safe = xp.where(count > 0, count, 1 + 0 * count)
    return xp.clip(total / safe, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_tis(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    cap: float = DEFAULT_TIS_CAP,
    *,
    cu_seqlens: Array = None,
) -> Array:
    """Sequence-level TIS: ``min(prod_t rho_t, C)`` broadcast over the sequence's tokens."""
    if cu_seqlens is not None:
        return _packed(sequence_tis, cu_seqlens, True, logp_old, logp_behavior, mask, cap=cap)
    xp = _xp(logp_old)
    w = xp.clip(xp.exp(sequence_log_ratio(logp_old, logp_behavior, mask)), None, cap)
    return w[..., None] * (mask > 0)


def icepop(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    low: float = DEFAULT_ICEPOP_LOW,
    high: float = DEFAULT_ICEPOP_HIGH,
) -> Array:
    """IcePop: ``rho_t`` where ``low <= rho_t <= high``, else 0 (the token is dropped)."""
    xp = _xp(logp_old)
    rho = xp.exp(log_ratio(logp_old, logp_behavior, mask))
    keep = (rho >= low) & (rho <= high) & (mask > 0)
    return xp.where(keep, rho, 0.0 * rho)


def sequence_mis_weights(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    cap: float = DEFAULT_TIS_CAP,
    low: float = 0.0,
    *,
    cu_seqlens: Array = None,
) -> Array:
    """Seq-MIS: ``rho_seq * 1{low <= rho_seq <= C}`` on every token of the sequence.

    A sequence over the cap is masked (weight 0, still in the loss's denominator, as verl's
    ``rollout_is_threshold="low_C"``); a kept one keeps its importance weight.
    """
    if cu_seqlens is not None:
        return _packed(
            sequence_mis_weights, cu_seqlens, True, logp_old, logp_behavior, mask, cap=cap, low=low
        )
    xp = _xp(logp_old)
    rho = xp.exp(sequence_log_ratio(logp_old, logp_behavior, mask))
    kept = (rho >= low) & (rho <= cap)
    w = xp.where(kept, rho, 0.0 * rho)
    return w[..., None] * (mask > 0)


def sequence_rs(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    low: float = DEFAULT_RS_LOW,
    high: float = DEFAULT_RS_HIGH,
    geometric: bool = False,
    *,
    cu_seqlens: Array = None,
) -> Array:
    """Seq-RS (rejection sampling): a per-sequence keep-mask (bool), weight 1 when kept.

    A sequence is kept when ``low <= ratio <= high``, with ``ratio = prod_t rho_t`` or,
    with ``geometric``, ``rho_geo = exp(mean_t log rho_t)``.
    """
    ratio_fn = geometric_log_ratio if geometric else sequence_log_ratio
    xp = _xp(logp_old)
    ratio = xp.exp(ratio_fn(logp_old, logp_behavior, mask, cu_seqlens=cu_seqlens))
    return (ratio >= low) & (ratio <= high)


def sequence_mis(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    low: float = DEFAULT_RS_LOW,
    high: float = DEFAULT_RS_HIGH,
    geometric: bool = False,
    *,
    cu_seqlens: Array = None,
) -> Array:
    """Deprecated name of ``sequence_rs`` (it always was rejection sampling).

    Seq-MIS as defined (``rho_seq * 1{rho_seq <= C}``) is ``sequence_mis_weights``.
    """
    warnings.warn(
        "corrections.sequence_mis is sequence rejection sampling: use sequence_rs, or "
        "sequence_mis_weights for Seq-MIS (rho_seq * 1{rho_seq <= C})",
        DeprecationWarning,
        stacklevel=2,
    )
    return sequence_rs(logp_old, logp_behavior, mask, low, high, geometric, cu_seqlens=cu_seqlens)


def veto(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    threshold: float = VETO_THRESHOLD,
    *,
    cu_seqlens: Array = None,
) -> Array:
    """Per-sequence keep-mask: False when any masked token has ``rho_t < threshold``."""
    if cu_seqlens is not None:
        return _packed(veto, cu_seqlens, False, logp_old, logp_behavior, mask, threshold=threshold)
    xp = _xp(logp_old)
    rho = xp.exp(log_ratio(logp_old, logp_behavior, mask))
    bad = (rho < threshold) & (mask > 0)
    return ~bad.any(-1)


def rejection_mask(
    logp_old: Array,
    logp_behavior: Array,
    mask: Array,
    option: str,
    upper: float,
    lower: float | None = None,
    *,
    cu_seqlens: Array = None,
) -> Array:
    """verl's ``compute_rollout_rejection_mask`` for one option: a per-token keep-mask.

    The statistics use ``lr = log pi_old - log mu`` clamped to +-20: ``k1 = -lr``,
    ``k2 = lr^2 / 2``, ``k3 = e^lr - 1 - lr``, per token, or summed (``seq_sum``), averaged
    (``seq_mean``) or maxed (``seq_max``) over a sequence. ``k1`` options keep
    ``log(lower) <= stat <= log(upper)`` (``lower`` defaults to ``1 / upper``); the others
    keep ``stat <= upper``.
    """
    if cu_seqlens is not None:
        return _packed(
            rejection_mask,
            cu_seqlens,
            True,
            logp_old,
            logp_behavior,
            mask,
            option=option,
            upper=upper,
            lower=lower,
        )
    if option not in REJECTION_OPTIONS:
        raise ValueError(f"rejection option must be one of {REJECTION_OPTIONS}, not {option!r}")
    xp = _xp(logp_old)
    lr = log_ratio(logp_old, logp_behavior, mask)
    kind = option[-2:]
    stat = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": xp.exp(lr) - 1.0 - lr}[kind]
    on = mask > 0
    if option.startswith("seq_sum"):
        stat = _masked_sum(stat, mask)[..., None]
    elif option.startswith("seq_mean"):
        count = on.sum(-1)
        stat = (_masked_sum(stat, mask) / xp.where(count > 0, count, 1 + 0 * count))[..., None]
    elif option.startswith("seq_max"):
        stat = xp.where(on, stat, 0.0 * stat - np.inf).max(-1)
        stat = stat.values if hasattr(stat, "values") else stat
        stat = xp.where(on.any(-1), stat, 0.0 * stat)[..., None]
    if kind == "k1":
        low = 1.0 / upper if lower is None else lower
        keep = (stat >= np.log(low)) & (stat <= np.log(upper))
    else:
        keep = stat <= upper
    return keep & on


def kl_k1(logp: Array, logp_ref: Array) -> Array:
    """k1 = ``-lr = log pi - log pi_ref``: unbiased for KL(pi || pi_ref), high variance."""
    return logp - logp_ref


def kl_k2(logp: Array, logp_ref: Array) -> Array:
    """k2 = ``lr^2 / 2``: low variance, biased."""
    lr = logp_ref - logp
    return 0.5 * lr * lr


def kl_k3(logp: Array, logp_ref: Array) -> Array:
    """k3 = ``e^lr - 1 - lr`` (``lr = log pi_ref - log pi``), as verl's ``low_var_kl``.

    Unbiased and non-negative; ``lr`` is clamped to +-20 and the result to +-10 (verl).
    """
    xp = _xp(logp)
    lr = xp.clip(logp_ref - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return xp.clip(xp.exp(lr) - 1.0 - lr, -K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: Final = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    # verl's names for the same estimators
    "kl": kl_k1,
    "mse": kl_k2,
    "low_var_kl": kl_k3,
}
