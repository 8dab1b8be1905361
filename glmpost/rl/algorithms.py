"""The brief's RL formulas as small pure tensor functions.

Each function cites the section of ``shared/seed/000_5969dbc2eea78ca5.txt`` (the brief) it
implements. Shapes: ``[N]`` one value per trajectory, ``[B, T]`` one per response token. Masks are
``bool``; nothing here reads files or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


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


def icepop_mask(train_old_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, *, beta: float = 2.0) -> torch.Tensor:
    """IcePop trust mask (brief, "IcePop 为什么有两层 ratio"; GLM-5: beta = 2).

        rho_t = pi_train_old(y_t|s_t) / pi_infer(y_t|s_t) = exp(logp_train_old - logp_infer)
        m_t   = 1[1/beta <= rho_t <= beta]

    Same weights, two engines: a token whose engines disagree by more than ``beta`` in either
    direction is *masked*, not clamped — it leaves the gradient entirely. With beta = 2, rho = 1.2
    and 1.9 are kept, 0.3 and 3.5 are masked. NaN (e.g. observation tokens) is never trusted.
    """
    if beta < 1.0:
        raise ValueError(f"IcePop beta must be >= 1, got {beta}")
    rho = torch.exp(train_old_log_probs.double() - infer_log_probs.double())
    return (rho >= 1.0 / beta) & (rho <= beta)


def dis_mask(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, *, eps_low: float = 0.2, eps_high: float = 0.28) -> torch.Tensor:
    """Direct double-sided importance-sampling mask (brief, "Direct Double-Sided Importance Sampling").

        r_t = exp(logp_theta - logp_rollout);   keep iff 1 - eps_low < r_t < 1 + eps_high

    The denominator is the log-prob saved at rollout time, not a rebuilt old policy; both sides
    reject (strict inequalities). NaN is never kept.
    """
    ratio = torch.exp(log_probs.detach().double() - rollout_log_probs.double())
    return (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)


@dataclass
class PolicyLossTerms:
    """Per-token pieces of the clipped objective, ``[B, T]`` each (losses carry the gradient)."""

    losses: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


def clipped_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> PolicyLossTerms:
    """PPO/GRPO clipped surrogate per token (brief, "GRPO 在优化什么"; GLM-5: eps_l 0.2, eps_h 0.28).

        r_t  = exp(logp_theta - logp_old)
        l_t  = -min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

    ``advantages`` broadcasts against ``[B, T]`` (``[B, 1]`` for sequence-level GRPO advantages).
    ``clipped`` marks tokens where the clipped term is the active (smaller) one.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped_term = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    losses = -torch.minimum(unclipped, clipped_term)
    return PolicyLossTerms(losses=losses, ratio=ratio.detach(), clipped=(clipped_term < unclipped).detach())


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per sampled token, always >= 0.

        k3_t = exp(logp_ref - logp_theta) - (logp_ref - logp_theta) - 1
    """
    delta = ref_log_probs - log_probs
    return torch.exp(delta) - delta - 1.0


def masked_sum_over(values: torch.Tensor, mask: torch.Tensor, denominator: float) -> torch.Tensor:
    """``sum(values * mask) / denominator``: token-mean with a denominator fixed for the global batch.

    Dividing every micro-batch and every data-parallel rank by the *global* number of trusted action
    tokens makes the summed gradient independent of how the batch was split.
    """
    if denominator <= 0:
        return (values * 0).sum()
    return torch.where(mask, values, torch.zeros_like(values)).sum() / denominator
