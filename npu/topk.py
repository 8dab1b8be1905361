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

:func:`install_deterministic_topk` makes the indexers of a loaded model use it,
:func:`set_indexer_topk` switches them either way, and :func:`observe_indexer_topk` lets
``diff-logprobs --indexer`` see every selection (scores and indices) on either rule.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch


def deterministic_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` (int32) of the ``k`` largest entries of the last dim, ties to the lower index.

    The rule of :func:`sorted_deterministic_topk` (its definition: one stable descending sort, NaN
    last), computed without sorting every row. Floating scores (float32, bfloat16, float16) go
    through ``torch.topk``: a row whose ``k + 1`` largest values are all distinct has no tie that
    could change its selection or its order, so ``torch.topk``'s answer is the rule's; the other rows
    (a tie, a NaN, or ``-0.0`` beside ``0.0``) and large ``k`` (``k >= L / 8``, where ``topk`` costs
    what one pass more does) take :func:`composite_topk`: one ``topk`` over int64 keys that order by
    score, then by position, so no two keys tie. Other dtypes take the sort.
    """
    length = scores.shape[-1]
    if k < 0 or k > length:
        raise ValueError(f"k = {k} out of range for a last dimension of {length}")
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return sorted_deterministic_topk(scores, k)
    if k == 0 or scores.numel() == 0:
        return torch.empty((*scores.shape[:-1], k), dtype=torch.int32, device=scores.device)
    if 8 * k >= length:
        return composite_topk(scores, k)
    top = original_topk(scores, k + 1, dim=-1)
    values = top.values
    distinct = (values[..., :-1] > values[..., 1:]).all(-1)
    indices = top.indices[..., :k]
    if not bool(distinct.all()):
        rows = indices.reshape(-1, k).clone()
        tied = (~distinct).reshape(-1).nonzero().squeeze(-1)
        rows[tied] = composite_topk(scores.reshape(-1, length)[tied], k).long()
        indices = rows.view(indices.shape)
    return indices.to(torch.int32)


def composite_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`deterministic_topk` of floating ``scores`` by one ``topk`` over int64 keys (int32 ``[..., k]``).

    Key = (the score's float32 bits mapped to an int32 whose order is the float order; NaN below
    ``-inf``) * 2**32 + (2**32 - 1 - position): larger score first, then lower position, and no
    two keys equal. ``-0.0`` is made ``0.0`` first (the sort calls them equal). Positions must be
    below 2**32.
    """
    values = scores.float() + 0.0  # -0.0 + 0.0 == +0.0
    bits = values.view(torch.int32)
    ordered = (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)  # flip the magnitude bits of negatives
    if bool(torch.isnan(values.sum())):  # a NaN (or +inf beside -inf): rank NaN below -inf
        ordered.masked_fill_(values.isnan(), torch.iinfo(torch.int32).min)
    positions = torch.arange(0xFFFFFFFF, 0xFFFFFFFF - values.shape[-1], -1, dtype=torch.int64, device=values.device)
    keys = ordered.to(torch.int64).bitwise_left_shift_(32).bitwise_or_(positions)
    return original_topk(keys, k, dim=-1).indices.to(torch.int32)


def sorted_deterministic_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k rule's definition: one stable descending sort per row, NaN moved behind every number,
    the first ``k`` positions (int32). :func:`deterministic_topk` gives the same, faster."""
    if k < 0 or k > scores.shape[-1]:
        raise ValueError(f"k = {k} out of range for a last dimension of {scores.shape[-1]}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    if scores.is_floating_point():
        # Move NaN behind every number; the stable sort keeps the score order among the numbers.
        nan_last = torch.sort(scores.gather(-1, order).isnan().to(torch.uint8), dim=-1, stable=True).indices
        order = order.gather(-1, nan_last)
    return order[..., :k].to(torch.int32)


def _eligible(scores: torch.Tensor, dim: int, largest: bool, out) -> bool:
    return out is None and largest and dim in (-1, scores.dim() - 1)


def _topk_values(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, *, out=None):
    if not _eligible(self, dim, largest, out):
        return original_topk(self, k, dim, largest, sorted, out=out)
    indices = deterministic_topk(self, k).long()
    return torch.return_types.topk((self.gather(-1, indices), indices))


original_topk = torch.Tensor.topk

# The indexer whose forward is running (innermost last): its rule and observers decide what
# ``Tensor.topk`` does while it runs.
_active: list[torch.nn.Module] = []


def _indexer_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, *, out=None):
    module = _active[-1]
    if module._glmpost_deterministic_topk:
        result = _topk_values(self, k, dim, largest, sorted, out=out)
    elif out is not None:
        result = original_topk(self, k, dim, largest, sorted, out=out)
    else:
        result = original_topk(self, k, dim, largest, sorted)
    if _eligible(self, dim, largest, out):
        for observer in list(module._glmpost_topk_observers):
            observer(module, self, result.indices)
    return result


@contextlib.contextmanager
def _topk_is_deterministic() -> Iterator[None]:
    previous = torch.Tensor.topk
    torch.Tensor.topk = _topk_values
    try:
        yield
    finally:
        torch.Tensor.topk = previous


def indexers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every DSA indexer in ``model`` (modules whose class ends in ``Indexer``)."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("Indexer")]


def _wrap(module: torch.nn.Module) -> None:
    """Route ``Tensor.topk`` inside ``module.forward`` through :func:`_indexer_topk` (once)."""
    if getattr(module, "_glmpost_topk_wrapped", False):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args, __original=original, __module=module, **kwargs):
        previous = torch.Tensor.topk
        _active.append(__module)
        torch.Tensor.topk = _indexer_topk
        try:
            return __original(*args, **kwargs)
        finally:
            torch.Tensor.topk = previous
            _active.pop()

    module.forward = forward
    module._glmpost_topk_wrapped = True
    module._glmpost_topk_observers = []
    module._glmpost_deterministic_topk = False


def set_indexer_topk(model: torch.nn.Module, *, deterministic: bool) -> int:
    """Make every DSA indexer of ``model`` use :func:`deterministic_topk` or ``torch.topk``.

    Returns the number of indexers whose rule changed. The indexer's own code runs unchanged;
    during its forward ``Tensor.topk`` follows the chosen rule (``torch.topk`` itself is untouched
    outside indexer forwards).
    """
    count = 0
    for _, module in indexers(model):
        _wrap(module)
        if module._glmpost_deterministic_topk != deterministic:
            module._glmpost_deterministic_topk = deterministic
            count += 1
    return count


def install_deterministic_topk(model: torch.nn.Module) -> int:
    """Make every DSA indexer of ``model`` select keys with :func:`deterministic_topk`.

    Returns the number of indexers changed (0 for a model without a DSA indexer, or when already
    installed).
    """
    return set_indexer_topk(model, deterministic=True)


@contextlib.contextmanager
def observe_indexer_topk(model: torch.nn.Module, observer: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], None]) -> Iterator[int]:
    """Call ``observer(indexer, scores [..., T], indices [..., k])`` on every top-k an indexer of
    ``model`` takes while the context is open (whichever rule it uses). Yields the number of indexers."""
    found = indexers(model)
    for _, module in found:
        _wrap(module)
        module._glmpost_topk_observers.append(observer)
    try:
        yield len(found)
    finally:
        for _, module in found:
            module._glmpost_topk_observers.remove(observer)
