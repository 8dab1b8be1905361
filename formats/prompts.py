"""Prompt data: JSONL lines of ``prompt`` text or chat ``messages`` with ``domain`` and ``task``.

One line = one prompt: ``{"id": ..., "prompt": "..."}`` or ``{"messages": [{"role": ..., "content":
...}, ...]}``, plus ``domain`` (routes to a verifier and a teacher) and ``task`` (what the verifier
needs). Prompts are rendered with the checkpoint's chat template into token ids once, here; every
later stage works on those ids (TITO: text is never re-tokenized downstream).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from glmpost.errors import GlmpostError
from glmpost.formats.pipes import is_pipe, pipe_bytes

CHAT_ROLES = ("system", "user", "assistant", "tool", "observation")


class PromptDataError(GlmpostError):
    """A prompt file line that cannot be used; the message names the file and line."""


@dataclass
class PromptItem:
    id: str
    messages: list[dict[str, str]]
    domain: str = ""
    task: dict[str, Any] = field(default_factory=dict)
    response: str | None = None  # a reference reply, for imports of finished conversations


def _text_field(obj: dict, key: str, default: str, where: str) -> str:
    """``id`` and ``domain`` are text in every record; an integer (a dataset's row number) is kept
    as its decimal text (``3`` -> ``"3"``); a float, boolean, null, list or object is refused."""
    value = obj.get(key, default)
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise PromptDataError(f"{where}: '{key}' must be a string (or an integer, kept as its decimal text), "
                          f"got {json.dumps(value)}")


def parse_prompt_line(obj: Any, *, where: str, default_id: str) -> PromptItem:
    """One JSON object as a :class:`PromptItem`; ``where`` (``file:line``) prefixes every error."""
    if not isinstance(obj, dict):
        raise PromptDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise PromptDataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise PromptDataError(f"{where}: messages[{i}] needs a string 'content'")
            if message.get("role") not in CHAT_ROLES:
                raise PromptDataError(f"{where}: messages[{i}] has role {message.get('role')!r} (one of {', '.join(CHAT_ROLES)})")
    elif isinstance(obj.get("prompt"), str):
        if not obj["prompt"].strip():
            raise PromptDataError(f"{where}: 'prompt' is empty")
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise PromptDataError(f"{where}: needs a string 'prompt' or a 'messages' list")
    task = obj.get("task", {})
    if not isinstance(task, dict):
        raise PromptDataError(f"{where}: 'task' must be an object")
    response = obj.get("response")
    if response is not None and not isinstance(response, str):
        raise PromptDataError(f"{where}: 'response' must be a string")
    if response is None and len(messages) > 1 and messages[-1].get("role") == "assistant":
        # A chat that ends with the assistant's turn (SFT data): that turn is the response.
        response, messages = messages[-1]["content"], messages[:-1]
    return PromptItem(
        id=_text_field(obj, "id", default_id, where),
        messages=[{"role": m["role"], "content": m["content"]} for m in messages],
        domain=_text_field(obj, "domain", "", where),
        task=task,
        response=response,
    )


def read_jsonl(path: Path):
    """Yield ``(where, object)`` for each non-blank line; invalid JSON or bytes that are not UTF-8
    are an error naming the line (and the byte's offset in the file)."""
    path = Path(path)
    try:
        handle = io.BytesIO(pipe_bytes(path)) if is_pipe(path) else open(path, "rb")
    except FileNotFoundError:
        raise PromptDataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PromptDataError(f"{path}: is a directory, expected a JSONL file") from None
    with handle:
        offset = 0
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptDataError(f"{where}: not UTF-8 text (byte {offset + exc.start} of the file: {exc.reason})") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptDataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None


def jsonl_rows(path: Path):
    """Yield ``(where, default id, object)`` for each line of :func:`read_jsonl`; the id defaults
    to ``<file stem>-<line>``."""
    for where, obj in read_jsonl(path):
        yield where, f"{Path(path).stem}-{where.rsplit(':', 1)[1]}", obj


def read_prompts(path: Path, rows=None) -> list[PromptItem]:
    """All prompts of a JSONL file (or of ``rows``, ``(where, default id, object)`` read from
    ``path``: :func:`jsonl_rows` by default); ids must be unique."""
    items: list[PromptItem] = []
    seen: dict[str, str] = {}
    for where, default_id, obj in jsonl_rows(path) if rows is None else rows:
        item = parse_prompt_line(obj, where=where, default_id=default_id)
        if item.id in seen:
            raise PromptDataError(f"{where}: id {item.id!r} repeats {seen[item.id]}")
        seen[item.id] = where
        items.append(item)
    if not items:
        raise PromptDataError(f"{path}: no prompts (the file is empty)")
    return items


def encode_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template, ending with the assistant turn opener;
    with ``tools`` (JSON function schemas), the template renders them too (GLM: into the system prompt);
    ``template_kwargs``: the template's own arguments (GLM's ``enable_thinking``)."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **extra,
                                        **(template_kwargs or {}))
    return [int(i) for i in ids]


def renders_tools(tokenizer, tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template renders ``tools``: a probe conversation rendered with them differs
    from the one without, and names every function."""
    probe = [{"role": "user", "content": "?"}]
    plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    with_tools = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, tools=tools)
    names = [str(tool.get("function", tool).get("name", "")) for tool in tools]
    return with_tools != plain and all(name in with_tools for name in names)


def encode_response(tokenizer, text: str, *, eos: bool = True) -> list[int]:
    """Token ids of a reply as the model would emit it: the text, then end-of-text."""
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    if eos and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def conversation_record(item: PromptItem, tokenizer, revision: str,
                        template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A trajectory record for a text conversation: the prompt through the chat template, the
    reference response (if any) tokenized as the model would emit it, every response token an action.

    For data from outside glmpost (SFT sets, imports); rollout records come from the engine instead.
    """
    response = encode_response(tokenizer, item.response) if item.response is not None else []
    return {
        "id": item.id,
        "prompt_id": item.id,
        "group_id": item.id,
        "domain": item.domain,
        "task": item.task,
        "prompt_token_ids": np.asarray(encode_prompt(tokenizer, item.messages, None, template_kwargs), dtype=np.int32),
        "response_token_ids": np.asarray(response, dtype=np.int32),
        "action_mask": np.ones(len(response), dtype=bool),
        "observation_mask": np.zeros(len(response), dtype=bool),
        "status": "completed",
        "tokenizer_revision": revision,
    }
