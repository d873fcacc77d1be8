"""Policy-gradient losses in PyTorch: PPO/GRPO clip and the Proximal KL loss.

Tensors are ``(B, T)`` and aligned with ``input_ids`` (``logp[b, t]`` is the log-probability
of ``input_ids[b, t]`` given the tokens before it); ``mask`` is the loss mask (1 on policy
tokens). ``turnstile.train.policy.token_logprobs`` computes such log-probabilities from a
causal language model.

**Proximal KL** is implemented from the reading of its published abstract (Hao Bai, Jiarui
Yao, Tong Zhang) given in Turnstile's method notes; the paper itself was not available. For
off-policy rollouts sampled by a behaviour policy ``mu`` (the recorded
``behavior_logprobs``) and a KL-regularised objective toward a fixed reference ``pi_ref``:

* ``w_t = min(pi_old / mu, C)`` (token TIS) or a keep-mask from IcePop/MIS corrects for
  ``mu != pi_old``;
* ``r_t = pi_theta / pi_old`` is the PPO ratio, clipped to ``1 +- eps``;
* ``c_t = sum_{t' >= t} m_t' (log pi_old(y_t') - log pi_ref(y_t'))`` is the future-token
  KL cost over the later policy tokens of the whole (multi-turn) sequence, bounded to
  ``[-B, B]``, and enters the advantage ``A~_t = A_t - beta * c~_t`` (detached);
* ``L = - sum_t m_t w_t min(r_t A~_t, clip(r_t) A~_t) / sum_t m_t``.

With ``mu = pi_old`` and ``beta = 0`` it is exactly the GRPO/PPO clipped loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from turnstile.train import corrections

# PPO's clip range; 0.2 is the value of the PPO paper and of GRPO implementations.
DEFAULT_CLIP_EPS: Final[float] = 0.2


def future_kl_cost(logp_old: Any, logp_ref: Any, mask: Any, bound: float | None = None) -> Any:
    """``c_t = sum_{t' >= t} m_t' (log pi_old - log pi_ref)``, optionally clipped to +-bound.

    Works on numpy arrays or torch tensors (``(..., T)``); the sum runs over all later
    policy tokens of the sequence, across turns. Masked-out positions add nothing.
    """
    xp = corrections._xp(logp_old)
    delta = xp.nan_to_num(logp_old - logp_ref, nan=0.0) * (mask > 0)
    if xp is torch:
        cost = torch.flip(torch.cumsum(torch.flip(delta, [-1]), -1), [-1])
    else:
        cost = xp.flip(xp.cumsum(xp.flip(delta, -1), -1), -1)
    if bound is not None:
        cost = xp.clip(cost, -bound, bound)
    return cost * (mask > 0)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` (0 for an empty mask)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = DEFAULT_CLIP_EPS,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GRPO/PPO token-mean clipped surrogate ``-mean_t w_t min(r A, clip(r) A)``."""
    safe_old = torch.nan_to_num(logp_old.detach(), nan=0.0)
    ratio = torch.exp(
        (logp - safe_old).clamp(-corrections.LOG_RATIO_CLAMP, corrections.LOG_RATIO_CLAMP)
    )
    adv = advantages.detach()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    if weights is not None:
        surrogate = surrogate * weights.detach()
    return -token_mean(torch.where(mask > 0, surrogate, torch.zeros_like(surrogate)), mask)


@dataclass(frozen=True)
class ProximalKLConfig:
    """Settings of ``proximal_kl_loss`` (see the module docstring)."""

    beta: float = 0.0  # weight of the future-token KL cost
    bound: float | None = None  # B: the cost is clipped to [-B, B]; None: unbounded
    clip_eps: float = DEFAULT_CLIP_EPS
    correction: str = "token_tis"  # token_tis, sequence_tis, icepop, sequence_mis, none
    cap: float = corrections.DEFAULT_TIS_CAP  # C of TIS; [1/C, C] for IcePop and MIS
    use_veto: bool = False  # also drop sequences with any rho_t < 1e-4


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
    c = config.cap
    if config.correction == "token_tis":
        w = corrections.token_tis(logp_old, logp_mu, mask, c)
    elif config.correction == "sequence_tis":
        w = corrections.sequence_tis(logp_old, logp_mu, mask, c)
    elif config.correction == "icepop":
        w = corrections.icepop(logp_old, logp_mu, mask, 1.0 / c, c)
    elif config.correction == "sequence_mis":
        keep = keep & corrections.sequence_mis(logp_old, logp_mu, mask, 1.0 / c, c)[..., None]
        w = keep.to(logp_old.dtype)
    elif config.correction == "none":
        w = keep.to(logp_old.dtype)
    else:
        raise ValueError(f"unknown correction {config.correction!r}")
    if config.use_veto:
        keep = keep & corrections.veto(logp_old, logp_mu, mask)[..., None]
    return w * keep, keep


def proximal_kl_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behavior: torch.Tensor,
    logp_ref: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: ProximalKLConfig | None = None,
) -> ProximalKLOutput:
    """The Proximal KL loss, implemented from the reading of its abstract in the notes.

    ``logp`` carries gradients (pi_theta); ``logp_old``, ``logp_behavior`` (mu, recorded)
    and ``logp_ref`` are treated as constants; ``advantages`` are per token (e.g. GRPO's
    sequence advantage on every policy token, or MRTPO's).
    """
    cfg = config or ProximalKLConfig()
    old = torch.nan_to_num(logp_old.detach(), nan=0.0)
    mu = torch.nan_to_num(logp_behavior.detach(), nan=0.0)
    ref = torch.nan_to_num(logp_ref.detach(), nan=0.0)
    weights, keep = _correction_weights(cfg, old, mu, mask)
    cost = future_kl_cost(old, ref, mask, cfg.bound)
    shaped = (advantages.detach() - cfg.beta * cost) * (mask > 0)
    loss = ppo_clip_loss(logp, old, shaped, keep.to(logp.dtype), cfg.clip_eps, weights)
    return ProximalKLOutput(loss, shaped, weights, keep)


def kl_penalty(
    logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Token-mean KL(pi || pi_ref) estimate (``k1``, ``k2`` or ``k3``), differentiable."""
    estimator = corrections.KL_ESTIMATORS[kind]
    values = estimator(logp, torch.nan_to_num(logp_ref.detach(), nan=0.0))
    return token_mean(torch.where(mask > 0, values, torch.zeros_like(values)), mask)
