"""Loss terms: the pieces an update's loss is the sum of, registered by name.

A loss term has one signature, ``(inputs) -> (per_token_values, metrics)``: ``inputs`` is a
:class:`LossInputs` (one micro-batch's forward, old log-probs, advantages, trust mask, reference
log-probs), ``per_token_values`` ``[B, L-1]`` and ``metrics`` named detached sums over the micro-batch
that the trainer divides by the global trusted-token count. For each term of
``config.loss_terms()`` the trainer adds ``coefficient * masked_sum_over(values, trust, trusted)``,
the sum over trusted tokens divided by their number in the whole mini-batch, so the gradient does
not depend on the micro-batch or data-parallel split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glmpost.kernel.trust_masks import per_sequence_sum
from glmpost.registry import Registry


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


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, *,
               clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's per-token loss (brief, SAO: the value model ``V_phi``), PPO's value clipping
    optional (as verl's ``compute_value_loss``):

        l_t = 0.5 * (V_t - R_t)^2                                              (clip None)
        l_t = 0.5 * max((V_t - R_t)^2, (clamp(V_t, V_old - c, V_old + c) - R_t)^2)   (clip c)

    ``returns`` ``R_t = A_t + V_old_t`` (:func:`~glmpost.rl.advantages.skip_observation_gae`).
    Returns ``(losses [B, T], clipped [B, T] bool)``: where the clipped term is the larger one.
    Reduce with :func:`masked_sum_over` over the action tokens.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


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


# (counts [N] float64 per example, config) -> (weights [N], denominator): how a mini-batch's per-token
# losses are averaged, by name (``config.loss_normalization``); the trainer sums the denominator over
# ranks and divides ``sum_e weight_e * sum_{t in e} l_t`` by it.
LOSS_NORMALIZATIONS: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry("loss normalization")
register_loss_normalization = LOSS_NORMALIZATIONS.register


@register_loss_normalization("token")
def token_level_normalization(counts: torch.Tensor, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level normalisation (brief, CompactionRL: the PPO loss over all trainable tokens ``M``)::

        L = -1/|M| * sum_{(s,i) in M} l_{s,i}         weights 1, denominator |M| = sum_s |M_s|

    Every trusted token weighs the same, whichever segment (context window) and trajectory it is
    in, so a trajectory that was compacted more often (more, shorter segments) is not up-weighted.
    ``counts``: the tokens each example (segment) contributes."""
    return torch.ones_like(counts), counts.sum()


@register_loss_normalization("segment")
def segment_mean_normalization(counts: torch.Tensor, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-segment mean token-level normalisation replaces (verl's ``seq-mean-token-mean``; the
    original GRPO's, TRL ``loss_type="grpo"``)::

        L = -1/K * sum_s 1/|M_s| * sum_{i in M_s} l_{s,i}     weights 1/|M_s|, denominator K

    over the ``K`` segments with a token: every segment weighs the same, so a trajectory cut into
    more segments by compaction counts more times (the bias CompactionRL removes)."""
    present = counts > 0
    return torch.where(present, 1.0 / counts.clamp(min=1.0), torch.zeros_like(counts)), present.sum().to(counts.dtype)


@register_loss_normalization("dapo")
def dapo_normalization(counts: torch.Tensor, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO's token-level policy-gradient loss (Yu et al., "DAPO", arXiv 2503.14476, Eq. 12; TRL
    ``loss_type="dapo"``): every token of the optimizer step's global batch weighs the same::

        L = 1 / sum_i |o_i| * sum_i sum_t l_{i,t}

    It is ``token``: glmpost's denominator is already the whole mini-batch's count across micro-batches
    and ranks (``--loss-denominator action`` counts every action token as DAPO and TRL do; ``trusted``,
    the default, leaves out the tokens a trust mask dropped)."""
    return token_level_normalization(counts)


@register_loss_normalization("bnpo")
def bnpo_normalization(counts: torch.Tensor, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``loss_type="bnpo"``: the token mean over "the local batch". glmpost never normalises by
    a micro-batch or one rank (the gradient is split-invariant), so its batch is the mini-batch and
    this equals ``dapo`` / ``token``; TRL's equals them with one micro-batch on one process."""
    return token_level_normalization(counts)


@register_loss_normalization("dr_grpo")
def dr_grpo_normalization(counts: torch.Tensor, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO's constant normaliser (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783,
    Sec. 3.1: ``1/|o_i|`` replaced by a constant ``MAX_TOKENS``; TRL ``loss_type="dr_grpo"``, constant
    ``max_completion_length``)::

        L = 1 / (N * MAX_TOKENS) * sum_i sum_t l_{i,t}       weights 1, denominator N * config.dr_grpo_max_tokens

    over the mini-batch's ``N`` examples (sequences; a compacted record's context windows each), every
    one counted whatever its length or how many of its tokens a mask dropped: no length bias."""
    return torch.ones_like(counts), torch.tensor(float(counts.numel() * config.dr_grpo_max_tokens), dtype=counts.dtype)


def opd_pg_loss(log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, denominator: float) -> torch.Tensor:
    """The brief's OPD loss, policy-gradient form with group size 1::

        L = - sum_{t in mask} A_t * log pi_theta(y_t|s_t) / denominator

    ``advantages`` carries no gradient (see :func:`opd_advantages`), so the gradient is
    ``-A_t * grad log pi_theta``: the teacher term is a constant. The trainer runs the same term as
    ``-A_t * r_t`` with ``r_t = pi_theta / pi_theta_old`` (PPO-style, equal gradient at ``r_t = 1``).
    """
    if denominator <= 0:
        return (log_probs * 0).sum()
    terms = -advantages.detach() * log_probs
    return torch.where(mask, terms, torch.zeros_like(terms)).sum() / denominator


def sampled_reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token sampled reverse KL (the k1 estimator of KL(pi_theta || pi_T) on student samples)::

        k_t = log pi_theta(y_t|s_t) - log pi_T(y_t|s_t)      where mask_t, else 0

    Its mean over action tokens is ``teacher_kl/<domain>`` in ``opd-merge``'s metrics; it is ``-A_t``
    of :func:`opd_advantages` without the task term.
    """
    delta = student_log_probs.double() - teacher_log_probs.double()
    return torch.where(mask, delta, torch.zeros_like(delta))


def topk_reverse_kl(
    student_topk_log_probs: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: bool = True,
) -> torch.Tensor:
    """Reverse KL restricted to the teacher's top-k set ``S_t``, with the MOPD correction
    (brief, "MOPD：能力整合发生在策略空间"; ``p = pi_theta``, ``q = pi_T``, both full-vocabulary
    probabilities of the candidates ``v in S_t``)::

        l_t = sum_{v in S_t} [ p(v) (log p(v) - log q(v)) + (q(v) - p(v)) ]    where mask_t, else 0

    Without the ``q - p`` term, ``d l / d p(v) = log(p/q) + 1`` vanishes at ``p = q / e``: the truncated
    KL pushes student mass out of ``S_t``. With it, ``d l / d p(v) = log(p/q)`` vanishes at ``p = q``:
    the optimum on the top-k set is the teacher's own probabilities, so the student's distribution
    renormalised on ``S_t`` is the teacher's renormalised on ``S_t``. Each term is ``>= 0`` (it is
    ``q * phi(p/q)`` with ``phi(x) = x log x - x + 1``), 0 exactly at ``p = q``. The teacher side
    carries no gradient.

    Args:
        student_topk_log_probs: ``[B, T, k]`` log pi_theta of the teacher's top-k ids (with grad).
        teacher_topk_log_probs: ``[B, T, k]`` the teacher's log-probs of its top-k ids (NaN off mask).
        mask: bool ``[B, T]``.
        correction: add ``q - p`` (MOPD); ``False`` gives the plain truncated reverse KL.
    Returns:
        ``[B, T]`` float per-token losses.
    """
    selected = mask[..., None].expand_as(student_topk_log_probs)
    # Off the mask the teacher may be NaN: replace it by the student's value so the term is an exact
    # 0 and no NaN reaches the backward pass (NaN * 0 is NaN).
    teacher = torch.where(selected, teacher_topk_log_probs.detach(), student_topk_log_probs.detach())
    log_p = student_topk_log_probs
    p = log_p.exp()
    terms = p * (log_p - teacher)
    if correction:
        terms = terms + (teacher.exp() - p)
    per_token = terms.sum(-1)
    return torch.where(mask, per_token, torch.zeros_like(per_token))


@dataclass
class LossInputs:
    """What every loss term sees for one micro-batch (``[B, L-1]`` unless noted)."""

    forward: Any  # the policy's forward with grad: log_probs, entropy (and gathered [B, L-1, k])
    old_log_probs: torch.Tensor
    advantages: torch.Tensor  # broadcastable to [B, L-1]
    trust: torch.Tensor  # bool: the update's final mask
    batch: Any  # the MicroBatch (token_fields: teacher payloads)
    ref_log_probs: torch.Tensor | None
    config: Any


@dataclass(frozen=True)
class LossTerm:
    """A registered term: its function, its coefficient read from the config, the metrics it
    returns (every rank sums the same names), the metric its weighted contribution is logged as (a
    total; None: not logged), and the token field of ids whose log-probs the forward must gather."""

    fn: Callable[[LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    coefficient: Callable[[Any], float]
    metrics: tuple[str, ...] = ()
    logged_as: str | None = None
    gather: str | None = None


LOSS_TERMS: Registry[LossTerm] = Registry("loss term")


def register_loss_term(name: str, *, coefficient: Callable[[Any], float] = lambda config: 1.0,
                       metrics: tuple[str, ...] = (), logged_as: str | None = None, gather: str | None = None):
    """``@register_loss_term("name", ...)``: the function and how the trainer weighs and logs it."""
    return lambda fn: LOSS_TERMS.add(name, LossTerm(fn, coefficient, metrics, logged_as, gather)).fn


def trusted_sum(values: torch.Tensor, trust: torch.Tensor) -> torch.Tensor:
    """``sum(values where trust)``: a metric's numerator."""
    return torch.where(trust, values, torch.zeros_like(values)).sum()


def clip_metrics(terms: PolicyLossTerms, trust: torch.Tensor) -> dict[str, torch.Tensor]:
    """A clipped policy term's metric sums: clipped trusted tokens and the ratio over trusted tokens."""
    return {"train/clip_fraction": (terms.clipped & trust).sum(), "train/ratio_mean": trusted_sum(terms.ratio, trust)}


@register_loss_term("policy", metrics=("train/clip_fraction", "train/ratio_mean"), logged_as="train/pg_loss")
def policy_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy gradient (:func:`clipped_policy_loss` with ``eps_low`` / ``eps_high``)."""
    config = inputs.config
    terms = clipped_policy_loss(inputs.forward.log_probs, inputs.old_log_probs, inputs.advantages,
                                eps_low=config.eps_low, eps_high=config.eps_high)
    return terms.losses, clip_metrics(terms, inputs.trust)


def gspo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                     trust: torch.Tensor, examples: torch.Tensor, *, eps_low: float, eps_high: float) -> PolicyLossTerms:
    """GSPO's sequence-level clipped objective (Zheng et al., "Group Sequence Policy Optimization",
    arXiv 2507.18071, Eq. 5-7; TRL ``importance_sampling_level="sequence"``)::

        s_i = exp( 1/|y_i| * sum_{t in y_i} (logp_theta(y_t) - logp_old(y_t)) )      length-normalised
        l_t = -min(s_i * A_t, clip(s_i, 1 - eps_low, 1 + eps_high) * A_t)          each token t of sequence i

    ``y_i``: the sequence's trusted tokens (``examples`` says which entries are whose,
    :meth:`~glmpost.rl.micro_batches.MicroBatch.example_ids`), so a masked token leaves the ratio too. The
    clip is one decision per sequence; with a sequence's advantage ``A_i`` this is GSPO-token (Eq. 11) as
    well, the same value and gradient. The paper's clip range is 3e-4 / 4e-4 (``--eps-low`` / ``--eps-high``).
    """
    log_ratio = torch.where(trust, log_probs - old_log_probs, torch.zeros_like(log_probs))
    lengths = per_sequence_sum(trust.to(log_ratio.dtype), examples).clamp(min=1.0)
    ratio = torch.exp(per_sequence_sum(log_ratio, examples) / lengths)
    unclipped = ratio * advantages
    clipped_term = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    losses = -torch.minimum(unclipped, clipped_term)
    return PolicyLossTerms(losses=losses, ratio=ratio.detach(), clipped=(clipped_term < unclipped).detach())


def cispo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, *,
                      eps_low: float, eps_high: float) -> PolicyLossTerms:
    """CISPO (MiniMax, "MiniMax-M1", arXiv 2506.13585, Eq. 4-5; ROLL ``cispo``; TRL ``loss_type="cispo"``
    with ``epsilon_high`` = 1 + eps_high)::

        r_t = exp(logp_theta - logp_old)
        l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_theta(y_t)

    The importance weight is clipped and carries no gradient; the token itself is never dropped (a PPO
    clip zeroes a clipped token's gradient, here it keeps ``-w_t A_t grad logp``). ``clipped`` marks
    tokens whose weight was clipped."""
    ratio = torch.exp(log_probs - old_log_probs).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return PolicyLossTerms(losses=-weight * advantages * log_probs, ratio=ratio, clipped=weight != ratio)


def dis_policy_loss(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, advantages: torch.Tensor) -> PolicyLossTerms:
    """The policy term of Direct Double-Sided IS (brief, "Direct Double-Sided Importance Sampling").

        r_t = exp(logp_theta - logp_rollout)      l_t = -r_t * A_t

    on the tokens the DIS mask keeps (``1 - dis_low < r_t < 1 + dis_high``, :func:`glmpost.kernel.trust_masks.dis_mask`,
    applied by the trainer as the final mask): the ratio is to the behaviour policy the rollout
    recorded, not to a rebuilt old policy, and it is masked, not clipped (its gradient is
    ``-r_t A_t grad log pi_theta``). ``rollout_log_probs`` may be NaN off the actions; those entries
    read the detached ``log_probs`` (ratio 1) so no NaN reaches the gradient.
    """
    behaviour = torch.where(torch.isfinite(rollout_log_probs), rollout_log_probs, log_probs.detach())
    ratio = torch.exp(log_probs - behaviour)
    return PolicyLossTerms(losses=-ratio * advantages, ratio=ratio.detach(), clipped=torch.zeros_like(ratio, dtype=torch.bool))


@register_loss_term("dis_policy", metrics=("train/ratio_mean",), logged_as="train/pg_loss")
def dis_policy_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DIS policy gradient (:func:`dis_policy_loss`), the policy term when the ``dis`` mask is on."""
    terms = dis_policy_loss(inputs.forward.log_probs, inputs.batch.rollout_log_probs, inputs.advantages)
    return terms.losses, {"train/ratio_mean": trusted_sum(terms.ratio, inputs.trust)}


@register_loss_term("gspo", metrics=("train/clip_fraction", "train/ratio_mean"), logged_as="train/pg_loss")
def gspo_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GSPO policy term (:func:`gspo_policy_loss` with ``eps_low`` / ``eps_high``), ``--policy-loss gspo``;
    ``train/ratio_mean`` is the sequence ratio's mean per trusted token."""
    config = inputs.config
    terms = gspo_policy_loss(inputs.forward.log_probs, inputs.old_log_probs, inputs.advantages, inputs.trust,
                             inputs.batch.example_ids(), eps_low=config.eps_low, eps_high=config.eps_high)
    return terms.losses, clip_metrics(terms, inputs.trust)


@register_loss_term("cispo", metrics=("train/clip_fraction", "train/ratio_mean"), logged_as="train/pg_loss")
def cispo_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The CISPO policy term (:func:`cispo_policy_loss` with ``cispo_eps_low`` / ``cispo_eps_high``),
    ``--policy-loss cispo``."""
    config = inputs.config
    terms = cispo_policy_loss(inputs.forward.log_probs, inputs.old_log_probs, inputs.advantages,
                              eps_low=config.cispo_eps_low, eps_high=config.cispo_eps_high)
    return terms.losses, clip_metrics(terms, inputs.trust)


@register_loss_term("topk_reverse_kl", metrics=("train/topk_kl",), gather="teacher_topk_ids")
def topk_reverse_kl_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MOPD's reverse KL on the teacher's top-k set (:func:`topk_reverse_kl`, ``topk_correction``)."""
    per_token = topk_reverse_kl(inputs.forward.gathered, inputs.batch.token_fields["teacher_topk_log_probs"],
                                inputs.trust, correction=inputs.config.topk_correction)
    return per_token, {"train/topk_kl": per_token.detach().sum()}


@register_loss_term("kl", coefficient=lambda config: config.kl_coef, metrics=("train/kl_ref_k3",))
def kl_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The k3 KL to the reference policy (:func:`k3_kl`), weighted by ``kl_coef``."""
    kl = k3_kl(inputs.forward.log_probs, inputs.ref_log_probs)
    return kl, {"train/kl_ref_k3": trusted_sum(kl, inputs.trust).detach()}


@register_loss_term("entropy", coefficient=lambda config: -config.entropy_coef)
def entropy_term(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The entropy bonus, ``-entropy_coef * H`` (``train/entropy`` is logged whether or not it is on)."""
    return inputs.forward.entropy, {}
