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

Memory: positions are processed ``chunk_size`` rows at a time, so the largest live tensors are
``[chunk_size, V]`` float32 buffers. Without autograd the peak extra memory is
``~ 2 * chunk_size * V * 4`` bytes, against ``2 * T * V * 4`` for the naive
``log_softmax(logits.float()).gather`` (``benchmarks/bench_logprobs.py``: 0.6 GiB vs 4.7 GiB at
T = 4096, V = 151,552, chunk 512). Under autograd the graph keeps no ``[chunk_size, V]`` tensor
and backward recomputes each chunk's logits (one extra head matmul per chunk):

* a bare ``nn.Linear`` head (or a weight given directly) goes through :class:`_FusedLinearLogProbs`,
  whose backward adds every chunk's weight gradient into one ``[V, H]`` buffer and holds at most two
  ``[chunk_size, V]`` float32 buffers;
* any other head module (QAT's fake-quant parametrization, DeepSpeed ZeRO-3's gathering hooks) runs
  each chunk's head + softmax inside a non-reentrant :func:`torch.utils.checkpoint`, so the module
  is called as ``model(...)`` calls it; its backward also holds a per-chunk ``[V, H]`` partial
  gradient that autograd adds into the weight's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glmpost.kernel.distribution import LOG_PROB_FLOOR, MASKED_LOGIT, ScoredDistribution, scaled_logits
from glmpost.kernel.heads import plain_linear, split_causal_lm, vocab_size_of

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TokenLogProbs",
    "sequence_log_probs",
    "token_log_probs_from_hidden",
]

# Rows of [chunk, V] logits processed at once. At V = 151,552 (GLM-5), T = 4096, 512 keeps the
# no-grad peak at ~0.13x the naive path's and runs as fast as it on CPU
# (benchmarks/bench_logprobs.py; 256 is slower on CPU, 1024 misses the 0.2x memory goal).
DEFAULT_CHUNK_SIZE = 512

@dataclass(frozen=True)
class TokenLogProbs:
    """Result of :func:`token_log_probs_from_hidden` and :func:`sequence_log_probs`.

    Attributes:
        log_probs: float32, ``log softmax(z / tau)[target]`` where ``mask`` is True, 0.0 elsewhere.
        entropy: float32 entropy of ``softmax(z / tau)`` where ``mask`` is True, 0.0 elsewhere;
            None unless requested.
        mask: bool, True where a value was computed. Same shape as ``log_probs``.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor


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
    return _chunked_log_probs(
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
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, L] with L >= 2; got {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor; got {input_ids.dtype}")
    batch, length = input_ids.shape
    device = input_ids.device
    _check_temperature_and_chunk(temperature, chunk_size)

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

    body, head = split_causal_lm(model)
    outputs = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    return _chunked_log_probs(
        hidden[:, :-1],
        head,
        vocab_size_of(head),
        input_ids[:, 1:],
        mask=scored,
        distribution=ScoredDistribution(temperature, top_k, top_p),
        chunk_size=chunk_size,
        return_entropy=return_entropy,
        linear=(head.weight, head.bias) if plain_linear(head) else None,
    )


def _chunked_log_probs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int | None,
    targets: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    distribution: ScoredDistribution,
    chunk_size: int,
    return_entropy: bool,
    linear: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> TokenLogProbs:
    """Shared core: select the masked rows of ``hidden [..., H]``, score them chunk by chunk.

    ``linear = (weight, bias)`` says ``head`` is exactly ``F.linear(rows, weight, bias)``: under
    autograd the rows then go through :class:`_FusedLinearLogProbs` (one weight-gradient buffer)
    instead of per-chunk checkpoints around ``head``."""
    _check_temperature_and_chunk(distribution.temperature, chunk_size)
    lead = tuple(hidden.shape[:-1])
    if tuple(targets.shape) != lead:
        raise ValueError(
            f"targets must have the leading shape of hidden {lead}; got {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor; got {targets.dtype}")
    if mask is not None and (tuple(mask.shape) != lead or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be bool with the leading shape of hidden {lead}; "
            f"got {tuple(mask.shape)} {mask.dtype}"
        )

    if mask is None:  # every row: no gather copy, no scatter
        rows = hidden.reshape(-1, hidden.shape[-1])
        row_targets = targets.reshape(-1).long()
    else:
        rows = hidden[mask]  # [N, H]
        row_targets = targets[mask].long()  # [N]
    if vocab_size is not None and row_targets.numel() > 0:
        low, high = int(row_targets.min()), int(row_targets.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"target ids must lie in [0, {vocab_size}); got min {low}, max {high}"
            )

    if torch.is_grad_enabled() and linear is not None:
        log_prob_all, entropy_all = _FusedLinearLogProbs.apply(
            rows, linear[0], linear[1], row_targets, distribution, chunk_size, return_entropy
        )
        return _assemble(lead, mask, [log_prob_all], [entropy_all] if return_entropy else [], return_entropy, hidden.device)

    chunk_fn = functools.partial(
        _chunk_log_probs, head=head, distribution=distribution, return_entropy=return_entropy
    )
    use_checkpoint = torch.is_grad_enabled()
    log_prob_parts, entropy_parts = [], []
    # At least one (possibly empty) chunk, so a batch with nothing to score still returns tensors
    # connected to the graph and loss.backward() works.
    for begin in range(0, max(rows.shape[0], 1), chunk_size):
        chunk_rows = rows[begin : begin + chunk_size]
        chunk_targets = row_targets[begin : begin + chunk_size]
        if use_checkpoint:
            log_prob, entropy = checkpoint(chunk_fn, chunk_rows, chunk_targets, use_reentrant=False)
        else:
            log_prob, entropy = chunk_fn(chunk_rows, chunk_targets)
        log_prob_parts.append(log_prob)
        entropy_parts.append(entropy)
    return _assemble(lead, mask, log_prob_parts, entropy_parts, return_entropy, hidden.device)


def _assemble(lead, mask, log_prob_parts, entropy_parts, return_entropy, device) -> TokenLogProbs:
    """Per-row results back in ``lead`` shape (0.0 where ``mask`` is False)."""
    if mask is None:
        mask = torch.ones(lead, dtype=torch.bool, device=device)
        log_probs = torch.cat(log_prob_parts).reshape(lead)
        entropy = torch.cat(entropy_parts).reshape(lead) if return_entropy else None
    else:
        log_probs = scatter_rows(torch.cat(log_prob_parts), mask)
        entropy = scatter_rows(torch.cat(entropy_parts), mask) if return_entropy else None
    return TokenLogProbs(log_probs=log_probs, entropy=entropy, mask=mask)


class _FusedLinearLogProbs(torch.autograd.Function):
    """Chunked log-probs (and entropy) through a linear head, with one weight-gradient buffer.

    Forward: :func:`_chunk_log_probs` chunk by chunk without a graph (the same values as the
    checkpointed path). Backward recomputes each chunk's logits and writes
    ``dL/dW += g_chunk^T @ rows_chunk`` into one ``[V, H]`` buffer (``addmm_``), where the
    checkpointed path makes a ``[V, H]`` partial per chunk that autograd then adds into the
    gradient: one ``[V, H]`` less at the peak of the backward. With ``z = float(W r + b) / tau``,
    ``lp = log_softmax(z)[y]``, ``H = -sum p log p``::

        dlp/dz = onehot(y) - p,     dH/dz = -p * (log p + H),     dL/d(Wr+b) = (dL/dz) / tau
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, distribution, chunk_size, return_entropy):
        # grad is off inside forward: the plain chunk loop, nothing recorded
        out = _chunked_log_probs(rows, functools.partial(F.linear, weight=weight, bias=bias), None, targets, mask=None,
                                 distribution=distribution, chunk_size=chunk_size, return_entropy=return_entropy)
        log_prob = out.log_probs
        entropy = out.entropy if return_entropy else rows.new_zeros(0, dtype=torch.float32)
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(rows, weight, bias, targets)
        ctx.distribution, ctx.chunk_size, ctx.return_entropy = distribution, chunk_size, return_entropy
        ctx.set_materialize_grads(False)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        rows, weight, bias, targets = ctx.saved_tensors
        temperature = ctx.distribution.temperature
        if not ctx.return_entropy:
            grad_entropy = None
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_rows = torch.zeros_like(rows) if need_rows else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias and bias is not None else None
        if grad_log_prob is None and grad_entropy is None:
            return grad_rows, grad_weight, grad_bias, None, None, None, None
        for begin in range(0, rows.shape[0], ctx.chunk_size):
            end = min(begin + ctx.chunk_size, rows.shape[0])
            chunk = rows[begin:end]
            # In place on as few [C, V] float32 buffers as possible (two at most).
            z = scaled_logits(F.linear(chunk, weight, bias).float(), ctx.distribution, inplace=True)
            g = None if grad_log_prob is None else grad_log_prob[begin:end, None]
            if g is not None and ctx.distribution.filtered:  # a target outside the kept set: floored, no gradient
                g = g.masked_fill(z.gather(-1, targets[begin:end, None]) == MASKED_LOGIT, 0.0)
            log_p = torch.log_softmax(z, dim=-1)
            del z
            if grad_entropy is None:
                grad_z = log_p.exp_().mul_(-g)  # -g p
            else:
                p = log_p.exp()
                entropy = torch.linalg.vecdot(p, log_p).neg_()[:, None]  # -sum p log p
                grad_z = log_p.add_(entropy).mul_(p).mul_(-grad_entropy[begin:end, None])  # -g_H p (log p + H)
                if g is not None:
                    grad_z.addcmul_(p, g, value=-1.0)  # - g p
                del p
            if g is not None:  # + g at the target
                grad_z.scatter_add_(-1, targets[begin:end, None], g.to(grad_z.dtype))
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_logits = grad_z.to(weight.dtype)
            del grad_z
            if grad_rows is not None:
                torch.mm(grad_logits, weight, out=grad_rows[begin:end])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), chunk)
            if grad_bias is not None:
                grad_bias.add_(grad_logits.sum(0))
            del grad_logits
        return grad_rows, grad_weight, grad_bias, None, None, None, None


def _chunk_log_probs(
    rows: torch.Tensor,
    targets: torch.Tensor,
    *,
    head: Callable[[torch.Tensor], torch.Tensor],
    distribution: ScoredDistribution,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_softmax(z)[targets], entropy(z) or None)``, ``z = float(head(rows)) / tau`` (filtered:
    the dropped tokens' ``z`` set to ``MASKED_LOGIT``, an out-of-set target floored).

    Uses the fused row-wise ``log_softmax`` kernel (one pass per row in cache, the same kernel as
    the naive path). Without autograd, temporaries are freed or updated in place so at most two
    ``[C, V]`` float32 buffers are alive; with autograd the ops are out of place (they run inside a
    checkpoint, which discards them after the forward).
    """
    inplace = not torch.is_grad_enabled()
    logits = scaled_logits(head(rows).float(), distribution, inplace=inplace)  # a fresh [C, V] tensor
    log_softmax = torch.log_softmax(logits, dim=-1)
    del logits
    log_prob = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
    if distribution.filtered:
        log_prob = log_prob.clamp(min=LOG_PROB_FLOOR)
    if not return_entropy:
        return log_prob, None
    if inplace:
        entropy = log_softmax.exp().mul_(log_softmax).sum(-1).neg_()
    else:
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_prob, entropy


def scatter_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place ``values [N]`` at the True entries of ``mask`` in a float32 zeros tensor."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(
        mask, values
    )


def _check_temperature_and_chunk(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
