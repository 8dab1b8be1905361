"""The settings of one rollout (``glmpost rollout``'s options, under the same names), each checked
where it is read: the engine, sampling, the environment of a multi-turn run, the context budget and
compaction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from glmpost.config import ConfigError, flat_values, section, setting, shared
from glmpost.envs import TOOL_CALL_PARSERS, resolve_environment
from glmpost.envs.reasoning import REASONING_PARSERS
from glmpost.errors import UsageError
from glmpost.formats.sources import ColumnsConfig
from glmpost.kernel.distribution import LOG_PROB_KINDS
from glmpost.kernel.engine import SamplingParams
from glmpost.kernel.fingerprint import DEFAULT_TOLERANCE
from glmpost.kernel.sglang_client import check_api_key
from glmpost.rollout.compaction import COMPACTION_MODES, CompactionSettings, resume_pieces
from glmpost.stage import recorded_options

ENGINES = ("local", "sglang", "vllm")
# What a server that reports no integer weight version is stamped with (EngineConfig.unversioned_server).
UNVERSIONED = ("refuse", "unknown", "checkpoint")
# Options that may differ between the tasks or reruns writing one output directory.
PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "env_workers", "device",
                    "config", "engine_name", "server", "concurrency", "timeout", "retries", "api_key", "admin_api_key",
                    "fingerprint_tolerance")

@dataclass
class EngineConfig:
    """What samples: the in-process engine, or SGLang-API servers and how to talk to them."""

    engine_name: str = setting("local", "local (in-process torch), sglang or vllm (HTTP: --server; vllm: vLLM's OpenAI "
                               "server, or glmpost serve --api vllm).", flag="--engine")
    server: Optional[str] = setting(None, "With --engine sglang or vllm: comma-separated server URLs (SGLang, vLLM or `glmpost serve`).")
    concurrency: int = setting(8, "With --engine sglang or vllm: requests in flight at once.", min=1)
    timeout: float = setting(600.0, "With --engine sglang or vllm: seconds to wait for one answer.", min=0.1)
    retries: int = setting(3, "With --engine sglang or vllm: retries of a failed request (backoff 0.5 s, doubling).", min=0)
    api_key: Optional[str] = setting(None, "With --engine sglang or vllm: the servers' API key, sent as 'Authorization: Bearer "
                                     "KEY' (never recorded).", cli={"show_default": False})
    admin_api_key: Optional[str] = setting(
        None, "With --engine sglang: the servers' admin key (SGLang's --admin-api-key), sent instead of --api-key on "
        "their control routes (/abort_request, to stop a request that timed out before it is sent again; never "
        "recorded).", cli={"show_default": False})
    unversioned_server: str = setting(
        "refuse", "With --engine sglang: a server that reports no integer weight_version (SGLang's 'default': launched "
        "without --weight-version, never synced): refuse (one error), unknown (its tokens' policy_versions -1; trainers "
        "say their staleness is unknown) or checkpoint (stamped with --checkpoint's policy version, on your word).")
    max_continuations: int = setting(
        3, "With --engine sglang or vllm: times a sequence the server aborted (a weight switch, /abort_request) is continued "
        "from its partial output with the rest of its token budget; then it is recorded aborted with its partial "
        "tokens.", min=0)
    server_log_prob_kind: str = setting(
        "auto", "With --engine sglang or vllm: what the servers' log-probs are of, recorded as sampling.log_prob_kind: auto "
        "(what /server_info reports, else probed with four 1-token requests) or " + ", ".join(LOG_PROB_KINDS) + ".")
    fingerprint_tolerance: float = setting(
        DEFAULT_TOLERANCE, "With --engine vllm: most mean |difference| between a server's prompt log-probs of a fixed "
        "sequence and the checkpoint's (float32, CPU) for the server to count as serving it (and nearer to them than to "
        "the previous version's in the same root); tokens from an unconfirmed server get policy version -1 (unknown).", above=0.0)

    def check(self) -> None:
        """Refuse an unknown engine or log-prob kind, ``sglang`` without servers, or an API key that
        cannot go in a header (without repeating it)."""
        if self.engine_name not in ENGINES:
            raise ConfigError("{engine_name} must be local, sglang or vllm, got {value!r}", value=self.engine_name)
        if self.engine_name != "local" and not self.server:
            raise ConfigError("{engine_name} {value} needs {server} URL[,URL...]", value=self.engine_name)
        if self.server_log_prob_kind != "auto" and self.server_log_prob_kind not in LOG_PROB_KINDS:
            raise ConfigError("{server_log_prob_kind} must be auto or one of {kinds}, got {value!r}",
                              kinds=", ".join(LOG_PROB_KINDS), value=self.server_log_prob_kind)
        if self.unversioned_server not in UNVERSIONED:
            raise ConfigError("{unversioned_server} must be one of {choices}, got {value!r}", choices=", ".join(UNVERSIONED),
                              value=self.unversioned_server)
        check_api_key(self.api_key)
        check_api_key(self.admin_api_key, "admin_api_key")


@dataclass
class MultiTurnConfig:
    """A multi-turn rollout's environment and how long its trajectories and steps may run."""

    env: Optional[str] = setting(
        None, "Multi-turn rollouts against this environment: calculator, calculator-glm, kv-lookup, kv-recall, latency or "
        "package.module:Class. "
        "Each turn's prompt is the exact ids before it; observations are recorded with observation_mask.")
    env_options: str = setting("{}", "With --env: the environment's keyword arguments, a JSON object.")
    max_turns: int = setting(8, "With --env: most model turns per trajectory (then it ends truncated).", min=1)
    env_timeout: float = setting(
        30.0, "With --env: seconds one reset() or step() may take (then the trajectory ends env_error).", min=0.001)
    env_workers: int = setting(
        8, "With --env: environment steps of one turn run at once, each trajectory on its own environment (1: one "
        "after another); the records do not depend on it (for environments whose instances share no state).", min=1)
    reasoning_parser: str = setting(
        "auto", "How a response's reasoning is split off (it stays in the trained ids and is counted): glm45 (vLLM's and "
        "SGLang's GLM rule: reasoning ends at the first </think>; all of it when the generation prompt ends in <think>), "
        "none, or auto (glm45 when the chat template writes </think>, else none). With --env, tool calls and answers are "
        "read from each turn's content only; a single-turn record keeps extra.reasoning_tokens, which judge's "
        "verifiers skip.")
    tool_call_parser: str = setting(
        "strict", "With --env and an environment with tools: strict (a malformed call makes the turn malformed, no call "
        "runs) or engine (what vLLM's GLM parsers give: the known calls of a turn, a repeated key's last value, {} for "
        "an unclosed value; untyped values read as JSON, then a Python literal).")

    def environment(self):
        """``(name, factory)`` of the environment, or None for single-turn rollouts; an unknown one or
        bad options is one error naming the option."""
        if self.reasoning_parser not in ("auto", *REASONING_PARSERS):
            raise ConfigError("{reasoning_parser} must be auto or one of {choices}, got {value!r}",
                              choices=", ".join(REASONING_PARSERS), value=self.reasoning_parser)
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError("{tool_call_parser} must be one of {choices}, got {value!r}",
                              choices=", ".join(TOOL_CALL_PARSERS), value=self.tool_call_parser)
        if self.env is None:
            return None
        try:
            options = json.loads(self.env_options)
        except json.JSONDecodeError as exc:
            raise ConfigError("{env_options} {value!r}: not JSON ({reason})", value=self.env_options, reason=exc) from None
        if not isinstance(options, dict):
            raise ConfigError("{env_options} {value!r}: expected a JSON object", value=self.env_options)
        return self.env, resolve_environment(self.env, options, where="--env")


@dataclass
class ContextConfig:
    """A multi-turn trajectory's context budget and CompactionRL's compaction of it."""

    compaction: str = setting(
        "off", "With --env: CompactionRL's context compaction. summary: when the context budget runs low (C - |h| < T_comp, "
        "or the next turn could overflow C) the policy writes a summary after --summary-prompt, trained as an action "
        "with the final reward, and the trajectory goes on in a rebuilt context (the prompt's turns, --resume-template "
        "holding the summary's exact ids, the newest --keep-last action-observation pairs), recorded as ids; drop: the "
        "same rebuild without a summary (the baseline); off: a trajectory that would overflow C ends truncated.")
    context_budget: Optional[int] = setting(
        None, "With --env: C, the most tokens of context a turn may be sampled on (default: the model's context).", min=1)
    compaction_threshold: Optional[int] = setting(
        None, "With --compaction: T_comp, compact when C - |h| < T_comp (default: --max-new-tokens); at most "
        "--context-budget.", min=0)
    keep_last: int = setting(
        2, "With --compaction: k, the newest action-observation pairs a rebuilt context copies (fewer when they do not "
        "fit the budget; drop keeps at least 1, so the newest observation is never lost).", min=0)
    summary_prompt: str = setting(
        "Summarize what you must remember to finish the task.",
        "With --compaction summary: q_sum, the user turn after the last observation that asks for the summary.")
    resume_template: str = setting(
        "Summary: {summary}", "With --compaction summary: the user turn that opens a rebuilt context; {summary} (exactly "
        "once) stands for the summary's exact ids.")
    max_summary_tokens: int = setting(
        64, "With --compaction summary: most tokens of a summary (a longer one is cut there, recorded truncated in "
        "extra.compaction.summaries, and the trajectory goes on).", min=1)


@dataclass
class RolloutConfig:
    """The settings of one rollout run (the options of ``glmpost rollout``, under the same names)."""

    inputs: list[str] = field(default_factory=list)  # prompt files / datasets directories, or shards to resample
    checkpoint: Optional[Path] = None  # a checkpoint root (its LATEST) or a version directory
    out: Optional[Path] = None  # the output directory for the rollout shards
    group_size: int = setting(8, "Samples per prompt (GRPO's G); siblings share a group_id.", min=1)
    temperature: float = setting(
        1.0, "Sampling temperature; 0 is greedy (its log-probs are then the model's own: log_prob_kind raw).", min=0.0)
    top_p: float = setting(1.0, "Nucleus sampling mass in (0, 1]; 1 disables.", above=0.0, max=1.0)
    top_k: int = setting(0, "Sample among the k most likely tokens; 0 disables.", min=0)
    max_new_tokens: int = setting(64, "Most tokens sampled per response.", min=1)
    stop_token_ids: str = setting("default", "Comma-separated ids that end a response (kept in it); 'default' = the "
                                  "model's eos ids, 'none' = never stop early.")
    seed: int = setting(0, "Sampling seed; each sequence's generator derives from it and the sequence id.")
    batch_size: int = setting(32, "Sequences decoded together (does not change the samples' seeds).", min=1)
    prompts_per_shard: int = setting(64, "Prompts per output shard (x group size records).", min=1)
    limit: Optional[int] = setting(None, "Use only the first N prompts.", min=1)
    columns: ColumnsConfig = section(ColumnsConfig)
    chat_template_kwargs: str = shared("chat_template_kwargs")
    shard_index: int = shared("shard_index")
    num_shards: int = shared("num_shards")
    device: str = shared("device")
    deterministic_topk: bool = shared("deterministic_topk")
    attention: str = shared("attention")
    record_routing: bool = setting(
        False, "Record the MoE experts each sampled token was routed to, per MoE layer, as the record's routed_experts "
        "(uint8/uint16 [T, moe_layers, k]; formats/SPEC.md): what diff-logprobs --routing compares and --routing-replay "
        "replays in training. --engine local, sglang (its return_routed_experts) or vllm (its per-choice "
        "routed_experts), the servers launched with --enable-return-routed-experts (checked by one request first); "
        "nothing is recorded for a dense model.",
        flag="--record-routing/--no-record-routing")
    engine: EngineConfig = section(EngineConfig)
    multi_turn: MultiTurnConfig = section(MultiTurnConfig)
    refill_rounds: int = setting(
        0, "Rounds of resampling the failed samples (env_error, aborted) of groups with more than half valid, to "
        "full size (GLM-5); refills get the next sample indices and extra.refill. 0 = off.", min=0)
    context: ContextConfig = section(ContextConfig)
    zstd_level: int = shared("zstd_level")
    overwrite: bool = shared("overwrite")

    def environment(self):
        """``(name, factory)`` of the environment of a multi-turn run, or None (:meth:`MultiTurnConfig.environment`)."""
        return self.multi_turn.environment()

    def compaction_settings(self, model_context: int) -> CompactionSettings:
        """The context budget and compaction settings, checked against each other and the model's
        context (a refused combination is one error naming the options)."""
        c = self.context
        if c.compaction not in COMPACTION_MODES:
            raise ConfigError("{compaction} must be one of {choices}, got {value!r}", choices=", ".join(COMPACTION_MODES),
                              value=c.compaction)
        if self.multi_turn.env is None and (c.compaction != "off" or c.context_budget is not None):
            raise ConfigError("{compaction} and {context_budget} apply to multi-turn rollouts: add {env}")
        budget = model_context if c.context_budget is None else c.context_budget
        if budget > model_context:
            raise ConfigError("{context_budget} {value} exceeds the model's context of {context} tokens", value=budget,
                              context=model_context)
        threshold = self.max_new_tokens if c.compaction_threshold is None else c.compaction_threshold
        if c.compaction != "off" and threshold > budget:
            raise ConfigError("{compaction_threshold} {value} is larger than {context_budget} {budget}: compaction "
                              "would start before the first turn", value=threshold, budget=budget)
        try:
            resume_pieces(c.resume_template)
        except ValueError as exc:
            raise ConfigError("{resume_template} {reason}", reason=exc) from None
        return CompactionSettings(c.compaction, budget, threshold, c.keep_last, c.summary_prompt, c.resume_template,
                                  c.max_summary_tokens)

    def sampling_params(self) -> SamplingParams:
        """The sampling settings, checked (their stop ids are set once the model's eos ids are known)."""
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                max_new_tokens=self.max_new_tokens, seed=self.seed)
        try:
            params.validate()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return params

    def check_engine(self) -> None:
        """:meth:`EngineConfig.check` (``record_routing`` is checked against each server by one request
        when the run opens: :func:`~glmpost.rollout.servers.check_routing_returned`)."""
        self.engine.check()

    def as_options(self) -> dict[str, Any]:
        """The settings as recorded options (JSON-safe; ``overwrite`` says nothing about the output,
        ``api_key`` is never recorded)."""
        return recorded_options(flat_values(self), leave_out=("overwrite", "api_key", "admin_api_key"))


def parse_stop_ids(value: str, default: list[int]) -> list[int]:
    """``stop_token_ids``: ``default`` (the model's eos ids), ``none`` / empty, or comma-separated ids."""
    if value == "default":
        return list(default)
    if value in ("", "none"):
        return []
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError("{stop_token_ids} {value!r}: expected comma-separated integers, 'default' or 'none'",
                          value=value) from None


