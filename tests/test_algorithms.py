"""The brief's RL formulas on hand-computed cases (fast, exact)."""

from __future__ import annotations

import math

import pytest
import torch

from glmpost.kernel.trust_masks import TRUST_MASKS, dis_mask, icepop_mask
from glmpost.rl.advantages import group_advantages
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.losses import clipped_policy_loss, k3_kl, masked_sum_over


def test_group_advantages_hand_computed():
    # group a: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5 -> (R - 0.5) / 0.5
    # group b: all equal -> 0; group c: a single member -> 0
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 0.3])
    advantages, zero = group_advantages(rewards, ["a", "a", "a", "b", "b", "c"], eps=0.0)
    assert advantages.tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    assert zero.tolist() == [False, False, False, True, True, True]
    with_eps, _ = group_advantages(rewards, ["a", "a", "a", "b", "b", "c"], eps=1e-6)
    assert with_eps[0].item() == pytest.approx(0.5 / (0.5 + 1e-6), abs=1e-7)


def test_group_advantages_binary_rewards_of_a_group_of_four():
    # One correct answer of four: mean 0.25, std = sqrt(3 * 0.0625 + 0.5625) / sqrt(3) = 0.5
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), ["g"] * 4, eps=0.0)
    assert advantages.tolist() == [1.5, -0.5, -0.5, -0.5]
    assert advantages.sum().item() == 0.0


def test_group_advantages_refuses_nan_and_mismatch():
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), ["g", "g"])
    with pytest.raises(ValueError, match="must match"):
        group_advantages(torch.tensor([1.0, 0.0]), ["g"])


def _log_ratio_pairs(ratios):
    infer = torch.full((len(ratios),), math.log(0.1), dtype=torch.float64)
    train = infer + torch.log(torch.tensor(ratios, dtype=torch.float64))
    return train, infer


def test_icepop_mask_is_the_briefs_example():
    # brief: with beta = 2, 1.2 and 1.9 are kept, 0.3 and 3.5 are masked; near-boundary values too.
    train, infer = _log_ratio_pairs([1.2, 1.9, 0.3, 3.5, 1.999, 2.001, 0.501, 0.499, 1.0])
    assert icepop_mask(train, infer, beta=2.0).tolist() == [True, True, False, False, True, False, True, False, True]


def test_icepop_is_a_mask_not_a_clamp_and_nan_is_untrusted():
    train = torch.tensor([math.log(0.35), float("nan"), math.log(0.1)])
    infer = torch.tensor([math.log(0.10), math.log(0.1), float("nan")])
    mask = icepop_mask(train, infer)
    assert mask.tolist() == [False, False, False]  # the brief's 0.35 / 0.10 = 3.5 leaves the gradient
    with pytest.raises(ValueError):
        icepop_mask(train, infer, beta=0.5)


def test_dis_mask_is_double_sided_and_strict():
    # brief: 1.1 kept; 1.8 and 0.3 masked. eps_l = 0.2, eps_h = 0.28 -> (0.8, 1.28) open interval.
    rollout = torch.full((7,), math.log(0.2), dtype=torch.float64)
    current = rollout + torch.log(torch.tensor([1.1, 1.8, 0.3, 0.81, 0.79, 1.27, 1.29], dtype=torch.float64))
    assert dis_mask(current, rollout, eps_low=0.2, eps_high=0.28).tolist() == [True, False, False, True, False, True, False]


def test_the_dis_band_is_its_own_setting_apart_from_the_ppo_clip():
    # dis_low = 0.1, dis_high = 0.5 -> kept iff 0.9 < r < 1.5, whatever the PPO clip (0.3 / 0.05) says.
    rollout = torch.zeros(4, dtype=torch.float64)
    train = torch.log(torch.tensor([0.85, 0.95, 1.4, 1.6], dtype=torch.float64))
    config = GRPOConfig(dis_low=0.1, dis_high=0.5, eps_low=0.3, eps_high=0.05)
    mask, _ = TRUST_MASKS["dis"](train, rollout, config)
    assert mask.tolist() == [False, True, True, False]
    default, _ = TRUST_MASKS["dis"](train, rollout, GRPOConfig())  # today's values: (0.8, 1.28)
    assert default.tolist() == [True, True, False, False]


def test_clipped_policy_loss_four_quadrants():
    # ratio 1.5/A+1: min(1.5, 1.28) = 1.28 (clipped); ratio 0.5/A-1: min(-0.5, -0.8) = -0.8 (clipped)
    # ratio 0.5/A+1: min(0.5, 0.8) = 0.5;              ratio 1.5/A-1: min(-1.5, -1.28) = -1.5
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5], dtype=torch.float64)
    old = torch.log(torch.full((4,), 0.2, dtype=torch.float64))
    new = (old + torch.log(ratios)).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    terms = clipped_policy_loss(new, old, advantages, eps_low=0.2, eps_high=0.28)
    assert terms.losses.detach().tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5], abs=1e-12)
    assert terms.clipped.tolist() == [True, True, False, False]
    terms.losses.sum().backward()
    # Clipped tokens get no gradient; others get d(-r*A)/dlogp = -r*A.
    assert new.grad.tolist() == pytest.approx([0.0, 0.0, -0.5, 1.5], abs=1e-12)


def test_k3_kl_hand_computed_and_nonnegative():
    logp = torch.log(torch.tensor([0.5, 0.25, 0.1]))
    ref = torch.log(torch.tensor([0.25, 0.25, 0.4]))
    k3 = k3_kl(logp, ref)
    # delta = log(ref/p): 0.5 - log 0.5 - 1; 0; 4 - log 4 - 1
    assert k3.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0, 3 - math.log(4)], abs=1e-6)
    assert (k3 >= 0).all()


def test_masked_sum_over_global_denominator():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, False, True]])
    assert masked_sum_over(values, mask, 10.0).item() == pytest.approx(1.0)
    # Summing two halves with the global denominator equals the whole.
    halves = masked_sum_over(values[:1], mask[:1], 3.0) + masked_sum_over(values[1:], mask[1:], 3.0)
    assert halves.item() == pytest.approx(masked_sum_over(values, mask, 3.0).item())
    assert masked_sum_over(values, mask, 0.0).item() == 0.0


def test_version_lag_is_checkpoint_minus_the_oldest_action_version():
    import numpy as np

    from glmpost.config import ConfigError
    from glmpost.rl.batches import check_version_lags, version_lag

    def rec(rid, versions, action, observation=None):
        n = len(versions)
        return {"id": rid, "policy_versions": np.array(versions, dtype=np.int32), "action_mask": np.array(action, dtype=bool),
                "observation_mask": np.array(observation or [0] * n, dtype=bool)}

    # observation tokens (and non-action ones, -1 by convention) do not count
    assert version_lag(rec("a", [-1, 5, 4, 3], [0, 1, 1, 0], [0, 0, 0, 1]), 5) == 1
    assert version_lag(rec("b", [5, 5], [1, 1]), 5) == 0
    assert version_lag({"id": "c", "action_mask": np.ones(2, bool), "observation_mask": np.zeros(2, bool)}, 5) is None
    assert version_lag(rec("d", [7], [1]), 5) == -2
    records = [rec("b", [5, 5], [1, 1]), rec("a", [-1, 5, 4], [0, 1, 1]), rec("e", [4], [1])]
    assert check_version_lags(records, 5, max_lag=1, stage="train-grpo") == {"0": 1, "1": 2}
    with pytest.raises(ConfigError) as stale:
        check_version_lags(records, 5, max_lag=0, stage="train-grpo")
    assert str(stale.value) == ("train-grpo: record 'a' was sampled by policy version 4, 1 behind --checkpoint's 5; IcePop "
                                "assumes the same weights: resample it, or pass --max-version-lag 1 (lagged records are then "
                                "masked with DIS)")
    with pytest.raises(ConfigError, match="record 'd' was sampled by policy version 7, newer than --checkpoint's 5"):
        check_version_lags([rec("d", [7], [1])], 5, max_lag=3, stage="opd-merge")


def test_a_version_lag_switches_the_trust_mask_to_dis():
    assert GRPOConfig().trust_masks() == ("icepop",) and GRPOConfig(max_version_lag=2).trust_masks() == ("dis",)
    train = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.5, 0.45, 0.62, 0.3]]))  # ratios 1, 1.11, 0.806, 1.67
    mask, _ = TRUST_MASKS["dis"](train, rollout, GRPOConfig(max_version_lag=1))
    assert mask.tolist() == [[True, True, True, False]]
    assert torch.equal(mask, dis_mask(train, rollout, eps_low=0.2, eps_high=0.28))
