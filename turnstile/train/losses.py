"""Policy-gradient losses in PyTorch: verl's PPO/GRPO policy loss and variants, Proximal KL.

Tensors are ``(B, T)`` and aligned with ``input_ids`` (``logp[b, t]`` is the log-probability
of ``input_ids[b, t]`` given the tokens before it); ``mask`` is the loss mask (1 on policy
tokens). ``turnstile.train.policy.token_logprobs`` computes such log-probabilities from a
causal language model. A packed row (``pack_batch``: ``(1, N)`` with ``cu_seqlens``) is
accepted wherever ``cu_seqlens`` is: it is unpacked into one row per sequence first
(``turnstile.train.packing``), so no sequence-level quantity crosses a boundary.

Named and configured as verl names them (``verl/trainer/ppo/core_algos.py``, v0.9.1):

* ``agg_loss`` with ``loss_agg_mode``: ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
  ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` (Dr. GRPO: the batch's token sum
  over sequences, divided by a constant ``loss_scale_factor``, default the row width);
* ``policy_loss`` (verl's ``compute_policy_loss_vanilla``): ``r = exp(clamp(logp -
  logp_old, +-20))``, ``max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``
  (asymmetric clipping, DAPO's clip-higher with ``clip_ratio_high > clip_ratio_low``) and,
  with ``clip_ratio_c`` (dual-clip PPO, verl's default 3.0), ``min(that, -A c)`` where
  ``A < 0``; multiplied by the importance weights, then aggregated;
* ``entropy_bonus`` (``- entropy_coeff * agg_loss(entropy)``) and ``kl_loss``
  (``use_kl_loss``: ``kl_loss_coef * agg_loss(kl(logp, logp_ref))``, ``kl_loss_type`` one
  of k1/k2/k3 or verl's kl/mse/low_var_kl, ``+`` for k2's gradient under the estimator's
  value). The KL *in the reward* (``use_kl_in_reward``) is in ``turnstile.train.shaping``.

**Proximal KL** is implemented from the reading of its published abstract (Hao Bai, Jiarui
Yao, Tong Zhang) given in Turnstile's method notes; the paper itself was not available. See
``docs/trainer.md`` for the exact estimator. For off-policy rollouts sampled by a
behaviour policy ``mu`` (the recorded ``behavior_logprobs``) and a KL-regularised objective
toward a fixed reference ``pi_ref``:

* ``w_t``: an importance correction of ``mu != pi_old`` (``turnstile.train.corrections``);
* ``r_t = pi_theta / pi_old`` is the PPO ratio, clipped as in ``policy_loss``;
* ``c_t = sum_{t' >= t} m_t' (log pi_old(y_t') - log pi_ref(y_t'))`` is the future-token
  KL cost over the later policy tokens of the whole rollout (across turns, and across the
  rollout's later samples when it was split), bounded to ``[-B, B]``, and enters the
  advantage ``A~_t = A_t - beta * c~_t`` (a constant: no gradient flows through it);
* ``L = agg(m_t w_t max(-r_t A~_t, -clip(r_t) A~_t))``, token-mean by default.

With ``mu = pi_old`` and ``beta = 0`` it is exactly the GRPO/PPO clipped loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

import torch

from turnstile.train import corrections, packing

# PPO's clip range; 0.2 is the value of the PPO paper and of verl's clip_ratio.
DEFAULT_CLIP_EPS: Final[float] = 0.2
# verl's default clip_ratio_c (dual-clip PPO's lower bound for negative advantages).
VERL_CLIP_RATIO_C: Final[float] = 3.0
LOSS_AGG_MODES: Final[tuple[str, ...]] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# verl's seq-mean-token-mean adds this to a sequence's token count.
_SEQ_TOKEN_EPS: Final[float] = 1e-8


def future_kl_cost(
    logp_old: Any,
    logp_ref: Any,
    mask: Any,
    bound: float | None = None,
    *,
    cu_seqlens: Any = None,
    rollout_index: Any = None,
    sample_index: Any = None,
) -> Any:
    """``c_t = sum_{t' >= t} m_t' (log pi_old - log pi_ref)``, optionally clipped to +-bound.

    Works on numpy arrays or torch tensors (``(..., T)``); the sum runs over all later
    policy tokens of the sequence, across turns. Masked-out positions add nothing. With
    ``rollout_index`` (one per row; ``sample_index`` orders a rollout's rows, default the
    row order) the sum runs on through the later samples of the same rollout. With
    ``cu_seqlens`` the input is a packed row, and both indices are per sequence.
    """
    if cu_seqlens is not None:
        padded = future_kl_cost(
            packing.unpack(logp_old, cu_seqlens),
            packing.unpack(logp_ref, cu_seqlens),
            packing.unpack(mask, cu_seqlens),
            bound,
            rollout_index=rollout_index,
            sample_index=sample_index,
        )
        return packing.repack(padded, cu_seqlens, logp_old)
    xp = corrections._xp(logp_old)
    delta = xp.nan_to_num(logp_old - logp_ref, nan=0.0) * (mask > 0)
    if xp is torch:
        cost = torch.flip(torch.cumsum(torch.flip(delta, [-1]), -1), [-1])
    else:
        cost = xp.flip(xp.cumsum(xp.flip(delta, -1), -1), -1)
    if rollout_index is not None:
        cost = cost + _later_samples(xp, delta.sum(-1), rollout_index, sample_index)[..., None]
    if bound is not None:
        cost = xp.clip(cost, -bound, bound)
    return cost * (mask > 0)


def _later_samples(xp: Any, totals: Any, rollout_index: Any, sample_index: Any) -> Any:
    """Per row: the sum of ``totals`` over the later rows of the same rollout."""
    rows = totals.shape[0]
    rollout = xp.asarray(rollout_index).reshape(-1)
    order = xp.asarray(sample_index).reshape(-1) if sample_index is not None else None
    if rollout.shape[0] != rows or (order is not None and order.shape[0] != rows):
        raise ValueError(f"rollout_index/sample_index need one entry per row ({rows})")
    if order is None:
        order = xp.arange(rows)
    if xp is torch:
        rollout, order = rollout.to(totals.device), order.to(totals.device)
    later = (rollout[None, :] == rollout[:, None]) & (order[None, :] > order[:, None])
    return (later * totals[None, :]).sum(-1)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """verl's ``agg_loss`` (one process): reduce a ``(B, T)`` loss matrix to a scalar.

    Fully masked rows do not count as sequences. ``loss_scale_factor`` is Dr. GRPO's
    constant normaliser for ``seq-mean-token-sum-norm`` (default: the row width ``T``).
    """
    m = (mask > 0).to(loss_mat.dtype)
    masked = torch.where(m > 0, loss_mat, torch.zeros_like(loss_mat))
    if loss_agg_mode == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    if loss_agg_mode == "token-sum":
        return masked.sum()
    rows = (m.sum(-1) > 0).to(loss_mat.dtype)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = (masked.sum(-1) * rows).sum() / rows.sum().clamp(min=1.0)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / (m.sum(-1) + _SEQ_TOKEN_EPS)
        return (per_seq * rows).sum() / rows.sum().clamp(min=1.0)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, not {loss_agg_mode!r}")


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` (0 for an empty mask)."""
    return agg_loss(values, mask, "token-mean")


def policy_loss_matrix(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float = DEFAULT_CLIP_EPS,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> torch.Tensor:
    """Per-token clipped policy loss of verl's ``compute_policy_loss_vanilla``."""
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    old = torch.nan_to_num(logp_old.detach(), nan=0.0)
    adv = advantages.detach()
    log_ratio = (logp - old).clamp(-corrections.LOG_RATIO_CLAMP, corrections.LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high))
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be above 1 (dual-clip PPO), not {clip_ratio_c}")
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * clip_ratio_c), loss)
    return loss


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float = DEFAULT_CLIP_EPS,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    weights: torch.Tensor | None = None,
    cu_seqlens: Any = None,
) -> torch.Tensor:
    """verl's vanilla PPO/GRPO policy loss (see the module docstring), aggregated.

    ``weights`` are importance weights (detached, e.g. ``corrections.token_tis``).
    ``clip_ratio_c`` None leaves dual-clip off (verl's default is 3.0).
    """
    if cu_seqlens is not None:
        return policy_loss(
            *(packing.unpack(x, cu_seqlens) for x in (logp, logp_old, advantages, mask)),
            clip_ratio=clip_ratio,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor,
            weights=None if weights is None else packing.unpack(weights, cu_seqlens),
        )
    loss = policy_loss_matrix(
        logp, logp_old, advantages, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    if weights is not None:
        loss = loss * weights.detach()
    return agg_loss(loss, mask, loss_agg_mode, loss_scale_factor)


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = DEFAULT_CLIP_EPS,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GRPO/PPO token-mean clipped surrogate ``-mean_t w_t min(r A, clip(r) A)``."""
    return policy_loss(logp, logp_old, advantages, mask, clip_ratio=clip_eps, weights=weights)


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    entropy_coeff: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """The term verl adds to the policy loss: ``- entropy_coeff * agg_loss(entropy)``."""
    return -entropy_coeff * agg_loss(entropy, mask, loss_agg_mode, loss_scale_factor)


def kl_values(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimates, differentiable in ``logp``; ``kind`` may end in ``+``.

    ``k3+`` (verl): the value of k3 with the gradient of k2 (``0.5 (logp - logp_ref)^2``),
    whose gradient is the KL's own in expectation.
    """
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in corrections.KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}")
    ref = torch.nan_to_num(logp_ref.detach(), nan=0.0)
    values: torch.Tensor = corrections.KL_ESTIMATORS[base](logp, ref)
    if kind.endswith("+") and base not in ("k2", "mse"):
        straight = 0.5 * (logp - ref).square()
        values = straight - straight.detach() + values.detach()
    return values


def kl_loss(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    logp_old: torch.Tensor | None = None,
) -> torch.Tensor:
    """verl's ``use_kl_loss`` term before its coefficient: ``agg_loss(kl(logp, ref))``.

    With ``logp_old`` the estimate is importance-corrected for tokens sampled by
    ``pi_old``: each value is multiplied by ``r = pi_theta / pi_old`` (gradient included),
    as TRL's ``use_bias_correction_kl``.
    """
    values = kl_values(logp, logp_ref, kl_loss_type)
    if logp_old is not None:
        old = torch.nan_to_num(logp_old.detach(), nan=0.0)
        clamp = corrections.LOG_RATIO_CLAMP
        values = values * torch.exp((logp - old).clamp(-clamp, clamp))
    return agg_loss(values, mask, loss_agg_mode, loss_scale_factor)


def kl_penalty(
    logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Token-mean KL(pi || pi_ref) estimate (``k1``, ``k2`` or ``k3``), differentiable.

    Note that none of k1/k2/k3 differentiated gives the gradient of the sequence KL (the
    future-token cost of ``proximal_kl_loss`` does, on-policy); see ``docs/trainer.md``.
    """
    return kl_loss(logp, logp_ref, mask, kind)


CORRECTIONS: Final[tuple[str, ...]] = (
    "token_tis",
    "sequence_tis",
    "icepop",
    "sequence_mis",
    "sequence_rs",
    "geometric_rs",
    "none",
)


@dataclass(frozen=True)
class ProximalKLConfig:
    """Settings of ``proximal_kl_loss`` (see the module docstring and docs/trainer.md).

    ``correction`` picks the importance correction of ``mu != pi_old``; in verl's terms:
    ``token_tis`` is ``rollout_is="token"`` with threshold ``cap``; ``sequence_tis`` is
    ``rollout_is="sequence"``; ``icepop`` is ``rollout_is="token"`` with threshold
    ``"icepop_low_icepop_high"``; ``sequence_mis`` is Seq-MIS, ``rho_seq * 1{rho_seq <= cap}``
    (``rollout_is="sequence"``, threshold ``"0_cap"``); ``sequence_rs`` and ``geometric_rs``
    reject sequences outside ``[rs_low, rs_high]`` (``rollout_rs="seq_sum_k1"`` /
    ``"seq_mean_k1"``) with weight 1 for the rest; ``none`` weighs every token 1.
    """

    beta: float = 0.0  # weight of the future-token KL cost
    bound: float | None = None  # B: the cost is clipped to [-B, B]; None: unbounded
    clip_eps: float = DEFAULT_CLIP_EPS  # verl's clip_ratio
    clip_ratio_low: float | None = None  # None: clip_eps
    clip_ratio_high: float | None = None  # None: clip_eps (DAPO's clip-higher: above low)
    clip_ratio_c: float | None = None  # dual-clip PPO; None: off (verl's default is 3.0)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant
    correction: str = "token_tis"
    cap: float = corrections.DEFAULT_TIS_CAP  # C of TIS and Seq-MIS
    icepop_low: float = corrections.DEFAULT_ICEPOP_LOW
    icepop_high: float = corrections.DEFAULT_ICEPOP_HIGH
    rs_low: float = corrections.DEFAULT_RS_LOW
    rs_high: float = corrections.DEFAULT_RS_HIGH
    use_veto: bool = False  # also drop sequences with any rho_t < veto_threshold
    veto_threshold: float = corrections.VETO_THRESHOLD
    entropy_coeff: float = 0.0  # needs the per-token entropy
    kl_loss_coef: float = 0.0  # verl's use_kl_loss: KL to pi_ref as a loss term
    kl_loss_type: str = "low_var_kl"
    kl_loss_importance: bool = False  # multiply the KL loss by pi_theta / pi_old (TRL)
    # Tokens sampled more than this many versions before `current_version` leave the loss
    # (weights, sequence ratios, future-KL cost, denominator); needs `behavior_versions`.
    max_token_staleness: int | None = None


@dataclass(frozen=True)
class ProximalKLOutput:
    loss: torch.Tensor
    shaped_advantages: torch.Tensor  # A~_t (detached)
    weights: torch.Tensor  # w_t, 0 where a token or sequence was rejected
    mask: torch.Tensor  # the loss mask after rejections (the loss's denominator)


def _correction_weights(
    config: ProximalKLConfig, logp_old: torch.Tensor, logp_mu: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    keep = mask > 0
    kind = config.correction
    if kind == "token_tis":
        w = corrections.token_tis(logp_old, logp_mu, mask, config.cap)
    elif kind == "sequence_tis":
        w = corrections.sequence_tis(logp_old, logp_mu, mask, config.cap)
    elif kind == "icepop":
        w = corrections.icepop(logp_old, logp_mu, mask, config.icepop_low, config.icepop_high)
    elif kind == "sequence_mis":
        w = corrections.sequence_mis_weights(logp_old, logp_mu, mask, config.cap)
    elif kind in ("sequence_rs", "geometric_rs"):
        kept = corrections.sequence_rs(
            logp_old, logp_mu, mask, config.rs_low, config.rs_high, kind == "geometric_rs"
        )
        keep = keep & kept[..., None]
        w = keep.to(logp_old.dtype)
    elif kind == "none":
        w = keep.to(logp_old.dtype)
    else:
        raise ValueError(f"correction must be one of {CORRECTIONS}, not {kind!r}")
    if config.use_veto:
        keep = keep & corrections.veto(logp_old, logp_mu, mask, config.veto_threshold)[..., None]
    return w * keep, keep


def proximal_kl_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behavior: torch.Tensor,
    logp_ref: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: ProximalKLConfig | None = None,
    *,
    cu_seqlens: Any = None,
    rollout_index: Any = None,
    sample_index: Any = None,
    entropy: torch.Tensor | None = None,
    behavior_versions: torch.Tensor | None = None,
    current_version: int | None = None,
) -> ProximalKLOutput:
    """The Proximal KL loss, implemented from the reading of its abstract in the notes.

    ``logp`` carries gradients (pi_theta); ``logp_old``, ``logp_behavior`` (mu, recorded)
    and ``logp_ref`` are treated as constants; ``advantages`` are per token (e.g. GRPO's
    sequence advantage on every policy token, or MRTPO's). ``cu_seqlens`` marks a packed
    row (its sequences are never mixed); ``rollout_index``/``sample_index`` (per row or
    per packed sequence, as ``pad_batch``/``pack_batch`` give them) run the future-KL
    cost on across a split rollout's samples. ``entropy`` (per token, with gradients) is
    needed for ``entropy_coeff``; ``kl_loss_coef`` adds the KL to ``logp_ref`` as a loss.
    ``behavior_versions`` (per token, the version that sampled it; -1 where none) and
    ``current_version`` are needed for ``max_token_staleness``: the tokens staler than it
    are taken out of ``mask`` before anything else (``corrections.fresh_token_mask``).
    """
    cfg = config or ProximalKLConfig()
    if cfg.max_token_staleness is not None:
        if behavior_versions is None or current_version is None:
            raise ValueError("max_token_staleness needs behavior_versions and current_version")
        mask = corrections.fresh_token_mask(
            mask, behavior_versions, current_version, cfg.max_token_staleness
        )
    if cu_seqlens is not None:

        def unpacked(x: torch.Tensor) -> torch.Tensor:
            result: torch.Tensor = packing.unpack(x, cu_seqlens)
            return result

        out = proximal_kl_loss(
            unpacked(logp),
            unpacked(logp_old),
            unpacked(logp_behavior),
            unpacked(logp_ref),
            unpacked(advantages),
            unpacked(mask),
            dataclasses.replace(cfg, max_token_staleness=None),  # mask is fresh already
            rollout_index=rollout_index,
            sample_index=sample_index,
            entropy=None if entropy is None else packing.unpack(entropy, cu_seqlens),
        )
        return ProximalKLOutput(
            out.loss,
            packing.repack(out.shaped_advantages, cu_seqlens, logp),
            packing.repack(out.weights, cu_seqlens, logp),
            packing.repack(out.mask, cu_seqlens, logp),
        )
    old = torch.nan_to_num(logp_old.detach(), nan=0.0)
    mu = torch.nan_to_num(logp_behavior.detach(), nan=0.0)
    ref = torch.nan_to_num(logp_ref.detach(), nan=0.0)
    weights, keep = _correction_weights(cfg, old, mu, mask)
    cost = future_kl_cost(
        old, ref, mask, cfg.bound, rollout_index=rollout_index, sample_index=sample_index
    )
    shaped = (advantages.detach() - cfg.beta * cost) * (mask > 0)
    loss = policy_loss(
        logp,
        old,
        shaped,
        keep.to(logp.dtype),
        clip_ratio=cfg.clip_eps,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        loss_scale_factor=cfg.loss_scale_factor,
        weights=weights,
    )
    if cfg.entropy_coeff:
        if entropy is None:
            raise ValueError("entropy_coeff needs the per-token entropy")
        loss = loss + entropy_bonus(
            entropy, keep, cfg.entropy_coeff, cfg.loss_agg_mode, cfg.loss_scale_factor
        )
    if cfg.kl_loss_coef:
        loss = loss + cfg.kl_loss_coef * kl_loss(
            logp,
            ref,
            keep,
            cfg.kl_loss_type,
            cfg.loss_agg_mode,
            cfg.loss_scale_factor,
            old if cfg.kl_loss_importance else None,
        )
    return ProximalKLOutput(loss, shaped, weights, keep)
