"""GRPO, GDPO and MRTPO advantages against the reference numbers of the method notes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from turnstile.train import advantages as adv

TOL = 1e-3
# A fresh interpreter importing pyarrow, numpy and the CLI takes a few seconds; 120 s
# covers a loaded machine.
IMPORT_TIMEOUT_S = 120
ONE_GROUP = np.array([[1, 0], [1, 0], [0, 1], [0, 0]], dtype=float)


def test_grpo_sums_rewards_then_normalises_the_group() -> None:
    a = adv.grpo_advantages(ONE_GROUP, ["g"] * 4)
    np.testing.assert_allclose(a, [0.5, 0.5, 0.5, -1.5], atol=TOL)


def test_gdpo_per_reward_before_and_after_batch_norm() -> None:
    per = adv.gdpo_reward_advantages(ONE_GROUP, ["g"] * 4)
    np.testing.assert_allclose(per[:, 0], [0.866, 0.866, -0.866, -0.866], atol=TOL)
    np.testing.assert_allclose(per[:, 1], [-0.5, -0.5, 1.5, -0.5], atol=TOL)
    before = adv.gdpo_advantages(ONE_GROUP, ["g"] * 4, normalize_batch=False)
    np.testing.assert_allclose(before, [0.3660, 0.3660, 0.6340, -1.3660], atol=TOL)
    after = adv.gdpo_advantages(ONE_GROUP, ["g"] * 4)
    np.testing.assert_allclose(after, [0.3981, 0.3981, 0.6896, -1.4858], atol=TOL)


def test_two_groups_where_grpo_cannot_tell_them_apart_but_gdpo_can() -> None:
    rewards = np.array([[0, 0], [0, 1], [0, 0], [1, 1]], dtype=float)
    groups = ["a", "a", "b", "b"]
    np.testing.assert_allclose(
        adv.grpo_advantages(rewards, groups), [-0.7071, 0.7071, -0.7071, 0.7071], atol=TOL
    )
    np.testing.assert_allclose(
        adv.gdpo_advantages(rewards, groups, normalize_batch=False),
        [-0.7071, 0.7071, -1.4142, 1.4142],
        atol=TOL,
    )


def test_nan_rewards_count_as_zero_and_singletons_get_zero() -> None:
    with_nan = np.array([[1, np.nan], [1, 0], [0, 1], [0, 0]])
    replaced = np.array([[1, 0], [1, 0], [0, 1], [0, 0]], dtype=float)
    np.testing.assert_allclose(
        adv.gdpo_advantages(with_nan, ["g"] * 4), adv.gdpo_advantages(replaced, ["g"] * 4)
    )
    assert adv.grpo_advantages([3.0], ["alone"]).tolist() == [0.0]
    # a reward constant within its group contributes nothing
    assert adv.gdpo_reward_advantages([[1.0, 2.0], [1.0, 3.0]], ["g", "g"])[:, 0].tolist() == [
        0.0,
        0.0,
    ]


def test_reward_weights_scale_each_reward() -> None:
    a = adv.gdpo_advantages(ONE_GROUP, ["g"] * 4, weights=[1.0, 0.0], normalize_batch=False)
    np.testing.assert_allclose(a, [0.866, 0.866, -0.866, -0.866], atol=TOL)
    with pytest.raises(ValueError):
        adv.grpo_advantages(ONE_GROUP, ["g"] * 4, weights=[1.0])


def test_reward_matrix_orders_names_and_marks_missing() -> None:
    m, names = adv.reward_matrix([{"b": 1.0, "a": 2.0}, {"a": 0.5}])
    assert names == ["a", "b"]
    assert m[0].tolist() == [2.0, 1.0] and m[1, 0] == 0.5 and np.isnan(m[1, 1])


def test_mrtpo_weights_and_token_advantages_preserve_the_total() -> None:
    d1 = [0.01, 0.30, 0.05, 0.04]
    d2 = [0.20, 0.01, 0.01, 0.18]
    np.testing.assert_allclose(adv.mrtpo_token_weights(d1), [0.1, 3.0, 0.5, 0.4], atol=TOL)
    np.testing.assert_allclose(adv.mrtpo_token_weights(d2), [2.0, 0.1, 0.1, 1.8], atol=TOL)
    a_t = adv.mrtpo_token_advantages([0.8660, -0.5], [d1, d2])
    np.testing.assert_allclose(a_t, [-0.9134, 2.5481, 0.3830, -0.5536], atol=TOL)
    assert a_t.sum() == pytest.approx(1.4641, abs=TOL)
    assert a_t.sum() == pytest.approx(4 * 0.3660, abs=TOL)


def test_mrtpo_floor_and_temperature() -> None:
    d = [0.01, 0.30, 0.05, 0.04]
    np.testing.assert_allclose(adv.mrtpo_token_weights(d, floor=0.0), np.ones(4))
    half = adv.mrtpo_token_weights(d, floor=0.5)
    np.testing.assert_allclose(half, 0.5 + 0.5 * np.array([0.1, 3.0, 0.5, 0.4]), atol=TOL)
    flat = adv.mrtpo_token_weights(d, temperature=1e6)
    np.testing.assert_allclose(flat, np.ones(4), atol=1e-3)
    sharp = adv.mrtpo_token_weights(d, temperature=0.5)
    assert sharp.sum() == pytest.approx(4.0) and sharp[1] > 3.0
    np.testing.assert_allclose(adv.mrtpo_token_weights([0, 0, 0]), np.ones(3))
    with pytest.raises(ValueError):
        adv.mrtpo_token_weights(d, temperature=0)


def test_mrtpo_with_constant_relevance_equals_gdpo() -> None:
    rewards = np.array([[1, 0], [1, 0], [0, 1], [0, 0], [1, 1], [0, 0]], dtype=float)
    groups = ["a"] * 4 + ["b"] * 2
    per = adv.gdpo_reward_advantages(rewards, groups)
    lengths = [3, 5, 2, 4, 1, 6]
    rel = [[np.full(n, 0.2), np.full(n, 0.05)] for n in lengths]
    before = adv.mrtpo_batch(per, rel, normalize_batch=False)
    after = adv.mrtpo_batch(per, rel)
    gdpo_before = adv.gdpo_advantages(rewards, groups, normalize_batch=False)
    gdpo_after = adv.gdpo_advantages(rewards, groups)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(before[i], np.full(n, gdpo_before[i]), atol=1e-9)
        np.testing.assert_allclose(after[i], np.full(n, gdpo_after[i]), atol=1e-9)
    # a reward without relevance (no verifier info) is spread uniformly
    none = adv.mrtpo_batch(
        per, [[None, None] for _ in lengths], normalize_batch=False, num_tokens=lengths
    )
    for i in range(len(lengths)):
        np.testing.assert_allclose(none[i], before[i])


def test_spread_over_mask_aligns_with_the_loss_mask() -> None:
    mask = np.array([0, 0, 1, 1, 0, 1], dtype=np.int8)
    assert adv.spread_over_mask(2.0, mask).tolist() == [0, 0, 2, 2, 0, 2]
    assert adv.spread_over_mask([1, 2, 3], mask).tolist() == [0, 0, 1, 2, 0, 3]
    with pytest.raises(ValueError):
        adv.spread_over_mask([1, 2], mask)


@settings(max_examples=60, deadline=None)
@given(
    arrays(
        np.float64,
        st.tuples(st.integers(2, 12), st.integers(1, 3)),
        elements=st.floats(-5, 5, allow_nan=False),
    ),
    st.integers(1, 4),
)
def test_group_advantages_are_centred_in_every_group(rewards: np.ndarray, n_groups: int) -> None:
    groups = [i % n_groups for i in range(rewards.shape[0])]
    for a in (
        adv.grpo_advantages(rewards, groups),
        adv.gdpo_advantages(rewards, groups, normalize_batch=False),
    ):
        assert a.shape == (rewards.shape[0],) and np.isfinite(a).all()
        for g in set(groups):
            assert abs(a[np.array(groups) == g].sum()) < 1e-6
    final = adv.gdpo_advantages(rewards, groups)
    assert abs(final.mean()) < 1e-6


@settings(max_examples=60, deadline=None)
@given(
    arrays(np.float64, st.integers(1, 30), elements=st.floats(0, 0.7, allow_nan=False)),
    st.floats(0, 1),
    st.floats(0.1, 10),
)
def test_mrtpo_weights_always_sum_to_the_length(d: np.ndarray, floor: float, temp: float) -> None:
    w = adv.mrtpo_token_weights(d, floor=floor, temperature=temp)
    assert w.shape == d.shape and (w >= 0).all()
    assert w.sum() == pytest.approx(d.size, rel=1e-5)


def test_the_numpy_parts_import_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import turnstile.train, turnstile.train.rescore, turnstile.train.corrections\n"
        "import turnstile.train.jsd, turnstile.train.dataset, turnstile.cli.main\n"
        "from turnstile.train import gdpo_advantages\n"
        "print(round(float(gdpo_advantages([[1, 0], [0, 1], [0, 0]], [0, 0, 0])[0]), 3))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=IMPORT_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(
        round(float(adv.gdpo_advantages([[1, 0], [0, 1], [0, 0]], [0, 0, 0])[0]), 3)
    )
