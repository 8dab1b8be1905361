"""A checkpoint's chat template as the exact pieces multi-turn rollouts append: the generation prompt,
an observation turn, a summary request, a resume turn, each rendered by the template itself.

GLM's checkpoints differ in what they render (shared/notes/glm-chat-formats.md): the generation prompt
is ``<|assistant|>`` on GLM-4.5/4.6, ``<|assistant|><think>`` on GLM-4.7/GLM-5 and
``<|assistant|>⏎<think></think>`` with ``enable_thinking=false``; tool results are ``tool`` messages
(no ``observation`` role: the templates silently drop unknown roles), one ``<tool_response>`` block
each under one ``<|observation|>``. So nothing here is a literal: each piece is the difference between
the template's rendering of a short conversation and of the same conversation with the new turns,
cut right after the content of the conversation's last message (a template that renders an earlier
turn differently once more turns follow, e.g. moving ``/nothink`` to the newest user turn, still
gives the new turns as it would render them). The observation role is found once by rendering a
sentinel in each candidate role.

Brief, "TITO：token ID 是动作事实": past turns are never re-rendered; these pieces are encoded once and
appended to the exact ids the model sampled.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from glmpost.errors import GlmpostError, UsageError

# Distinct texts no template writes by itself: where a probe message's content lands in a rendering.
_USER, _ASSISTANT, _PROBE = "glmpost-probe-user-7f3a", "glmpost-probe-assistant-7f3a", "glmpost-probe-tool-7f3a"
OBSERVATION_ROLES = ("observation", "tool")  # GLM's own role (the tiny template), then OpenAI's (GLM-4.5+)
TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.S)


class ChatFormatError(GlmpostError):
    """The chat template cannot render a turn a run needs; the message names the checkpoint."""


def template_kwargs(value: Any, *, where: str = "--chat-template-kwargs") -> dict[str, Any]:
    """Extra chat-template arguments (``{"enable_thinking": false}``) from a JSON object text or a
    dict; anything else is one error naming ``where``."""
    if isinstance(value, dict):
        parsed = value
    else:
        try:
            parsed = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where} {value!r}: not JSON ({exc.msg})") from None
    if not isinstance(parsed, dict):
        raise UsageError(f"{where} {value!r}: expected a JSON object")
    reserved = sorted(set(parsed) & {"messages", "tools", "add_generation_prompt", "tokenize", "return_dict"})
    if reserved:
        raise UsageError(f"{where}: {', '.join(reserved)} cannot be set here")
    return dict(parsed)


class ChatFormat:
    """The pieces of ``tokenizer``'s chat template rendered with ``kwargs`` (its ``enable_thinking``,
    ``clear_thinking`` ...); ``where`` names the checkpoint in errors."""

    def __init__(self, tokenizer, kwargs: dict[str, Any] | None = None, *, where: str = "the checkpoint"):
        self.tokenizer, self.kwargs, self.where = tokenizer, dict(kwargs or {}), where
        if not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError(f"{where}: the tokenizer has no chat template")
        self.generation_prompt = self._piece([("user", _USER)], [], generation_prompt=True)
        self.generation_ids = self.encode(self.generation_prompt)
        self.observation_role = self._observation_role()
        self.observation_id = tokenizer.convert_tokens_to_ids("<|observation|>")

    # -- rendering ------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool, tools=None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                  tokenize=False, **extra, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def _piece(self, context: Sequence[tuple[str, str]], new: Sequence[dict[str, Any]], *, generation_prompt: bool) -> str:
        """What the template writes for the ``new`` messages (and the generation prompt) after a
        conversation of ``context`` ``(role, content)`` turns: the text after the last context
        message's content and after what the template puts behind it (when it still does)."""
        messages = [{"role": role, "content": content} for role, content in context]
        last = messages[-1]["content"]
        try:
            before = self.render(messages, generation_prompt=False)
            after = self.render(messages + list(new), generation_prompt=generation_prompt)
        except Exception as exc:  # jinja's TemplateError, or a template's raise_exception
            raise ChatFormatError(f"{self.where}: the chat template cannot render "
                                  f"{[m['role'] for m in new] or 'the generation prompt'} ({type(exc).__name__}: {exc})") from None
        if last not in before or last not in after:
            raise ChatFormatError(f"{self.where}: the chat template does not render a {context[-1][0]} turn's content")
        tail = before[before.rindex(last) + len(last):]
        at = after.rindex(last) + len(last)
        return after[at + len(tail):] if after.startswith(tail, at) else after[at:]

    def _observation_role(self) -> str | None:
        """The first of :data:`OBSERVATION_ROLES` whose message the template renders (None: neither)."""
        for role in OBSERVATION_ROLES:
            try:
                text = self._piece([("user", _USER), ("assistant", _ASSISTANT)], [{"role": role, "content": _PROBE}],
                                   generation_prompt=True)
            except ChatFormatError:
                continue
            if _PROBE in text:
                return role
        return None

    # -- the pieces multi-turn rollouts append ----------------------------------------------------
    def observation_messages(self, text: str) -> list[dict[str, str]]:
        """``text`` as observation messages: one ``observation`` message, or one ``tool`` message per
        ``<tool_response>`` block (the template writes the blocks itself; text outside the blocks, or
        none, makes it one message of the whole text)."""
        if self.observation_role is None:
            raise ChatFormatError(f"{self.where}: the chat template renders neither an observation nor a tool turn")
        if self.observation_role == "observation":
            return [{"role": "observation", "content": text}]
        blocks = TOOL_RESPONSE.findall(text)
        if not blocks or TOOL_RESPONSE.sub("", text).strip():
            blocks = [text]
        return [{"role": "tool", "content": block} for block in blocks]

    def observation_text(self, text: str, *, after: str = "assistant") -> str:
        """Observation ``text`` as the template renders it after an ``after`` turn (``assistant``: a
        step's answer, ``user``: a reset observation after the prompt), with the generation prompt."""
        context = [("user", _USER), ("assistant", _ASSISTANT)] if after == "assistant" else [("user", _USER)]
        return self._piece(context, self.observation_messages(text), generation_prompt=True)

    def summary_request_text(self, observation: str, summary_prompt: str) -> str:
        """CompactionRL's summary request: the observation turn, ``summary_prompt`` as a user turn, the
        generation prompt."""
        new = self.observation_messages(observation) + [{"role": "user", "content": summary_prompt}]
        return self._piece([("user", _USER), ("assistant", _ASSISTANT)], new, generation_prompt=True)

    def user_turn_text(self, content: str) -> str:
        """A user turn after the prompt's turns, with the generation prompt (a rebuilt context's resume turn)."""
        return self._piece([("user", _USER)], [{"role": "user", "content": content}], generation_prompt=True)

    def strip_generation_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """A prompt's ids without the generation prompt it ends with (as they are when it does not)."""
        ids, tail = list(prompt_ids), self.generation_ids
        return ids[: -len(tail)] if tail and ids[-len(tail):] == tail else ids

    def strip_observation_marker(self, ids: list[int], *, after: Sequence[int]) -> list[int]:
        """``ids`` without their leading ``<|observation|>`` when the action ``after`` ends with it (the
        model emitted the turn marker: it is an action token)."""
        if after and after[-1] == self.observation_id and ids and ids[0] == self.observation_id:
            return ids[1:]
        return ids

    @property
    def prompt_in_reasoning(self) -> bool:
        """The generation prompt opens a reasoning block (GLM-4.7 / GLM-5: ``<|assistant|><think>``)."""
        return self.generation_prompt.rstrip().endswith("<think>")

    @property
    def has_reasoning(self) -> bool:
        """The template writes reasoning blocks (``</think>`` in it): GLM-4.5 and later."""
        return "</think>" in str(self.tokenizer.chat_template)

    def facts(self) -> dict[str, Any]:
        """What a run records of the format (stage.json)."""
        return {"generation_prompt": self.generation_prompt, "observation_role": self.observation_role,
                "template_kwargs": self.kwargs}
