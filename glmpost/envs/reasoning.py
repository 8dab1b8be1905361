"""The reasoning split of a model turn: which of its exact ids are reasoning (``<think>R</think>``) and
which are the content that tool calls and answers are read from.

vLLM and SGLang split a GLM turn before they parse its tool calls (vLLM
``vllm/reasoning/glm4_moe_reasoning_parser.py``, SGLang's ``glm45`` reasoning parser): the reasoning
ends at the first ``</think>``; when the generation prompt itself ends in ``<think>`` (GLM-4.7 /
GLM-5) everything before that is reasoning, and a turn cut before it closes is all reasoning. glmpost
splits the same way (``glm45``), on the ids: the split is a position in the action, the ids stay as
sampled (TITO) and are all trained; only what the environment reads (:attr:`Action.text`,
:attr:`Action.tool_calls`) is the content. ``none`` leaves every turn content (templates without
reasoning, the tiny built-in one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

REASONING_PARSERS = ("glm45", "none")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    """How one turn splits: ids ``[0, content_start)`` are reasoning (their count is the turn's
    reasoning tokens), the rest content."""

    content_start: int

    @property
    def reasoning_tokens(self) -> int:
        return self.content_start


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _first_close(ids: list[int], tokenizer) -> int | None:
    """The position just after the first ``</think>`` in ``ids``: by its id when the tokenizer has it
    as one token (GLM's do), else the fewest ids whose decoded text holds it; None when there is none."""
    added = tokenizer.get_added_vocab()
    if THINK_CLOSE in added:
        close = int(added[THINK_CLOSE])
        return next((i + 1 for i, token in enumerate(ids) if token == close), None)
    if THINK_CLOSE not in _decode(tokenizer, ids):
        return None
    low, high = 1, len(ids)
    while low < high:  # the smallest k whose ids[:k] decode to a text holding </think>
        middle = (low + high) // 2
        if THINK_CLOSE in _decode(tokenizer, ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


def split_reasoning(ids: Sequence[int], tokenizer, parser: str, *, prompt_in_reasoning: bool = False) -> ReasoningSplit:
    """The reasoning split of one turn's ``ids`` (module doc); ``prompt_in_reasoning``: the generation
    prompt ends in ``<think>``."""
    if parser == "none":
        return ReasoningSplit(0)
    if parser != "glm45":
        raise ValueError(f"unknown reasoning parser {parser!r} (one of {', '.join(REASONING_PARSERS)})")
    ids = [int(i) for i in ids]
    end = _first_close(ids, tokenizer)
    if end is not None:
        return ReasoningSplit(end)
    opened = prompt_in_reasoning or _decode(tokenizer, ids).lstrip().startswith(THINK_OPEN)
    return ReasoningSplit(len(ids) if opened else 0)


def default_reasoning_parser(template_has_reasoning: bool) -> str:
    """``glm45`` for a chat template that writes reasoning blocks, else ``none``."""
    return "glm45" if template_has_reasoning else "none"
