"""See which keys the GLM-5 DSA indexer selects (brief, "DSA Indexer 的确定性为什么是 RL 问题").

transformers' ``GlmMoeDsaIndexer.forward`` scores every key for every query
(``relu(q·k)`` weighted over index heads, ``-inf`` where causality or padding masks the key) and
returns ``index_scores.topk(index_topk).indices``; the attention then sees only those keys. The
indices are not surfaced, so :class:`IndexerCapture` observes each indexer's top-k call
(:func:`glmpost.npu.topk.observe_indexer_topk`, whichever tie rule the model uses) and keeps, per
layer, the *usable* selected positions (:func:`glmpost.closure.mismatch.valid_selection`) and whether the
row's selection hinged on a tie at the boundary (:func:`glmpost.closure.mismatch.boundary_ties`).

Memory: one int64 ``[B, S, index_topk]`` tensor per layer for the current batch.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from glmpost.closure.mismatch import boundary_ties, valid_selection
from glmpost.npu.topk import indexers, observe_indexer_topk


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
