"""The chunked core of the log-prob head (:mod:`glmpost.kernel.logprobs` has the formula and the
public functions): rows of hidden states scored ``chunk_size`` at a time, so float32 ``[T, V]``
logits never exist whole.

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


def chunked_log_probs(
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
    check_temperature_and_chunk(distribution.temperature, chunk_size)
    rows, row_targets = _rows_to_score(hidden, targets, mask, vocab_size)
    lead = tuple(hidden.shape[:-1])

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


def _rows_to_score(hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                   vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N, H], targets [N])``: the rows of ``hidden [..., H]`` that ``mask`` selects (all
    without one), checked against ``targets`` and the vocabulary."""
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
    return rows, row_targets


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
        out = chunked_log_probs(rows, functools.partial(F.linear, weight=weight, bias=bias), None, targets, mask=None,
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


def check_temperature_and_chunk(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:  # also rejects NaN
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
