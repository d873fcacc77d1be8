"""Proximal KL's gradient against the exact one, on a toy where every sequence is enumerated.

The toy: vocabulary of 3, sequences ``(y0, e, y2)``: ``y0`` from the policy, ``e`` an
environment token from a fixed distribution (loss mask 0), ``y2`` from the policy given
``(y0, e)``. The policy and the reference are tabular softmaxes. The objective is

    J(theta) = E_y[A(y)] - beta * KL(pi_theta(y) || pi_ref(y))

(the environment's factor cancels in the KL). Its gradient is taken by central finite
differences of the enumerated ``J``; the Proximal KL loss (on-policy: ``pi_old = mu =
pi_theta``) is differentiated by autograd on every sequence and averaged with weights
``pi(y)``. With the token-mean over the two policy tokens, ``E[grad loss] = -grad J / 2``.
"""

from __future__ import annotations

import itertools

import torch

from turnstile.train import losses

V = 3
F64 = torch.float64
BETA = 0.7
FD_STEP = 1e-6
SEQUENCES = list(itertools.product(range(V), repeat=3))


def toy() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "theta0": torch.randn(V, generator=g, dtype=F64),
        "theta2": torch.randn(V, V, V, generator=g, dtype=F64),
        "ref0": torch.randn(V, generator=g, dtype=F64),
        "ref2": torch.randn(V, V, V, generator=g, dtype=F64),
        "env": torch.softmax(torch.randn(V, generator=g, dtype=F64), 0),
        "reward": torch.randn(V, V, V, generator=g, dtype=F64),
    }


def _flat(theta0: torch.Tensor, theta2: torch.Tensor) -> torch.Tensor:
    return torch.cat([theta0.reshape(-1), theta2.reshape(-1)])


def _split(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return flat[:V], flat[V:].reshape(V, V, V)


def token_logps(
    theta0: torch.Tensor, theta2: torch.Tensor, env: torch.Tensor, y: tuple[int, ...]
) -> torch.Tensor:
    """``log p`` of the three tokens of ``y`` (the environment's from its fixed law)."""
    return torch.stack(
        [
            torch.log_softmax(theta0, 0)[y[0]],
            torch.log(env[y[1]]),
            torch.log_softmax(theta2[y[0], y[1]], 0)[y[2]],
        ]
    )


def objective(flat: torch.Tensor, t: dict[str, torch.Tensor]) -> float:
    theta0, theta2 = _split(flat)
    total = 0.0
    for y in SEQUENCES:
        lp = token_logps(theta0, theta2, t["env"], y)
        lr = token_logps(t["ref0"], t["ref2"], t["env"], y)
        p = float(lp.sum().exp())
        total += p * (float(t["reward"][y]) - BETA * float((lp - lr).sum()))
    return total


def finite_difference_gradient(t: dict[str, torch.Tensor]) -> torch.Tensor:
    flat = _flat(t["theta0"], t["theta2"])
    grad = torch.zeros_like(flat)
    for i in range(flat.numel()):
        step = torch.zeros_like(flat)
        step[i] = FD_STEP
        grad[i] = (objective(flat + step, t) - objective(flat - step, t)) / (2 * FD_STEP)
    return grad


def expected_loss_gradient(
    t: dict[str, torch.Tensor], kl_kind: str | None = None, split: bool | None = None
) -> torch.Tensor:
    """``sum_y pi(y) grad loss(y)`` with Proximal KL (or, with ``kl_kind``, GRPO plus the
    KL estimator as a loss term, verl's use_kl_loss). ``split`` lays each sequence out as
    two samples of one rollout, ``(y0, e)`` and ``(e, y2)``, with (True) or without
    (False) telling the loss that they are one rollout."""
    theta0 = t["theta0"].clone().requires_grad_(True)
    theta2 = t["theta2"].clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    total = torch.zeros(V + V**3, dtype=F64)
    for y in SEQUENCES:
        lp = token_logps(theta0, theta2, t["env"], y)[None]
        lr = token_logps(t["ref0"], t["ref2"], t["env"], y)[None]
        adv = torch.full_like(lp, float(t["reward"][y]))
        old = lp.detach()
        if kl_kind is None:
            cfg = losses.ProximalKLConfig(beta=BETA, correction="none")
        else:
            cfg = losses.ProximalKLConfig(
                correction="none", kl_loss_coef=BETA, kl_loss_type=kl_kind
            )
        if split is None:
            loss = losses.proximal_kl_loss(lp, old, old, lr, adv, mask, cfg).loss
        else:
            rows = [[0, 1], [1, 2]]
            loss = losses.proximal_kl_loss(
                lp[0, rows],
                old[0, rows],
                old[0, rows],
                lr[0, rows],
                adv[0, rows],
                torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64),
                cfg,
                rollout_index=[0, 0] if split else None,
            ).loss
        g0, g2 = torch.autograd.grad(loss, (theta0, theta2))
        total += float(old.sum().exp()) * _flat(g0, g2)
    return total


def test_proximal_kl_gradient_is_the_exact_kl_regularised_gradient() -> None:
    t = toy()
    exact = finite_difference_gradient(t)
    estimated = -2.0 * expected_loss_gradient(t)
    assert float(exact.abs().max()) > 0.05  # the toy's gradient is not trivially small
    torch.testing.assert_close(estimated, exact, atol=1e-7, rtol=0)


def test_kl_estimators_as_a_loss_do_not_give_the_sequence_kl_gradient() -> None:
    # verl's use_kl_loss adds beta * agg(k(logp, ref)); differentiated on-policy, none of
    # k1/k2/k3 is the gradient of the sequence KL (k1's expected gradient is 0; k2 and k3
    # miss the future tokens' KL), so the total gradient differs from the exact one
    t = toy()
    exact = finite_difference_gradient(t)
    for kind in ("k1", "k2", "k3"):
        estimated = -2.0 * expected_loss_gradient(t, kl_kind=kind)
        assert float((estimated - exact).abs().max()) > 1e-2, kind


def test_the_future_cost_runs_across_a_split_rollouts_samples() -> None:
    t = toy()
    exact = finite_difference_gradient(t)
    torch.testing.assert_close(
        -2.0 * expected_loss_gradient(t, split=True), exact, atol=1e-7, rtol=0
    )
    # cut at the sample boundary, the first token misses the second one's KL
    cut = -2.0 * expected_loss_gradient(t, split=False)
    assert float((cut - exact).abs().max()) > 1e-2
