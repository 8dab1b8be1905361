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
text (:mod:`glmpost.envs.glm_tool_pieces`: with GLM's tag tokens a tag the model spelled out of
ordinary pieces is text, never a call), and each call knows its ``span``, the positions of its ids.

Two parsers (``mode``, :data:`TOOL_CALL_PARSERS`). ``strict``: anything off (a tag out of place, a call
or value left open, an unknown tool, a repeated or empty key) makes the turn malformed, with no calls.
``engine``: what a serving engine's GLM tool parser hands its client on the same text, malformed or
not, each thing it forgave named in ``ToolCalls.repaired`` (:data:`REPAIRS`). It follows vLLM's regex
parsers, ``vllm/tool_parsers/glm4_moe_tool_parser.py`` (``Glm4MoeModelToolParser.extract_tool_calls``,
``_deserialize``, ``_is_string_type``; commit 081866a6) with the two regexes of
``glm47_moe_tool_parser.py`` (``Glm47MoeModelToolParser``, commit b91ee1b4), read on the pieces:

- a call is a ``<tool_call>`` to the first ``</tool_call>`` after it (a ``<tool_call>`` inside is
  text of the call); a ``<tool_call>`` no ``</tool_call>`` follows is no call (``unclosed-call``);
  tags outside calls are ignored (``stray-tag``);
- its name is the text before its first ``<arg_key>``, stripped; a call with none is dropped
  (``no-name``), and with ``tools`` (not empty) a name none of them has is dropped, the others kept
  (``unknown-tool``: vLLM's parser engine, ``vllm/parser/glm47_moe.py`` ``validate_tool_names=True``,
  and SGLang's ``BaseFormatDetector.parse_base_json`` drop it; the regex parser kept it);
- its arguments are each ``<arg_key>K</arg_key>`` that whitespace (or a literal ``\\n``) and an
  ``<arg_value>V</arg_value>`` follow, the shortest such match, left to right: a value without its
  ``</arg_value>`` or text between ``</arg_key>`` and ``<arg_value>`` loses that argument
  (``ignored-text``), unless a later pair completes the match, whose key or value then holds the
  tags between (``tag-in-argument``); a repeated key keeps its last value (``repeated-key``); an
  empty key is a key (``empty-key``);
- a value whose schema type is ``string`` is its raw text; any other (no schema, another type) is
  stripped and read as JSON, else as a Python literal (``'abc'``, ``True``, ``None``, ``{'a': 1}``:
  ``python-literal``), else kept as the stripped text; the arguments then go through JSON as the
  client gets them (a tuple becomes a list). A value whose reading raises anything but a parse
  error (``{[1]: 2}``), or that JSON cannot hold (``{1, 2}``), fails the whole turn as it fails
  vLLM's parser: no calls, ``error`` set;
- ``content`` is the text before the first ``<tool_call>``, or the whole turn when no call is kept.

Where SGLang (``python/sglang/srt/function_call/glm4_moe_detector.py``) disagrees, vLLM is followed:
SGLang reads a ``string`` value as JSON first and an untyped one unstripped, with an unescaping step
and number coercion, and its GLM-4.5 detector needs a newline after the name. vLLM's parser engine
(``vllm/parser/glm47_moe.py``, vLLM PR #45915: ``glm45``/``glm47`` from vLLM 0.24 on) differs in three ways
the regex parsers and this mode do not follow: untyped values stay text, typed ones are coerced by
schema only (``coerce_to_schema_type``: no Python literals), and an unclosed call keeps the pairs it
completed.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Sequence

from glmpost.envs.glm_tool_pieces import (  # the tags, TURN_ENDS and tag_ids are this module's names too
    CALL_CLOSE,
    CALL_OPEN,
    KEY_CLOSE,
    KEY_OPEN,
    TAGS,
    TURN_ENDS,
    VALUE_CLOSE,
    VALUE_OPEN,
    Piece,
    tag_ids,
    turn_pieces,
)

TOOL_CALL_PARSERS = ("strict", "engine")
# What the engine mode forgives, as ToolCalls.repaired names it (once per occurrence).
REPAIRS = ("unclosed-call", "stray-tag", "no-name", "unknown-tool", "ignored-text", "tag-in-argument", "repeated-key",
           "empty-key", "python-literal")


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name, its arguments, and ``span``, the ``[start, end)`` positions of
    its ids (``<tool_call>`` to ``</tool_call>``) in the action."""

    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]


@dataclass(frozen=True)
class ToolCalls:
    """What one turn called: its calls in order, the text before the first (``content``), for a
    malformed turn why (``error``; its calls are then empty) and, in the engine mode, what was
    forgiven to read them (``repaired``, names from :data:`REPAIRS`; empty for a clean turn)."""

    calls: tuple[ToolCall, ...] = ()
    content: str = ""
    error: str | None = None
    repaired: tuple[str, ...] = ()

    @property
    def malformed(self) -> bool:
        return self.error is not None


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

    def __init__(self, pieces: list[Piece], types: dict[str, dict[str, Any]] | None):
        self.pieces, self.types, self.at = pieces, types, 0

    def peek(self) -> Piece | None:
        return self.pieces[self.at] if self.at < len(self.pieces) else None

    def text(self) -> str:
        """The text piece here (consumed), or "" when a tag (or nothing) comes next."""
        piece = self.peek()
        if piece is None or piece.tag is not None:
            return ""
        self.at += 1
        return piece.text

    def expect(self, tag: str, after: str) -> Piece:
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


# The engine mode reads the pieces as one string in which each tag is one private-use character, so
# the regexes of vLLM's parser apply to tags, never to a tag the model spelled out of ordinary ids.
_SYMBOL = {tag: chr(0xF0000 + index) for index, tag in enumerate(TAGS)}
_ANY_TAG = re.compile("[" + "".join(_SYMBOL.values()) + "]")
_CALL = re.compile(f"{_SYMBOL[CALL_OPEN]}.*?{_SYMBOL[CALL_CLOSE]}", re.DOTALL)
_PAIR = re.compile(rf"{_SYMBOL[KEY_OPEN]}(.*?){_SYMBOL[KEY_CLOSE]}((?:\\n|\s)*){_SYMBOL[VALUE_OPEN]}(.*?)"
                   rf"{_SYMBOL[VALUE_CLOSE]}", re.DOTALL)


class _Symbols:
    """The pieces as one string, each tag one symbol, and the way back to their text and ids."""

    def __init__(self, pieces: list[Piece]):
        self.pieces, self.offsets, parts, at = pieces, [], [], 0
        for piece in pieces:
            self.offsets.append(at)
            parts.append(_SYMBOL[piece.tag] if piece.tag else _ANY_TAG.sub("\ufffd", piece.text))
            at += len(parts[-1])
        self.string = "".join(parts)

    def piece_at(self, char: int) -> Piece:
        return self.pieces[bisect_right(self.offsets, char) - 1]

    def text(self, begin: int, end: int) -> str:
        """The text of ``string[begin:end]``, each tag written out."""
        out = []
        for index in range(max(bisect_right(self.offsets, begin) - 1, 0), len(self.pieces)):
            piece, offset = self.pieces[index], self.offsets[index]
            if offset >= end:
                break
            if piece.tag is None:
                out.append(piece.text[max(begin - offset, 0) : end - offset])
            elif offset >= begin:
                out.append(piece.tag)
        return "".join(out)


def _engine_value(raw: str, kind: Any, repaired: list[str]) -> Any:
    """A value as vLLM reads it: a ``string`` parameter's raw text; else the stripped text as JSON,
    else as a Python literal, else as text. Any other error than a parse error fails the turn (vLLM's
    parser then gives no calls)."""
    if kind == "string":
        return raw
    text = raw.strip()
    try:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SyntaxWarning)
                value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    except Exception as exc:  # vLLM's parser fails the whole turn on these
        raise _Malformed(f"the engine's parser fails on argument value {text[:40]!r}: {type(exc).__name__}") from exc
    repaired.append("python-literal")
    return value


def _engine_arguments(symbols: _Symbols, begin: int, end: int, kinds: dict[str, Any], repaired: list[str]) -> dict:
    """The arguments in ``string[begin:end]`` (from the call's first ``<arg_key>``), as its client gets them."""
    arguments: dict[str, Any] = {}
    at = begin
    for pair in _PAIR.finditer(symbols.string, begin, end):
        if symbols.string[at : pair.start()].strip() or pair.group(2).strip():
            repaired.append("ignored-text")
        if _ANY_TAG.search(pair.group(1)) or _ANY_TAG.search(pair.group(3)):
            repaired.append("tag-in-argument")
        key = symbols.text(*pair.span(1)).strip()
        repaired.extend(["repeated-key"] * (key in arguments) + ["empty-key"] * (not key))
        arguments[key] = _engine_value(symbols.text(*pair.span(3)), kinds.get(key), repaired)
        at = pair.end()
    if symbols.string[at:end].strip():
        repaired.append("ignored-text")
    try:
        return json.loads(json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise _Malformed(f"the engine's parser fails on arguments that are no JSON ({exc})") from exc


def _engine_call(symbols: _Symbols, begin: int, end: int, types: dict[str, dict[str, Any]] | None,
                 repaired: list[str]) -> ToolCall | None:
    """The call of ``string[begin:end]`` (``<tool_call>`` to ``</tool_call>``), or None where the engine drops it."""
    first_key = symbols.string.find(_SYMBOL[KEY_OPEN], begin + 1, end - 1)
    arguments_at = end - 1 if first_key < 0 else first_key
    name = symbols.text(begin + 1, arguments_at).strip()
    if not name or (types is not None and name not in types):
        repaired.append("unknown-tool" if name else "no-name")
        return None
    arguments = _engine_arguments(symbols, arguments_at, end - 1, (types or {}).get(name, {}), repaired)
    return ToolCall(name, arguments, (symbols.piece_at(begin).start, symbols.piece_at(end - 1).end))


def _read_engine(pieces: list[Piece], types: dict[str, dict[str, Any]] | None) -> ToolCalls:
    """The engine mode's reading of a turn (the module's docstring says what it forgives)."""
    symbols = _Symbols(pieces)
    string, calls, repaired, at = symbols.string, [], [], 0
    try:
        for found in _CALL.finditer(string):
            repaired.extend(["stray-tag"] * len(_ANY_TAG.findall(string, at, found.start())))
            call = _engine_call(symbols, found.start(), found.end(), types, repaired)
            calls.extend([call] if call is not None else [])
            at = found.end()
    except _Malformed as exc:
        return ToolCalls((), symbols.text(0, len(string)), str(exc), tuple(repaired))
    unclosed = string.find(_SYMBOL[CALL_OPEN], at)
    unclosed = len(string) if unclosed < 0 else unclosed
    repaired.extend(["stray-tag"] * len(_ANY_TAG.findall(string, at, unclosed)))
    repaired.extend(["unclosed-call"] * string.count(_SYMBOL[CALL_OPEN], unclosed))
    content = symbols.text(0, string.find(_SYMBOL[CALL_OPEN]) if calls else len(string))
    return ToolCalls(tuple(calls), content, None, tuple(repaired))


def _read_strict(pieces: list[Piece], types: dict[str, dict[str, Any]] | None) -> ToolCalls:
    reader = _Reader(pieces, types)
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


def parse_tool_calls(ids: Sequence[int], tokenizer, tools: Sequence[dict[str, Any]] | None = None, *,
                     mode: str = "strict", start: int = 0) -> ToolCalls:
    """The GLM tool calls in one action's exact ``ids`` from ``start`` (where the caller's reasoning
    block ends; 0: all of them) up to the turn end: each call's name, its arguments and its ids' span
    (positions in the whole ``ids``); ``content`` is the text from ``start`` to the first call.

    ``mode="strict"``: a value is JSON when it parses as JSON, unless its schema says ``string``; else
    the raw text. With ``tools``, a name none of them has is malformed. A malformed turn (a tag out of
    place, a call or argument left open, an empty name or key) has no calls and says why; text
    between calls is allowed and ignored. ``mode="engine"``: what vLLM's GLM tool parser gives on the
    same turn (the module's docstring), what it forgave in ``repaired``; tools are checked when
    ``tools`` is not empty (vLLM's check)."""
    if mode not in TOOL_CALL_PARSERS:
        raise ValueError(f"mode={mode!r}: the tool-call parsers are {', '.join(TOOL_CALL_PARSERS)}")
    pieces = turn_pieces(ids, tokenizer, start)
    if mode == "engine":
        return _read_engine(pieces, _parameter_types(tools) if tools else None)
    return _read_strict(pieces, _parameter_types(tools) if tools is not None else None)


def tool_responses(results: Sequence[str]) -> str:
    """The observation text of a turn's results: GLM's observation turn, after its ``<|observation|>``
    and newline, is one ``<tool_response>`` per call::

        <tool_response>
        RESULT
        </tool_response>
    """
    return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)
