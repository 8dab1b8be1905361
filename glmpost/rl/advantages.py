"""Advantage estimators: where each action token's advantage comes from, registered by name.

An estimator has one signature, ``(batch, old_log_probs, config) -> (advantages, metrics)``:
``batch`` is a :class:`~glmpost.rl.batches.MicroBatch`, ``old_log_probs`` ``[B, L-1]`` the
training engine's log-probs on the weights before the update, ``advantages`` broadcastable to
``[B, L-1]`` (``[B, 1]`` for one per trajectory) and ``metrics`` named detached sums over the
micro-batch (none yet). The trainer uses the one ``config.advantage_estimator`` names.

Brief: GRPO's group advantage ("GRPO 在优化什么"), OPD's teacher log-ratio ("OPD：把教师变成逐 token
优势") and the task advantage OPD may add ("OPD 和 RL 的关系").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

import torch

from glmpost.registry import Registry

AdvantageEstimator = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register


def group_advantages(
    rewards: torch.Tensor, group_ids: Sequence[str], *, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantages (brief, "GRPO 在优化什么").

        A_i = (R_i - mean(R_1..R_G)) / (std(R_1..R_G) + eps)

    over the trajectories sharing a ``group_id``; ``std`` is the unbiased sample standard deviation
    (as in verl and TRL). A group whose rewards are all equal — or that has a single member —
    carries no relative signal: its advantages are exactly 0.

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
    advantages = torch.zeros_like(rewards)
    zero_signal = torch.zeros(rewards.shape, dtype=torch.bool)
    for g in range(len(index)):
        members = groups == g
        values = rewards[members]
        if values.numel() < 2 or bool((values == values[0]).all()):
            zero_signal[members] = True
            continue
        advantages[members] = (values - values.mean()) / (values.std(unbiased=True) + eps)
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
