"""DAPO's overlong shaping and filtering, dynamic sampling, KL in the reward.

Formulas: verl/workers/reward_manager/dapo.py (verl 0.9.1): ``expected_len = max_resp_len -
overlong_buffer.len``, ``exceed_len = length - expected_len``, ``overlong_reward =
min(-exceed_len / overlong_buffer.len * penalty_factor, 0)``; verl's ``filter_groups``
(keep a group when the std of its metric is > 0 or it has one member); verl's
``apply_kl_penalty`` (``token_level_rewards = scores - beta * kl``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.unit.test_train_batches import sample
from turnstile.train import batches, shaping


def test_overlong_penalty_ramp() -> None:
    # max 20, buffer 4: up to 16 no penalty; 18 -> -(2 / 4) * 1.0; 20 -> -1.0
    got = shaping.overlong_penalty([10, 16, 18, 20], 20, 4)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0])
    np.testing.assert_allclose(shaping.overlong_penalty([19], 20, 4, 0.5), [-0.375])
    with pytest.raises(ValueError):
        shaping.overlong_penalty([1], 20, 0)


def test_overlong_reward_counts_a_split_rollouts_tokens() -> None:
    samples = [
        sample("A", 0, "g", [0, 1, 1, 1], {"r": 1.0}),
        sample("A", 1, "g", [0, 1, 1, 0, 1], {"r": 1.0}),  # A: 6 loss tokens
        sample("B", 0, "g", [0, 1, 1], {"r": 0.0}),  # B: 2
    ]
    penalty = shaping.add_overlong_reward(samples, max_response_length=6, overlong_buffer_len=2)
    # A: exceed 6 - 4 = 2 -> -1.0; B: 0
    np.testing.assert_allclose(penalty, [-1.0, 0.0])
    assert samples[1].rewards == {"r": 1.0, "overlong": -1.0}
    # GRPO sums it: A 0, B 0 -> a group with no spread
    np.testing.assert_allclose(batches.assign_grpo(samples), [0.0, 0.0, 0.0])


def test_overlong_filter_and_dynamic_sampling() -> None:
    samples = [
        sample("A", 0, "g", [0, 1], {"r": 1.0}),
        sample("A", 1, "g", [0, 1], {"r": 1.0}),
        sample("B", 0, "g", [0, 1], {"r": 1.0}),  # g: all 1 -> dropped
        sample("C", 0, "h", [0, 1], {"r": 1.0}),
        sample("D", 0, "h", [0, 1], {"r": 0.0}),  # h: spread -> kept
        sample("E", 0, "k", [0, 1], {"r": 0.3}),  # k: a group of one -> kept
    ]
    kept = shaping.dynamic_sampling(samples)
    assert [s.rollout_id for s in kept] == ["C", "D", "E"]
    # on a weighted sum of rewards: g has spread in the sum of x and y
    two = [
        sample("A", 0, "g", [1], {"x": 1.0, "y": 0.0}),
        sample("B", 0, "g", [1], {"x": 0.0, "y": 1.0}),
    ]
    assert shaping.dynamic_sampling(two) == []
    assert len(shaping.dynamic_sampling(two, weights=[1.0, 0.5])) == 2
    assert [s.key for s in shaping.overlong_filter(samples, {"A", "D"})] == [
        ("B", 0),
        ("C", 0),
        ("E", 0),
    ]


def test_kl_in_reward() -> None:
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.5, -1.0], [0.0, -1.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    # k1 = old - ref: row 0: 0.5 - 1.0 = -0.5; row 1: 0 (the third token is masked)
    np.testing.assert_allclose(shaping.kl_reward_penalty(old, ref, mask), [-0.5, 0.0])
    # low_var_kl: e^(ref - old) - 1 - (ref - old)
    k3 = (math.exp(-0.5) + 0.5 - 1) + (math.exp(1.0) - 1 - 1.0)
    np.testing.assert_allclose(shaping.kl_reward_penalty(old, ref, mask, "low_var_kl")[0], k3)
    samples = [
        sample("A", 0, "g", [0, 1, 1], {"r": 1.0}),
        sample("A", 1, "g", [0, 1, 0], {"r": 1.0}),
        sample("B", 0, "g", [0, 1, 1], {"r": 1.0}),
    ]
    added = shaping.add_kl_reward(samples, {("A", 0): 0.4, ("A", 1): 0.2, ("B", 0): 0.1}, 0.5)
    np.testing.assert_allclose(added, [-0.3, -0.05])
    assert samples[1].rewards["kl_penalty"] == pytest.approx(-0.3)
    with pytest.raises(ValueError):
        shaping.kl_reward_penalty(old, ref, mask, "k9")
