"""Issue 46's registered pieces on hand-computed cases: GSPO's sequence clip, CISPO, token TIS,
sequence TIS, MIS, the loss normalisations (dapo, bnpo, dr_grpo) and the advantage scalings (group,
batch, Dr. GRPO's none); how they compose in the trainer and refuse what does not go together.
(tests/test_trl_peer.py proves them equal to TRL's on a model's batch.)"""

from __future__ import annotations

import math

import pytest
import torch

from glmpost.config import SettingError
from glmpost.kernel.trust_masks import IMPORTANCE_CORRECTIONS, per_sequence_sum
from glmpost.rl.advantages import group_advantages
from glmpost.rl.configs import GRPOConfig, OPDConfig
from glmpost.rl.losses import LOSS_NORMALIZATIONS, cispo_policy_loss, gspo_policy_loss


def test_per_sequence_sum_of_padded_and_packed_rows():
    values = torch.tensor([[1.0, 2.0, 4.0, 8.0], [16.0, 32.0, 64.0, 128.0]])
    padded = torch.tensor([[0, 0, 0, -1], [1, 1, -1, -1]])
    assert per_sequence_sum(values, padded).tolist() == [[7.0, 7.0, 7.0, 0.0], [48.0, 48.0, 0.0, 0.0]]
    packed = torch.tensor([[0, 0, 1, 1], [-1, 2, 2, 2]])
    assert per_sequence_sum(values, packed).tolist() == [[3.0, 3.0, 12.0, 12.0], [0.0, 224.0, 224.0, 224.0]]


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    # Sequence 0: trusted log-ratios 0.1, 0.3 (an untrusted 5.0 is left out): s0 = e^0.2 = 1.2214 > 1.2, A = +1:
    # clipped, loss -1.2 at each token, no gradient. Sequence 1: -0.05, -0.15, 0.0: s1 = e^(-0.2/3) = 0.93551,
    # A = -2, inside the band: loss -s1 * A = 1.87102 at each token.
    old = torch.zeros(2, 4)
    log_probs = torch.tensor([[0.1, 5.0, 0.3, 0.0], [-0.05, -0.15, 0.0, 0.0]], requires_grad=True)
    trust = torch.tensor([[True, False, True, False], [True, True, True, False]])
    examples = torch.tensor([[0, 0, 0, -1], [1, 1, 1, -1]])
    advantages = torch.tensor([[1.0], [-2.0]])
    terms = gspo_policy_loss(log_probs, old, advantages, trust, examples, eps_low=0.2, eps_high=0.2)
    s1 = math.exp(-0.2 / 3)
    assert terms.losses[0, 0].item() == pytest.approx(-1.2) and terms.losses[0, 2].item() == pytest.approx(-1.2)
    assert terms.losses[1, :3].tolist() == pytest.approx([2 * s1] * 3)
    assert terms.ratio[0, 0].item() == pytest.approx(math.exp(0.2)) and terms.ratio[1, 1].item() == pytest.approx(s1)
    assert terms.clipped[0, 0] and not terms.clipped[1, 0]
    torch.where(trust, terms.losses, torch.zeros_like(terms.losses)).sum().backward()
    # d/d logp_t of sum over the 3 tokens of -A s1 = 3 * (-A) * s1 / 3 = 2 s1 for each token of sequence 1.
    assert log_probs.grad[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert log_probs.grad[1, :3].tolist() == pytest.approx([2 * s1] * 3) and log_probs.grad[1, 3] == 0


def test_gspo_is_the_same_packed():
    log_probs = torch.tensor([[0.1, 0.3, -0.05, -0.15, 0.0]])
    trust = torch.ones(1, 5, dtype=torch.bool)
    packed = gspo_policy_loss(log_probs, torch.zeros(1, 5), torch.tensor([[1.0, 1.0, -2.0, -2.0, -2.0]]), trust,
                              torch.tensor([[0, 0, 1, 1, 1]]), eps_low=0.2, eps_high=0.2)
    assert packed.losses[0].tolist() == pytest.approx([-1.2, -1.2] + [2 * math.exp(-0.2 / 3)] * 3)


def test_cispo_clips_the_weight_stops_its_gradient_and_keeps_every_token():
    # r = 0.5, 1, 7 under (1 - 1, 1 + 4): weights 0.5, 1, 5 (the last clipped); A = 1, -1, 2.
    probs = torch.tensor([0.25, 0.5, 0.7])
    log_probs = probs.log().clone().requires_grad_(True)
    old = log_probs.detach() - torch.tensor([0.5, 1.0, 7.0]).log()
    advantages = torch.tensor([1.0, -1.0, 2.0])
    terms = cispo_policy_loss(log_probs, old, advantages, eps_low=1.0, eps_high=4.0)
    assert terms.losses.tolist() == pytest.approx([-0.5 * math.log(0.25), math.log(0.5), -10.0 * math.log(0.7)])
    assert terms.clipped.tolist() == [False, False, True]
    terms.losses.sum().backward()
    assert log_probs.grad.tolist() == pytest.approx([-0.5, 1.0, -10.0])  # -sg(w) A: the clipped token still learns
    below = cispo_policy_loss(log_probs, old, advantages, eps_low=0.2, eps_high=4.0)
    assert below.losses[0].item() == pytest.approx(-0.8 * math.log(0.25)) and below.clipped[0]


class Cap:
    importance_cap = 2.0


def _two_sequences():
    # rho_t = pi_old / pi_rollout: sequence 0 has 2.0, 1.5 (product 3.0); sequence 1 has 0.5, 1.2 (product 0.6);
    # its third entry is not an action (rho 1 whatever the values), the fourth has no rollout log-prob (NaN: rho 1).
    old = torch.tensor([[math.log(0.4), math.log(0.3), 0.0, 0.0], [math.log(0.1), math.log(0.6), -3.0, -1.0]])
    rollout = torch.tensor([[math.log(0.2), math.log(0.2), float("nan"), float("nan")],
                            [math.log(0.2), math.log(0.5), -1.0, float("nan")]])
    actions = torch.tensor([[True, True, False, False], [True, True, False, True]])
    examples = torch.tensor([[0, 0, -1, -1], [1, 1, 1, 1]])
    return old, rollout, actions, examples


def test_token_tis_truncates_each_tokens_ratio():
    weights, keep = IMPORTANCE_CORRECTIONS["tis"](*_two_sequences(), Cap)
    assert weights.flatten().tolist() == pytest.approx([2.0, 1.5, 1.0, 1.0, 0.5, 1.2, 1.0, 1.0])
    assert bool(keep.all())


def test_sequence_tis_truncates_the_product_not_the_geometric_mean():
    weights, keep = IMPORTANCE_CORRECTIONS["seq-tis"](*_two_sequences(), Cap)
    # Sequence 0: min(3.0, 2) = 2 (its geometric mean sqrt(3) = 1.73 would pass uncapped); sequence 1: 0.6.
    assert weights[0, :2].tolist() == pytest.approx([2.0, 2.0]) and weights[1].tolist() == pytest.approx([0.6] * 4)
    assert bool(keep.all())


def test_mis_rejects_a_whole_sequence_above_the_cap_and_weighs_the_rest():
    weights, keep = IMPORTANCE_CORRECTIONS["mis"](*_two_sequences(), Cap)
    assert keep.tolist() == [[False, False, True, True], [True, True, True, True]]  # 3.0 > 2: rejected whole
    assert weights[0, :2].tolist() == [0.0, 0.0] and weights[1].tolist() == pytest.approx([0.6] * 4)


class MaxTokens:
    dr_grpo_max_tokens = 8


def test_loss_normalizations_hand_computed():
    counts = torch.tensor([3.0, 0.0, 5.0], dtype=torch.float64)
    for name in ("token", "dapo", "bnpo"):  # DAPO's token-level loss is glmpost's token normalisation
        weights, denominator = LOSS_NORMALIZATIONS[name](counts, MaxTokens)
        assert weights.tolist() == [1.0, 1.0, 1.0] and float(denominator) == 8.0
    weights, denominator = LOSS_NORMALIZATIONS["dr_grpo"](counts, MaxTokens)
    assert weights.tolist() == [1.0, 1.0, 1.0] and float(denominator) == 3 * 8  # every sequence, whatever its length
    weights, denominator = LOSS_NORMALIZATIONS["segment"](counts, MaxTokens)
    assert weights.tolist() == pytest.approx([1 / 3, 0.0, 1 / 5]) and float(denominator) == 2.0


def test_advantage_scalings_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 2.0, 0.0])
    groups = ["g"] * 4 + ["h"] * 2 + ["k"] * 2
    # g: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; h: equal rewards; k: mean 1, std sqrt(2).
    group, zero = group_advantages(rewards, groups, eps=0.0)
    assert group.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 1 / math.sqrt(2), -1 / math.sqrt(2)])
    assert zero.tolist() == [False] * 4 + [True] * 2 + [False] * 2
    none, _ = group_advantages(rewards, groups, eps=0.0, scaling="none")  # Dr. GRPO: R - mean
    assert none.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 1.0, -1.0])
    # The batch's unbiased std: mean 0.5, squared deviations 0.25 x 5 + 2.25 = 3.5, / 7 = 0.5: sqrt(0.5).
    batch, _ = group_advantages(rewards, groups, eps=0.0, scaling="batch")
    assert batch.tolist() == pytest.approx([x / math.sqrt(0.5) for x in (0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 1.0, -1.0)])


def test_the_variants_choose_the_trainers_pieces_and_refuse_what_does_not_go_together():
    assert GRPOConfig().loss_terms() == ("policy",) and GRPOConfig().importance_correction_name() is None
    assert GRPOConfig(policy_loss="gspo", entropy_coef=0.1, kl_coef=0.1).loss_terms() == ("gspo", "kl", "entropy")
    assert GRPOConfig(policy_loss="cispo").loss_terms() == ("cispo",)
    assert OPDConfig(importance_correction="mis").importance_correction_name() == "mis"
    refused = {
        "policy_loss": dict(policy_loss="gspo", trust_mask=["dis"]),
        "importance_correction": dict(importance_correction="tis", max_version_lag=1),
        "dr_grpo_max_tokens": dict(loss_normalization="dr_grpo"),
        "advantage_scaling": dict(advantage_scaling="std"),
    }
    for field, settings in refused.items():
        with pytest.raises(SettingError) as caught:
            GRPOConfig(**settings).validate()
        assert caught.value.field == field
    with pytest.raises(SettingError):
        GRPOConfig(policy_loss="sapo").validate()
    with pytest.raises(SettingError):
        GRPOConfig(importance_correction="icepop").validate()
    GRPOConfig(loss_normalization="dr_grpo", dr_grpo_max_tokens=8, importance_correction="seq-tis").validate()
