"""CompactionRL's context compaction in multi-turn rollouts (brief, "CompactionRL：摘要也要为任务结果负责").

When the context budget runs low, ``C - |h_t| < T_comp``, the same trainable policy writes a summary
``S_t ~ pi_theta(. | h_t + q_sum)`` and the trajectory continues in a rebuilt context

    h'_t = (s) + u_resume(S_t) + (z_{t-k+1}, ..., z_t)

``(s)``: the prompt's own turns (system and task; the environment's reset observation is not
repeated), ``u_resume``: a user turn of the resume template holding the summary's exact ids (its
stop token left out), ``z_i``: the last ``k`` atomic (action ids, observation ids) pairs, the last
observation rendered with the assistant's generation prompt. Everything is token ids: nothing the
model wrote is re-tokenized (TITO across compactions); only the templates' own text is encoded.

The summary request is the last observation rendered as an observation turn, then ``q_sum`` as a
user turn and the generation prompt: it is appended as observation tokens and the summary is an
action segment of kind ``summary``, trained with the trajectory's final reward. Mode ``drop`` is
the baseline without summaries: the context is rebuilt from ``(s)`` and the last ``max(k, 1)``
pairs alone (the newest observation always survives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from glmpost.config import ConfigError
from glmpost.envs.reasoning import split_reasoning
from glmpost.formats.chat_format import ChatFormat

COMPACTION_MODES = ("off", "summary", "drop")
SUMMARY_SLOT = "{summary}"
_SENTINEL = "\x00glmpost-summary\x00"


@dataclass
class CompactionSettings:
    """How a multi-turn rollout compacts: ``mode`` (off, summary, drop), the budget ``C``, the
    threshold ``T_comp``, the pairs kept ``k``, the summary prompt and resume template, the most
    tokens a summary may take."""

    mode: str = "off"
    budget: int = 0
    threshold: int = 0
    keep_last: int = 2
    summary_prompt: str = ""
    resume_template: str = "Summary: " + SUMMARY_SLOT
    max_summary_tokens: int = 64

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def pairs_kept(self) -> int:
        """Pairs copied into a rebuilt context (``drop`` keeps at least the newest one)."""
        return max(self.keep_last, 1) if self.mode == "drop" else self.keep_last

    def as_json(self) -> dict:
        return {"mode": self.mode, "budget": self.budget, "threshold": self.threshold, "keep_last": self.keep_last}


def due(settings: CompactionSettings, context_length: int, max_new_tokens: int) -> bool:
    """The brief's trigger ``C - |h_t| < T_comp``, and, so the budget bounds every action turn,
    ``|h_t| + max_new_tokens > C`` (the next turn could overflow it)."""
    return settings.on and (settings.budget - context_length < settings.threshold
                            or context_length + max_new_tokens > settings.budget)


class ContextBuilder:
    """The template pieces of compaction as exact ids of the policy's tokenizer, each rendered by the
    checkpoint's own chat template (:class:`~glmpost.formats.chat_format.ChatFormat`): its generation
    prompt, its observation role (GLM-4.5+'s ``tool`` messages), its user turn."""

    def __init__(self, chat: ChatFormat, settings: CompactionSettings, stop_ids: Sequence[int], *,
                 reasoning_parser: str = "none"):
        self.chat, self.tokenizer, self.settings = chat, chat.tokenizer, settings
        self.reasoning_parser = reasoning_parser
        self.stop_ids = set(stop_ids)
        self.opener = list(chat.generation_ids)
        before, after = chat.user_turn_text(resume_pieces(settings.resume_template)).split(_SENTINEL)
        self.resume_before, self.resume_after = chat.encode(before), chat.encode(after)

    def head(self, prompt_ids: Sequence[int]) -> list[int]:
        """``(s)``: a prompt's ids without its trailing generation prompt."""
        return self.chat.strip_generation_prompt(prompt_ids)

    def request(self, observation: str, *, after: Sequence[int]) -> list[int]:
        """The summary request: ``observation`` as an observation turn (its ``<|observation|>`` left
        out when the action ``after`` ends with it), ``q_sum`` as a user turn, the generation prompt."""
        ids = self.chat.encode(self.chat.summary_request_text(observation, self.settings.summary_prompt))
        return self.chat.strip_observation_marker(ids, after=after)

    def summary_body(self, summary_ids: Sequence[int]) -> list[int]:
        """The summary's ids as the resume turn copies them: its content (after its reasoning block,
        when the reasoning parser splits one off), without the stop token that ended it."""
        ids = list(summary_ids)
        start = split_reasoning(ids, self.tokenizer, self.reasoning_parser,
                                prompt_in_reasoning=self.chat.prompt_in_reasoning).content_start
        ids = ids[start:]
        return ids[:-1] if ids and ids[-1] in self.stop_ids else ids

    def rebuild(self, head: Sequence[int], summary_ids: Sequence[int] | None,
                pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
        """``(s) + u_resume(S) + pairs`` (``summary_ids`` None: ``(s)``, the generation prompt, pairs)."""
        ids = list(head)
        if summary_ids is None:
            ids += self.opener
        else:
            ids += self.resume_before + self.summary_body(summary_ids) + self.resume_after
        for action, observation in pairs:
            ids += list(action) + list(observation)
        return ids

    def fixed_length(self, head: Sequence[int]) -> int:
        """The rebuilt context's length without a summary token and without pairs."""
        if self.settings.mode == "drop":
            return len(head) + len(self.opener)
        return len(head) + len(self.resume_before) + len(self.resume_after)


def resume_pieces(template: str) -> str:
    """``template`` with its one ``{summary}`` slot marked; ValueError when it has none or several."""
    if template.count(SUMMARY_SLOT) != 1:
        raise ValueError(f"must contain {SUMMARY_SLOT} exactly once, got {template!r}")
    return template.replace(SUMMARY_SLOT, _SENTINEL)


def fit_pairs(builder: ContextBuilder, head: Sequence[int], summary_ids: Sequence[int] | None,
              pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, room: int) -> tuple[list[int], int]:
    """The rebuilt context with as many of the newest ``pairs`` as leave ``room`` tokens of the
    budget, and how many that is (the oldest are dropped first)."""
    for kept in range(len(pairs), -1, -1):
        ids = builder.rebuild(head, summary_ids, pairs[len(pairs) - kept :])
        if builder.settings.budget - len(ids) >= room or kept == 0:
            return ids, kept
    raise AssertionError("unreachable")


def check_rebuild_room(prompts: Sequence[Any], builder: ContextBuilder, max_new_tokens: int) -> None:
    """Refuse a context budget that no rebuilt context fits: the prompt's own turns, the resume turn
    with a summary of ``max_summary_tokens`` (mode summary), and room for the next turn (the larger
    of the threshold and ``max_new_tokens``), before any pair is copied. ``prompts``: rollout prompts
    (their ``token_ids`` and ``source``)."""
    settings = builder.settings
    summary = settings.max_summary_tokens if settings.mode == "summary" else 0
    room = max(settings.threshold, max_new_tokens)
    for prompt in prompts:
        fixed = builder.fixed_length(builder.head(prompt.token_ids)) + summary
        if fixed + room > settings.budget:
            parts = "the prompt's turns, the resume turn and a summary of {max_summary_tokens}" if summary else "the prompt's turns"
            raise ConfigError("{source}: a rebuilt context needs {fixed} tokens (" + parts + ") and {room} for the next "
                              "turn, more than {context_budget} {budget}", source=prompt.source, fixed=fixed, room=room,
                              budget=settings.budget, exit_code=1)
