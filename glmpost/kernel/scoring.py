"""Chunked scoring of given tokens: the teacher's prefill (sampled log-probs and its top-k) and the
student's gather of the teacher's top-k ids, without float32 ``[T, V]`` logits.

The formula is :func:`glmpost.kernel.logprobs.sequence_log_probs`'s (``z = float(head(h)) / tau``,
``logp = log_softmax(z)``), with the same chunking; :func:`score_records` is what
``glmpost score-teacher`` runs per teacher, :func:`score_tokens` also the trainer's forward when a
loss term needs gathered log-probs (MOPD's top-k loss).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from glmpost.kernel.chunked import DEFAULT_CHUNK_SIZE, scatter_rows
from glmpost.kernel.distribution import LOG_PROB_FLOOR, ScoredDistribution, scaled_logits
from glmpost.kernel.heads import in_head_dtype, split_causal_lm, vocab_size_of
from glmpost.kernel.logprobs import packed_positions


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
    position_ids: torch.Tensor | None = None,
    score_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
    gather_ids: torch.Tensor | None = None,
    topk: int = 0,
) -> TokenScores:
    """Causal-shifted per-token scores of a Hugging Face causal LM, ``chunk_size`` positions at a time.

    The formula is :func:`glmpost.kernel.logprobs.sequence_log_probs`'s (``z = float(head(h)) / tau``,
    ``logp = log_softmax(z)``); on top of the sampled token's log-prob it can gather the log-probs of
    given ids per position (``gather_ids [B, L-1, k]``: the student's side of the top-k loss) and
    return the model's own top-``topk`` ids and log-probs (the teacher's top-k payload). Only the
    rows in ``score_mask`` (and real tokens of ``attention_mask``) reach the LM head; the largest
    live tensors are ``[chunk_size, V]``. Under autograd each chunk runs in a non-reentrant
    checkpoint, as in :mod:`glmpost.kernel.logprobs`. Ties in the top-k follow ``torch.topk``.
    ``top_k`` / ``top_p`` restrict the distribution to the kept set as there (a gathered id outside
    it reads ``LOG_PROB_FLOOR``). ``position_ids``: packed rows, as there.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, L] with L >= 2; got {tuple(input_ids.shape)}")
    distribution = ScoredDistribution(temperature, top_k, top_p)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0; got {chunk_size}")
    scored = score_mask.clone()
    if attention_mask is not None:
        scored &= attention_mask.bool()[:, 1:]
    body, head = split_causal_lm(model)
    vocab = vocab_size_of(head)
    if topk and vocab is not None and topk > vocab:
        raise ValueError(f"top-k {topk} exceeds the vocabulary size {vocab}")
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   **packed_positions(position_ids, attention_mask, input_ids))
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    with torch.autocast(hidden.device.type, enabled=False):  # the head in its weight's dtype (in_head_dtype)
        return _head_scores(in_head_dtype(hidden[:, :-1], head), input_ids[:, 1:], scored, gather_ids, vocab,
                            functools.partial(_chunk_scores, head=head, distribution=distribution,
                                              return_entropy=return_entropy, topk=topk), chunk_size)


def _head_scores(hidden, targets, scored, gather_ids, vocab, fn, chunk_size) -> TokenScores:
    """:func:`score_tokens` after the body: ``fn`` (:func:`_chunk_scores`) over the scored rows of
    ``hidden`` ``[B, L-1, H]``, ``chunk_size`` at a time."""
    rows = hidden[scored]
    targets = targets[scored].long()
    ids = gather_ids[scored].long() if gather_ids is not None else None
    if vocab is not None and targets.numel():
        high = int(targets.max()) if ids is None else max(int(targets.max()), int(ids.max()))
        if int(targets.min()) < 0 or high >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got max {high}")
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
            return scatter_rows(values, scored)
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
    distribution: ScoredDistribution,
    return_entropy: bool,
    topk: int,
):
    """``(logp[targets], entropy, logp[ids], topk ids, topk logp)`` of one chunk; Nones where not asked."""
    logits = scaled_logits(head(rows).float(), distribution, inplace=False)
    log_softmax = torch.log_softmax(logits, dim=-1)
    del logits
    floor = (lambda t: t.clamp(min=LOG_PROB_FLOOR)) if distribution.filtered else (lambda t: t)
    log_prob = floor(log_softmax.gather(-1, targets[:, None]).squeeze(-1))
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if return_entropy else None
    gathered = floor(log_softmax.gather(-1, ids)) if ids is not None else None
    top_ids = top_lp = None
    if topk:
        top = torch.topk(log_softmax, topk, dim=-1)
        top_ids, top_lp = top.indices, top.values
    return log_prob, entropy, gathered, top_ids, top_lp


@dataclass
class TeacherPayload:
    """One record's teacher fields, ``T`` = its response length; NaN / 0 off the action tokens."""

    log_probs: np.ndarray  # float32 [T]
    topk_ids: np.ndarray | None = None  # int32 [T, k]
    topk_log_probs: np.ndarray | None = None  # float32 [T, k]


def joined_payload(parts: list[TeacherPayload]) -> TeacherPayload:
    """One record's payload from its context windows' payloads, in order (a record without
    compaction: its one payload)."""
    if len(parts) == 1:
        return parts[0]
    join = lambda name: None if getattr(parts[0], name) is None else np.concatenate([getattr(p, name) for p in parts])
    return TeacherPayload(join("log_probs"), join("topk_ids"), join("topk_log_probs"))


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
