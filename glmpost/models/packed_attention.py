"""Packed rows under transformers' own attention, at the cost of each sequence alone.

A packed row holds several sequences one after another, ``position_ids`` restarting at 0 for each
(:func:`glmpost.rl.micro_batches.pack`). transformers keeps attention within each sequence by a
block-diagonal mask (``masking_utils.find_packed_sequence_indices``), but SDPA on a CPU (or an NPU)
still computes the whole ``[L, L]`` square and masks it: packing long-tailed lengths then costs more
than padding them. :data:`PACKED_SDPA` is transformers' SDPA attention with one change: on a packed
row (no cache, restarting positions) it runs causal SDPA on each sequence alone, ``sum n_i^2``
instead of ``(sum n_i)^2`` (the variable-length kernels transformers uses on CUDA flash attention do
the same in one call). Every other call is transformers' SDPA, unchanged, with its masks.
"""

from __future__ import annotations

import torch

PACKED_SDPA = "glmpost_sdpa"


def sequence_bounds(position_ids: torch.Tensor | None, length: int) -> list[list[tuple[int, int]]] | None:
    """Per row, the ``(start, stop)`` of each sequence of a packed row (a new one wherever a position
    is not the previous one's + 1); None when no row restarts or the shapes are not a packed
    prefill."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] != length or length < 2:
        return None
    restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1).cpu()
    if not bool(restarts.any()):
        return None
    bounds = []
    for row in restarts:
        starts = [0, *(torch.nonzero(row).flatten() + 1).tolist()]
        bounds.append(list(zip(starts, [*starts[1:], length])))
    return bounds


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' ``sdpa_attention_forward``, each sequence of a packed row attended alone
    (``query`` ``[B, H, L, D]``; returns ``[B, L, H, D]`` as it does)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = sequence_bounds(kwargs.get("position_ids"), query.shape[2]) if query.shape[2] == key.shape[2] else None
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    rows = []
    for row, spans in enumerate(bounds):
        b = slice(row, row + 1)
        rows.append(torch.cat([
            sdpa_attention_forward(module, query[b, :, start:stop], key[b, :, start:stop], value[b, :, start:stop], None,
                                   dropout=dropout, scaling=scaling, is_causal=True)[0]
            for start, stop in spans], dim=1))
    return torch.cat(rows, dim=0), None


def register() -> None:
    """Make :data:`PACKED_SDPA` an attention implementation transformers knows (its masks SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_sdpa(model: torch.nn.Module) -> bool:
    """Run ``model``'s SDPA attention as :data:`PACKED_SDPA`; False (nothing changed) for a model on
    another implementation (eager, flash attention: its own variable-length path, glmpost's native
    GLM-5 attention)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    register()
    model.set_attn_implementation(PACKED_SDPA)
    return config._attn_implementation == PACKED_SDPA
