"""What a recorded log-prob is a log-prob *of*: the distribution kinds engines return, and the filter.

Brief, "动作与概率契约": train, rollout and teacher compute log-probs of the same ids on the same
prefix; IcePop's ratio is only an engine check when both sides compute the same quantity. Engines
disagree on that quantity once top-k / top-p truncate sampling (TRL#6789), so every record's
``sampling.log_prob_kind`` names it (formats/SPEC.md) and every train-side path computes exactly it:

* ``sampled``: ``log softmax(keep(z / T))``, the truncated, renormalised distribution the token was
  drawn from (temperature, then top-k, then top-p). What glmpost's engine returns by default.
* ``tempered``: ``log_softmax(z / T)`` before top-k / top-p. What SGLang returns in current releases.
* ``raw``: ``log_softmax(z)``, before temperature and filtering. What SGLang returns for greedy
  decoding and with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, and what glmpost's engine returns for
  greedy decoding (temperature 0): the point mass it samples from has log-prob 0 everywhere it is
  defined, which says nothing, so the model's own distribution is recorded instead.
* ``top_p_renormalized``: ``log softmax(keep_top_p(z / T))``, renormalised over the top-p set but
  not top-k (SGLang releases of early 2025, ``top_p_normalize_probs_torch``).

Every kind is "softmax over the tokens a filter keeps, at a temperature" (:class:`ScoredDistribution`),
so one chunked formula (:mod:`glmpost.kernel.logprobs`) computes all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_PROB_KINDS = {
    "sampled": "log-softmax of logits / T over the tokens top-k and top-p keep (what was sampled from)",
    "tempered": "log_softmax(logits / T) before top-k / top-p filtering (SGLang's default)",
    "raw": "log_softmax(logits), before temperature and filtering (greedy; SGLANG_RETURN_ORIGINAL_LOGPROB=1)",
    "top_p_renormalized": "log-softmax of logits / T over the top-p set, top-k not applied (SGLang, early 2025)",
}
DEFAULT_LOG_PROB_KIND = "sampled"

# Train-side paths set dropped tokens' logits to MASKED_LOGIT, not -inf: exp() of it is exactly 0, so
# the kept tokens' log-probs equal the engine's (-inf) bit for bit, while p * log p and the fused
# backward's in-place arithmetic stay finite. A target outside the kept set (the two sides kept
# different sets at a boundary) reads LOG_PROB_FLOOR, with no gradient: finite, so a ratio of two of
# them is never NaN, and far outside any trust band, so IcePop and DIS mask it.
MASKED_LOGIT = -1e30
LOG_PROB_FLOOR = -1e4


@dataclass(frozen=True)
class ScoredDistribution:
    """``softmax`` over the tokens ``keep_mask(z / temperature, top_k, top_p)`` keeps (``top_k`` 0 and
    ``top_p`` 1.0: every token)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:  # also rejects NaN
            raise ValueError(f"temperature must be > 0; got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off); got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 = off); got {self.top_p}")

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def check_log_prob_kind(kind: str) -> str:
    if kind not in LOG_PROB_KINDS:
        raise ValueError(f"unknown log-prob kind {kind!r}; expected one of {', '.join(LOG_PROB_KINDS)}")
    return kind


def scored_distribution(kind: str, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> ScoredDistribution:
    """The distribution a log-prob of ``kind`` is taken under, for a token sampled at ``temperature``
    with ``top_k`` (0 = off) and ``top_p`` (1.0 = off).

    Raises ValueError for an unknown kind, and for ``sampled`` / ``tempered`` /
    ``top_p_renormalized`` at temperature 0 (greedy has only the raw distribution).
    """
    check_log_prob_kind(kind)
    if kind == "raw":
        return ScoredDistribution()
    if not temperature > 0:
        raise ValueError(f"log-prob kind {kind!r} is undefined at temperature {temperature} (greedy records are 'raw')")
    if kind == "tempered":
        return ScoredDistribution(temperature)
    if kind == "top_p_renormalized":
        return ScoredDistribution(temperature, 0, top_p)
    return ScoredDistribution(temperature, max(top_k, 0), top_p)


def keep_mask(scaled: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Bool ``[..., V]``: the tokens top-k then top-p (nucleus) keep from the scaled logits.

    Top-k keeps every token tied with the k-th largest. Top-p then keeps the smallest set of most
    likely tokens (of the top-k distribution) whose probability reaches ``top_p``: a token is dropped
    when the mass strictly before it is ``>= top_p``, so the token crossing the threshold stays.
    A pure function of ``scaled``: the engine and every train-side path call it on the same values.

    With top-k on and no tie at its boundary, top-p only sorts the k kept values (``torch.topk``
    returns them sorted); otherwise it sorts whole rows, ``_SORT_ROWS`` rows at a time, so the
    extra memory stays near ``_SORT_ROWS * V * 20`` bytes whatever the number of rows.
    """
    vocab = scaled.shape[-1]
    if top_k and top_k < vocab:
        values, indices = torch.topk(scaled, top_k, dim=-1)
        keep = scaled >= values[..., -1:]
        if not top_p < 1.0:
            return keep
        # Rows without a tie at the boundary keep exactly `indices`, in order: sort k values, not V.
        out = torch.zeros_like(keep).scatter(-1, indices, _nucleus(values, top_p))
        tied = keep.sum(-1) != top_k
        if bool(tied.any()):
            out[tied] = keep[tied] & _sorted_nucleus(scaled[tied].masked_fill(~keep[tied], float("-inf")), top_p)
        return out
    if not top_p < 1.0:
        return torch.ones(scaled.shape, dtype=torch.bool, device=scaled.device)
    return _sorted_nucleus(scaled, top_p)


def _sorted_nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`_nucleus` of whole rows, sorted ``_SORT_ROWS`` rows at a time."""
    vocab = scaled.shape[-1]
    rows = scaled.reshape(-1, vocab)
    nucleus = torch.empty(rows.shape, dtype=torch.bool, device=scaled.device)
    for begin in range(0, rows.shape[0], _SORT_ROWS):
        block = rows[begin : begin + _SORT_ROWS]
        sorted_logits, order = torch.sort(block, dim=-1, descending=True)
        nucleus[begin : begin + _SORT_ROWS] = torch.zeros_like(block, dtype=torch.bool).scatter(
            -1, order, _nucleus(sorted_logits, top_p))
    return nucleus.reshape(scaled.shape)


_SORT_ROWS = 64


def _nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool, same shape: which of the descending ``sorted_logits`` top-p keeps (the mass strictly
    before a token ``< top_p``)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    return torch.cumsum(probs, dim=-1) - probs < top_p


def filter_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature-scaled logits with the tokens :func:`keep_mask` drops set to -inf."""
    scaled = logits / temperature
    if not (top_k and top_k < scaled.shape[-1]) and not top_p < 1.0:
        return scaled
    return scaled.masked_fill(~keep_mask(scaled, top_k=top_k, top_p=top_p), float("-inf"))


def scaled_logits(logits: torch.Tensor, distribution: ScoredDistribution, *, inplace: bool) -> torch.Tensor:
    """float32 ``logits / T`` with the tokens :func:`keep_mask` drops set to ``MASKED_LOGIT`` (the
    train-side form of :func:`filter_logits`; ``inplace`` may reuse ``logits``' storage)."""
    if distribution.temperature != 1.0:
        logits = logits.div_(distribution.temperature) if inplace else logits / distribution.temperature
    if not distribution.filtered:
        return logits
    dropped = ~keep_mask(logits.detach(), top_k=distribution.top_k, top_p=distribution.top_p)
    return logits.masked_fill_(dropped, MASKED_LOGIT) if inplace else logits.masked_fill(dropped, MASKED_LOGIT)


def distribution_log_softmax(logits: torch.Tensor, distribution: ScoredDistribution) -> torch.Tensor:
    """``log softmax`` of ``distribution`` from raw float32 logits ``[..., V]`` (-inf off the kept set)."""
    return torch.log_softmax(filter_logits(logits, temperature=distribution.temperature, top_k=distribution.top_k,
                                           top_p=distribution.top_p), dim=-1)
