"""Multi-turn rollouts against an environment, with exact token ids (TITO).

Brief, "TITO：token ID 是动作事实": the model's ids are never re-tokenized. A trajectory is the prompt's
ids, then turn after turn the model's exact ids (its action, ending with the turn marker it emitted:
GLM has no assistant close token, ``<|observation|>`` calls the environment and ``<|endoftext|>`` /
``<|user|>`` ends the answer; that marker is an action token and is trained) and the environment's
answer rendered once with the chat template's observation turn (``<|observation|>\\n TEXT
<|assistant|>\\n``, the ``<|observation|>`` left out when the model emitted it) and appended as ids.
Each turn's prompt is exactly everything before it.

Turn ``t`` of sequence ``KEY`` samples with the seed of ``KEY`` (turn 0, as a single-turn rollout) or
``KEY#turnT``, so a trajectory's samples depend on its own seed only (:func:`glmpost.kernel.engine.turn_key`).

A trajectory ends ``completed`` when the environment says done, ``truncated`` when a turn hits
``max_new_tokens``, the turn budget runs out, or the next observation would overflow the context
(the model's, or the context budget), ``env_error`` when the environment raised, timed out or
answered malformed, and ``aborted`` when the engine failed it (the reason is kept in each case).

With compaction (:mod:`glmpost.rollout.compaction`, CompactionRL) a trajectory whose context budget
runs low writes a summary (a model turn of kind ``summary``, seeded like any turn by its index) and
goes on in a rebuilt context: its turns then form context windows, each window's first turn holding
the exact ids it was sampled after (:attr:`Turn.context`).

An environment that declares ``tools`` gets each action's GLM tool calls parsed from its exact ids
(:attr:`glmpost.envs.Action.tool_calls`); its observation is rendered and appended like any other.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from glmpost.envs import EnvironmentFailure, call_environment, checked_reset, checked_step
from glmpost.kernel.engine import Completion, turn_key
from glmpost.rollout.compaction import CompactionSettings, ContextBuilder, due, fit_pairs
from glmpost.rollout.observations import ObservationRenderer


@dataclass
class Turn:
    """One model turn and the observation appended after it (``observation_ids`` empty for the last)."""

    action: Completion
    observation: str = ""
    observation_ids: list[int] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    server: str | None = None  # the server that sampled it (None: in this process)
    version: Any = None  # the weight version that sampled it, as the engine reported it
    kind: str = "action"  # or "summary": the policy's summary of its context (compaction)
    context: list[int] | None = None  # a window's first turn: the rebuilt context it was sampled after
    summary_request: bool = False  # observation_ids are the observation, then the summary prompt
    pair_ids: list[int] = field(default_factory=list)  # the observation as a kept pair copies it
    sampled_on: int = 0  # tokens of context the turn was sampled after
    reasoning_tokens: int = 0  # of the action: its reasoning block (ObservationRenderer.action)


@dataclass
class Trajectory:
    """A multi-turn trajectory: the reset observation's ids (before the first turn, part of the
    prompt), the turns, how it ended and the environment's total reward; with compaction, the
    prompt's own turns ``head_ids`` (``(s)``), the compactions so far and the rebuilt context the
    next turn starts (``next_context``)."""

    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    status: str = "truncated"
    reason: str | None = None
    version: Any = None  # the weight version the engine last reported
    drift: int | None = None  # action tokens a text round trip would change (retokenize_drift)
    head_ids: list[int] = field(default_factory=list)
    compactions: list[dict[str, Any]] = field(default_factory=list)
    next_context: list[int] | None = None
    summary_due: bool = False

    @property
    def reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def malformed(self) -> int:
        return sum(bool(t.info.get("malformed")) for t in self.turns)

    def action_turns(self) -> list[Turn]:
        """The turns that acted in the environment (not the summaries)."""
        return [t for t in self.turns if t.kind == "action"]

    def peak_context(self) -> int:
        """The longest context a turn was sampled on, its own tokens included."""
        return max((t.sampled_on + len(t.action.token_ids) for t in self.turns), default=len(self.prompt_ids))

    def response_ids(self) -> list[int]:
        return [i for t in self.turns for i in (*t.action.token_ids, *t.observation_ids)]

    def server_moves(self) -> list[dict[str, Any]]:
        """Each turn sampled on another server than the turn before (its home failed): the
        trajectory moved there with its exact ids."""
        return [{"turn": number, "from": before.server, "to": turn.server}
                for number, (before, turn) in enumerate(zip(self.turns, self.turns[1:]), start=1)
                if before.server and turn.server and before.server != turn.server]

    def action_flags(self) -> list[bool]:
        """Per response token: True for the model's, False for the environment's."""
        return [flag for t in self.turns for flag in [True] * len(t.action.token_ids) + [False] * len(t.observation_ids)]

    def ids(self) -> list[int]:
        """Everything the next turn is conditioned on: the current window's context and its turns."""
        if self.next_context is not None:
            return list(self.next_context)
        start = max((i for i, t in enumerate(self.turns) if t.context is not None), default=None)
        if start is None:
            return self.prompt_ids + self.response_ids()
        return list(self.turns[start].context) + [i for t in self.turns[start:]
                                                  for i in (*t.action.token_ids, *t.observation_ids)]

    def kept_pairs(self, count: int) -> list[tuple[list[int], list[int]]]:
        """The newest ``count`` (action ids, observation ids) pairs, as a rebuilt context copies them."""
        pairs = [(t.action.token_ids, t.pair_ids) for t in self.turns if t.kind == "action" and t.pair_ids]
        return pairs[max(len(pairs) - count, 0) :] if count else []


def home_server(key: str, servers: int) -> int:
    """The server every turn of trajectory ``key`` goes to first: a stable hash of the key, so a
    trajectory's prefix stays in one server's cache."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % max(servers, 1)


@dataclass
class MultiTurnSettings:
    """What bounds a trajectory: turns, tokens per turn, the context (the model's, or the smaller
    compaction budget), the environment's time; with ``compaction`` on, how contexts are rebuilt
    (``builder``: the templates' ids) and the model's own context (``model_context``), which a
    summary request must fit."""

    max_turns: int
    max_new_tokens: int
    context: int
    env_timeout: float | None
    env_workers: int = 1  # environment steps of one turn run at once (each trajectory has its own environment)
    compaction: CompactionSettings = field(default_factory=CompactionSettings)
    builder: ContextBuilder | None = None
    model_context: int | None = None


# (prompts, turn keys, trajectory keys[, max_new_tokens=N for summaries]) -> one (completion or
# None, weight version, failure reason) per prompt
GenerateFn = Callable[..., list[tuple[Completion | None, Any, str | None]]]


def run_trajectories(generate: GenerateFn, prompts: Sequence[list[int]], keys: Sequence[str], tasks: Sequence[dict],
                     make_env: Callable[[], Any], renderer: ObservationRenderer, settings: MultiTurnSettings,
                     decode: Callable[[list[int]], str], served: Callable[[str], str | None] = lambda key: None,
                     between_turns: Callable[[], None] | None = None) -> list[Trajectory]:
    """Run one trajectory per prompt, every still-active trajectory's turn in one ``generate`` call
    (the engine's batches; the trajectory keys let an engine keep each trajectory's KV cache between
    its turns; the summaries of compacting trajectories in a call of their own, with
    ``max_new_tokens`` the summary's), each with its own fresh environment; ``served(turn key)``
    names the server that sampled a turn (kept per turn: a move to another server is recorded).
    ``between_turns()`` runs before every round of turns after the first (a rollout switching to new
    weights there: each turn keeps the version that sampled it, so a trajectory may span versions)."""
    trajectories, envs, active = [], [], []
    builder = settings.builder if settings.compaction.on else None
    for index, (prompt, task) in enumerate(zip(prompts, tasks)):
        trajectory = Trajectory(list(prompt), head_ids=builder.head(prompt) if builder else [])
        trajectories.append(trajectory)
        env = None
        try:
            env = call_environment(make_env, timeout=settings.env_timeout, what="the environment's constructor")
            first = checked_reset(call_environment(env.reset, task, timeout=settings.env_timeout, what="reset()"))
            if first:
                trajectory.prompt_ids = renderer.prompt_with(trajectory.prompt_ids, first)
            active.append(index)
        except EnvironmentFailure as exc:
            trajectory.status, trajectory.reason = "env_error", str(exc)
        envs.append(env)
    rounds = 0
    while active:
        if rounds and between_turns is not None:
            between_turns()
        rounds += 1
        summarising = [i for i in active if trajectories[i].summary_due]
        acting = [i for i in active if not trajectories[i].summary_due]
        still = {index for index, turn, _ in _sample(generate, trajectories, keys, summarising, served, settings, summary=True)
                 if _take_summary(trajectories[index], turn, settings)}
        stepping = [(index, turn) for index, turn, _ in _sample(generate, trajectories, keys, acting, served, settings)]

        def step(item: tuple[int, Turn]) -> bool:
            index, taken = item
            trajectory = trajectories[index]
            return _take_turn(trajectory, taken, envs[index], renderer, settings, decode,
                              last=len(trajectory.action_turns()) + 1 == settings.max_turns)

        # A slow tool step (latency's long tail) then delays its turn once, not every trajectory after it.
        if settings.env_workers > 1 and len(stepping) > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=settings.env_workers, thread_name_prefix="glmpost-step") as pool:
                going = list(pool.map(step, stepping))
        else:
            going = [step(item) for item in stepping]
        still.update(index for (index, _), on in zip(stepping, going) if on)
        active = [index for index in active if index in still]
    return trajectories


def _sample(generate: GenerateFn, trajectories: list[Trajectory], keys: Sequence[str], indices: list[int],
            served: Callable[[str], str | None], settings: MultiTurnSettings, *, summary: bool = False):
    """One ``generate`` call for the next turn of the trajectories ``indices`` (summaries with the
    summary's token budget): ``(index, Turn, version)`` for each one the engine delivered; the others
    end ``aborted``. A window's first turn takes its rebuilt context."""
    if not indices:
        return []
    prompts = [trajectories[i].ids() for i in indices]
    turn_keys = [turn_key(keys[i], len(trajectories[i].turns)) for i in indices]
    sessions = [keys[i] for i in indices]
    outcomes = (generate(prompts, turn_keys, sessions, max_new_tokens=settings.compaction.max_summary_tokens) if summary
                else generate(prompts, turn_keys, sessions))
    delivered = []
    for index, prompt, key, (completion, version, reason) in zip(indices, prompts, turn_keys, outcomes):
        trajectory = trajectories[index]
        trajectory.version = version if version is not None else trajectory.version
        if completion is None:
            trajectory.status, trajectory.reason = "aborted", reason
            continue
        turn = Turn(completion, server=served(key), version=version, kind="summary" if summary else "action",
                    context=trajectory.next_context, sampled_on=len(prompt))
        trajectory.next_context = None
        if completion.finish_reason == "abort":  # the server stopped it: its partial turn is kept, the trajectory ends
            trajectory.turns.append(turn)
            trajectory.status, trajectory.reason = "aborted", reason
            continue
        delivered.append((index, turn, version))
    return delivered


def _take_turn(trajectory: Trajectory, turn: Turn, env: Any, renderer: ObservationRenderer,
               settings: MultiTurnSettings, decode: Callable[[list[int]], str], *, last: bool) -> bool:
    """Add one model turn and the environment's answer; True when the trajectory goes on."""
    completion = turn.action
    trajectory.turns.append(turn)
    if completion.finish_reason == "length":
        trajectory.status, trajectory.reason = "truncated", "a turn reached max_new_tokens"
        return False
    # GLM's own tool calls, read from the exact ids of the turn's content
    action, turn.reasoning_tokens = renderer.action(completion.token_ids, decode, getattr(env, "tools", None))
    try:
        step = checked_step(call_environment(env.step, action, timeout=settings.env_timeout, what="step()"))
    except EnvironmentFailure as exc:
        trajectory.status, trajectory.reason = "env_error", str(exc)
        return False
    turn.reward, turn.info, turn.observation = float(step.reward), dict(step.info), step.observation
    if step.done:
        trajectory.status = "completed"
        return False
    if last:
        trajectory.status, trajectory.reason = "truncated", f"the turn budget ({settings.max_turns}) ran out"
        return False
    ids = renderer.ids(step.observation, after=completion.token_ids)
    length = len(trajectory.ids()) + len(ids)
    if due(settings.compaction, length, settings.max_new_tokens):
        turn.pair_ids = ids
        return _compact(trajectory, turn, settings)
    if length + settings.max_new_tokens > settings.context:
        trajectory.status, trajectory.reason = "truncated", f"the next turn would overflow the context of {settings.context}"
        return False
    turn.observation_ids = ids
    return True


def _compact(trajectory: Trajectory, turn: Turn, settings: MultiTurnSettings) -> bool:
    """The context budget ran low after ``turn``'s observation: ask for a summary (mode ``summary``:
    the observation and the summary prompt appended, the summary sampled next) or rebuild the
    context without one (``drop``). True when the trajectory goes on."""
    compaction, builder = settings.compaction, settings.builder
    if compaction.mode == "drop":
        return _rebuild(trajectory, None, settings)
    request = builder.request(turn.observation, after=turn.action.token_ids)
    model_context = settings.model_context or settings.context
    if len(trajectory.ids()) + len(request) + compaction.max_summary_tokens > model_context:
        trajectory.status, trajectory.reason = "truncated", (
            f"the summary request would overflow the model's context of {model_context}")
        return False
    turn.observation_ids, turn.summary_request = request, True
    trajectory.summary_due = True
    return True


def _take_summary(trajectory: Trajectory, turn: Turn, settings: MultiTurnSettings) -> bool:
    """Add the policy's summary and rebuild the context around it (a summary cut at the summary's
    token budget is kept as it is and recorded ``truncated``); True when the trajectory goes on."""
    trajectory.turns.append(turn)
    trajectory.summary_due = False
    return _rebuild(trajectory, turn, settings)


def _rebuild(trajectory: Trajectory, summary: Turn | None, settings: MultiTurnSettings) -> bool:
    """Set the next window's context: ``(s) + u_resume(S) + the newest pairs`` that leave the next
    turn room in the budget (fewer than ``keep_last`` when they do not fit; none fitting at all ends
    the trajectory ``truncated``)."""
    compaction, builder = settings.compaction, settings.builder
    room = max(compaction.threshold, settings.max_new_tokens)
    summary_ids = None if summary is None else summary.action.token_ids
    context, kept = fit_pairs(builder, trajectory.head_ids, summary_ids,
                              trajectory.kept_pairs(compaction.pairs_kept()), room=room)
    entry = {"turn": len(trajectory.turns) - 1, "window": len(trajectory.compactions) + 1, "kept_pairs": kept,
             "context": len(context)}
    if summary is not None:
        entry.update(tokens=len(summary_ids), truncated=summary.action.finish_reason == "length")
    trajectory.compactions.append(entry)
    if compaction.budget - len(context) < room:
        trajectory.status, trajectory.reason = "truncated", (
            f"the rebuilt context ({len(context)} tokens) leaves less than {room} of the context budget {compaction.budget}")
        return False
    trajectory.next_context = context
    return True


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, Any]:
    """The multi-turn part of a shard's metrics line (none for single-turn rollouts): turns,
    observation tokens, the environment's reward, malformed tool calls, reasoning tokens (the turns'
    reasoning blocks, --reasoning-parser), and trajectories by status."""
    if not trajectories:
        return {}
    statuses = Counter(t.status for t in trajectories)
    return {
        "rollout/turns_mean": float(np.mean([len(t.turns) for t in trajectories])),
        "rollout/observation_tokens": sum(len(turn.observation_ids) for t in trajectories for turn in t.turns),
        "rollout/env_reward_mean": float(np.mean([t.reward for t in trajectories])),
        "rollout/malformed_tool_calls": sum(t.malformed for t in trajectories),
        "rollout/reasoning_tokens": sum(turn.reasoning_tokens for t in trajectories for turn in t.turns),
        "rollout/retokenize_drift_tokens": sum(t.drift or 0 for t in trajectories),
        "rollout/peak_context_mean": float(np.mean([t.peak_context() for t in trajectories])),
        "rollout/peak_context_max": max(t.peak_context() for t in trajectories),
        "rollout/compactions": sum(len(t.compactions) for t in trajectories),
        "rollout/summary_tokens": sum(len(turn.action.token_ids) for t in trajectories for turn in t.turns
                                      if turn.kind == "summary"),
        **{f"rollout/status/{status}": count for status, count in sorted(statuses.items())},
    }


def retokenize_drift(tokenizer, response_ids: Sequence[int], action_mask: Sequence[bool]) -> int:
    """How many action tokens a text round trip would change (the drift ledger): the response
    decoded (special tokens kept) and encoded again, aligned with the exact ids
    (``difflib.SequenceMatcher``); an action position outside every matching run counts. 0 means
    re-tokenizing would have been harmless for this record; TITO never does it either way."""
    ids = [int(i) for i in response_ids]
    again = list(tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False))
    if again == ids:
        return 0
    kept = [False] * len(ids)
    for block in difflib.SequenceMatcher(None, ids, again, autojunk=False).get_matching_blocks():
        kept[block.a : block.a + block.size] = [True] * block.size
    return sum(1 for action, same in zip(action_mask, kept) if action and not same)
