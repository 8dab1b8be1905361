"""Skip-observation GAE (brief, SAO): hand-computed cases, written out the way verl's
``test_core_algos_on_cpu.py`` derives its numbers, and the two properties that define it."""

from __future__ import annotations

import random

import pytest
import torch

from glmpost.rl.advantages import skip_observation_gae

# One trajectory: action, action | observation, observation | action (two turns).
MASK = torch.tensor([[True, True, False, False, True]])
VALUES = torch.tensor([[0.5, 0.2, 7.0, -3.0, 0.4]])  # the observation values are never read


def _rewards(*pairs) -> torch.Tensor:
    rewards = torch.zeros(1, 5)
    for position, value in pairs:
        rewards[0, position] = value
    return rewards


def test_gamma_lambda_one_with_a_terminal_reward():
    # t=4: delta = 1 + 0 - 0.4 = 0.6,           A = 0.6
    # t=1: delta = 0 + V4 - V1 = 0.4 - 0.2 = 0.2, A = 0.2 + 0.6 = 0.8   (bootstraps across the observation)
    # t=0: delta = 0 + V1 - V0 = 0.2 - 0.5 = -0.3, A = -0.3 + 0.8 = 0.5
    # (gamma = lambda = 1: A_t = R - V_t; returns are R = 1 everywhere)
    advantages, returns = skip_observation_gae(_rewards((4, 1.0)), VALUES, MASK, gamma=1.0, lam=1.0)
    assert advantages.tolist()[0] == pytest.approx([0.5, 0.8, 0.0, 0.0, 0.6])
    assert returns.tolist()[0] == pytest.approx([1.0, 1.0, 0.0, 0.0, 1.0])


def test_gamma_lambda_one_without_a_reward():
    # No reward anywhere: A_t = 0 - V_t.
    advantages, returns = skip_observation_gae(_rewards(), VALUES, MASK, gamma=1.0, lam=1.0)
    assert advantages.tolist()[0] == pytest.approx([-0.5, -0.2, 0.0, 0.0, -0.4])
    assert returns.tolist()[0] == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.0])


def test_discounted_case_and_a_turn_reward():
    # gamma 0.9, lambda 0.95 (gamma * lambda = 0.855), terminal reward 1:
    # t=4: delta = 1 - 0.4 = 0.6,                 A4 = 0.6
    # t=1: delta = 0.9 * 0.4 - 0.2 = 0.16,        A1 = 0.16 + 0.855 * 0.6 = 0.673
    # t=0: delta = 0.9 * 0.2 - 0.5 = -0.32,       A0 = -0.32 + 0.855 * 0.673 = 0.255415
    advantages, returns = skip_observation_gae(_rewards((4, 1.0)), VALUES, MASK, gamma=0.9, lam=0.95)
    assert advantages.tolist()[0] == pytest.approx([0.255415, 0.673, 0.0, 0.0, 0.6], abs=1e-6)
    assert returns.tolist()[0] == pytest.approx([0.755415, 0.873, 0.0, 0.0, 1.0], abs=1e-6)
    # A turn reward 0.5 on turn 0's last action token, gamma = lambda = 1: A_t = (0.5 + 1) - V_t before it.
    advantages, _ = skip_observation_gae(_rewards((1, 0.5), (4, 1.0)), VALUES, MASK, gamma=1.0, lam=1.0)
    assert advantages.tolist()[0] == pytest.approx([1.0, 1.3, 0.0, 0.0, 0.6])


def _random_case(rng: random.Random, length: int):
    mask = torch.tensor([[rng.random() < 0.6 for _ in range(length)]])
    mask[0, 0] = True
    actions = mask[0].nonzero().flatten().tolist()
    rewards = torch.zeros(1, length)
    for position in rng.sample(actions, k=min(2, len(actions))):
        rewards[0, position] = rng.uniform(-1, 1)
    values = torch.tensor([[rng.uniform(-1, 1) for _ in range(length)]])
    return rewards, values, mask


def _plain_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    advantages, running, next_value = [0.0] * len(values), 0.0, 0.0
    for t in reversed(range(len(values))):
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t], next_value = running, values[t]
    return advantages


@pytest.mark.parametrize("seed", range(20))
def test_observation_values_are_never_read_and_it_is_gae_on_the_action_tokens(seed):
    rng = random.Random(seed)
    rewards, values, mask = _random_case(rng, rng.randint(2, 24))
    gamma, lam = rng.choice([(1.0, 1.0), (0.9, 0.95), (0.99, 0.5)])
    advantages, returns = skip_observation_gae(rewards, values, mask, gamma=gamma, lam=lam)
    scrambled = values.clone()
    scrambled[~mask] = torch.randn(int((~mask).sum())) * 100
    again, _ = skip_observation_gae(rewards, scrambled, mask, gamma=gamma, lam=lam)
    assert torch.equal(again, advantages)  # the same operations on the same action-token values
    actions = mask[0]
    expected = _plain_gae(rewards[0, actions].tolist(), values[0, actions].tolist(), gamma, lam)
    assert advantages[0, actions].tolist() == pytest.approx(expected, abs=1e-5)
    assert (advantages[0, ~actions] == 0).all() and (returns[0, ~actions] == 0).all()
    # Right padding (mask 0, reward 0) changes nothing.
    padded, _ = skip_observation_gae(torch.cat([rewards, torch.zeros(1, 3)], 1), torch.cat([values, torch.ones(1, 3)], 1),
                                     torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)], 1), gamma=gamma, lam=lam)
    assert torch.equal(padded[:, : mask.shape[1]], advantages)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="non-action token"):
        skip_observation_gae(_rewards((2, 1.0)), VALUES, MASK, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="must be the same"):
        skip_observation_gae(torch.zeros(1, 4), VALUES, MASK, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        skip_observation_gae(_rewards(), VALUES, MASK, gamma=1.5, lam=1.0)


def test_value_loss_by_hand_with_and_without_clipping():
    from glmpost.rl.losses import value_loss

    values, returns, old = torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 0.0]]), torch.tensor([[0.8, 0.5, 1.0]])
    losses, clipped = value_loss(values, returns, old)
    # 0.5 (V - R)^2: 0.5 * 0.25, 0.5 * 1, 0.5 * 4
    assert losses.tolist()[0] == pytest.approx([0.125, 0.5, 2.0]) and not clipped.any()
    losses, clipped = value_loss(values, returns, old, clip=0.1)
    # clamp(V, V_old -+ 0.1): 0.9, 0.4, 1.1 -> (V_c - R)^2: 0.16, 0.36, 1.21; max with the unclipped (0.25, 1, 4)
    assert losses.tolist()[0] == pytest.approx([0.125, 0.5, 2.0])
    assert clipped.tolist()[0] == [False, False, False]
    losses, clipped = value_loss(torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[0.95]]), clip=0.1)
    # V fell from 0.95 to 0: the clamp gives 0.85, (0.85 - 1)^2 = 0.0225 < (0 - 1)^2 = 1: unclipped wins
    assert losses.item() == pytest.approx(0.5) and not clipped.item()
    losses, clipped = value_loss(torch.tensor([[1.2]]), torch.tensor([[1.0]]), torch.tensor([[0.0]]), clip=0.1)
    # the clamped value 0.1 is further from R: 0.5 * (0.1 - 1)^2 = 0.405 > 0.5 * 0.04
    assert losses.item() == pytest.approx(0.405) and clipped.item()


def test_the_gae_estimator_reads_the_critics_advantages():
    from glmpost.rl.advantages import ADVANTAGE_ESTIMATORS
    from glmpost.rl.micro_batches import MicroBatch

    estimator = ADVANTAGE_ESTIMATORS["gae"]
    batch = MicroBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), torch.ones(1, 3, dtype=torch.bool),
                       torch.zeros(1, 3), torch.zeros(1, 1), {"gae_advantages": torch.tensor([[0.5, float("nan"), -1.0]])})
    advantages, _ = estimator(batch, torch.zeros(1, 3), None)
    assert advantages.tolist() == [[0.5, 0.0, -1.0]]
    batch.token_fields.clear()
    with pytest.raises(ValueError, match="train-sao"):
        estimator(batch, torch.zeros(1, 3), None)
