"""Trust masks: which action tokens an update may learn from, registered by name.

A trust mask has one signature, ``(train_log_probs, rollout_log_probs, config) -> (mask, metrics)``
over ``[B, L-1]`` tensors (NaN off the actions, never trusted). The trainer ANDs the masks
``config.trust_masks`` names into the action mask: ``icepop`` once, on the weights before the
update; ``dis`` on the weights of each optimizer step. The same final mask gives the loss its
numerator and its denominator (the trusted-token count; the trainer checks they agree).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glmpost.registry import Registry

TrustMask = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
TRUST_MASKS: Registry[TrustMask] = Registry("trust mask")
register_trust_mask = TRUST_MASKS.register


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


@register_trust_mask("icepop")
def icepop(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop on the same weights (:func:`icepop_mask` with ``beta`` = ``config.icepop_beta``)."""
    # brief: rho = pi_train_old / pi_infer; keep iff 1/beta <= rho <= beta (a mask, not a clamp)
    return icepop_mask(train_log_probs, rollout_log_probs, beta=config.icepop_beta), {}


@register_trust_mask("dis")
def dis(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DIS (:func:`dis_mask` with ``config.dis_low`` / ``dis_high``): a token is kept only where
    pi_theta / pi_rollout stays inside the trust band. The trainer takes it on the weights of every
    optimizer step (``train_log_probs`` are pi_theta's then), and the policy term becomes
    :func:`glmpost.rl.losses.dis_policy_loss`: the tool for records of an older policy (brief,
    "IcePop 与 DIS 不要混用": it absorbs version lag and engine mismatch alike)."""
    return dis_mask(train_log_probs, rollout_log_probs, eps_low=config.dis_low, eps_high=config.dis_high), {}
