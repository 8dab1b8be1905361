"""One rollout run: from a checkpoint and prompts to rollout shards, ``stage.json`` and ``metrics.jsonl``.

    check the settings -> open the checkpoint -> load the prompts -> open the engine
    -> claim the output directory -> plan this task's shards -> write the missing ones

* **engine**: ``local`` samples in this process (:class:`~glmpost.kernel.engine.LocalEngine`,
  ``batch_size`` sequences per call); ``sglang`` sends the same batches to SGLang servers (or
  ``glmpost serve``) with each sequence's seed as ``sampling_seed``, after checking that every server
  is reachable, takes ``api_key``, serves the checkpoint's tokenizer revision and takes the run's
  sampling fields; records carry ``sampling.seed_reproducible`` and the servers' log-prob kind
  (``server_log_prob_kind``). A request that finally fails becomes ``aborted`` records, never a
  lost prompt.
* **output**: an output directory written before with other options (or another checkpoint version)
  is refused unless ``overwrite``; the prompts are cut into parts of ``prompts_per_shard`` prompts,
  parts are split among ``num_shards`` tasks, and a task writes only its parts that are missing.
* **metrics**: one ``metrics.jsonl`` line per written shard; :meth:`RolloutRunner.run` returns the
  run's summary.
* **weights**: a run samples one checkpoint version; ``rollout --follow`` asks the runner to follow a
  checkpoint root (:meth:`RolloutRunner.follow_weights`), and the runner then switches to its newest
  version before each part and, with the local engine, between the turns of a multi-turn part
  (:meth:`RolloutRunner.switch_to_newest`, the one way its weights change).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm import tqdm

from glmpost.checkpoints import LATEST, CheckpointRoot
from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.formats import ShardWriter
from glmpost.formats.chat_format import template_kwargs
from glmpost.formats.prompts import renders_tools
from glmpost.kernel.engine import Completion, SamplingParams
from glmpost.kernel.loading import attention_ran
from glmpost.locks import output_lock
from glmpost.npu import resolve_device
from glmpost.rollout.agentic import (
    MultiTurnSettings,
    Trajectory,
    home_server,
    retokenize_drift,
    run_trajectories,
    trajectory_metrics,
)
from glmpost.rollout.compaction import CompactionSettings, ContextBuilder, check_rebuild_room
from glmpost.rollout.engines import engine_version, eos_id_list, open_backend
from glmpost.rollout.local_backend import LocalBackend
from glmpost.rollout.observations import open_renderer, reasoning_counter
from glmpost.rollout.policy import PolicyCheckpoint
from glmpost.rollout.records import (
    RolloutPrompt,
    aborted_record,
    as_version,
    check_context,
    load_rollout_prompts,
    rollout_record,
    trajectory_record,
)
from glmpost.rollout.parts import STAGE, RolloutTotals, ShardPlan, plan_shards, shard_metrics
from glmpost.rollout.refill import Sample, next_round, refill_metrics
from glmpost.rollout.servers import Outcome
from glmpost.rollout.settings import PER_TASK_OPTIONS, RolloutConfig, parse_stop_ids
from glmpost.rollout.sglang_backend import SGLangBackend
from glmpost.stage import MetricsWriter, check_same_options, log, write_stage_json


@dataclass(frozen=True)
class FollowedWeights:
    """Where a following rollout's weights come from (:meth:`RolloutRunner.follow_weights`)."""

    root: Path  # the checkpoint root whose LATEST is sampled
    keep_cache: bool  # at a switch between turns, trajectories in flight keep their KV caches (else recompute them)
    label: str  # the rollout's name in the log


def newest_version(root: Path | None, current: PolicyCheckpoint) -> PolicyCheckpoint | None:
    """The root's LATEST version when it is not ``current``'s, else None."""
    if root is None or not (root / LATEST).is_file():
        return None
    if CheckpointRoot(root).latest_dir() == current.version_dir:  # the cheap look, before every turn
        return None
    newest = PolicyCheckpoint.open(root)
    return newest if newest.version_dir != current.version_dir else None


class RolloutRunner:
    """Runs one rollout: ``RolloutRunner(config, options=...).run()`` returns the summary.

    ``options`` are the options recorded in ``stage.json`` and the shard headers (by default
    :meth:`RolloutConfig.as_options`). The runner holds the engine it samples with (``backend``, on
    ``checkpoint``), the sampling params prepared for it (``params``, see :meth:`prepare`) and the
    engine map its records carry (``engine_info``, built once when the engine opens).
    """

    def __init__(self, config: RolloutConfig, *, options: dict[str, Any] | None = None):
        self.config = config
        self.options = config.as_options() if options is None else options
        self.environment = None  # (name, factory) of a multi-turn run
        self.compaction = CompactionSettings()  # and its context budget and compaction (set by prepare)
        self.builder: ContextBuilder | None = None
        self.prompts: list[RolloutPrompt] = []
        self.backend: LocalBackend | SGLangBackend | None = None  # set by open_engine
        self.checkpoint: PolicyCheckpoint | None = None  # the version sampling now
        self.device: Any = None
        self.params: SamplingParams | None = None  # as prepared for the engine (prepare)
        self.engine_info: dict[str, Any] = {}
        self.following: FollowedWeights | None = None  # rollout --follow's (follow_weights)
        self.turn_switches = 0  # weight switches between the turns of multi-turn parts

    def open(self, checkpoint: PolicyCheckpoint) -> list[RolloutPrompt]:
        """Check the engine settings, resolve the environment of a multi-turn run, load the prompts
        (this run's ``limit``) with ``checkpoint``'s tokenizer (and chat template, with the tools the
        environment declares); returns them."""
        config = self.config
        config.check_engine()
        self.environment = config.environment()
        self.template_kwargs = template_kwargs(config.chat_template_kwargs)
        self.reasoning_parser, self.reasoning = (reasoning_counter(checkpoint, config.multi_turn.reasoning_parser,
                                                                   self.template_kwargs) if not self.environment else ("", None))
        tools = None
        if self.environment is not None:
            self.renderer = open_renderer(checkpoint, config.multi_turn, self.template_kwargs)
            self.decode = lambda ids: checkpoint.tokenizer.decode(ids, skip_special_tokens=True)
            tools = getattr(self.environment[1], "tools", None)  # rendered into the prompts by the chat template
            if tools and not renders_tools(checkpoint.tokenizer, tools):
                raise ConfigError("{env} {value} declares tools, but the checkpoint's chat template does not render "
                                  "them (apply_chat_template(tools=...))", value=self.environment[0])
        self.prompts = load_rollout_prompts(config.inputs, checkpoint.tokenizer, checkpoint.revision, config.columns,
                                            tools, self.template_kwargs)[: config.limit]
        return self.prompts

    def run(self) -> dict[str, Any]:
        """Check, load, claim the output, write this task's missing shards; the run's summary."""
        config = self.config
        if config.checkpoint is None or config.out is None:
            raise UsageError("a rollout needs a checkpoint and an output directory")
        params = config.sampling_params()
        device = resolve_device(config.device)
        checkpoint = PolicyCheckpoint.open(config.checkpoint)
        prompts = self.open(checkpoint)
        with output_lock(config.out, stage=STAGE, task=(config.shard_index, config.num_shards)):
            self.open_engine(checkpoint, device)
            try:
                self.prepare(params)
                self._claim_output(checkpoint, servers=getattr(self.backend, "server_facts", list)())
                plan = plan_shards(prompts, config)
                totals = self._write_shards(plan, checkpoint)
            finally:
                self.backend.close()
        return self._summary(prompts, plan, totals, checkpoint)

    def open_engine(self, checkpoint: PolicyCheckpoint, device: Any) -> None:
        """Open the engine ``engine_name`` names on ``checkpoint`` (a local one on ``device``) and
        build the engine map every record of this run carries."""
        self.checkpoint, self.device = checkpoint, device
        self.backend = open_backend(checkpoint, self.config, device)
        self.engine_info = {"engine": self.backend.engine_name(), "engine_version": engine_version(),
                            "group_size": self.config.group_size, "seed_reproducible": self.backend.seed_reproducible}

    def prepare(self, params: SamplingParams) -> SamplingParams:
        """Before sampling (a run, each round of ``rollout --follow``, a switch before a part): ``params``
        with the model's stop ids, the prompts checked against its context, the engine handed them
        (servers: with the kind their log-probs are of); what the engine took becomes :attr:`params`,
        which the records carry. ``params`` itself is never changed (it is frozen)."""
        prompts, backend = self.prompts, self.backend
        eos_ids = eos_id_list(backend.default_stops)
        params = replace(params, stop_token_ids=parse_stop_ids(self.config.stop_token_ids, eos_ids))
        model_context = backend.model_config.max_position_embeddings
        self.compaction = self.config.compaction_settings(model_context)
        check_context(prompts, max_new_tokens=self.config.max_new_tokens, context=self.compaction.budget,
                      budget=self.config.context.context_budget is not None)
        if self.compaction.on:
            self.builder = ContextBuilder(self.renderer.chat, self.compaction, params.stop_token_ids or eos_ids,
                                          reasoning_parser=self.renderer.reasoning_parser)
            check_rebuild_room(prompts, self.builder, self.config.max_new_tokens)
        self.params = backend.prepare(params, eos_ids)
        return self.params

    def follow_weights(self, root: Path | None, *, keep_cache: bool, label: str) -> None:
        """Sample ``root``'s newest version from now on (``rollout --follow``; None: this one only): the
        caller switches before each part with :meth:`switch_to_newest`, the runner itself between the
        turns of a multi-turn part when its engine is local (a server's weights are switched by
        sync-weights, each answer saying which version sampled it), or, with servers of LoRA versions,
        to the newer adapter once they hold it (:mod:`glmpost.rollout.lora_servers`); trajectories in
        flight at such a switch keep their KV caches (``keep_cache``) or recompute them (an adapter
        switch: always recomputed, the servers' caches being per adapter). ``label`` names it in the log."""
        self.following = None if root is None else FollowedWeights(Path(root), keep_cache, label)

    def switch_to_newest(self, *, between_turns: bool = False) -> bool:
        """The one way this runner's weights change: to the followed root's LATEST when it is not the
        version sampling now (True when it switched). The local engine loads the weights in place
        (between turns the trajectories in flight keep their caches or not, see :meth:`follow_weights`;
        before a part none is in flight), a server backend is opened anew on the version (which
        confirms and stamps it); before a part the params are then prepared again."""
        following = self.following
        newer = newest_version(following.root if following else None, self.checkpoint)
        if newer is None:
            return False
        local = isinstance(self.backend, LocalBackend)
        adapter = None if local else self.backend.switch_adapter(newer)  # servers of LoRA versions: name the newer adapter
        if adapter is False or (adapter is None and between_turns and not local):
            return False  # not on the servers yet; or a server's full weights, which sync-weights switches
        how = f" between turns ({'keep' if following.keep_cache else 'recompute'} the KV caches)" if between_turns else ""
        how = " (the adapter the servers hold)" if adapter else how
        log(f"{following.label}: switching from v{self.checkpoint.policy_version} to v{newer.policy_version}{how}")
        if local:
            self.backend.switch(newer, self.config, self.device, keep_cache=between_turns and following.keep_cache)
        elif adapter is None:
            self.backend.close()
            self.backend = open_backend(newer, self.config, self.device)
        self.checkpoint = newer
        if between_turns:
            self.turn_switches += 1
        else:
            self.prepare(self.params)
        return True

    def sampling_versions(self) -> list[int]:
        """The version each engine samples now (one for the local engine, one per server): a server's
        may be behind :attr:`checkpoint` until sync-weights moves it, or unknown (-1)."""
        return self.backend.sampling_versions(self.checkpoint)

    def _turn_hook(self) -> Callable[[], None] | None:
        """What runs between the turns of a multi-turn part: a switch to the newest weights, when
        following a root with the local engine or with servers of LoRA versions (the newer adapter)."""
        if self.following is None or not (isinstance(self.backend, LocalBackend) or self.backend.lora is not None):
            return None
        return lambda: self.switch_to_newest(between_turns=True)

    def _claim_output(self, checkpoint: PolicyCheckpoint, *, servers: list[dict]) -> None:
        """Create ``out``, refuse one written with other options, record this run's in stage.json
        (with ``servers``: each server's URL, engine and release)."""
        out = self.config.out
        out.mkdir(parents=True, exist_ok=True)
        facts = {"policy_version": checkpoint.policy_version, "checkpoint": str(checkpoint.version_dir)}
        check_same_options(out, STAGE, self.options, ignore=PER_TASK_OPTIONS, overwrite=self.config.overwrite,
                           facts=facts)
        local = self.config.engine.engine_name == "local"
        ran = {"attention_ran": attention_ran(checkpoint.version_dir, self.config.attention)} if local else {"servers": servers}
        ran["chat_format"] = self.renderer.facts() if self.environment is not None else {"reasoning_parser": self.reasoning_parser}
        write_stage_json(out, STAGE, self.options, checkpoint=str(checkpoint.version_dir),
                         policy_version=checkpoint.policy_version, **ran)

    def _write_shards(self, plan: ShardPlan, checkpoint: PolicyCheckpoint) -> RolloutTotals:
        """Generate and write every shard of ``plan.todo``, one metrics line each."""
        totals = RolloutTotals()
        total = sum(len(plan.parts[i]) for i, _ in plan.todo) * self.config.group_size
        progress = tqdm(total=total, desc="rollout", unit="seq", leave=False, disable=None)
        with MetricsWriter(self.config.out / "metrics.jsonl") as metrics, progress:
            for part_index, path in plan.todo:
                part = plan.parts[part_index]
                started = time.perf_counter()
                samples = self.generate(part, progress)
                outcomes = [s.outcome for s in samples]
                seconds = time.perf_counter() - started
                self.write_part(path, samples, checkpoint)
                completions = [c for c, _, _ in outcomes if c is not None]
                aborted = sum(s.status() == "aborted" for s in samples)  # by the engine, or a trajectory's server
                if aborted:
                    reason = next(s.outcome[2] for s in samples if s.status() == "aborted")
                    log(f"{path.name}: {aborted} of {len(outcomes)} sequences aborted: {reason}")
                metrics.write(**shard_metrics(path.name, completions, aborted=aborted, seconds=seconds,
                                              policy_version=checkpoint.policy_version),
                              **trajectory_metrics([c.trajectory for c in completions if isinstance(c, _Trajectory)]),
                              **refill_metrics(samples))
                totals.add(len(outcomes), completions, seconds, aborted=aborted)
        return totals

    def generate(self, part: list[RolloutPrompt], progress: tqdm) -> list[Sample]:
        """``group_size`` samples of every prompt of one part, keyed ``prompt_id/sample_index``
        (multi-turn: trajectories, see :mod:`glmpost.rollout.agentic`), then up to ``refill_rounds``
        rounds of refills (:mod:`glmpost.rollout.refill`)."""
        groups = [[Sample(p, i) for i in range(self.config.group_size)] for p in part]
        self._sample([s for group in groups for s in group], progress)
        occupants = [list(group) for group in groups]
        for round_number in range(1, self.config.refill_rounds + 1):
            refills = next_round(groups, occupants, round_number)
            if not refills:
                break
            progress.total += len(refills)
            self._sample(refills, progress)
        return [s for group in groups for s in group]

    def _sample(self, samples: list[Sample], progress: tqdm) -> None:
        """Give every sample its outcome: one engine call (single-turn) or one set of trajectories."""
        keys = [s.key for s in samples]
        sequences = [s.prompt.token_ids for s in samples]
        if self.environment is None:
            outcomes = self.backend.generate(sequences, keys, progress)
        else:
            outcomes = self._trajectories(sequences, keys, [s.prompt.task for s in samples])
            progress.update(len(samples))
        for sample, outcome in zip(samples, outcomes):
            sample.outcome = outcome

    def _trajectories(self, sequences: list[list[int]], keys: list[str], tasks: list[dict]) -> list[Outcome]:
        """One trajectory per sequence (:func:`~glmpost.rollout.agentic.run_trajectories`); between its
        turns, a following runner's local engine may switch weights in place (:meth:`_turn_hook`)."""
        turns, backend = self.config.multi_turn, self.backend
        settings = MultiTurnSettings(turns.max_turns, self.config.max_new_tokens, self.compaction.budget,
                                     turns.env_timeout, turns.env_workers, compaction=self.compaction,
                                     builder=self.builder, model_context=backend.model_config.max_position_embeddings)
        quiet = tqdm(disable=True)  # the bar counts trajectories, not turns
        servers = len(backend.pool.clients) if isinstance(backend, SGLangBackend) else 1

        def generate(seqs: list[list[int]], turn_keys: list[str], sessions: list[str],
                     max_new_tokens: int | None = None) -> list[Outcome]:
            homes = [home_server(session, servers) for session in sessions] if servers > 1 else None
            return backend.generate(seqs, turn_keys, quiet, homes=homes, sessions=sessions, max_new_tokens=max_new_tokens)

        trajectories = run_trajectories(generate, sequences, keys, tasks, self.environment[1], self.renderer, settings,
                                        self.decode, served=backend.served, between_turns=self._turn_hook())
        return [_as_outcome(t) for t in trajectories]

    def write_part(self, path: Path, samples: Sequence[Sample], checkpoint: PolicyCheckpoint) -> None:
        """One part's shard (written atomically): a rollout record per delivered sequence, an aborted
        record per failed one, each with :attr:`params` and :attr:`engine_info`, stamped with
        ``checkpoint`` (the version the part started with)."""
        with ShardWriter(path, stage=STAGE, options=self.options, tokenizer_revision=checkpoint.revision,
                         level=self.config.zstd_level) as writer:
            for sample in samples:
                prompt, (completion, version, reason) = sample.prompt, sample.outcome
                common = {"sample_index": sample.index, "params": self.params, "policy_version": checkpoint.policy_version,
                          "tokenizer_revision": checkpoint.revision, "engine": self.engine_info}
                if isinstance(completion, _Trajectory):
                    trajectory = completion.trajectory
                    trajectory.drift = retokenize_drift(checkpoint.tokenizer, trajectory.response_ids(), trajectory.action_flags())
                    record = trajectory_record(prompt, trajectory, env_name=self.environment[0],
                                               token_policy_version=as_version(version), drift=trajectory.drift,
                                               compaction=self.compaction, **common)
                elif completion is None or completion.finish_reason == "abort":  # with its partial tokens, if any
                    record = aborted_record(prompt, reason, partial=completion, token_policy_version=as_version(version),
                                            **common)
                else:
                    record = rollout_record(prompt, completion, token_policy_version=as_version(version), **common)
                    if self.reasoning is not None:  # what judge's verifiers skip: the response's reasoning block
                        record["extra"] = {"reasoning_tokens": self.reasoning(completion.token_ids)}
                if sample.replaces is not None:
                    group = record["group_id"]
                    record.setdefault("extra", {})["refill"] = {"replaces": f"{group}/{sample.replaces}", "round": sample.round}
                writer.write(record)

    def _summary(self, prompts: list[RolloutPrompt], plan: ShardPlan, totals: RolloutTotals,
                 checkpoint: PolicyCheckpoint) -> dict[str, Any]:
        """The run's result, as ``glmpost rollout --json`` prints it."""
        counts = totals.counts
        return {
            "out": str(self.config.out),
            "policy_version": checkpoint.policy_version,
            "prompts": len(prompts),
            "shards_written": counts["shards"],
            "shards_skipped": plan.skipped,
            "records": counts["records"],
            "response_tokens": counts["response_tokens"],
            "truncation_rate": round(counts["truncated"] / counts["records"], 4) if counts["records"] else 0.0,
            "aborted": counts["aborted"],
            "engine": self.config.engine.engine_name,
            "tokens_per_s": round(counts["response_tokens"] / totals.seconds, 1) if totals.seconds else 0.0,
        }


@dataclass
class _Trajectory(Completion):
    """A multi-turn trajectory standing in for a completion in a shard's outcomes and totals (its
    ``token_ids``: the whole response; ``finish_reason`` "length" when it ended truncated)."""

    trajectory: Any = None


def _as_outcome(trajectory: Trajectory) -> Outcome:
    ids = trajectory.response_ids()
    reason = "length" if trajectory.status == "truncated" else "stop"
    return _Trajectory(ids, [], reason, trajectory=trajectory), trajectory.version, trajectory.reason


def run_rollout(config: RolloutConfig, *, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``RolloutRunner(config, options=options).run()``."""
    return RolloutRunner(config, options=options).run()
