"""GRPO, GDPO and MRTPO advantages against the reference numbers of the method notes."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
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
    np.testing.assert_allclose(
        adv.mrtpo_token_weights(d1, floor=1.0, max_weight=None), [0.1, 3.0, 0.5, 0.4], atol=TOL
    )
    np.testing.assert_allclose(
        adv.mrtpo_token_weights(d2, floor=1.0, max_weight=None), [2.0, 0.1, 0.1, 1.8], atol=TOL
    )
    a_t = adv.mrtpo_token_advantages([0.8660, -0.5], [d1, d2], floor=1.0, max_weight=None)
    np.testing.assert_allclose(a_t, [-0.9134, 2.5481, 0.3830, -0.5536], atol=TOL)
    assert a_t.sum() == pytest.approx(1.4641, abs=TOL)
    assert a_t.sum() == pytest.approx(4 * 0.3660, abs=TOL)


def test_mrtpo_floor_and_temperature() -> None:
    d = [0.01, 0.30, 0.05, 0.04]
    np.testing.assert_allclose(adv.mrtpo_token_weights(d, floor=0.0), np.ones(4))
    half = adv.mrtpo_token_weights(d, floor=0.5, max_weight=None)
    np.testing.assert_allclose(half, 0.5 + 0.5 * np.array([0.1, 3.0, 0.5, 0.4]), atol=TOL)
    flat = adv.mrtpo_token_weights(d, temperature=1e6, floor=1.0, max_weight=None)
    np.testing.assert_allclose(flat, np.ones(4), atol=1e-3)
    sharp = adv.mrtpo_token_weights(d, temperature=0.5, floor=1.0, max_weight=None)
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
        "import turnstile.train.shaping, turnstile.train.packing\n"
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


# ----------------------------------------------------------------- GDPO variants, NaN modes


def _trl_normalize_then_sum(rewards: np.ndarray, group_size: int) -> npt.NDArray[np.float64]:
    """TRL's ``multi_objective_aggregation="normalize_then_sum"`` written out in numpy.

    trl/trainer/grpo_trainer.py (trl 1.16.0): ``mean_k = nanmean(grouped)``, ``std_k =
    nanstd(grouped)`` (N-1 over the known values), ``reward_k = (grouped - mean_k) /
    (std_k + 1e-4)``, ``rewards = nansum(reward_k)``, NaN where every reward is NaN, then
    ``(rewards - nanmean) / (nanstd + 1e-4)`` and NaN -> 0.
    """
    out = np.zeros_like(rewards)
    for g in range(0, rewards.shape[0], group_size):
        block = rewards[g : g + group_size]
        mean = np.nanmean(block, axis=0)
        std = np.array([np.std(c[~np.isnan(c)], ddof=1) for c in block.T])
        out[g : g + group_size] = (block - mean) / (std + 1e-4)
    total = np.nansum(out, axis=1)
    total[np.isnan(rewards).all(axis=1)] = np.nan
    known = total[~np.isnan(total)]
    final = (total - known.mean()) / (known.std(ddof=1) + 1e-4)
    return np.asarray(np.nan_to_num(final, nan=0.0), dtype=np.float64)


def test_gdpo_nan_rewards_ignored_as_current_trl() -> None:
    rewards = np.array([[1, np.nan], [1, 0], [0, 1], [0, 0], [np.nan, np.nan], [1, 1], [0, 1]])
    groups = ["a"] * 4 + ["b"] * 3
    # group a, format: known [0, 1, 0]: mean 1/3, N-1 std sqrt(1/3) -> (x - 1/3) / 0.57745
    per = adv.gdpo_reward_advantages(rewards, groups, nan="ignore")
    assert np.isnan(per[0, 1]) and np.isnan(per[4]).all()
    np.testing.assert_allclose(per[1:4, 1], [-0.57725, 1.15451, -0.57725], atol=1e-5)
    ignored = adv.gdpo_advantages(rewards[:4], groups[:4], nan="ignore")
    np.testing.assert_allclose(ignored, _trl_normalize_then_sum(rewards[:4], 4), atol=1e-9)
    # a response with no reward at all: advantage 0, and left out of the batch statistics
    both = adv.gdpo_advantages(np.vstack([rewards[:4], rewards[:4]]), ["a"] * 4 + ["c"] * 4)
    assert both.shape == (8,)
    zeroed = adv.gdpo_advantages(rewards[:4], groups[:4], nan="zero")
    assert not np.allclose(zeroed, ignored)
    with pytest.raises(ValueError):
        adv.gdpo_advantages(rewards, groups, nan="drop")


def test_gdpo_nan_ignore_leaves_unscorable_responses_out() -> None:
    rewards = np.array([[1, 0], [0, 1], [np.nan, np.nan], [1, 1]])
    got = adv.gdpo_advantages(rewards, ["g"] * 4, nan="ignore")
    assert got[2] == 0.0
    known = _trl_normalize_then_sum(rewards[[0, 1, 3]], 3)
    np.testing.assert_allclose(got[[0, 1, 3]], known, atol=1e-9)


def test_grpo_nan_modes() -> None:
    rewards = np.array([[1, np.nan], [1, 0], [np.nan, np.nan], [0, 0]])
    # zero: sums [1, 1, 0, 0] -> +-0.5 / 0.57735; ignore: sums [1, 1, -, 0] over three
    zero = adv.grpo_advantages(rewards, ["g"] * 4)
    np.testing.assert_allclose(zero, [0.8660, 0.8660, -0.8660, -0.8660], atol=TOL)
    ignore = adv.grpo_advantages(rewards, ["g"] * 4, nan="ignore")
    # known sums [1, 1, 0]: mean 2/3, N-1 std sqrt(1/3)
    third = (1 - 2 / 3) / math.sqrt(1 / 3)
    np.testing.assert_allclose(ignore, [third, third, 0.0, -2 * third], atol=1e-5)


def test_gdpo_verl_variant_whitens_over_tokens() -> None:
    # NVlabs/GDPO verl-GDPO/verl/trainer/ppo/ray_trainer.py (commit 7ab53af): per reward
    # compute_grpo_outcome_advantage ((x - mean) / (std + 1e-6), torch.std N-1), summed,
    # then verl_F.masked_whiten over the response tokens: token-weighted mean, variance
    # times n / (n - 1), (x - mean) * rsqrt(var + 1e-8).
    counts = np.array([1, 2, 3, 4])
    correct = (ONE_GROUP[:, 0] - 0.5) / (np.std(ONE_GROUP[:, 0], ddof=1) + 1e-6)
    fmt = (ONE_GROUP[:, 1] - 0.25) / (np.std(ONE_GROUP[:, 1], ddof=1) + 1e-6)
    tokens = np.repeat(correct + fmt, counts)
    whitened = (tokens - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + 1e-8)
    expected = whitened[np.cumsum(counts) - 1]
    got = adv.gdpo_advantages(ONE_GROUP, ["g"] * 4, variant="verl", token_counts=counts)
    np.testing.assert_allclose(got, expected, atol=1e-9)
    # with one token each it is a response-level whitening; the TRL fork differs by eps
    trl = adv.gdpo_advantages(ONE_GROUP, ["g"] * 4)
    verl = adv.gdpo_advantages(ONE_GROUP, ["g"] * 4, variant="verl")
    np.testing.assert_allclose(verl, trl, atol=1e-3)
    # verl gives a group of one its reward / (1 + 1e-6) rather than 0
    alone = adv.gdpo_advantages([[2.0, 1.0]], ["x"], variant="verl", normalize_batch=False)
    assert alone[0] == pytest.approx(3.0 / (1 + 1e-6))
    with pytest.raises(ValueError):
        adv.gdpo_advantages(ONE_GROUP, ["g"] * 4, variant="nemo")


# ----------------------------------------------------------------- MRTPO weights


def test_mrtpo_unknown_relevance_gets_the_uniform_weight() -> None:
    # known tokens share T - (unknown count) in proportion to d: 2 * [0.1, 0.3] / 0.4
    w = adv.mrtpo_token_weights([np.nan, 0.1, 0.3], floor=1.0, max_weight=None)
    np.testing.assert_allclose(w, [1.0, 0.5, 1.5])
    np.testing.assert_allclose(adv.mrtpo_token_weights([np.nan, np.nan]), [1.0, 1.0])


def test_mrtpo_default_floor_and_cap_bound_one_relevant_token() -> None:
    # one relevant token in 2,000: pure weights give it 2,000
    d = np.zeros(2000)
    d[7] = 0.3
    pure = adv.mrtpo_token_weights(d, floor=1.0, max_weight=None)
    assert pure[7] == pytest.approx(2000.0)
    # defaults: lambda 0.5 -> 0.5 + 0.5 * 2000 = 1000.5, capped at 10; the other 1,999
    # tokens (0.5 each) share the remaining 1,990 equally
    w = adv.mrtpo_token_weights(d)
    assert adv.MRTPO_DEFAULT_FLOOR == 0.5 and adv.MRTPO_DEFAULT_MAX_WEIGHT == 10.0
    assert w[7] == pytest.approx(10.0)
    np.testing.assert_allclose(np.delete(w, 7), 1990 / 1999)
    assert w.sum() == pytest.approx(2000.0)
    # the cap redistributes proportionally and repeatedly: [0, 0, 5, 1] * 4/6 -> the 3.33
    # token is capped at 2, the 0.67 one takes the remaining 2
    np.testing.assert_allclose(
        adv.mrtpo_token_weights([0.0, 0.0, 0.5, 0.1], floor=1.0, max_weight=2.0),
        [0.0, 0.0, 2.0, 2.0],
    )
    with pytest.raises(ValueError):
        adv.mrtpo_token_weights(d, max_weight=0.5)
