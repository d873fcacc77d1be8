"""Off-policy corrections, KL estimators, JSD and the Proximal KL loss (reference numbers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from turnstile.train import corrections as corr
from turnstile.train import jsd, losses

TOL = 1e-3
RHO = np.array([[1.25, 0.8, 1.0, 5.0]])
MASK = np.ones_like(RHO)


def _logs() -> tuple[np.ndarray, np.ndarray]:
    return np.log(RHO), np.zeros_like(RHO)  # log pi_old, log mu


def test_token_and_sequence_tis_mis_and_geometric_ratio() -> None:
    old, mu = _logs()
    np.testing.assert_allclose(corr.token_tis(old, mu, MASK), [[1.25, 0.8, 1.0, 2.0]], atol=TOL)
    assert math.exp(corr.sequence_log_ratio(old, mu, MASK)[0]) == pytest.approx(5.0, abs=TOL)
    np.testing.assert_allclose(corr.sequence_tis(old, mu, MASK), [[2.0] * 4], atol=TOL)
    assert corr.sequence_rs(old, mu, MASK, 0.5, 2.0).tolist() == [False]
    assert corr.sequence_rs(old, mu, MASK, 0.5, 6.0).tolist() == [True]
    geo = math.exp(corr.geometric_log_ratio(old, mu, MASK)[0])
    assert geo == pytest.approx(1.4953, abs=TOL)
    assert corr.sequence_rs(old, mu, MASK, 0.5, 2.0, geometric=True).tolist() == [True]
    # the old name still works, with a deprecation warning (it was always rejection)
    with pytest.warns(DeprecationWarning, match="sequence_rs"):
        assert corr.sequence_mis(old, mu, MASK, 0.5, 2.0).tolist() == [False]


def test_seq_mis_keeps_the_weight_of_a_kept_sequence() -> None:
    # Seq-MIS = rho_seq * 1{rho_seq <= C}: rho 1.8, C 2 -> 1.8 (rejection sampling: 1.0);
    # rho 3 -> 0
    mask = np.ones((2, 2))
    old = np.log(np.array([[1.5, 1.2], [1.5, 2.0]]))
    w = corr.sequence_mis_weights(old, np.zeros_like(old), mask, cap=2.0)
    np.testing.assert_allclose(w, [[1.8, 1.8], [0.0, 0.0]], atol=1e-12)
    assert corr.sequence_rs(old, np.zeros_like(old), mask, 0.5, 2.0).tolist() == [True, False]


def test_icepop_veto_and_masking() -> None:
    old, mu = _logs()
    np.testing.assert_allclose(corr.icepop(old, mu, MASK, 0.9, 2.0), [[1.25, 0.0, 1.0, 0.0]])
    assert corr.veto(old, mu, MASK).tolist() == [True]
    broken = old.copy()
    broken[0, 2] = math.log(1e-5)
    assert corr.veto(broken, mu, MASK).tolist() == [False]
    # masked-out positions (NaN behaviour logprobs there) change nothing
    mask = np.array([[1, 1, 1, 0]])
    mu_nan = mu.copy()
    mu_nan[0, 3] = np.nan
    assert corr.token_tis(old, mu_nan, mask).tolist() == [[1.25, 0.8, 1.0, 0.0]]
    assert math.exp(corr.sequence_log_ratio(old, mu_nan, mask)[0]) == pytest.approx(1.0)


def test_log_ratios_are_clamped() -> None:
    old = np.array([[100.0, -100.0]])
    lr = corr.log_ratio(old, np.zeros_like(old), np.ones_like(old))
    assert lr.tolist() == [[20.0, -20.0]]


def test_corrections_on_torch_match_numpy_and_are_detached() -> None:
    old, mu = _logs()
    t_old = torch.tensor(old, requires_grad=True)
    w = corr.token_tis(t_old, torch.tensor(mu), torch.tensor(MASK))
    assert not w.requires_grad
    np.testing.assert_allclose(w.numpy(), corr.token_tis(old, mu, MASK))
    assert corr.sequence_rs(t_old, torch.tensor(mu), torch.tensor(MASK)).tolist() == [False]


def test_kl_estimators() -> None:
    assert corr.kl_k1(-1.0, -1.5) == pytest.approx(0.5)
    assert corr.kl_k2(-1.0, -1.5) == pytest.approx(0.125)
    assert float(corr.kl_k3(np.float64(-1.0), -1.5)) == pytest.approx(0.10653, abs=1e-5)
    t = corr.kl_k3(torch.tensor(-1.0), torch.tensor(-1.5))
    assert float(t) == pytest.approx(0.10653, abs=1e-5)


def test_jsd_full_bucketed_and_bound() -> None:
    p = np.array([0.7, 0.2, 0.05, 0.03, 0.02])
    q = np.array([0.3, 0.6, 0.05, 0.01, 0.04])
    assert float(jsd.jsd(p, q)) == pytest.approx(0.09778, abs=1e-4)
    b = jsd.bucketed_jsd(p[:3], q[:3])
    assert b.value == pytest.approx(0.09347, abs=1e-4)
    assert b.upper == pytest.approx(0.12812, abs=1e-4)
    assert b.value <= float(jsd.jsd(p, q)) <= b.upper
    from_lp = jsd.bucketed_jsd_from_logprobs(
        {0: math.log(0.7), 1: math.log(0.2), 2: math.log(0.05), 9: -1.0},
        {0: math.log(0.3), 1: math.log(0.6), 2: math.log(0.05)},
    )
    assert from_lp.value == pytest.approx(b.value, abs=1e-9)
    logits = np.log(p)
    assert float(jsd.jsd_from_logits(logits + 3.0, np.log(q))) == pytest.approx(0.09778, abs=1e-4)


@settings(max_examples=80, deadline=None)
@given(
    arrays(np.float64, 12, elements=st.floats(1e-3, 1.0)),
    arrays(np.float64, 12, elements=st.floats(1e-3, 1.0)),
    st.integers(1, 11),
)
def test_the_bucket_bound_always_holds(a: np.ndarray, b: np.ndarray, k: int) -> None:
    p, q = a / a.sum(), b / b.sum()
    full = float(jsd.jsd(p, q))
    shared = np.argsort(-p)[:k]
    r = jsd.bucketed_jsd(p[shared], q[shared])
    assert r.value - 1e-12 <= full <= r.upper + 1e-12
    assert 0.0 <= r.value <= r.upper <= math.log(2) + 1e-12


def test_future_kl_cost_and_shaped_advantages() -> None:
    delta = np.array([0.2, -0.1, 0.5, 0.0])
    ref = np.zeros(4)
    mask = np.ones(4)
    cost = losses.future_kl_cost(delta, ref, mask)
    np.testing.assert_allclose(cost, [0.6, 0.4, 0.5, 0.0], atol=1e-9)
    np.testing.assert_allclose(1.0 - 0.1 * cost, [0.94, 0.96, 0.95, 1.0], atol=1e-9)
    bounded = losses.future_kl_cost(delta, ref, mask, bound=0.45)
    np.testing.assert_allclose(1.0 - 0.1 * bounded, [0.955, 0.96, 0.955, 1.0], atol=1e-9)
    # the sum runs over later policy tokens only, across turns (prompt tokens skipped)
    turns = losses.future_kl_cost(
        np.array([0.2, 9.0, -0.1, 0.5]), np.zeros(4), np.array([1, 0, 1, 1])
    )
    np.testing.assert_allclose(turns, [0.6, 0.0, 0.4, 0.5], atol=1e-9)


def test_proximal_kl_loss_shapes_the_advantage_in_torch() -> None:
    old = torch.tensor([[0.2, -0.1, 0.5, 0.0]], dtype=torch.float64)
    out = losses.proximal_kl_loss(
        old.clone().requires_grad_(True),
        old,
        old,
        torch.zeros_like(old),
        torch.ones_like(old),
        torch.ones_like(old),
        losses.ProximalKLConfig(beta=0.1, bound=0.45),
    )
    np.testing.assert_allclose(out.shaped_advantages.numpy(), [[0.955, 0.96, 0.955, 1.0]])
    assert float(out.loss.detach()) == pytest.approx(-np.mean([0.955, 0.96, 0.955, 1.0]))


def _ppo_reference(
    logp: torch.Tensor, old: torch.Tensor, a: torch.Tensor, m: torch.Tensor, eps: float = 0.2
) -> torch.Tensor:
    ratio = torch.exp(logp - old)
    s = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps, 1 + eps) * a)
    return -(s * m).sum() / m.sum()


def test_proximal_kl_reduces_to_grpo_ppo_when_mu_is_old_and_beta_is_zero() -> None:
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 7, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(3, 7, generator=g, dtype=torch.float64)
    ref = old - torch.rand(3, 7, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 7)
    mask = (torch.rand(3, 7, generator=g) > 0.3).to(torch.float64)
    for correction in losses.CORRECTIONS:
        out = losses.proximal_kl_loss(
            logp, old, old, ref, adv, mask, losses.ProximalKLConfig(beta=0.0, correction=correction)
        )
        expected = _ppo_reference(logp, old, adv, mask)
        assert float(out.loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
        (grad,) = torch.autograd.grad(out.loss, logp)
        (grad_ref,) = torch.autograd.grad(expected, logp)
        torch.testing.assert_close(grad, grad_ref)
    # with a stale behaviour policy the TIS weights change the loss
    stale = losses.proximal_kl_loss(logp, old, old - 0.5, ref, adv, mask)
    plain = float(_ppo_reference(logp, old, adv, mask).detach())
    assert float(stale.loss.detach()) != pytest.approx(plain)
    assert float(stale.weights.max()) <= corr.DEFAULT_TIS_CAP


def test_sequence_rs_rejection_changes_the_denominator() -> None:
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    mu = old.clone()
    mu[1] = -2.0  # sequence 1: prod rho = e^6, rejected
    adv = torch.ones(2, 3, dtype=torch.float64)
    out = losses.proximal_kl_loss(
        logp,
        old,
        mu,
        old,
        adv,
        torch.ones(2, 3),
        losses.ProximalKLConfig(correction="sequence_rs"),
    )
    assert out.mask.tolist() == [[True] * 3, [False] * 3]
    assert float(out.loss.detach()) == pytest.approx(-1.0)
    with pytest.raises(ValueError):
        losses.proximal_kl_loss(
            logp, old, mu, old, adv, torch.ones(2, 3), losses.ProximalKLConfig(correction="bogus")
        )


def test_kl_penalty_is_a_token_mean() -> None:
    logp = torch.full((1, 4), -1.0, requires_grad=True)
    ref = torch.full((1, 4), -1.5)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    k3 = float(losses.kl_penalty(logp, ref, mask, "k3").detach())
    assert k3 == pytest.approx(0.10653, abs=1e-5)
    assert float(losses.kl_penalty(logp, ref, mask, "k1").detach()) == pytest.approx(0.5)


def test_stale_tokens_leave_the_corrections_and_the_proximal_kl_loss() -> None:
    versions = np.array([[-1, 3, 3, 5, 5]])
    mask = np.array([[0, 1, 1, 1, 1]])
    assert corr.token_staleness(versions, 5, mask).tolist() == [[0, 2, 2, 0, 0]]
    fresh = corr.fresh_token_mask(mask, versions, 5, 1)
    assert fresh.tolist() == [[0, 0, 0, 1, 1]]
    # The sequence ratio runs over the fresh tokens only.
    old = np.array([[0.0, -1.0, -1.0, -1.0, -1.0]])
    mu = np.array([[0.0, -3.0, -3.0, -1.5, -1.5]])
    assert corr.sequence_log_ratio(old, mu, fresh)[0] == pytest.approx(1.0)
    assert corr.sequence_log_ratio(old, mu, mask)[0] == pytest.approx(5.0)
    t = torch.tensor
    logp = t(old, requires_grad=True)
    args = (logp, t(old), t(mu), t(old), t(np.ones_like(old)), t(mask))
    cfg = losses.ProximalKLConfig(correction="sequence_tis", max_token_staleness=1)
    out = losses.proximal_kl_loss(*args, cfg, behavior_versions=t(versions), current_version=5)
    assert out.mask.tolist() == [[False, False, False, True, True]]
    assert out.weights[0, 1:3].tolist() == [0.0, 0.0]
    everything = losses.proximal_kl_loss(*args, losses.ProximalKLConfig(correction="sequence_tis"))
    assert everything.mask.sum() == 4
    with pytest.raises(ValueError, match="behavior_versions"):
        losses.proximal_kl_loss(*args, cfg)
