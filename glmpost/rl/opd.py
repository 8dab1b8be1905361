"""On-policy distillation (OPD) and multi-teacher OPD (MOPD) as small tensor functions.

Brief, "OPD：把教师变成逐 token 优势": the student samples ``y ~ pi_theta(.|x)``; the teacher scores
every state ``s_t = (x, y_<t)`` the student actually visited, and the log-ratio replaces the RL
advantage::

    A_t^OPD = sg[ log pi_T(y_t|s_t) - log pi_theta(y_t|s_t) ]          (group size 1)

which is the policy-gradient form of the sampled reverse KL: only the teacher's log-prob of the
sampled token is needed, never the ``[tokens, vocab]`` logits. Brief, "MOPD：能力整合发生在策略空间":
each trajectory is hard-routed by its domain to one teacher; the top-k variant minimises the reverse
KL over the teacher's top-k set with the correction ``pi_T(v) - pi_theta(v)`` so the optimum on that
set is still teacher = student.

Shapes: ``[B, T]`` one value per token, ``[B, T, k]`` one per top-k candidate. Masks are ``bool``;
observation tokens (tool output, copied context) are never in a mask and get no teacher signal.
The chunked scorers at the bottom compute per-token teacher / student values without materialising
float32 ``[T, V]`` logits (the same chunking as :mod:`glmpost.closure.logprobs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from glmpost.closure.logprobs import (
    DEFAULT_CHUNK_SIZE,
    _scatter_rows,
    _split_causal_lm,
    _vocab_size,
)

__all__ = [
    "TeacherPayload",
    "TokenScores",
    "opd_advantages",
    "opd_pg_loss",
    "payload_from_rows",
    "sampled_reverse_kl",
    "score_records",
    "score_tokens",
    "topk_reverse_kl",
]


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


# --------------------------------------------------------------------------------------------
# Chunked scoring: teacher prefill (sampled log-probs and top-k) and the student's top-k gather.


@dataclass(frozen=True)
class TokenScores:
    """Result of :func:`score_tokens`; every ``[B, L-1]`` entry is 0 where ``mask`` is False.

    Attributes:
        log_probs: float32 ``[B, L-1]`` log-prob of ``input_ids[:, t+1]``.
        mask: bool ``[B, L-1]`` scored entries.
        entropy: float32 ``[B, L-1]`` or None.
        gathered: float32 ``[B, L-1, k]`` log-probs of the given ``gather_ids`` or None.
        topk_ids: int64 ``[B, L-1, k]`` the model's own ``k`` most likely ids (descending) or None.
        topk_log_probs: float32 ``[B, L-1, k]`` their log-probs or None.
    """

    log_probs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None


def score_tokens(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    score_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
    gather_ids: torch.Tensor | None = None,
    topk: int = 0,
) -> TokenScores:
    """Causal-shifted per-token scores of a Hugging Face causal LM, ``chunk_size`` positions at a time.

    The formula is :func:`glmpost.closure.logprobs.sequence_log_probs`'s (``z = float(head(h)) / tau``,
    ``logp = log_softmax(z)``); on top of the sampled token's log-prob it can gather the log-probs of
    given ids per position (``gather_ids [B, L-1, k]``: the student's side of the top-k loss) and
    return the model's own top-``topk`` ids and log-probs (the teacher's top-k payload). Only the
    rows in ``score_mask`` (and real tokens of ``attention_mask``) reach the LM head; the largest
    live tensors are ``[chunk_size, V]``. Under autograd each chunk runs in a non-reentrant
    checkpoint, as in :mod:`glmpost.closure.logprobs`. Ties in the top-k follow ``torch.topk``.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, L] with L >= 2; got {tuple(input_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0; got {chunk_size}")
    scored = score_mask.clone()
    if attention_mask is not None:
        scored &= attention_mask.bool()[:, 1:]
    body, head = _split_causal_lm(model)
    vocab = _vocab_size(head)
    if topk and vocab is not None and topk > vocab:
        raise ValueError(f"top-k {topk} exceeds the vocabulary size {vocab}")
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    rows = hidden[:, :-1][scored]
    targets = input_ids[:, 1:][scored].long()
    ids = gather_ids[scored].long() if gather_ids is not None else None
    if vocab is not None and targets.numel():
        high = int(targets.max()) if ids is None else max(int(targets.max()), int(ids.max()))
        if int(targets.min()) < 0 or high >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got max {high}")
    fn = functools.partial(_chunk_scores, head=head, temperature=temperature, return_entropy=return_entropy, topk=topk)
    parts: list[tuple] = []
    use_checkpoint = torch.is_grad_enabled()
    for begin in range(0, max(rows.shape[0], 1), chunk_size):
        args = (rows[begin : begin + chunk_size], targets[begin : begin + chunk_size],
                None if ids is None else ids[begin : begin + chunk_size])
        parts.append(checkpoint(fn, *args, use_reentrant=False) if use_checkpoint else fn(*args))

    def joined(i: int, dtype=torch.float32):
        if parts[0][i] is None:
            return None
        values = torch.cat([p[i] for p in parts])
        if values.dim() == 1:
            return _scatter_rows(values, scored)
        out = torch.zeros((*scored.shape, values.shape[-1]), dtype=dtype, device=values.device)
        return out.masked_scatter(scored[..., None], values.to(dtype)) if values.numel() else out

    return TokenScores(
        log_probs=joined(0), mask=scored, entropy=joined(1), gathered=joined(2),
        topk_ids=joined(3, torch.long), topk_log_probs=joined(4),
    )


def _chunk_scores(
    rows: torch.Tensor,
    targets: torch.Tensor,
    ids: torch.Tensor | None,
    *,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    return_entropy: bool,
    topk: int,
):
    """``(logp[targets], entropy, logp[ids], topk ids, topk logp)`` of one chunk; Nones where not asked."""
    logits = head(rows).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    del logits
    log_prob = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if return_entropy else None
    gathered = log_softmax.gather(-1, ids) if ids is not None else None
    top_ids = top_lp = None
    if topk:
        top = torch.topk(log_softmax, topk, dim=-1)
        top_ids, top_lp = top.indices, top.values
    return log_prob, entropy, gathered, top_ids, top_lp


# --------------------------------------------------------------------------------------------
# Teacher scoring of trajectory records (what `glmpost score-teacher` runs per teacher)


@dataclass
class TeacherPayload:
    """One record's teacher fields, ``T`` = its response length; NaN / 0 off the action tokens."""

    log_probs: np.ndarray  # float32 [T]
    topk_ids: np.ndarray | None = None  # int32 [T, k]
    topk_log_probs: np.ndarray | None = None  # float32 [T, k]


def payload_from_rows(log_probs, actions, topk_ids=None, topk_log_probs=None) -> TeacherPayload:
    """Teacher fields of one record from per-response-token rows; observations get no signal."""
    actions = np.asarray(actions, dtype=bool)
    lp = np.where(actions, np.asarray(log_probs, dtype=np.float32), np.float32("nan")).astype(np.float32)
    if topk_ids is None:
        return TeacherPayload(lp)
    ids = np.where(actions[:, None], np.asarray(topk_ids), 0).astype(np.int32)
    top = np.where(actions[:, None], np.asarray(topk_log_probs, dtype=np.float32), np.float32("nan")).astype(np.float32)
    return TeacherPayload(lp, ids, top)


@torch.no_grad()
def score_records(
    model: torch.nn.Module,
    records: list[dict],
    *,
    topk: int = 0,
    batch_size: int = 8,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    pad_token_id: int = 0,
) -> list[TeacherPayload]:
    """Teacher prefill on exactly each record's ``prompt_token_ids + response_token_ids`` at temperature 1.

    Records are scored ``batch_size`` at a time (right-padded, sorted by length so padding stays
    small) with :func:`score_tokens`, so the largest logits buffer is ``[chunk_size, V]`` whatever
    the batch. Only action tokens (``action_mask & ~observation_mask``) reach the LM head; every
    other response token gets NaN (and top-k id 0): observations carry no teacher signal.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_token_ids"]) + len(records[i]["response_token_ids"]))
    results: list[TeacherPayload | None] = [None] * len(records)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows = [records[i] for i in chunk]
        lengths = [len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in rows]
        width = max(max(lengths), 2)
        input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        score_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
        for row, record in enumerate(rows):
            p, n = len(record["prompt_token_ids"]), lengths[row]
            ids = np.concatenate([record["prompt_token_ids"], record["response_token_ids"]]).astype(np.int64)
            input_ids[row, :n] = torch.from_numpy(ids)
            attention[row, :n] = 1
            score_mask[row, p - 1 : n - 1] = torch.from_numpy(record["action_mask"] & ~record["observation_mask"])
        scores = score_tokens(model, input_ids.to(device), attention.to(device), score_mask=score_mask.to(device),
                              chunk_size=chunk_size, topk=topk)
        for row, (index, record) in enumerate(zip(chunk, rows)):
            p, n = len(record["prompt_token_ids"]), lengths[row]
            actions = record["action_mask"] & ~record["observation_mask"]
            if topk:
                results[index] = payload_from_rows(scores.log_probs[row, p - 1 : n - 1].cpu().numpy(), actions,
                                                   scores.topk_ids[row, p - 1 : n - 1].cpu().numpy(),
                                                   scores.topk_log_probs[row, p - 1 : n - 1].cpu().numpy())
            else:
                results[index] = payload_from_rows(scores.log_probs[row, p - 1 : n - 1].cpu().numpy(), actions)
    return results  # type: ignore[return-value]
