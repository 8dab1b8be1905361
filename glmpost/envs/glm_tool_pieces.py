"""GLM's tool-call tags in an action's exact ids: the turn read as tags and runs of text, each piece
with the ids it covers (what :mod:`glmpost.envs.glm_tool_calls` parses, either mode).

When the tokenizer has the six tags as added tokens (GLM's do: one id each), the ids are split at
those ids, so a tag the model spelled out of ordinary pieces is text, never a tag; otherwise (the
tiny built-in tokenizer) the ids are decoded with their special tokens and the tags found in that
text, each piece's ids found back from its characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Sequence

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
TAGS = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)
# What ends a GLM turn (the engine stops there): nothing after one belongs to the turn's calls.
TURN_ENDS = ("<|observation|>", "<|endoftext|>", "<|user|>")
_TAG_PATTERN = re.compile("|".join(re.escape(tag) for tag in TAGS))


@dataclass(frozen=True)
class Piece:
    """A tag (``tag`` set) or a run of text, with the ``[start, end)`` ids it covers."""

    tag: str | None
    text: str
    start: int
    end: int


def tag_ids(tokenizer) -> dict[int, str] | None:
    """The id of each tag when every one of the six is an added token of ``tokenizer`` (GLM's
    tokenizers), else None (the tags are plain text)."""
    added = tokenizer.get_added_vocab()
    if not all(tag in added for tag in TAGS):
        return None
    return {int(added[tag]): tag for tag in TAGS}


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _turn_length(ids: Sequence[int], tokenizer) -> int:
    """How many of ``ids`` belong to the turn: up to its first turn end (``<|observation|>``...)."""
    ends = {tokenizer.convert_tokens_to_ids(marker) for marker in TURN_ENDS}
    return next((i for i, token in enumerate(ids) if token in ends), len(ids))


def _pieces_by_id(ids: Sequence[int], tokenizer, tags: dict[int, str]) -> list[Piece]:
    """Tags where the ids are the tag ids; the runs between decoded as text."""
    pieces, start = [], 0
    for position, token in enumerate([*ids, None]):
        if token is None or token in tags:
            if position > start:
                pieces.append(Piece(None, _decode(tokenizer, ids[start:position]), start, position))
            if token is not None:
                pieces.append(Piece(tags[token], tags[token], position, position + 1))
            start = position + 1
    return pieces


def _prefix_ids(ids: Sequence[int], tokenizer, char: int, *, covering: bool) -> int:
    """The fewest ids whose text reaches character ``char`` of the turn's text (``covering``), or the
    most whose text stays before it."""
    low, high = 0, len(ids)
    while low < high:  # the smallest k with len(text of ids[:k]) >= char
        middle = (low + high) // 2
        if len(_decode(tokenizer, ids[:middle])) >= char:
            high = middle
        else:
            low = middle + 1
    if covering or low == 0 or len(_decode(tokenizer, ids[:low])) == char:
        return low
    return low - 1


def _pieces_by_text(ids: Sequence[int], tokenizer) -> list[Piece]:
    """The tags found in the decoded text, each piece's ids found back from its characters."""
    text = _decode(tokenizer, ids)
    pieces, at = [], 0

    def add(tag: str | None, start: int, end: int) -> None:
        pieces.append(Piece(tag, text[start:end], _prefix_ids(ids, tokenizer, start, covering=False),
                            _prefix_ids(ids, tokenizer, end, covering=True)))

    for found in _TAG_PATTERN.finditer(text):
        if found.start() > at:
            add(None, at, found.start())
        add(found.group(), found.start(), found.end())
        at = found.end()
    if at < len(text):
        add(None, at, len(text))
    return pieces


def turn_pieces(ids: Sequence[int], tokenizer, start: int = 0) -> list[Piece]:
    """The pieces of ``ids[start:]`` up to its turn end, their positions counted in the whole ``ids``."""
    if not 0 <= start <= len(ids):
        raise ValueError(f"start={start} is not a position in the action's {len(ids)} ids")
    ids = [int(i) for i in ids[start:]]
    ids = ids[: _turn_length(ids, tokenizer)]
    tags = tag_ids(tokenizer)
    pieces = _pieces_by_id(ids, tokenizer, tags) if tags is not None else _pieces_by_text(ids, tokenizer)
    return [replace(piece, start=piece.start + start, end=piece.end + start) for piece in pieces] if start else pieces
