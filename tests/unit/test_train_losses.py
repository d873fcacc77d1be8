"""Loss variants (verl's names) against numbers computed from their formulas; packed rows.

Formulas: verl/trainer/ppo/core_algos.py (verl 0.9.1): ``agg_loss``,
``compute_policy_loss_vanilla`` (asymmetric clip_ratio_low/high, dual-clip clip_ratio_c),
``kl_penalty`` / ``kl_penalty_forward``; the entropy bonus of verl's dp_actor
(``policy_loss = pg_loss - entropy_coeff * agg_loss(entropy)``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turnstile.train import corrections as corr
from turnstile.train import losses

F64 = torch.float64


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def val(x: torch.Tensor) -> float:
    return float(x.detach())


# ----------------------------------------------------------------- loss aggregation


def test_agg_loss_modes() -> None:
    loss = t([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 7.0, 7.0], [8.0, 8.0, 8.0, 8.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])  # the third row is fully masked
    # token-mean: (1 + 2 + 3 + 4 + 5) / 5; token-sum: 15
    assert val(losses.agg_loss(loss, mask, "token-mean")) == pytest.approx(3.0)
    assert val(losses.agg_loss(loss, mask, "token-sum")) == pytest.approx(15.0)
    # seq-mean-token-sum: (6 + 9) / 2 rows (the empty row does not count)
    assert val(losses.agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(7.5)
    # seq-mean-token-mean: (6 / 3 + 9 / 2) / 2
    assert val(losses.agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(3.25)
    # Dr. GRPO: seq-mean-token-sum over a constant (default: the row width 4)
    norm = losses.agg_loss(loss, mask, "seq-mean-token-sum-norm")
    assert val(norm) == pytest.approx(7.5 / 4)
    fixed = losses.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10)
    assert val(fixed) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        losses.agg_loss(loss, mask, "seq-sum")


# ----------------------------------------------------------------- clipping


def test_asymmetric_clip_higher_and_dual_clip() -> None:
    # verl: loss = max(-A r, -A clip(r, 1 - low, 1 + high)); dual clip: where A < 0,
    # min(loss, -A c)
    ratio = t([[1.3, 0.7, 5.0, 1.1]])
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones_like(ratio)
    old = torch.zeros_like(ratio)
    logp = ratio.log()
    m = losses.policy_loss_matrix(logp, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # r 1.3, A 1: max(-1.3, -1.28) = -1.28; r 0.7, A -1: max(0.7, 0.8) = 0.8;
    # r 5, A -1: max(5, 1.2) = 5; r 1.1, A 1: -1.1
    np.testing.assert_allclose(m.numpy(), [[-1.28, 0.8, 5.0, -1.1]], atol=1e-12)
    dual = losses.policy_loss_matrix(logp, old, adv, clip_ratio_c=3.0)
    # symmetric 0.2: [-1.2, 0.8, min(5, 3) = 3, -1.1]
    np.testing.assert_allclose(dual.numpy(), [[-1.2, 0.8, 3.0, -1.1]], atol=1e-12)
    total = losses.policy_loss(logp, old, adv, mask, clip_ratio_c=3.0, loss_agg_mode="token-sum")
    assert val(total) == pytest.approx(-1.2 + 0.8 + 3.0 - 1.1)
    with pytest.raises(ValueError):
        losses.policy_loss_matrix(logp, old, adv, clip_ratio_c=1.0)
    # the deprecated-shape ppo_clip_loss is the token-mean of the symmetric form
    assert val(losses.ppo_clip_loss(logp, old, adv, mask)) == pytest.approx(
        (-1.2 + 0.8 + 5.0 - 1.1) / 4
    )


def test_clip_higher_changes_the_gradient_only_above_one_plus_low() -> None:
    logp = t([[math.log(1.25)]]).requires_grad_(True)
    adv, old, mask = t([[1.0]]), t([[0.0]]), t([[1.0]])
    sym = losses.policy_loss(logp, old, adv, mask)
    (g_sym,) = torch.autograd.grad(sym, logp)
    high = losses.policy_loss(logp, old, adv, mask, clip_ratio_high=0.28)
    (g_high,) = torch.autograd.grad(high, logp)
    # symmetric: r = 1.25 is clipped at 1.2 (no gradient); clip-higher 1.28: d(-r)/dlogp = -r
    assert val(g_sym) == 0.0
    assert val(g_high) == pytest.approx(-1.25)


# ----------------------------------------------------------------- entropy and KL terms


def test_entropy_bonus_and_kl_loss_terms() -> None:
    ent = t([[0.5, 1.5, 9.0]])
    mask = t([[1, 1, 0]])
    assert val(losses.entropy_bonus(ent, mask, 0.01)) == pytest.approx(-0.01 * 1.0)
    logp = t([[-1.0, -2.0, -3.0]]).requires_grad_(True)
    ref = t([[-1.5, -1.0, 0.0]])
    # k1 = logp - ref: [0.5, -1]; k2 = (logp - ref)^2 / 2: [0.125, 0.5];
    # k3 = e^(ref - logp) - 1 - (ref - logp): [e^-0.5 - 0.5, e^1 - 2]
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    assert val(losses.kl_loss(logp, ref, mask, "kl")) == pytest.approx(-0.25)
    assert val(losses.kl_loss(logp, ref, mask, "mse")) == pytest.approx(0.3125)
    assert val(losses.kl_loss(logp, ref, mask, "low_var_kl")) == pytest.approx(sum(k3) / 2)
    # k3+: k3's value, k2's gradient (logp - ref) / 2 tokens
    plus = losses.kl_loss(logp, ref, mask, "k3+")
    assert val(plus) == pytest.approx(sum(k3) / 2)
    (g,) = torch.autograd.grad(plus, logp)
    np.testing.assert_allclose(g.numpy(), [[0.25, -0.5, 0.0]])
    with pytest.raises(ValueError):
        losses.kl_values(logp, ref, "k4")


def test_proximal_kl_config_adds_entropy_and_kl_loss_terms() -> None:
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    old = logp.detach()
    ref = t([[-1.5, -1.0]])
    adv, mask = t([[1.0, 1.0]]), t([[1.0, 1.0]])
    ent = t([[0.5, 1.5]])
    base = losses.proximal_kl_loss(logp, old, old, ref, adv, mask)
    cfg = losses.ProximalKLConfig(entropy_coeff=0.1, kl_loss_coef=0.5, kl_loss_type="mse")
    full = losses.proximal_kl_loss(logp, old, old, ref, adv, mask, cfg, entropy=ent)
    expected = val(base.loss) - 0.1 * 1.0 + 0.5 * (0.125 + 0.5) / 2
    assert val(full.loss) == pytest.approx(expected)
    with pytest.raises(ValueError):
        losses.proximal_kl_loss(logp, old, old, ref, adv, mask, cfg)


# ----------------------------------------------------------------- sequence boundaries


def _two_samples() -> dict[str, torch.Tensor]:
    """Sample A: prompt + 2 policy tokens with delta 0.1; B: prompt + 2 with delta 0.5."""
    mask = t([[0, 1, 1], [0, 1, 1]])
    old = t([[0.0, -1.0, -1.0], [0.0, -2.0, -2.0]])
    ref = old - t([[0.0, 0.1, 0.1], [0.0, 0.5, 0.5]])
    return {"mask": mask, "old": old, "ref": ref}


def _pack(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1)


CU = torch.tensor([0, 3, 6], dtype=torch.int32)


def test_future_kl_cost_honours_packed_boundaries() -> None:
    s = _two_samples()
    padded = losses.future_kl_cost(s["old"], s["ref"], s["mask"])
    np.testing.assert_allclose(padded.numpy(), [[0, 0.2, 0.1], [0, 1.0, 0.5]], atol=1e-12)
    packed = losses.future_kl_cost(
        _pack(s["old"]), _pack(s["ref"]), _pack(s["mask"]), cu_seqlens=CU
    )
    # without the boundaries A's cost would be [0, 1.2, 1.1]
    np.testing.assert_allclose(packed.numpy(), [[0, 0.2, 0.1, 0, 1.0, 0.5]], atol=1e-12)
    # numpy and a flat row as well
    flat = losses.future_kl_cost(
        s["old"].numpy().ravel(),
        s["ref"].numpy().ravel(),
        s["mask"].numpy().ravel(),
        cu_seqlens=np.array([0, 3, 6]),
    )
    np.testing.assert_allclose(flat, [0, 0.2, 0.1, 0, 1.0, 0.5], atol=1e-12)


def test_sequence_corrections_honour_packed_boundaries() -> None:
    # rho = 3 on B only (B's two policy tokens: rho sqrt(3) each), A on-policy
    mask = t([[0, 1, 1], [0, 1, 1]])
    old = t([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    mu = old - t([[0.0, 0.0, 0.0], [0.0, 0.5 * math.log(3), 0.5 * math.log(3)]])
    p_old, p_mu, p_mask = _pack(old), _pack(mu), _pack(mask)
    assert corr.sequence_rs(old, mu, mask).tolist() == [True, False]
    assert corr.sequence_rs(p_old, p_mu, p_mask, cu_seqlens=CU).tolist() == [True, False]
    rho = np.exp(corr.sequence_log_ratio(p_old, p_mu, p_mask, cu_seqlens=CU).numpy())
    np.testing.assert_allclose(rho, [1.0, 3.0])
    geo = np.exp(corr.geometric_log_ratio(p_old, p_mu, p_mask, cu_seqlens=CU).numpy())
    np.testing.assert_allclose(geo, [1.0, math.sqrt(3)])
    tis = corr.sequence_tis(p_old, p_mu, p_mask, cu_seqlens=CU)
    np.testing.assert_allclose(tis.numpy(), [[0, 1, 1, 0, 2, 2]])
    mis = corr.sequence_mis_weights(p_old, p_mu, p_mask, cap=4.0, cu_seqlens=CU)
    np.testing.assert_allclose(mis.numpy(), [[0, 1, 1, 0, 3, 3]])
    broken = mu.clone()
    broken[1, 2] = old[1, 2] + 10.0  # rho = e^-10 < 1e-4 on B
    assert corr.veto(p_old, _pack(broken), p_mask, cu_seqlens=CU).tolist() == [True, False]
    rej = corr.rejection_mask(p_old, p_mu, p_mask, "seq_sum_k1", 2.0, cu_seqlens=CU)
    assert rej.tolist() == [[False, True, True, False, False, False]]


@pytest.mark.parametrize("correction", losses.CORRECTIONS)
@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_packed_proximal_kl_equals_padded(correction: str, mode: str) -> None:
    g = torch.Generator().manual_seed(3)
    lengths = [3, 5, 2]
    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    mask = (valid & (torch.arange(width)[None, :] > 0)).to(F64)
    old = -torch.rand(3, width, generator=g, dtype=F64) * 2
    mu = old + 0.4 * torch.randn(3, width, generator=g, dtype=F64)
    ref = old - torch.rand(3, width, generator=g, dtype=F64)
    adv = torch.randn(3, 1, generator=g, dtype=F64).expand(3, width).contiguous()
    logp = (old + 0.1 * torch.randn(3, width, generator=g, dtype=F64)).requires_grad_(True)
    cfg = losses.ProximalKLConfig(
        beta=0.2, bound=0.8, correction=correction, loss_agg_mode=mode, cap=1.5
    )
    idx = torch.tensor([0, 1, 0])  # rows 0 and 2 are one rollout
    padded = losses.proximal_kl_loss(logp, old, mu, ref, adv, mask, cfg, rollout_index=idx)
    cu = torch.tensor([0, 3, 8, 10])

    def pack(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]

    packed_logp = pack(logp.detach()).requires_grad_(True)
    packed = losses.proximal_kl_loss(
        packed_logp,
        pack(old),
        pack(mu),
        pack(ref),
        pack(adv),
        pack(mask),
        cfg,
        cu_seqlens=cu,
        rollout_index=idx,
    )
    # seq-mean-token-sum-norm divides by the row width, which the unpacked rows share
    assert val(packed.loss) == pytest.approx(val(padded.loss), abs=1e-12)
    torch.testing.assert_close(packed.shaped_advantages, pack(padded.shaped_advantages))
    torch.testing.assert_close(packed.weights, pack(padded.weights))
    (g_pad,) = torch.autograd.grad(padded.loss, logp)
    (g_pack,) = torch.autograd.grad(packed.loss, packed_logp)
    torch.testing.assert_close(g_pack, pack(g_pad))


def test_future_kl_cost_runs_on_across_a_rollouts_samples() -> None:
    # the notes' deltas [0.2, -0.1, 0.5, 0.0] -> c = [0.6, 0.4, 0.5, 0.0], with the rollout
    # split after its second token into two samples (rows), given out of order
    old = t([[0.0, 0.5, 0.0], [0.0, 0.2, -0.1]])  # row 0: sample 1, row 1: sample 0
    mask = t([[0, 1, 1], [0, 1, 1]])
    ref = torch.zeros_like(old)
    cost = losses.future_kl_cost(
        old, ref, mask, rollout_index=[7, 7], sample_index=torch.tensor([1, 0])
    )
    np.testing.assert_allclose(cost.numpy(), [[0, 0.5, 0.0], [0, 0.6, 0.4]], atol=1e-12)
    # different rollouts do not mix; bounded after summing across samples
    alone = losses.future_kl_cost(old, ref, mask, rollout_index=[1, 2])
    np.testing.assert_allclose(alone.numpy(), [[0, 0.5, 0.0], [0, 0.1, -0.1]], atol=1e-12)
    bounded = losses.future_kl_cost(old, ref, mask, 0.45, rollout_index=[7, 7], sample_index=[1, 0])
    np.testing.assert_allclose(bounded.numpy(), [[0, 0.45, 0.0], [0, 0.45, 0.4]], atol=1e-12)


def test_icepop_bounds_are_its_own() -> None:
    # a token with rho 3: TIS (cap 2) -> 2; IcePop's default band [0.5, 5] keeps it at 3
    old, mu, mask = t([[math.log(3.0), 0.0]]), t([[0.0, 0.0]]), t([[1.0, 1.0]])
    cfg = losses.ProximalKLConfig(correction="icepop", cap=2.0)
    out = losses.proximal_kl_loss(old.clone().requires_grad_(True), old, mu, old, mask, mask, cfg)
    np.testing.assert_allclose(out.weights.numpy(), [[3.0, 1.0]])
    narrow = losses.ProximalKLConfig(correction="icepop", icepop_low=0.9, icepop_high=2.0)
    out = losses.proximal_kl_loss(
        old.clone().requires_grad_(True), old, mu, old, mask, mask, narrow
    )
    np.testing.assert_allclose(out.weights.numpy(), [[0.0, 1.0]])
    assert corr.DEFAULT_ICEPOP_LOW == 0.5 and corr.DEFAULT_ICEPOP_HIGH == 5.0
