"""Training examples as micro-batches: right-padded rows, or packed rows.

:func:`micro_batch_plan` cuts a rank's examples into micro-batches (a count, a padded token budget,
or a packed one); :func:`collate` lays a micro-batch out one example per row, right-padded;
:func:`pack` concatenates its examples into one row with the positions restarting at 0 for each, so
the model keeps attention within each example (transformers builds a block-diagonal mask from
restarting ``position_ids``, or runs variable-length flash attention on CUDA; on SDPA glmpost attends
each sequence alone, :mod:`glmpost.models.packed_attention`; glmpost's native GLM-5 attention masks
by segment). Either way entry ``t`` of every per-token field scores ``input_ids[t +
1]``; an example's entries are where :attr:`MicroBatch.places` says, and
:meth:`MicroBatch.lay` / :meth:`MicroBatch.per_example` move per-example values in and out of the
layout, so the trainer never depends on which one ran. Packing changes where a token sits, not what
it is scored against: the update is the padded one's (the loss's denominators are global counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from glmpost.config import setting
from glmpost.rl.batches import TrainExample


def micro_batch_tokens_setting():
    """The ``micro_batch_tokens`` setting of every training stage that cuts micro-batches."""
    return setting(0, "When > 0: micro-batches by this token budget instead of --micro-batch-size (trajectories longest "
                   "first, each micro-batch's rows x longest length at most this; a longer trajectory alone). The update "
                   "is the same, less of it padding.", min=0)


def pack_sequences_setting():
    """The ``pack_sequences`` setting of every training stage that cuts micro-batches."""
    return setting(False, "Pack each micro-batch's trajectories into one row, positions restarting at 0 for each and "
                   "attention kept within each (no padding); with --micro-batch-tokens the budget is the row's total "
                   "tokens. The update is the padded one's. train-sao packs the policy's micro-batches, not the "
                   "critic's.", flag="--pack-sequences/--no-pack-sequences")


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L]: right-padded rows, or packed rows
    attention_mask: torch.Tensor | None  # [B, L] 1 for real tokens; None for packed rows (no padding)
    action_mask: torch.Tensor  # bool [B, L-1]: entry t scores input_ids[t+1], a response action
    rollout_log_probs: torch.Tensor  # float32 [B, L-1], NaN off actions
    advantages: torch.Tensor  # float32 [B, 1] per row; packed: [B, L-1], each example's over its entries
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, L-1, ...]: NaN / 0 off responses
    later_tokens: torch.Tensor | None = None  # float64 [B] each example's N_{>s} (CompactionRL); packed: [B, L-1]
    position_ids: torch.Tensor | None = None  # [B, L] packed: 0.. per example; None: 0.. per row
    places: list[tuple[int, int, int]] = field(default_factory=list)  # per example: (row, first input position, tokens)

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def entries(self, example: int) -> tuple[int, slice]:
        """Example ``example``'s ``[n - 1]`` entries: its row and their slice of the row's ``L - 1``."""
        row, start, length = self.places[example]
        return row, slice(start, start + length - 1)

    def per_example(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Each example's entries of a per-token ``[B, L-1, ...]`` tensor, in the micro-batch's order."""
        out = []
        for example in range(len(self.places)):
            row, cut = self.entries(example)
            out.append(values[row, cut])
        return out

    def lay(self, values: Sequence[torch.Tensor], *, fill: float = 0.0) -> torch.Tensor:
        """Per-example ``[m, ...]`` tensors (``m`` at most the example's ``n - 1`` entries; the rest
        read ``fill``) laid out as this micro-batch's ``[B, L-1, ...]``, on its device."""
        first = values[0]
        out = torch.full((*self.action_mask.shape, *first.shape[1:]), fill, dtype=first.dtype)
        for example, value in enumerate(values):
            row, cut = self.entries(example)
            take = min(value.shape[0], cut.stop - cut.start)
            out[row, cut.start : cut.start + take] = value[:take].cpu()
        return out.to(self.action_mask.device)

    def example_ids(self) -> torch.Tensor:
        """``[B, L-1]`` long: the example (its index in the micro-batch) each entry belongs to, -1 for
        none (padding); what a per-sequence quantity (GSPO's ratio, sequence-level IS) sums over."""
        out = torch.full(self.action_mask.shape, -1, dtype=torch.long)
        for example in range(len(self.places)):
            row, cut = self.entries(example)
            out[row, cut] = example
        return out.to(self.action_mask.device)

    def spread(self, values: Sequence[float], *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One value per example over all its entries: ``[B, L-1]`` (0 elsewhere)."""
        out = torch.zeros(self.action_mask.shape, dtype=dtype)
        for example, value in enumerate(values):
            row, cut = self.entries(example)
            out[row, cut] = float(value)
        return out.to(self.action_mask.device)


def _first_fit_decreasing(lengths: Sequence[int], indices: Sequence[int], fits) -> list[list[int]]:
    """``indices`` longest first (ties by index), each into the first bin where ``fits(members,
    longest, length)`` holds, else a new bin."""
    bins: list[list[int]] = []
    longest: list[int] = []
    for index in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, members in enumerate(bins):
            if fits(members, longest[b], lengths[index]):
                members.append(index)
                longest[b] = max(longest[b], lengths[index])
                break
        else:
            bins.append([index])
            longest.append(lengths[index])
    return bins


def micro_batch_plan(lengths: Sequence[int], indices: Sequence[int], *, size: int, tokens: int = 0,
                     pack: bool = False) -> list[list[int]]:
    """This rank's ``indices`` (into ``lengths``, each example's token count) as micro-batches.

    ``tokens`` 0: ``size`` at a time, in order. ``tokens`` > 0: by a token budget, first-fit
    decreasing: examples longest first (ties by index), each into the first micro-batch whose cost
    stays within ``tokens`` with it, else a new one (an example longer than the budget goes alone).
    The cost of a padded micro-batch is rows x its longest length; of a packed one (``pack``), the
    sum of its lengths (its one row). Deterministic, so every rank knows every rank's plan. The
    loss is a sum over the global batch divided by global token counts: the split changes how the
    work is cut, not the update."""
    if tokens <= 0:
        return [list(indices[start : start + size]) for start in range(0, len(indices), size)]
    if pack:
        return _first_fit_decreasing(lengths, indices, lambda members, longest, length:
                                      sum(lengths[i] for i in members) + length <= tokens)
    return _first_fit_decreasing(lengths, indices, lambda members, longest, length:
                                 (len(members) + 1) * max(longest, length) <= tokens)


def _laid_out(examples: Sequence[TrainExample], places: list[tuple[int, int, int]], shape: tuple[int, int], *,
              pad_token_id: int, device: torch.device) -> MicroBatch:
    """Every per-token field of ``examples`` at their ``places`` in ``shape`` ``[B, L]``."""
    batch, length = shape
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    actions = torch.zeros((batch, length - 1), dtype=torch.bool)
    rollout = torch.full((batch, length - 1), float("nan"), dtype=torch.float32)
    fields = {}
    for name in examples[0].token_fields:
        first = examples[0].token_fields[name]
        fill = float("nan") if first.dtype.kind == "f" else 0
        fields[name] = torch.full((batch, length - 1, *first.shape[1:]), fill, dtype=torch.from_numpy(first[:0]).dtype)
    for e, (row, start, n) in zip(examples, places):
        input_ids[row, start : start + n] = torch.tensor(e.input_ids)
        # Response token j sits at input position start + p + j and is predicted by entry start + p + j - 1.
        response = slice(start + e.prompt_length - 1, start + n - 1)
        actions[row, response] = torch.from_numpy(e.action_mask)
        rollout[row, response] = torch.from_numpy(e.rollout_log_probs.astype(np.float32))
        for name, laid in fields.items():
            laid[row, response] = torch.from_numpy(np.ascontiguousarray(e.token_fields[name]))
    return MicroBatch(input_ids.to(device), None, actions.to(device), rollout.to(device), torch.zeros(0),
                      {name: laid.to(device) for name, laid in fields.items()}, places=places)


def collate(examples: Sequence[TrainExample], *, pad_token_id: int, device: torch.device) -> MicroBatch:
    """One example per row, right-padded to the longest."""
    lengths = [len(e.input_ids) for e in examples]
    batch = _laid_out(examples, [(row, 0, n) for row, n in enumerate(lengths)], (len(examples), max(lengths)),
                      pad_token_id=pad_token_id, device=device)
    attention = torch.zeros(batch.input_ids.shape, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
    batch.attention_mask = attention.to(device)
    batch.advantages = torch.tensor([[e.advantage] for e in examples], dtype=torch.float32, device=device)
    batch.later_tokens = torch.tensor([float(e.later_tokens) for e in examples], dtype=torch.float64, device=device)
    return batch


def pack(examples: Sequence[TrainExample], *, pad_token_id: int, device: torch.device) -> MicroBatch:
    """All of ``examples`` in one row, one after another, positions restarting at 0 for each."""
    places, start = [], 0
    for e in examples:
        places.append((0, start, len(e.input_ids)))
        start += len(e.input_ids)
    batch = _laid_out(examples, places, (1, start), pad_token_id=pad_token_id, device=device)
    batch.position_ids = torch.cat([torch.arange(len(e.input_ids)) for e in examples]).unsqueeze(0).to(device)
    batch.advantages = batch.spread([e.advantage for e in examples])
    batch.later_tokens = batch.spread([e.later_tokens for e in examples], dtype=torch.float64)
    return batch


def fit(values: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad or cut a per-example ``[L_i - 1]`` tensor to the micro-batch width."""
    if values.shape[0] >= width:
        return values[:width]
    pad = torch.zeros(width - values.shape[0], dtype=values.dtype)
    return torch.cat([values, pad])
