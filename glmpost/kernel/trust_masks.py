"""Trust masks: which action tokens an update may learn from, registered by name.

A trust mask has one signature, ``(train_log_probs, rollout_log_probs, config) -> (mask, metrics)``
over ``[B, L-1]`` tensors (NaN off the actions, never trusted). The trainer ANDs the masks
``config.trust_masks`` names into the action mask: ``icepop`` once, on the weights before the
update; ``dis`` on the weights of each optimizer step. The same final mask gives the loss its
numerator and its denominator (the trusted-token count; the trainer checks they agree).

An importance correction (``config.importance_correction``: ``tis``, ``seq-tis``, ``mis``) weighs
rather than masks: ``(train_old_log_probs, rollout_log_probs, actions, examples, config) -> (weights,
keep)``, a detached weight per token that multiplies the policy term and a mask ANDed into the trust
mask (``mis`` rejects whole sequences), both from ``rho_t = pi_train_old / pi_rollout`` on the
weights before the update.
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


# (train_old_log_probs, rollout_log_probs, actions, examples, config) -> (weights [B, L-1] float32, keep [B, L-1] bool)
ImportanceCorrection = Callable[..., tuple[torch.Tensor, torch.Tensor]]
IMPORTANCE_CORRECTIONS: Registry[ImportanceCorrection] = Registry("importance correction")
register_importance_correction = IMPORTANCE_CORRECTIONS.register


def per_sequence_sum(values: torch.Tensor, examples: torch.Tensor) -> torch.Tensor:
    """Each entry's sequence total: ``out[b, t] = sum of values over the entries of example
    examples[b, t]`` (0 where ``examples`` is -1). ``examples`` ``[B, L-1]`` long names the example each
    entry belongs to (:meth:`glmpost.rl.micro_batches.MicroBatch.example_ids`: a padded row is one
    example, a packed row several). Differentiable in ``values``."""
    inside = examples >= 0
    ids = torch.where(inside, examples, torch.zeros_like(examples))
    sums = values.new_zeros(int(ids.max()) + 1 if ids.numel() else 1).index_add(0, ids[inside], values[inside])
    return torch.where(inside, sums[ids], torch.zeros_like(values))


def rollout_log_ratio(train_old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``log rho_t = logp_train_old - logp_rollout`` (float64) on the action tokens; 0 (``rho_t`` 1) elsewhere
    and where either side is not finite (TRL's rule for tokens the engine could not score)."""
    delta = train_old_log_probs.double() - rollout_log_probs.double()
    return torch.where(actions & torch.isfinite(delta), delta, torch.zeros_like(delta))


def _everywhere(like: torch.Tensor) -> torch.Tensor:
    return torch.ones(like.shape, dtype=torch.bool, device=like.device)


@register_importance_correction("tis")
def token_tis(train_old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, actions: torch.Tensor,
              examples: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level truncated importance sampling (Yao et al., "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training", 2025; slime ``--use-tis``, verl ``rollout_is: token``, TRL
    ``vllm_importance_sampling_mode="token_truncate"``)::

        w_t = min(pi_train_old(y_t) / pi_rollout(y_t), C)        C = config.importance_cap

    the policy term's token loss times ``sg(w_t)``; nothing is masked."""
    log_ratio = rollout_log_ratio(train_old_log_probs, rollout_log_probs, actions)
    return torch.clamp(torch.exp(log_ratio), max=config.importance_cap).float(), _everywhere(log_ratio)


def sequence_ratio(train_old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, actions: torch.Tensor,
                   examples: torch.Tensor) -> torch.Tensor:
    """``rho_seq = prod_t rho_t = exp(sum_t log rho_t)`` over each sequence's action tokens, at each of its entries."""
    return torch.exp(per_sequence_sum(rollout_log_ratio(train_old_log_probs, rollout_log_probs, actions), examples))


@register_importance_correction("seq-tis")
def sequence_tis(train_old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, actions: torch.Tensor,
                 examples: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level truncated importance sampling, the product form (verl ``rollout_is: sequence``,
    ``rho_seq = prod_t rho_t``, docs/algo/rollout_corr.md; TRL ``vllm_importance_sampling_mode="sequence_truncate"``,
    ``exp(sum_t (logp_old - logp_sampling))``; not the geometric mean)::

        w_i = min(prod_t pi_train_old(y_t) / pi_rollout(y_t), C)     for every token of sequence i"""
    ratio = sequence_ratio(train_old_log_probs, rollout_log_probs, actions, examples)
    return torch.clamp(ratio, max=config.importance_cap).float(), _everywhere(ratio)


@register_importance_correction("mis")
def sequence_mis(train_old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, actions: torch.Tensor,
                 examples: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level masked importance sampling (Liu, Li et al., "When Speed Kills Stability: Demystifying RL
    Collapse from the Training-Inference Mismatch", 2025; TRL ``vllm_importance_sampling_mode="sequence_mask"``;
    verl's sequence IS with sequence rejection above the threshold)::

        w_i = rho_seq_i * 1[rho_seq_i <= C]        rho_seq_i = prod_t pi_train_old(y_t) / pi_rollout(y_t)

    a sequence above the cap is rejected whole (``keep`` False at all its entries: masked, not truncated);
    the others keep their untruncated sequence weight."""
    ratio = sequence_ratio(train_old_log_probs, rollout_log_probs, actions, examples)
    keep = (ratio <= config.importance_cap) | (examples < 0)
    return torch.where(keep, ratio, torch.zeros_like(ratio)).float(), keep


def correction_counts(weights: torch.Tensor, keep: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """What an importance correction did to a micro-batch, as sums (float64 ``[4]``): the weights of
    the kept action tokens, the kept action tokens, the rejected ones, the action tokens."""
    kept, rejected = actions & keep, actions & ~keep
    return torch.stack([weights.double()[kept].sum(), kept.sum().double(), rejected.sum().double(),
                        actions.sum().double()]).cpu()


def correction_metrics(totals: torch.Tensor) -> dict[str, float]:
    """``train/is_weight_mean`` (the mean weight of a kept action token) and ``train/is_rejected_fraction``
    (the action tokens a sequence-level rejection masked) from :func:`correction_counts` summed over ranks."""
    weight_sum, kept, rejected, actions = totals.tolist()
    return {"train/is_weight_mean": weight_sum / kept if kept else 0.0,
            "train/is_rejected_fraction": rejected / actions if actions else 0.0}
