"""One judge run (what ``glmpost judge`` runs): every record of rollout shards gets its reward
components, the scalar reward and failure reasons.

    check the components -> select this task's shards -> refuse an output written with other options
    -> read every pending input through (tokenizer revision, rollout fields, a verifier per domain)
    -> build the reward mixture -> judge each pending shard into its output, one metrics line each

One output shard per input shard (same file name), written atomically; an output shard that is
already complete is kept unless ``overwrite``. Nothing is written before every pending input has
been read through. :class:`JudgeStage` is the stage; :mod:`glmpost.drivers` runs it once or following a spool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from tqdm import tqdm

from glmpost.config import ConfigError, section, setting, shared
from glmpost.formats import (
    ShardReader,
    ShardWriter,
    iter_checked_records,
    require_fields,
)
from glmpost.kernel.loading import load_tokenizer
from glmpost.npu import resolve_device
from glmpost.rewards.components import (
    MODEL_SOURCES,
    ComponentSpec,
    check_components,
    default_components,
    parse_spec_string,
    uses_domain_routing,
)
from glmpost.rewards.dynamic_sampling import GroupFilter
from glmpost.rewards.math_answers import math_checker_setting
from glmpost.rewards.mixture import RewardMixture, RewardStats
from glmpost.rewards.verifiers import VerifierTable

STAGE = "judge"
# What judging reads from each record (all produced by `glmpost rollout`).
ROLLOUT_FIELDS = ("prompt_token_ids", "response_token_ids", "action_mask", "status", "tokenizer_revision")
# Options that may differ between the tasks (and reruns) writing one output directory; all others must agree.
PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "device", "config", "zstd_level")


def parse_domains(value: Any) -> dict[str, str]:
    """The [judge.domains] table, or --domains as a TOML inline table / DOMAIN=VERIFIER,... string."""
    if isinstance(value, str):
        try:
            value = parse_spec_string(value)
        except ValueError as exc:
            raise ConfigError("{domains} {value!r}: {problem}", value=value, problem=str(exc)) from None
    if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
        raise ConfigError("{domains} / [judge.domains]: expected DOMAIN = \"VERIFIER\" entries, got {value!r}", value=value)
    return dict(value)


@dataclass
class VerifierRouting:
    """Which verifier scores each domain: the routing ``judge`` and ``eval`` share (each words its
    help for what it judges: records, or the prompts it samples)."""

    domains: dict[str, str] | None = setting(
        None, 'Domain-to-verifier table, as the recipe\'s [judge.domains] (e.g. \'{gsm8k = "math"}\'). '
        "Domains named like a built-in verifier need no entry.",
        cli={"annotation": Optional[str], "metavar": "TABLE", "parser": parse_domains})
    default_verifier: str | None = setting(
        None, "Verifier for records whose domain has none (or no domain); without it such a record is an error.",
        cli={"metavar": "VERIFIER"})
    math_checker: str = math_checker_setting()

    def as_options(self) -> dict[str, Any]:
        return {"domains": self.domains, "default_verifier": self.default_verifier, "math_checker": self.math_checker}


@dataclass
class JudgeConfig:
    """What one ``judge`` run does (the options of ``glmpost judge``, under the same names).
    ``options`` are the effective options written to ``stage.json`` and the shard headers (the run
    spells the components as tables and the ``verifiers`` as ``DOMAIN=VERIFIER`` strings)."""

    inputs: list[str]  # rollout shards: files, directories or globs
    out: Path  # one judged shard per input shard, same file name
    checkpoint: Path  # its tokenizer decodes the responses
    rewards: list[ComponentSpec] = field(default_factory=list)  # none: the domain verifier alone
    penalties: list[ComponentSpec] = field(default_factory=list)
    verifiers: list[tuple[str, str]] = field(default_factory=list)  # (domain, verifier); they win over domains
    routing: VerifierRouting = section(VerifierRouting)
    device: str = shared("device")
    batch_size: int = setting(64, "Records handed to the reward mixture at a time (models batch within it).", min=1)
    dynamic_sampling: bool = setting(
        False, "DAPO's dynamic sampling: leave out of the output every group (group_id, within a shard) whose rewards are "
        "all equal (its GRPO advantages are all 0), counted in judge/dynamic_sampling/*. Following spools the trainer's "
        "--follow-records then fills with informative groups only (the rollout over-samples); run once, the rollout's "
        "prompts are the over-sampled batch.")
    shard_index: int = shared("shard_index")
    num_shards: int = shared("num_shards")
    zstd_level: int = shared("zstd_level")
    overwrite: bool = shared("overwrite")
    options: dict[str, Any] = field(default_factory=dict)


class JudgeStage:
    """The judge as a :class:`~glmpost.drivers.ShardStage`: one judged shard per rollout shard;
    ``specs`` are the reward mixture's components (rewards, then penalties)."""

    name = STAGE
    per_task_options = PER_TASK_OPTIONS
    outputs = "judged shards"
    redo = "judging again"

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.specs = check_components([*(config.rewards or default_components()), *config.penalties])
        self.options = {
            **config.options,
            "rewards": [s.to_json() for s in self.specs if s.kind == "reward"],
            "penalties": [s.to_json() for s in self.specs if s.kind == "penalty"],
            "verifiers": [f"{d}={v}" for d, v in config.verifiers],
        }
        self.tokenizer, self.revision = load_tokenizer(config.checkpoint)
        routing = config.routing
        self.table = VerifierTable({**(routing.domains or {}), **dict(config.verifiers)}, routing.default_verifier,
                                   options={"math_checker": routing.math_checker})
        self.totals = RewardStats(self.specs)
        self.dropped = GroupFilter() if config.dynamic_sampling else None
        self.mixture: RewardMixture | None = None

    def spool_revision(self, spool: Path) -> str:
        return self.revision

    def check(self, shard: Path) -> int:
        return check_input(shard, self.revision, self.table if uses_domain_routing(self.specs) else None)

    def open(self) -> dict[str, Any]:
        needs_model = any(spec.source in MODEL_SOURCES for spec in self.specs)
        self.mixture = RewardMixture(self.specs, tokenizer=self.tokenizer, tokenizer_revision=self.revision, verifiers=self.table,
                                     device=resolve_device(self.config.device) if needs_model else "cpu")
        return {"tokenizer_revision": self.revision}

    def process(self, shard: Path, target: Path, progress: tqdm) -> dict[str, Any]:
        """Judge one input shard into ``target`` (written atomically: a crash leaves no partial shard)."""
        stats = RewardStats(self.mixture.specs)
        shard_options = {**self.options, "input_shard": str(shard)}
        judged: list[dict[str, Any]] = []  # with --dynamic-sampling, the shard's records until its groups are known
        with ShardWriter(target, stage=STAGE, options=shard_options, tokenizer_revision=self.revision,
                         level=self.config.zstd_level) as writer:
            for batch in batches(iter(ShardReader(shard)), self.config.batch_size):
                for record in self.mixture.judge(batch):
                    stats.add(record)
                    if self.dropped is None:
                        writer.write(record)
                    else:
                        judged.append(record)
                progress.update(len(batch))
            if self.dropped is None:
                self.totals.merge(stats)
                return stats.metrics()
            dropped = GroupFilter()
            for record in dropped.keep_informative(judged, where=str(shard)):
                writer.write(record)
        self.totals.merge(stats)
        self.dropped.merge(dropped)
        return {**stats.metrics(), **dropped.metrics()}

    def close(self) -> None:
        self.mixture = None

    def summary(self) -> dict[str, Any]:
        totals = {**self.totals.metrics(), **(self.dropped.metrics() if self.dropped is not None else {})}
        return {key.removeprefix("judge/"): value for key, value in totals.items()}


def check_input(path: Path, revision: str, table: VerifierTable | None) -> int:
    """Read one input shard through before anything is written (the checked reader every stage
    uses: the rollout fields, the checkpoint's tokenizer revision) and, with ``table``, a verifier
    for every record's domain. Returns its record count."""
    def routable(record: dict[str, Any], where: str) -> None:
        if table is None:
            return
        if table.default is None:
            require_fields(record, ("domain",), where=where)
        try:
            table.lookup(record.get("domain"))
        except ConfigError as exc:
            raise ConfigError("{where}: " + exc.message, where=f"{path}: record {record['id']!r}", **exc.values) from None

    return sum(1 for _ in iter_checked_records([path], revision=revision, stage=STAGE, require=ROLLOUT_FIELDS, check=routable))


def batches(records: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    """``records`` in lists of ``size`` (the last one shorter)."""
    batch: list[dict[str, Any]] = []
    for record in records:
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
