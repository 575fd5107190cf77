"""Tests of gspo.algo.group_advantages, paper Eq. 6: exact zeros without signal, hand values,
the population std, missing rewards, and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_defaults import group_advantages

F64 = torch.float64


# --------------------------------------------------------------------------------------------
# group_advantages (Eq. 6)
# --------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.floats(-1e6, 1e6, allow_nan=False, width=32), st.integers(2, 8), st.integers(1, 3),
       st.sampled_from([torch.float32, F64]), st.sampled_from(["group", "none"]))
def test_equal_rewards_give_exact_zeros(c, group_size, groups, dtype, scale):
    rewards = torch.full((group_size * groups,), c, dtype=dtype)
    adv, stats = group_advantages(rewards, group_size, scale=scale)
    assert (adv == 0).all() and adv.dtype == dtype
    assert stats["adv/frac_zero_std"] == 1.0


def test_one_outlier_hand_value():
    # [1, 0, 0, 0]: mean 1/4, population std sqrt(1/4 * 3/4) = sqrt(3)/4, so
    # A = (3/4) / (sqrt(3)/4) = sqrt(3) for the outlier and (-1/4) / (sqrt(3)/4) = -1/sqrt(3)
    adv, stats = group_advantages(torch.tensor([1.0, 0, 0, 0], dtype=F64), 4, eps=0.0)
    r3 = math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([r3, -1 / r3, -1 / r3, -1 / r3], dtype=F64),
                               rtol=1e-14, atol=0)
    assert stats["adv/frac_zero_std"] == 0.0 and stats["reward/frac_missing"] == 0.0
    assert stats["adv/abs_mean"] == pytest.approx((r3 + 3 / r3) / 4, rel=1e-14)
    # the default eps = 1e-6 is added to the std
    adv_eps, _ = group_advantages(torch.tensor([1.0, 0, 0, 0]), 4)
    assert adv_eps[0].item() == pytest.approx(0.75 / (r3 / 4 + 1e-6), rel=1e-6)
    # Dr. GRPO, scale="none": mean only
    adv_none, _ = group_advantages(torch.tensor([1.0, 0, 0, 0], dtype=F64), 4, scale="none")
    torch.testing.assert_close(adv_none, torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64))


def test_std_is_population_std():
    # [1, 0]: population std 0.5 gives A = +-1; the sample std (0.7071) would give +-0.7071
    adv, _ = group_advantages(torch.tensor([1.0, 0.0], dtype=F64), 2, eps=0.0)
    assert adv.tolist() == [1.0, -1.0]


def test_missing_rewards():
    # group 0: [1, NaN, 0, 0]: valid [1, 0, 0], mean 1/3, population std sqrt(2)/3, so
    #          A = (2/3) / (sqrt(2)/3) = sqrt(2) and (-1/3) / (sqrt(2)/3) = -1/sqrt(2); NaN -> 0
    # group 1: one valid reward: no signal, all 0
    nan = math.nan
    rewards = torch.tensor([1.0, nan, 0.0, 0.0, nan, nan, nan, 1.0], dtype=F64)
    adv, stats = group_advantages(rewards, 4, eps=0.0)
    r2 = math.sqrt(2)
    expected = torch.tensor([r2, 0, -1 / r2, -1 / r2, 0, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(adv, expected, rtol=1e-14, atol=0)
    assert stats["reward/frac_missing"] == 4 / 8 and stats["adv/frac_zero_std"] == 0.5
    assert stats["reward/mean"] == pytest.approx(2 / 4)
    adv_none, _ = group_advantages(rewards, 4, scale="none")
    torch.testing.assert_close(adv_none, torch.tensor([2 / 3, 0, -1 / 3, -1 / 3, 0, 0, 0, 0],
                                                      dtype=F64))
    all_missing, stats = group_advantages(torch.full((4,), nan), 2)
    assert (all_missing == 0).all() and math.isnan(stats["reward/mean"])


@settings(max_examples=40, deadline=None)
# subnormal rewards excluded: some machines flush them to zero (seen on the GPU host's CPU)
@given(st.lists(st.floats(0, 1, allow_subnormal=False), min_size=6, max_size=6), st.sampled_from([2, 3, 6]))
def test_advantages_are_centred_and_unit_scaled(values, group_size):
    adv, _ = group_advantages(torch.tensor(values, dtype=F64), group_size, eps=0.0)
    for grp in adv.reshape(-1, group_size):
        assert abs(grp.sum().item()) < 1e-9
        assert grp.square().sum().item() == pytest.approx(group_size, rel=1e-9) or \
            (grp == 0).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(rewards=torch.zeros(5), group_size=2), "group_size"),
    (dict(rewards=torch.zeros(4), group_size=1), "group_size"),
    (dict(rewards=torch.zeros(4), group_size=True), "group_size"),
    (dict(rewards=torch.zeros(2, 2), group_size=2), "rewards"),
    (dict(rewards=torch.tensor([1.0, math.inf]), group_size=2), "rewards"),
    (dict(rewards=torch.zeros(4), group_size=2, scale="batch"), "scale"),
    (dict(rewards=torch.zeros(4), group_size=2, eps=-1.0), "eps"),
])
def test_group_advantages_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)
