"""Deterministic top-k for the DSA indexer (brief, "DSA Indexer 的确定性为什么是 RL 问题").

The GLM-5 indexer picks each query's top-k keys by a relu-based score, so many keys tie (often at
exactly 0). ``torch.topk`` breaks ties differently for different sequence lengths, paddings and
kernels, so the rollout engine (incremental, left-padded batches) and the trainer (full sequence,
right-padded) attend to different keys and compute different log-probs for the same tokens
(shared/notes/tiny-glm5-rl-facts.md: up to ~16 nats). :func:`deterministic_topk` fixes the rule:

* order: larger score first; **ties: the lower position wins** (a stable sort), so the selected
  set depends only on the scores and the keys' relative order, not on how much padding precedes
  them or how long the sequence is;
* **NaN ranks after every number** (including -inf): it is selected only when a row has fewer than
  ``k`` numbers;
* **indices are int32**, as the transformers indexer returns them.

:func:`install_deterministic_topk` makes the indexers of a loaded model use it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch


def deterministic_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` (int32) of the ``k`` largest entries of the last dim, ties to the lower index."""
    if k < 0 or k > scores.shape[-1]:
        raise ValueError(f"k = {k} out of range for a last dimension of {scores.shape[-1]}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    if scores.is_floating_point():
        # Move NaN behind every number; the stable sort keeps the score order among the numbers.
        nan_last = torch.sort(scores.gather(-1, order).isnan().to(torch.uint8), dim=-1, stable=True).indices
        order = order.gather(-1, nan_last)
    return order[..., :k].to(torch.int32)


def _topk_values(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, *, out=None):
    if out is not None or not largest or dim not in (-1, self.dim() - 1):
        return _original_topk(self, k, dim, largest, sorted, out=out)
    indices = deterministic_topk(self, k).long()
    return torch.return_types.topk((self.gather(-1, indices), indices))


_original_topk = torch.Tensor.topk


@contextlib.contextmanager
def _topk_is_deterministic() -> Iterator[None]:
    previous = torch.Tensor.topk
    torch.Tensor.topk = _topk_values
    try:
        yield
    finally:
        torch.Tensor.topk = previous


def install_deterministic_topk(model: torch.nn.Module) -> int:
    """Make every DSA indexer of ``model`` select keys with :func:`deterministic_topk`.

    The indexer's own code runs unchanged; during its forward ``Tensor.topk`` follows the rule
    above. Returns the number of indexers changed (0 for a model without a DSA indexer).
    """
    count = 0
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Indexer") and not getattr(module, "_glmpost_deterministic_topk", False):
            original = module.forward

            @functools.wraps(original)
            def forward(*args, __original=original, **kwargs):
                with _topk_is_deterministic():
                    return __original(*args, **kwargs)

            module.forward = forward
            module._glmpost_deterministic_topk = True
            count += 1
    return count
