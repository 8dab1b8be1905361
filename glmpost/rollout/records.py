"""From prompts to rollout records: what the engine was fed, what it produced, with what evidence.

A rollout record carries everything later stages need to train on exactly the actions taken
(DESIGN.md §3, brief "TITO：token ID 是动作事实"): the exact prompt and response token ids, the
action / observation masks, the log-prob of each action under the distribution it was sampled from,
the policy version that produced it, the sampling settings and the tokenizer revision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.formats import iter_checked_records, resolve_shard_paths
from glmpost.formats.prompts import encode_prompt, read_prompts
from glmpost.formats.sources import ColumnsConfig, check_not_mixed, is_prompt_source, source_rows
from glmpost.kernel.engine import Completion, SamplingParams
from glmpost.kernel.sglang_sampling import explicit


@dataclass
class RolloutPrompt:
    """A prompt as token ids, with what the verifier and teacher routing need."""

    prompt_id: str
    token_ids: list[int]
    domain: str = ""
    task: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # file:line or shard:record, for error messages


def as_version(value: Any) -> int | None:
    """A server's weight_version as a policy version when it is an integer, else None (SGLang
    reports ``"default"`` when launched without ``--weight-version``)."""
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def load_rollout_prompts(inputs: Sequence[str | Path], tokenizer, revision: str,
                         columns: ColumnsConfig | None = None,
                         tools: list[dict[str, Any]] | None = None,
                         template_kwargs: dict[str, Any] | None = None) -> list[RolloutPrompt]:
    """Prompts from JSONL, parquet, CSV or JSON files or datasets directories (their ``columns``
    mapped, :mod:`glmpost.formats.sources`; rendered with the chat template, its ``template_kwargs``,
    and ``tools`` when given) or shards (their prompt ids, as recorded).

    Shards are accepted so a stage can resample the prompts of earlier trajectories; their records
    must have been tokenized with the same tokenizer revision. A directory holding both shards and
    prompt files is refused (:func:`~glmpost.formats.sources.check_not_mixed`). Prompt ids must be unique across
    inputs (records of one prompt in a shard collapse into one prompt).
    """
    prompts: list[RolloutPrompt] = []
    seen: dict[str, str] = {}
    for item in inputs:
        path = Path(item)
        if is_prompt_source(path):
            for prompt in read_prompts(path, source_rows(path, columns)):
                where = f"{path}: prompt {prompt.id!r}"
                ids = encode_prompt(tokenizer, prompt.messages, tools, template_kwargs)
                _add(prompts, seen, RolloutPrompt(prompt.id, ids, prompt.domain, prompt.task, where))
            continue
        check_not_mixed(path)
        for shard in resolve_shard_paths([item]):
            for index, (record, _) in enumerate(iter_checked_records([shard], revision=revision, stage="rollout")):
                where = f"{shard}: record {index}"
                if record["prompt_id"] in seen:
                    continue
                _add(prompts, seen, RolloutPrompt(record["prompt_id"], record["prompt_token_ids"].tolist(),
                                                  record.get("domain", ""), record.get("task", {}), where))
    return prompts


def _add(prompts: list[RolloutPrompt], seen: dict[str, str], prompt: RolloutPrompt) -> None:
    if prompt.prompt_id in seen:
        raise GlmpostError(f"{prompt.source}: prompt id {prompt.prompt_id!r} repeats {seen[prompt.prompt_id]}")
    seen[prompt.prompt_id] = prompt.source
    prompts.append(prompt)


def check_context(prompts: Iterable[RolloutPrompt], *, max_new_tokens: int, context: int, budget: bool = False) -> None:
    """Refuse prompts that leave no room for ``max_new_tokens`` in the model's context (``budget``:
    in the smaller ``--context-budget``)."""
    limit = "{context_budget} {context}" if budget else "the model's context of {context} tokens"
    for prompt in prompts:
        if len(prompt.token_ids) + max_new_tokens > context:
            raise ConfigError("{source}: prompt is {length} tokens; with {max_new_tokens} {value} it exceeds " + limit,
                              source=prompt.source, length=len(prompt.token_ids), value=max_new_tokens, context=context,
                              exit_code=1)
        if not prompt.token_ids:
            raise GlmpostError(f"{prompt.source}: prompt has no tokens")


def group_id(prompt_id: str, *, seed: int, policy_version: int) -> str:
    """Sampling groups are unique per prompt, seed and policy version, so datasets can be merged."""
    return f"{prompt_id}@v{policy_version}s{seed}"


def rollout_record(
    prompt: RolloutPrompt,
    completion: Completion,
    *,
    sample_index: int,
    params: SamplingParams,
    policy_version: int,
    tokenizer_revision: str,
    engine: dict[str, Any],
    token_policy_version: int | None = None,
) -> dict[str, Any]:
    """The trajectory record of one single-turn completion: every response token is an action.

    ``token_policy_version`` (default ``policy_version``) stamps ``policy_versions``: the version a
    server reported for the weights that produced the tokens (:data:`~glmpost.formats.schema.UNKNOWN_VERSION` when it
    reported none), unless the completion carries one per token.
    """
    length = len(completion.token_ids)
    stamp = policy_version if token_policy_version is None else token_policy_version
    group = group_id(prompt.prompt_id, seed=params.seed, policy_version=policy_version)
    return {
        "id": f"{group}/{sample_index}",
        "prompt_id": prompt.prompt_id,
        "group_id": group,
        "domain": prompt.domain,
        "task": prompt.task,
        "prompt_token_ids": np.asarray(prompt.token_ids, dtype=np.int32),
        "response_token_ids": np.asarray(completion.token_ids, dtype=np.int32),
        "action_mask": np.ones(length, dtype=bool),
        "observation_mask": np.zeros(length, dtype=bool),
        "rollout_log_probs": np.asarray(completion.log_probs, dtype=np.float32),
        "policy_versions": (np.full(length, stamp, dtype=np.int32) if completion.token_versions is None
                            else np.asarray(completion.token_versions, dtype=np.int32)),
        "sampling": {**params.to_json(), **engine},
        "tokenizer_revision": tokenizer_revision,
        "segments": [{"start": 0, "end": length, "kind": "action", "turn": 0}],
        "status": "completed" if completion.finish_reason == "stop" else "truncated",
        **({"routed_experts": completion.routed_experts} if completion.routed_experts is not None else {}),
    }


def trajectory_record(
    prompt: RolloutPrompt,
    trajectory: Any,
    *,
    sample_index: int,
    params: SamplingParams,
    policy_version: int,
    tokenizer_revision: str,
    engine: dict[str, Any],
    env_name: str,
    token_policy_version: int | None = None,
    drift: int | None = None,
    compaction: Any = None,
) -> dict[str, Any]:
    """The record of one multi-turn trajectory (:class:`glmpost.rollout.agentic.Trajectory`): the
    model's tokens are actions with their log-probs and policy version, the environment's are
    observations (NaN log-prob, version -1), one segment each with its turn (formats/SPEC.md §6);
    each turn's tokens carry the version that sampled it (a trajectory may span versions), and the
    turns sampled on a KV cache an older version built are listed in ``extra.kv_cache.stale_turns``;
    the environment's reward, turns and per-step info go to ``extra.env`` (with ``drift``, the
    action tokens a text round trip would have changed: :func:`glmpost.rollout.agentic.retokenize_drift`,
    and the longest context a turn was sampled on). With ``compaction`` on (its
    :class:`~glmpost.rollout.compaction.CompactionSettings`), a summary is a segment of kind
    ``summary`` (action tokens), the observation that asked for it has ``role`` ``summary_request``,
    each later window's first segment carries its rebuilt context as ids (``context``), and
    ``extra.compaction`` sums the compactions up (formats/SPEC.md §5)."""
    record = rollout_record(prompt, Completion([], [], "length"), sample_index=sample_index, params=params,
                            policy_version=policy_version, tokenizer_revision=tokenizer_revision, engine=engine)

    stamp = policy_version if token_policy_version is None else token_policy_version
    ids, actions, log_probs, segments, versions, stale = [], [], [], [], [], []
    for number, turn in enumerate(trajectory.turns):
        turn_version = as_version(turn.version)
        turn_version = stamp if turn_version is None else turn_version
        built_by = turn.action.cache_version
        if built_by is not None and built_by != turn_version:  # sampled on keys and values older weights computed
            stale.append({"turn": number, "version": turn_version, "cache_version": built_by})
        for kind, part, lps in ((turn.kind, turn.action.token_ids, turn.action.log_probs),
                                ("observation", turn.observation_ids, [float("nan")] * len(turn.observation_ids))):
            if part:
                segment = {"start": len(ids), "end": len(ids) + len(part), "kind": kind, "turn": number}
                if kind != "observation" and turn.context is not None:  # a context window's first segment
                    segment["context"] = np.asarray(turn.context, dtype=np.int32)
                if kind == "observation" and turn.summary_request:
                    segment["role"] = "summary_request"
                segments.append(segment)
                ids += part
                actions += [kind != "observation"] * len(part)
                log_probs += lps
                if kind != "observation" and turn.action.token_versions is not None:  # continued across a switch
                    versions += list(turn.action.token_versions)
                else:
                    versions += [turn_version if kind != "observation" else -1] * len(part)
    action_mask = np.asarray(actions, dtype=bool)
    record.update({
        "prompt_token_ids": np.asarray(trajectory.prompt_ids, dtype=np.int32),
        "response_token_ids": np.asarray(ids, dtype=np.int32),
        "action_mask": action_mask,
        "observation_mask": ~action_mask,
        "rollout_log_probs": np.asarray(log_probs, dtype=np.float32),
        "policy_versions": np.asarray(versions, dtype=np.int32),
        "segments": segments,
        "status": trajectory.status,
    })
    record["extra"] = _trajectory_extra(trajectory, env_name=env_name, drift=drift, compaction=compaction, stale=stale)
    routed = _trajectory_routing(trajectory)
    if routed is not None:
        record["routed_experts"] = routed
    return record


def _trajectory_routing(trajectory: Any) -> np.ndarray | None:
    """A multi-turn record's ``routed_experts``: each action's recorded experts, observation rows
    "not recorded" (the dtype's largest value), in :func:`trajectory_record`'s token order; None
    when no turn recorded routing."""
    recorded = [t.action.routed_experts for t in trajectory.turns if t.action.routed_experts is not None]
    if not recorded:
        return None
    like = recorded[0]
    rows = []
    for turn in trajectory.turns:
        for routed, count in ((turn.action.routed_experts, len(turn.action.token_ids)), (None, len(turn.observation_ids))):
            rows.append(routed if routed is not None else np.full((count, *like.shape[1:]), np.iinfo(like.dtype).max, like.dtype))
    return np.concatenate(rows).astype(like.dtype)


def _trajectory_extra(trajectory: Any, *, env_name: str, drift: int | None, compaction: Any, stale: list[dict]) -> dict[str, Any]:
    """A multi-turn record's ``extra`` (:func:`trajectory_record`)."""
    acted = trajectory.action_turns()
    extra = {"env": {"name": env_name, "reward": trajectory.reward, "turns": len(acted),
                     "malformed": trajectory.malformed, "steps": [t.info for t in acted],
                     "peak_context": trajectory.peak_context()}}
    if compaction is not None and compaction.on:
        extra["compaction"] = compaction_extra(trajectory, compaction)
    if drift is not None:
        extra["env"]["retokenize_drift"] = drift
    reasoning = [t.reasoning_tokens for t in acted]
    if any(reasoning):  # turns split by the reasoning parser: each action turn's reasoning tokens
        extra["env"]["reasoning_tokens"] = reasoning
    servers = [t.server for t in trajectory.turns if t.server]
    if servers:  # sampled by servers: where it lived, and every move to another one
        extra["env"]["server"] = servers[0]
        extra["env"]["server_moves"] = trajectory.server_moves()
    if stale:  # the KV owner contract: which turns attended to another version's cache
        extra["kv_cache"] = {"stale_turns": stale}
    if trajectory.reason:
        extra["status_reason"] = trajectory.reason
    return extra


def compaction_extra(trajectory: Any, compaction: Any) -> dict[str, Any]:
    """``extra.compaction`` of a trajectory: the settings, its windows, each summary (turn, window,
    tokens, whether the summary budget cut it), the pairs each rebuilt context kept and the peak
    context."""
    summaries = [{key: entry[key] for key in ("turn", "window", "tokens", "truncated")}
                 for entry in trajectory.compactions if "tokens" in entry]
    windows = 1 + sum(turn.context is not None for turn in trajectory.turns)
    return {**compaction.as_json(), "windows": windows, "summaries": summaries,
            "kept_pairs": [entry["kept_pairs"] for entry in trajectory.compactions],
            "peak_context": trajectory.peak_context()}


def aborted_record(
    prompt: RolloutPrompt,
    reason: str,
    *,
    sample_index: int,
    params: SamplingParams,
    policy_version: int,
    tokenizer_revision: str,
    engine: dict[str, Any],
    partial: Completion | None = None,
    token_policy_version: int | None = None,
) -> dict[str, Any]:
    """The record of a sequence the engine never delivered whole: status ``aborted``, the tokens it
    got before the abort (``partial``; none when the request failed), and why in
    ``extra.status_reason`` — a failed request is recorded, never a lost prompt."""
    record = rollout_record(prompt, partial or Completion([], [], "length"), sample_index=sample_index, params=params,
                            policy_version=policy_version, tokenizer_revision=tokenizer_revision, engine=engine,
                            token_policy_version=token_policy_version)
    record["status"] = "aborted"
    record["extra"] = {"status_reason": reason}
    return record


def sglang_sampling_params(params: SamplingParams, eos_ids: Sequence[int]) -> dict[str, Any]:
    """SGLang ``sampling_params`` that sample exactly as ``params`` do in the local engine, every
    key that changes the distribution included (:data:`~glmpost.kernel.sglang_sampling.EXPLICIT_DEFAULTS`:
    a server's ``--preferred-sampling-params`` fill only what a request leaves out).

    SGLang stops at the model's eos ids unless ``ignore_eos`` (which turns off every token stop;
    python/sglang/srt/managers/schedule_batch.py ``_check_token_based_finish``), so a stop set must
    be empty or contain every eos id. Add ``sampling_seed`` per sequence.
    """
    stops = sorted(set(params.stop_token_ids))
    if stops and not set(eos_ids) <= set(stops):
        raise ValueError(f"SGLang always stops at the eos ids {sorted(eos_ids)}: the stop ids {stops} must include them "
                         "(or be 'none')")
    return explicit({
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k or -1,
        "stop_token_ids": stops,
        "ignore_eos": not stops,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    })


def completion_from_sglang(answer: dict[str, Any], stop_token_ids: Sequence[int]) -> tuple[Completion | None, str | None, str | None]:
    """``(completion, weight_version, abort_reason)`` from one SGLang ``/generate`` answer.

    The sequence ended ``stop`` when its last token is a stop id (SGLang reports ``length`` when a
    stop token is also the last allowed one) or when the server says it stopped: SGLang also stops
    at the tokenizer's eos and ``additional_stop_token_ids`` (schedule_batch.py
    ``_check_token_based_finish``), which the run's stop set may not hold.

    An aborted sequence (``finish_reason`` ``abort``: ``/abort_request``, ``abort_all_requests``,
    ``pause_generation(mode=abort)``; HTTP 200 with the partial output) comes back as a completion
    of ``finish_reason`` ``abort`` holding the tokens it got, with the server's message as the
    reason. The completion is None (and the reason set) when the answer lacks the evidence a record
    needs (output ids with their log-probs).
    """
    meta = answer.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    version = meta.get("weight_version")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length", "abort"):
        return None, version, f"server finish_reason {finish!r}"
    entries = meta.get("output_token_logprobs") or []
    ids = answer.get("output_ids")
    if ids is None:
        ids = [e[1] for e in entries]
    if len(entries) != len(ids) or any(e[0] is None or e[1] != t for e, t in zip(entries, ids)):
        return None, version, "server answer has no log-prob for every output token"
    ids = [int(t) for t in ids]
    log_probs = [float(e[0]) for e in entries]
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        return Completion(ids, log_probs, "abort"), version, f"aborted by the server ({message or 'no message'})"
    reason = "stop" if ids and (ids[-1] in set(stop_token_ids) or kind == "stop") else "length"
    return Completion(ids, log_probs, reason), version, None
