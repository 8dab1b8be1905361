"""Per-token log-probs of given token ids, chunked so float32 ``[T, V]`` logits never exist whole.

Every stage that needs ``log pi(token | prefix)`` (the trainer's loss, the rollout recompute of old
log-probs, teacher scoring, ``diff-logprobs``) calls :func:`sequence_log_probs`, so train, rollout
and teacher agree on one formula (DESIGN.md section 5, "Actions and probabilities").

The formula, for hidden states ``h_t`` from the decoder body, LM head ``W`` (and bias ``b``) and
sampling temperature ``tau > 0``::

    z_t       = float32(W h_t + b) / tau                  # [V], the temperature-scaled logits
    logp_t    = log_softmax(z_t)[y_t] = z_t[y_t] - logsumexp_v z_t[v]
    entropy_t = -sum_v p_t[v] log p_t[v]                  # p_t = softmax(z_t)
              = logsumexp_v z_t[v] - sum_v p_t[v] z_t[v]  # computed as the first form

The log-probs are those of the temperature-scaled distribution ``softmax(logits / tau)``: the one a
rollout engine samples from at temperature ``tau``. ``tau = 1`` gives the model's own distribution.
With a top-k / top-p filter (``top_k``, ``top_p``) they are those of the truncated, renormalised
distribution the engine samples from (a record's ``sampling.log_prob_kind`` ``sampled``): ``z`` off
the kept set is ``MASKED_LOGIT`` before the softmax (:mod:`glmpost.kernel.distribution`). The kept
set is recomputed per chunk (a sort of ``[chunk_size, V]`` when top-p is on) and again in backward.

The chunked core (memory, the fused linear head): :mod:`glmpost.kernel.chunked`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from glmpost.kernel.chunked import DEFAULT_CHUNK_SIZE, TokenLogProbs, check_temperature_and_chunk, chunked_log_probs
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.heads import in_head_dtype, plain_linear, split_causal_lm, vocab_size_of

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TokenLogProbs",
    "sequence_log_probs",
    "token_log_probs_from_hidden",
]


def token_log_probs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
) -> TokenLogProbs:
    """Log-prob (and entropy) of ``targets`` under ``softmax((hidden @ W.T + b).float() / tau)``,
    restricted to the tokens top-k / top-p keep when those are on (see :func:`sequence_log_probs`).

    A pure tensor function: ``logp[i] = log_softmax(z_i)[targets[i]]`` with
    ``z_i = float32(hidden[i] @ lm_head_weight.T + lm_head_bias) / temperature``, computed
    ``chunk_size`` rows at a time (see the module docstring for the entropy formula and memory).

    Args:
        hidden: ``[..., H]`` hidden states (any float dtype, same as the weight's).
        lm_head_weight: ``[V, H]``.
        targets: ``[...]`` integer token ids in ``[0, V)`` (only checked where ``mask`` is True).
        lm_head_bias: optional ``[V]``.
        mask: optional bool ``[...]``; rows where it is False are skipped and read 0.0.
        temperature: ``tau > 0``.
        top_k, top_p: the sampling filter (0 and 1.0: off).
        chunk_size: rows per chunk, > 0.
        return_entropy: also return the entropy per row.

    Returns:
        :class:`TokenLogProbs` with float32 ``[...]`` tensors.

    Raises:
        ValueError: on a non-positive temperature or chunk size, mismatched shapes or dtypes, or a
            target outside the vocabulary.
    """
    if hidden.dim() < 1 or lm_head_weight.dim() != 2:
        raise ValueError(
            f"hidden must be [..., H] and lm_head_weight [V, H]; got {tuple(hidden.shape)} "
            f"and {tuple(lm_head_weight.shape)}"
        )
    if hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is {tuple(hidden.shape)} but lm_head_weight is "
            f"{tuple(lm_head_weight.shape)} (expected [V, {hidden.shape[-1]}])"
        )
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(
            f"hidden dtype {hidden.dtype} differs from lm_head_weight dtype {lm_head_weight.dtype}"
        )
    if lm_head_bias is not None and tuple(lm_head_bias.shape) != (lm_head_weight.shape[0],):
        raise ValueError(
            f"lm_head_bias must be [V] = [{lm_head_weight.shape[0]}]; "
            f"got {tuple(lm_head_bias.shape)}"
        )
    head = functools.partial(F.linear, weight=lm_head_weight, bias=lm_head_bias)
    return chunked_log_probs(
        hidden,
        head,
        lm_head_weight.shape[0],
        targets,
        mask=mask,
        distribution=ScoredDistribution(temperature, top_k, top_p),
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        linear=(lm_head_weight, lm_head_bias),
    )


def sequence_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    response_start: int | torch.Tensor | None = None,
    score_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
) -> TokenLogProbs:
    """Causal-shifted per-token log-probs of ``input_ids`` under a Hugging Face causal LM.

    Entry ``[b, t]`` (``0 <= t < L-1``) is ``log p_tau(input_ids[b, t+1] | input_ids[b, :t+1])``,
    where ``p_tau = softmax(logits / temperature)`` is the distribution a rollout engine samples
    from at that temperature. Runs the decoder body once (``use_cache=False``), then applies the
    model's own LM head module chunk by chunk via the same code as
    :func:`token_log_probs_from_hidden`: a bare ``nn.Linear`` head through the fused path, any other
    head as a module call (so fake-quant heads and ZeRO-3 parameter gathering behave as in
    ``model(...)``). Gradients flow to the body and the
    head when grad is enabled and equal those of ``log_softmax(model(...).logits.float())``.

    Args:
        model: a causal LM exposing ``get_output_embeddings()`` and a decoder body
            (``get_decoder()``, ``.model`` or ``.base_model``) returning ``last_hidden_state``.
        input_ids: int ``[B, L]``, ``L >= 2``.
        attention_mask: optional ``[B, L]``, 1 for real tokens; batches must be right-padded
            (each row is ones then zeros); None means no padding.
        position_ids: optional int ``[B, L]`` for packed rows (several sequences one after
            another, positions restarting at 0 for each, no ``attention_mask``): the body keeps
            attention within each sequence (transformers' packed-sequence mask, glmpost's native
            GLM-5 segments). Entries whose target starts a new sequence score nothing useful:
            leave them out of ``score_mask``.
        response_start: optional int or int ``[B]``: index into ``input_ids`` of the first token
            to score (e.g. the prompt length); entries with ``t + 1 < response_start`` are skipped.
        score_mask: optional bool ``[B, L-1]``: entries to score (e.g. action tokens only).
        temperature: ``tau > 0``.
        top_k, top_p: the sampling filter a ``sampled`` record's log-probs are under
            (:mod:`glmpost.kernel.distribution`; 0 and 1.0: off). On, the log-prob is
            ``z[y] - logsumexp_{v in S} z[v]`` over the kept set ``S`` of ``z = logits / tau``
            (top-k, then top-p: :func:`~glmpost.kernel.distribution.keep_mask`, the engine's own
            rule), its gradient ``onehot(y) - p_S`` (``S`` held fixed), the entropy that of
            ``p_S``; a target outside ``S`` reads ``LOG_PROB_FLOOR`` with no gradient.
        chunk_size: positions per chunk.
        return_entropy: also return the entropy of ``p_tau`` at each scored position.

    Returns:
        :class:`TokenLogProbs` with float32 ``log_probs`` (and ``entropy``) ``[B, L-1]`` and the
        bool ``mask`` of scored entries: those whose target ``input_ids[b, t+1]`` is a real token,
        at or after ``response_start`` and in ``score_mask``. Every other entry (padding, prompt)
        is 0.0 and never reaches the LM head.

    Raises:
        ValueError: on bad shapes, a left-padded mask, a non-positive temperature or chunk size,
            or a model whose head post-processes logits (soft-capping, logit scaling).
    """
    scored = scored_entries(input_ids, attention_mask, response_start, score_mask)
    check_temperature_and_chunk(temperature, chunk_size)

    body, head = split_causal_lm(model)
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                   **packed_positions(position_ids, attention_mask, input_ids))
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    with torch.autocast(hidden.device.type, enabled=False):  # the head in its weight's dtype (in_head_dtype)
        return chunked_log_probs(
            in_head_dtype(hidden[:, :-1], head),
            head,
            vocab_size_of(head),
            input_ids[:, 1:],
            mask=scored,
            distribution=ScoredDistribution(temperature, top_k, top_p),
            chunk_size=chunk_size,
            return_entropy=return_entropy,
            linear=(head.weight, head.bias) if plain_linear(head) else None,
        )


def packed_positions(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                     input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The body's ``position_ids`` keyword for packed rows (checked), or nothing."""
    if position_ids is None:
        return {}
    if attention_mask is not None:
        raise ValueError("position_ids are for packed rows, which have no attention_mask (no padding)")
    if position_ids.dim() != 2 or position_ids.shape[1] != input_ids.shape[1] or position_ids.shape[0] not in (1, input_ids.shape[0]):
        raise ValueError(f"position_ids must be [B, L] = {tuple(input_ids.shape)}; got {tuple(position_ids.shape)}")
    return {"position_ids": position_ids}


def scored_entries(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, response_start: int | torch.Tensor | None,
                   score_mask: torch.Tensor | None) -> torch.Tensor:
    """The bool ``[B, L-1]`` entries :func:`sequence_log_probs` scores (its arguments, checked):
    a real target token, at or after ``response_start``, in ``score_mask``."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, L] with L >= 2; got {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor; got {input_ids.dtype}")
    batch, length = input_ids.shape
    device = input_ids.device

    scored = torch.ones(batch, length - 1, dtype=torch.bool, device=device)
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, length):
            raise ValueError(
                f"attention_mask must match input_ids [B, L] = {(batch, length)}; "
                f"got {tuple(attention_mask.shape)}"
            )
        real = attention_mask.bool()
        if bool((real[:, 1:] & ~real[:, :-1]).any()):
            raise ValueError(
                "attention_mask must be right-padded (each row ones then zeros); "
                "left padding would change position ids"
            )
        scored &= real[:, 1:]
    if response_start is not None:
        start = torch.as_tensor(response_start, device=device)
        if start.dim() == 0:
            start = start.expand(batch)
        if tuple(start.shape) != (batch,) or start.dtype.is_floating_point:
            raise ValueError(
                f"response_start must be an int or an int tensor [B] = [{batch}]; "
                f"got {tuple(start.shape)} {start.dtype}"
            )
        target_index = torch.arange(1, length, device=device)
        scored &= target_index[None, :] >= start[:, None]
    if score_mask is not None:
        if tuple(score_mask.shape) != (batch, length - 1) or score_mask.dtype != torch.bool:
            raise ValueError(
                f"score_mask must be bool [B, L-1] = {(batch, length - 1)}; "
                f"got {tuple(score_mask.shape)} {score_mask.dtype}"
            )
        scored &= score_mask
    return scored
