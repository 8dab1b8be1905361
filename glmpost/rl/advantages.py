"""Advantage estimators: where each action token's advantage comes from, registered by name.

An estimator has one signature, ``(batch, old_log_probs, config) -> (advantages, metrics)``:
``batch`` is a :class:`~glmpost.rl.batches.MicroBatch`, ``old_log_probs`` ``[B, L-1]`` the
training engine's log-probs on the weights before the update, ``advantages`` broadcastable to
``[B, L-1]`` (``[B, 1]`` for one per trajectory) and ``metrics`` named detached sums over the
micro-batch (none yet). The trainer uses the one ``config.advantage_estimator`` names.

Brief: GRPO's group advantage ("GRPO 在优化什么"), OPD's teacher log-ratio ("OPD：把教师变成逐 token
优势"), the task advantage OPD may add ("OPD 和 RL 的关系") and SAO's skip-observation GAE over a
critic's values (:func:`skip_observation_gae`; its estimator comes with ``train-sao``).

Scalings apply to an estimator's advantages: ``cross_segment``, CompactionRL's
``(gamma * lambda)^{N_{>s}}`` on a compacted trajectory's segments (:func:`cross_segment_factor`).
Before them, how a group's rewards become advantages is a registered reward scaling
(:data:`REWARD_SCALINGS`, ``config.advantage_scaling``): GRPO's std, the batch's std, or Dr. GRPO's none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

import torch

from glmpost.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
# (batch, advantages, config) -> advantages: what the trainer applies to an estimator's output, by
# name (``config.advantage_scalings()``).
ADVANTAGE_SCALINGS: Registry[Callable[..., torch.Tensor]] = Registry("advantage scaling")
register_advantage_scaling = ADVANTAGE_SCALINGS.register
# (group rewards [n], every reward of the batch [N], eps) -> the group's advantages [n], float64: how a
# group's rewards become advantages, by name (``config.advantage_scaling``; TRL's ``scale_rewards``).
REWARD_SCALINGS: Registry[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = Registry("reward scaling")
register_reward_scaling = REWARD_SCALINGS.register


@register_reward_scaling("group")
def group_std_scaling(values: torch.Tensor, rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """GRPO's (brief, "GRPO 在优化什么"; TRL ``scale_rewards="group"``): ``A_i = (R_i - mean_g) / (std_g + eps)``,
    ``std_g`` the group's unbiased standard deviation."""
    return (values - values.mean()) / (values.std(unbiased=True) + eps)


@register_reward_scaling("batch")
def batch_std_scaling(values: torch.Tensor, rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """The group baseline over the batch's spread (TRL ``scale_rewards="batch"``, after "Tricks or Traps? A Deep Dive
    into RL for LLM Reasoning", arXiv 2508.08221): ``A_i = (R_i - mean_g) / (std_batch + eps)``, ``std_batch`` the
    unbiased standard deviation of every reward of the update."""
    return (values - values.mean()) / (rewards.std(unbiased=True) + eps)


@register_reward_scaling("none")
def no_std_scaling(values: torch.Tensor, rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783, Sec. 3.1;
    TRL ``scale_rewards="none"``): ``A_i = R_i - mean_g``. Dividing by the group's std weighs a question by how
    uniform its rewards are (too easy or too hard: up-weighted), the difficulty bias this removes."""
    return values - values.mean()


def group_advantages(
    rewards: torch.Tensor, group_ids: Sequence[str], *, eps: float = 1e-6, scaling: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantages (brief, "GRPO 在优化什么").

        A_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)

    over the trajectories sharing a ``group_id``; ``std`` is the unbiased sample standard deviation
    (as in verl and TRL). A group whose rewards are all equal — or that has a single member —
    carries no relative signal: its advantages are exactly 0. ``scaling`` names the registered
    :data:`REWARD_SCALINGS` entry: ``group`` (the formula above), ``batch`` (the batch's std) or
    ``none`` (Dr. GRPO: ``R_i - mean``).

    Args:
        rewards: ``[N]`` float scalar rewards (no NaN: exclude failed judgements first).
        group_ids: ``N`` group ids.
    Returns:
        ``(advantages [N] float32, zero_signal [N] bool)``; ``zero_signal`` marks members of groups
        whose advantages are all 0 (for the ``zero-advantage groups`` metric).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.ndim != 1 or rewards.numel() != len(group_ids):
        raise ValueError(f"rewards {tuple(rewards.shape)} and {len(group_ids)} group ids must match")
    if torch.isnan(rewards).any():
        raise ValueError("rewards contain NaN; exclude trajectories whose judgement failed first")
    index: dict[str, int] = {}
    groups = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    scale = REWARD_SCALINGS[scaling]
    advantages = torch.zeros_like(rewards)
    zero_signal = torch.zeros(rewards.shape, dtype=torch.bool)
    for g in range(len(index)):
        members = groups == g
        values = rewards[members]
        if values.numel() < 2 or bool((values == values[0]).all()):
            zero_signal[members] = True
            continue
        advantages[members] = scale(values, rewards, eps)
    return advantages.float(), zero_signal


def opd_advantages(
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    task_advantages: torch.Tensor | None = None,
    task_weight: float = 0.0,
) -> torch.Tensor:
    """Per-token OPD advantage (brief, "OPD：把教师变成逐 token 优势"), detached::

        A_t = sg[ log pi_T(y_t|s_t) - log pi_theta(y_t|s_t) ] + w * A_task      where mask_t
        A_t = 0                                                                  elsewhere

    Positive where the teacher likes the sampled token more than the student does (the student
    raises it), negative where less. ``task_advantages`` (e.g. GRPO group advantages ``[B, 1]``)
    is added with weight ``w`` (brief, "OPD 和 RL 的关系": "在 OPD advantage 上叠加 task advantage").
    NaN teacher values off the mask (observations) never leak into the result.

    Args:
        teacher_log_probs, student_log_probs: float ``[B, T]``.
        mask: bool ``[B, T]``, the action tokens that enter the loss.
        task_advantages: optional, broadcastable to ``[B, T]``.
        task_weight: ``w >= 0``.
    """
    delta = (teacher_log_probs.detach().double() - student_log_probs.detach().double())
    if task_advantages is not None and task_weight:
        delta = delta + task_weight * task_advantages.detach().double()
    return torch.where(mask, delta, torch.zeros_like(delta)).float()


def skip_observation_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, *, gamma: float,
                         lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a multi-turn trajectory's action tokens only (brief, SAO: "skip-observation GAE").

    Within a turn, the usual token-level recursion; across an observation, the last action token
    ``a_{i,N}`` of turn ``i`` bootstraps from the first action token ``a_{i+1,0}`` of turn ``i+1``:

        delta(a_{i,N}) = r + gamma * V(a_{i+1,0}) - V(a_{i,N})
        A(a_{i,N})     = delta(a_{i,N}) + gamma * lambda * A(a_{i+1,0})

    so observation tokens never enter the recursion (their values are never read) and the result is
    plain GAE on the sequence with the observations cut out. After the last action token the value
    is 0 (the trajectory ended). ``returns = A + V`` are the critic's targets.

    Args:
        rewards: ``[B, T]`` float, non-zero only at action tokens (a turn's reward at its last
            action token, the outcome reward at the trajectory's last one).
        values: ``[B, T]`` float, the critic's value of each position (read at action tokens only).
        action_mask: ``[B, T]`` bool, the model's tokens (False at observations and padding).
        gamma, lam: the discount and GAE's lambda, in [0, 1].
    Returns:
        ``(advantages, returns)``, float32 ``[B, T]``, 0 off the action tokens.
    """
    if not (rewards.shape == values.shape == action_mask.shape) or rewards.ndim != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and action_mask "
                         f"{tuple(action_mask.shape)} must be the same [B, T]")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma {gamma} and lambda {lam} must be in [0, 1]")
    mask = action_mask.bool()
    rewards, values = rewards.to(torch.float64), values.to(torch.float64)
    if bool((rewards[~mask] != 0).any()):
        raise ValueError("a reward sits on a non-action token: put a turn's reward on its last action token")
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=torch.float64, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        acting = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(acting, advantage, 0.0)
        # Off the action tokens nothing moves: the next action token's value and advantage carry over.
        next_value = torch.where(acting, values[:, t], next_value)
        next_advantage = torch.where(acting, advantage, next_advantage)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages.float(), returns.float()


@register_advantage_estimator("grpo")
def grpo_estimator(batch, old_log_probs: torch.Tensor, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO: each trajectory's group advantage (:func:`group_advantages`, computed when the batch is
    prepared), the same for all its action tokens: ``[B, 1]``."""
    return batch.advantages, {}


@register_advantage_estimator("opd")
def opd_estimator(batch, old_log_probs: torch.Tensor, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OPD: ``A_t = sg(log pi_T - log pi_theta_old) + w * A_task`` per action token
    (:func:`opd_advantages`; ``w`` = ``config.task_advantage_weight``), ``[B, L-1]``."""
    return opd_advantages(batch.token_fields["teacher_log_probs"], old_log_probs, batch.action_mask,
                          task_advantages=batch.advantages, task_weight=config.task_advantage_weight), {}


@register_advantage_estimator("task")
def weighted_task_estimator(batch, old_log_probs: torch.Tensor, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``w * A_task`` (``[B, 1]``): MOPD's top-k loss distils in its own loss term, so the policy
    gradient carries only the weighted task advantage (0 for pure distillation)."""
    return config.task_advantage_weight * batch.advantages, {}


@register_advantage_estimator("gae")
def gae_estimator(batch, old_log_probs: torch.Tensor, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAO: each action token's skip-observation GAE advantage (:func:`skip_observation_gae`),
    computed from the critic's values before the policy update and carried in the batch as the
    ``gae_advantages`` token field ``[B, L-1]``."""
    if "gae_advantages" not in batch.token_fields:
        raise ValueError("the gae estimator needs the critic's advantages (token field gae_advantages): train with train-sao")
    return batch.token_fields["gae_advantages"].nan_to_num(0.0), {}


def later_trainable_tokens(counts: Sequence[int]) -> list[int]:
    """``N_{>s}`` of each segment ``s`` of one trajectory (brief, CompactionRL): the trainable
    tokens in the segments after it, from each segment's trainable-token count in order.

        N_{>s} = sum_{s' > s} |M_{s'}|          e.g. counts [5, 3, 4] -> [7, 4, 0]
    """
    later, total = [], 0
    for count in reversed(counts):
        later.append(total)
        total += int(count)
    return later[::-1]


def cross_segment_factor(later_tokens: torch.Tensor, gamma_lambda: float) -> torch.Tensor:
    """CompactionRL's cross-segment credit (brief, "CompactionRL：摘要也要为任务结果负责")::

        A_{s,i} = (gamma * lambda)^{N_{>s}} * A^loc_{s,i}

    the factor for segments with ``later_tokens`` = ``N_{>s}``: an early segment's local advantages
    (GAE computed within the segment, its last action token bootstrapping from the final reward) are
    discounted as if the later segments' trainable tokens stood between it and the outcome. 1 for
    the last segment, and for every segment when ``gamma * lambda`` is 1. float64, the shape of
    ``later_tokens``."""
    if not 0.0 <= gamma_lambda <= 1.0:
        raise ValueError(f"gamma * lambda must be in [0, 1], got {gamma_lambda}")
    return torch.pow(torch.tensor(gamma_lambda, dtype=torch.float64), later_tokens.to(torch.float64))


@register_advantage_scaling("cross_segment")
def cross_segment_scaling(batch, advantages: torch.Tensor, config) -> torch.Tensor:
    """Each example's (context window's) advantages times :func:`cross_segment_factor` of its
    ``N_{>s}`` (``batch.later_tokens``: per row, or per entry in packed rows) with base ``config.segment_decay_base()``; examples of
    uncompacted trajectories (``N_{>s}`` 0) are unchanged."""
    base = config.segment_decay_base()
    if base == 1.0 or batch.later_tokens is None or not bool((batch.later_tokens > 0).any()):
        return advantages
    factor = cross_segment_factor(batch.later_tokens, base).to(advantages.device)
    if factor.dim() == 1:  # one per row; a packed batch has one per entry already
        factor = factor.view(-1, *([1] * (advantages.dim() - 1)))
    return (advantages.double() * factor).to(advantages.dtype)
