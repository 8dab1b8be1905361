"""See which keys the GLM-5 DSA indexer selects (brief, "DSA Indexer 的确定性为什么是 RL 问题").

transformers' ``GlmMoeDsaIndexer.forward`` scores every key for every query
(``relu(q·k)`` weighted over index heads, ``-inf`` where causality or padding masks the key) and
returns ``index_scores.topk(index_topk).indices``; the attention then sees only those keys. The
indices are not surfaced, so :class:`IndexerCapture` observes each indexer's top-k call
(:func:`glmpost.npu.topk.observe_indexer_topk`, whichever tie rule the model uses) and keeps, per
layer, the *usable* selected positions (:func:`valid_selection`) and whether the
row's selection hinged on a tie at the boundary (:func:`boundary_ties`).

Memory: one int64 ``[B, S, index_topk]`` tensor per layer for the current batch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from glmpost.npu.topk import indexers, observe_indexer_topk


def valid_selection(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The selected key positions that count: ``indices`` (int ``[..., k]``) with ``-1`` where the
    selected key's score is ``-inf`` or NaN (masked by causality or padding: never attended)."""
    picked = scores.gather(-1, indices.long())
    usable = ~(picked.isnan() | (picked == float("-inf")))
    return torch.where(usable, indices.long(), torch.full_like(indices, -1, dtype=torch.long))


def boundary_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool ``[...]``: the row's selection is decided by a tie at the top-k boundary.

    With ``s_(1) >= s_(2) >= ...`` the row's usable scores (not ``-inf``, not NaN) sorted
    descending and ``n`` their count, a row ties at the boundary iff ``n > k`` and
    ``s_(k) == s_(k+1)``: then which of the tied keys is selected is up to the tie rule
    (rows with ``n <= k`` select every usable key and never tie).
    """
    if k <= 0 or k >= scores.shape[-1]:
        return torch.zeros(scores.shape[:-1], dtype=torch.bool, device=scores.device)
    usable = ~(scores.isnan() | (scores == float("-inf")))
    ordered = scores.masked_fill(~usable, float("-inf")).sort(dim=-1, descending=True).values
    return (usable.sum(-1) > k) & (ordered[..., k - 1] == ordered[..., k])


def pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[-1] >= width:
        return x
    return torch.cat([x, torch.full((*x.shape[:-1], width - x.shape[-1]), -1, dtype=x.dtype)], dim=-1)


def topk_set_overlap(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row agreement of two selections ``a [N, ka]``, ``b [N, kb]`` (key positions, ``-1`` = empty slot).

    With ``A``, ``B`` the rows' sets of positions ``>= 0`` (each position at most once per row):

    * ``jaccard = |A ∩ B| / |A ∪ B|`` (1 when both are empty), float64 ``[N]``;
    * ``same_set = (A == B)``, bool ``[N]``;
    * ``same_order``: the two rows list the same positions in the same order (empty slots last),
      bool ``[N]``: what an index-consuming kernel (flash-mla) would see.
    """
    a, b = a.long(), b.long()
    width = max(a.shape[-1], b.shape[-1])
    a, b = pad_rows(a, width), pad_rows(b, width)
    size_a, size_b = (a >= 0).sum(-1), (b >= 0).sum(-1)
    b_sorted = b.sort(dim=-1).values
    where = torch.searchsorted(b_sorted, a.contiguous()).clamp(max=width - 1)
    hit = (b_sorted.gather(-1, where) == a) & (a >= 0)
    inter = hit.sum(-1)
    union = size_a + size_b - inter
    jaccard = torch.where(union == 0, torch.ones_like(union, dtype=torch.float64), inter.double() / union.clamp(min=1))
    same_set = (inter == size_a) & (inter == size_b)
    # Compare the lists with the empty slots moved last (their relative order kept).
    a_list = a.gather(-1, (a < 0).to(torch.uint8).sort(dim=-1, stable=True).indices)
    b_list = b.gather(-1, (b < 0).to(torch.uint8).sort(dim=-1, stable=True).indices)
    same_order = (a_list == b_list).all(-1)
    return {"jaccard": jaccard, "same_set": same_set, "same_order": same_order}


def indexer_summary(a: torch.Tensor, b: torch.Tensor, ties_a: torch.Tensor, ties_b: torch.Tensor) -> dict[str, Any]:
    """Summary of :func:`topk_set_overlap` over rows, with the boundary ties of each path.

    ``differing_with_ties`` is the fraction of rows with different sets where either path had a
    boundary tie (1.0 says the ties explain every difference).
    """
    rows = int(a.shape[0])
    if rows == 0:
        return {"rows": 0}
    overlap = topk_set_overlap(a, b)
    differ = ~overlap["same_set"]
    tied = ties_a | ties_b
    return {
        "rows": rows,
        "mean_jaccard": float(overlap["jaccard"].mean()),
        "identical_sets": float(overlap["same_set"].double().mean()),
        "identical_order": float(overlap["same_order"].double().mean()),
        "differing_sets": int(differ.sum()),
        "boundary_ties_a": float(ties_a.double().mean()),
        "boundary_ties_b": float(ties_b.double().mean()),
        "differing_with_ties": int((differ & tied).sum()) / int(differ.sum()) if bool(differ.any()) else None,
    }


class IndexerCapture:
    """Capture the DSA indexers' selections of ``model`` during full-sequence forwards.

    Call :meth:`start` before each forward of a right-padded batch, then :meth:`rows` per row;
    :meth:`close` when done. A model without an indexer raises ValueError.
    """

    def __init__(self, model: torch.nn.Module):
        found = indexers(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no DSA indexer (a module whose class ends in 'Indexer')")
        self._layer = {id(module): i for i, (_, module) in enumerate(found)}
        self.layers = len(found)
        self._batch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(observe_indexer_topk(model, self._observe))

    def _observe(self, module: torch.nn.Module, scores: torch.Tensor, indices: torch.Tensor) -> None:
        layer = self._layer[id(module)]
        if layer in self._batch:
            raise RuntimeError(f"indexer layer {layer} ran twice in one forward (incremental decoding is not captured)")
        self._batch[layer] = (valid_selection(scores, indices).cpu(), boundary_ties(scores, indices.shape[-1]).cpu())

    def start(self) -> None:
        self._batch.clear()

    def rows(self, row: int, length: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per layer: selected positions int64 ``[length, k]`` (-1 = empty) and tie flags bool
        ``[length]`` of batch row ``row``'s first ``length`` (real) query positions."""
        if len(self._batch) != self.layers:
            raise RuntimeError(f"captured {len(self._batch)} of {self.layers} indexer layers")
        selections, ties = [], []
        for layer in range(self.layers):
            selected, tied = self._batch[layer]
            selections.append(selected[row, :length].numpy().astype(np.int64))
            ties.append(tied[row, :length].numpy().astype(bool))
        return selections, ties

    def close(self) -> None:
        self._stack.close()
