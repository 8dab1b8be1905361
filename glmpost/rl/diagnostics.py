"""Batch diagnostics: metrics of a batch on the weights before the update, registered by name.

A diagnostic has one signature, ``(examples, old, all_reduce_sum) -> metrics``: ``examples`` the
global batch, ``old`` this rank's :class:`~glmpost.rl.trainer.OldPolicyStats` (old log-probs of the
examples it owns), ``all_reduce_sum`` the backend's sum over ranks. The trainer computes the ones
``config.diagnostics()`` names once per update and logs them with every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from glmpost.registry import Registry
from glmpost.rl.losses import sampled_reverse_kl

Diagnostic = Callable[[Any, Any, Callable[[torch.Tensor], torch.Tensor]], dict[str, float]]
BATCH_DIAGNOSTICS: Registry[Diagnostic] = Registry("batch diagnostic")
register_diagnostic = BATCH_DIAGNOSTICS.register


def _response_slice(example, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An example's ``[L-1]`` entries that score its response tokens, and its action mask."""
    start = example.prompt_length - 1
    actions = torch.from_numpy(example.action_mask)
    return values[start : start + len(actions)], actions


@register_diagnostic("mismatch")
def mismatch(examples, old, all_reduce_sum) -> dict[str, float]:
    """Train-vs-rollout mismatch on the same weights (what IcePop sees): mean |logp_train -
    logp_rollout| and the k3 estimate of KL(pi_infer || pi_train) over the action tokens."""
    deltas = []
    for index, old_lp in old.old_log_probs.items():
        example = examples[index]
        train, actions = _response_slice(example, old_lp)
        rollout = torch.from_numpy(example.rollout_log_probs.astype(np.float32))[actions]
        deltas.append((train[actions] - rollout).double())
    delta = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)
    # k3 estimate of KL(pi_infer || pi_train) from tokens sampled by the rollout engine:
    # r = pi_train / pi_infer, k3 = r - 1 - log r.
    sums = torch.tensor(
        [delta.abs().sum(), (torch.exp(delta) - delta - 1).sum(), float(delta.numel())], dtype=torch.float64
    )
    total = all_reduce_sum(sums).tolist()
    count = max(total[2], 1.0)
    return {
        "train/mismatch_abs_logp_mean": total[0] / count,
        "train/mismatch_k3_kl": total[1] / count,
    }


@register_diagnostic("teacher_kl")
def teacher_kl(examples, old, all_reduce_sum) -> dict[str, float]:
    """``teacher_kl/<domain>``: mean of log pi_theta - log pi_T over the domain's action tokens (the
    sampled reverse KL to the routed teacher, before the update), its token count, and the mean
    over all domains (``train/teacher_kl``)."""
    domains = sorted({e.domain for e in examples})
    sums = torch.zeros(2 * len(domains), dtype=torch.float64)
    for index, old_lp in old.old_log_probs.items():
        example = examples[index]
        student, actions = _response_slice(example, old_lp)
        teacher = torch.from_numpy(example.token_fields["teacher_log_probs"].astype(np.float32))
        kl = sampled_reverse_kl(student, teacher, actions)
        d = domains.index(example.domain)
        sums[2 * d] += kl.sum()
        sums[2 * d + 1] += float(actions.sum())
    total = all_reduce_sum(sums).tolist()
    metrics = {}
    for d, domain in enumerate(domains):
        name = domain or "none"
        metrics[f"teacher_kl/{name}"] = total[2 * d] / max(total[2 * d + 1], 1.0)
        metrics[f"teacher_tokens/{name}"] = total[2 * d + 1]
    metrics["train/teacher_kl"] = sum(total[0::2]) / max(sum(total[1::2]), 1.0)
    return metrics
