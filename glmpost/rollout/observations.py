"""How a multi-turn rollout reads a model turn and answers it, in the checkpoint's own chat format.

A turn's reasoning is split off first (:mod:`glmpost.envs.reasoning`, as vLLM and SGLang split a GLM
turn), its tool calls are parsed from the content's exact ids (:mod:`glmpost.envs.glm_tool_calls`),
and the environment's answer is rendered once by the chat template (an observation turn and the
generation prompt: :class:`~glmpost.formats.chat_format.ChatFormat`) and appended as ids.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from glmpost.config import ConfigError
from glmpost.envs import Action, parse_tool_calls
from glmpost.envs.reasoning import default_reasoning_parser, split_reasoning
from glmpost.formats.chat_format import ChatFormat


class ObservationRenderer:
    """How a multi-turn rollout reads and answers a model turn in the checkpoint's chat format
    (:class:`~glmpost.formats.chat_format.ChatFormat`): the turn's reasoning split off
    (``reasoning_parser``, :mod:`glmpost.envs.reasoning`), its tool calls parsed from the content
    (``tool_call_parser``), and an observation as the exact ids the template gives an observation
    turn followed by the generation prompt."""

    def __init__(self, tokenizer, chat: ChatFormat | None = None, *, reasoning_parser: str = "none",
                 tool_call_parser: str = "strict"):
        self.tokenizer = tokenizer
        self.chat = chat if chat is not None else ChatFormat(tokenizer)
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        if self.chat.observation_role is None:
            raise ConfigError("{env}: the checkpoint's chat template renders neither an observation nor a tool turn "
                              f"({self.chat.where})")

    def ids(self, text: str, *, after: Sequence[int]) -> list[int]:
        """The ids of observation ``text`` after the action ``after``; without the leading
        ``<|observation|>`` when the action already ends with it."""
        return self.chat.strip_observation_marker(self.chat.encode(self.chat.observation_text(text)), after=after)

    def prompt_with(self, prompt_ids: Sequence[int], text: str) -> list[int]:
        """A prompt's ids with a reset observation placed before the generation prompt (the template's
        observation turn after the prompt's last turn, then the generation prompt)."""
        return self.chat.strip_generation_prompt(prompt_ids) + self.chat.encode(self.chat.observation_text(text, after="user"))

    def action(self, token_ids: Sequence[int], decode: Callable[[list[int]], str], tools) -> tuple[Action, int]:
        """The environment's view of one turn and its reasoning tokens: the text and tool calls of the
        content only (a call or an answer inside the reasoning is never acted on)."""
        ids = [int(i) for i in token_ids]
        split = split_reasoning(ids, self.tokenizer, self.reasoning_parser, prompt_in_reasoning=self.chat.prompt_in_reasoning)
        start = split.content_start
        calls = (parse_tool_calls(ids, self.tokenizer, tools, mode=self.tool_call_parser, start=start) if tools else None)
        reasoning = decode(ids[:start]) if start else ""
        return Action(tuple(ids), decode(ids[start:]), calls, reasoning), split.reasoning_tokens

    def facts(self) -> dict[str, Any]:
        """What stage.json records of the run's chat format and parsers."""
        return {**self.chat.facts(), "reasoning_parser": self.reasoning_parser, "tool_call_parser": self.tool_call_parser}



def resolved_parser(parser: str, chat: ChatFormat) -> str:
    """``parser``, with ``auto`` resolved from the template (``glm45`` where it writes ``</think>``)."""
    return default_reasoning_parser(chat.has_reasoning) if parser == "auto" else parser


def reasoning_counter(checkpoint: Any, parser: str, kwargs: dict[str, Any]) -> tuple[str, Callable[[Sequence[int]], int] | None]:
    """For a single-turn rollout: the reasoning parser (``auto`` resolved from the template) and the
    number of reasoning tokens a response starts with (its reasoning block,
    :func:`~glmpost.envs.reasoning.split_reasoning`), None when the parser is ``none`` (or there is
    no chat template)."""
    if parser == "none" or not getattr(checkpoint.tokenizer, "chat_template", None):
        return "none", None
    chat = ChatFormat(checkpoint.tokenizer, kwargs, where=f"{checkpoint.version_dir}'s chat template")
    parser = resolved_parser(parser, chat)
    if parser == "none":
        return parser, None
    return parser, lambda ids: split_reasoning(ids, chat.tokenizer, parser,
                                               prompt_in_reasoning=chat.prompt_in_reasoning).reasoning_tokens


def open_renderer(checkpoint: Any, multi_turn: Any, kwargs: dict[str, Any]) -> ObservationRenderer:
    """The renderer of a multi-turn rollout on ``checkpoint`` (its tokenizer and chat template, rendered
    with ``kwargs``), its reasoning parser resolved (``auto``: from the template) and its tool-call
    parser; a template that cannot render a needed turn is one error naming the checkpoint."""
    chat = ChatFormat(checkpoint.tokenizer, kwargs, where=f"{checkpoint.version_dir}'s chat template")
    return ObservationRenderer(checkpoint.tokenizer, chat, reasoning_parser=resolved_parser(multi_turn.reasoning_parser, chat),
                               tool_call_parser=multi_turn.tool_call_parser)
