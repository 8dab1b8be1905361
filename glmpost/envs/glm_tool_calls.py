"""GLM's own tool calls (GLM-4.5 / 4.6 / 4.7 / GLM-5), parsed from the exact ids the policy sampled.

The checkpoint's chat template renders an environment's tools (JSON schemas, OpenAI function format)
into the system prompt (a ``# Tools`` section, the schemas inside ``<tools></tools>``); the model then
calls them as::

    <tool_call>FUNCTION_NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...</tool_call>

(GLM-4.7 and GLM-5 leave the newlines out), several calls a turn, and ends the turn with
``<|observation|>``. The results come back in one observation turn, one ``<tool_response>`` each
(:func:`tool_responses`), followed by ``<|assistant|>``.

Brief, "TITO：token ID 是动作事实": :func:`parse_tool_calls` reads the action's ids, never a re-tokenized
text. When the tokenizer has the six tags as added tokens (GLM's do: one id each), the ids are split
at those ids, so a tag the model spelled out of ordinary pieces is text, never a call; otherwise (the
tiny built-in tokenizer) the ids are decoded with their special tokens and the tags found in that
text, each call's span mapped back to the ids it came from. Either way a call knows its ``span``,
the positions of its ids in the action.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
TAGS = (CALL_OPEN, CALL_CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)
# What ends a GLM turn (the engine stops there): nothing after one belongs to the turn's calls.
TURN_ENDS = ("<|observation|>", "<|endoftext|>", "<|user|>")
_TAG_PATTERN = re.compile("|".join(re.escape(tag) for tag in TAGS))


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name, its arguments, and ``span``, the ``[start, end)`` positions of
    its ids (``<tool_call>`` to ``</tool_call>``) in the action."""

    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]


@dataclass(frozen=True)
class ToolCalls:
    """What one turn called: its calls in order, the text before the first (``content``) and, for a
    malformed turn, why (``error``; its calls are then empty)."""

    calls: tuple[ToolCall, ...] = ()
    content: str = ""
    error: str | None = None

    @property
    def malformed(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class _Piece:
    """A tag (``tag`` set) or a run of text, with the ``[start, end)`` ids it covers."""

    tag: str | None
    text: str
    start: int
    end: int


class _Malformed(Exception):
    pass


def tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    """The function names of ``tools`` (OpenAI format ``{"type": "function", "function": {...}}``, or
    the bare function object)."""
    return [str(tool.get("function", tool).get("name", "")) for tool in tools or ()]


def _parameter_types(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Per function name, its parameters' JSON-schema ``type`` (where the schema gives one)."""
    types = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[str(function.get("name", ""))] = {key: spec.get("type") for key, spec in properties.items()
                                                if isinstance(spec, dict)}
    return types


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


def _pieces_by_id(ids: Sequence[int], tokenizer, tags: dict[int, str]) -> list[_Piece]:
    """Tags where the ids are the tag ids; the runs between decoded as text."""
    pieces, start = [], 0
    for position, token in enumerate([*ids, None]):
        if token is None or token in tags:
            if position > start:
                pieces.append(_Piece(None, _decode(tokenizer, ids[start:position]), start, position))
            if token is not None:
                pieces.append(_Piece(tags[token], tags[token], position, position + 1))
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


def _pieces_by_text(ids: Sequence[int], tokenizer) -> list[_Piece]:
    """The tags found in the decoded text, each piece's ids found back from its characters."""
    text = _decode(tokenizer, ids)
    pieces, at = [], 0

    def add(tag: str | None, start: int, end: int) -> None:
        pieces.append(_Piece(tag, text[start:end], _prefix_ids(ids, tokenizer, start, covering=False),
                             _prefix_ids(ids, tokenizer, end, covering=True)))

    for found in _TAG_PATTERN.finditer(text):
        if found.start() > at:
            add(None, at, found.start())
        add(found.group(), found.start(), found.end())
        at = found.end()
    if at < len(text):
        add(None, at, len(text))
    return pieces


def _value(raw: str, kind: Any) -> Any:
    """An argument's value: the raw text for a ``string`` parameter, else its JSON value when it
    parses as JSON, else the raw text."""
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class _Reader:
    """Reads calls off the pieces, one at a time."""

    def __init__(self, pieces: list[_Piece], types: dict[str, dict[str, Any]] | None):
        self.pieces, self.types, self.at = pieces, types, 0

    def peek(self) -> _Piece | None:
        return self.pieces[self.at] if self.at < len(self.pieces) else None

    def text(self) -> str:
        """The text piece here (consumed), or "" when a tag (or nothing) comes next."""
        piece = self.peek()
        if piece is None or piece.tag is not None:
            return ""
        self.at += 1
        return piece.text

    def expect(self, tag: str, after: str) -> _Piece:
        piece = self.peek()
        if piece is None or piece.tag != tag:
            found = "the end of the turn" if piece is None else (piece.tag or f"text {piece.text[:40]!r}")
            raise _Malformed(f"{after} without {tag} (found {found})")
        self.at += 1
        return piece

    def call(self) -> ToolCall:
        """One call, from its ``<tool_call>`` to its ``</tool_call>``."""
        start = self.expect(CALL_OPEN, "a call").start
        name = self.text().strip()
        if not name:
            raise _Malformed("a <tool_call> without a function name")
        if self.types is not None and name not in self.types:
            raise _Malformed(f"unknown tool {name!r} (tools: {', '.join(self.types) or 'none'})")
        arguments: dict[str, Any] = {}
        while True:
            piece = self.peek()
            if piece is not None and piece.tag == CALL_CLOSE:
                self.at += 1
                return ToolCall(name, arguments, (start, piece.end))
            self.expect(KEY_OPEN, f"tool call {name!r}")
            key = self.text().strip()
            self.expect(KEY_CLOSE, f"{KEY_OPEN}{key}")
            if not key or key in arguments:
                raise _Malformed(f"tool call {name!r}: {'an empty' if not key else 'a repeated'} argument key {key!r}")
            if self.text().strip():
                raise _Malformed(f"tool call {name!r}: text between {KEY_CLOSE} and {VALUE_OPEN}")
            self.expect(VALUE_OPEN, f"argument {key!r}")
            raw = self.text()
            self.expect(VALUE_CLOSE, f"argument {key!r}'s {VALUE_OPEN}")
            arguments[key] = _value(raw, (self.types or {}).get(name, {}).get(key))
            if self.text().strip():
                raise _Malformed(f"tool call {name!r}: text after argument {key!r}'s {VALUE_CLOSE}")


def parse_tool_calls(ids: Sequence[int], tokenizer, tools: Sequence[dict[str, Any]] | None = None) -> ToolCalls:
    """The GLM tool calls in one action's exact ``ids`` (up to its turn end): each call's name, its
    arguments (a value is JSON when it parses as JSON, unless its schema says ``string``; else the
    raw text) and its ids' span. With ``tools``, a name none of them has is malformed. A malformed
    turn (a tag out of place, a call or argument left open, an empty name or key) has no calls and
    says why; text between calls is allowed and ignored."""
    ids = [int(i) for i in ids][: _turn_length(ids, tokenizer)]
    tags = tag_ids(tokenizer)
    pieces = _pieces_by_id(ids, tokenizer, tags) if tags is not None else _pieces_by_text(ids, tokenizer)
    reader = _Reader(pieces, _parameter_types(tools) if tools is not None else None)
    content = reader.text()
    calls = []
    try:
        while (piece := reader.peek()) is not None:
            if piece.tag is None:
                reader.at += 1
            elif piece.tag == CALL_OPEN:
                calls.append(reader.call())
            else:
                raise _Malformed(f"{piece.tag} outside a {CALL_OPEN}")
    except _Malformed as exc:
        return ToolCalls((), content, str(exc))
    return ToolCalls(tuple(calls), content)


def tool_responses(results: Sequence[str]) -> str:
    """The observation text of a turn's results: GLM's observation turn, after its ``<|observation|>``
    and newline, is one ``<tool_response>`` per call::

        <tool_response>
        RESULT
        </tool_response>
    """
    return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)
