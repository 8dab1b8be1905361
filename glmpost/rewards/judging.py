"""One judge run (what ``glmpost judge`` runs): every record of rollout shards gets its reward
components, the scalar reward and failure reasons.

    check the components -> select this task's shards -> refuse an output written with other options
    -> read every pending input through (tokenizer revision, rollout fields, a verifier per domain)
    -> build the reward mixture -> judge each pending shard into its output, one metrics line each

One output shard per input shard (same file name), written atomically; an output shard that is
already complete is kept unless ``overwrite``. Nothing is written before every pending input has
been read through. :meth:`JudgeRun.run` returns the run's summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tqdm import tqdm

from glmpost.config import ConfigError, setting, shared
from glmpost.formats import (
    ShardReader,
    ShardWriter,
    iter_checked_records,
    require_fields,
    resolve_shard_paths,
    select_shards,
)
from glmpost.kernel.loading import load_tokenizer
from glmpost.npu import resolve_device
from glmpost.rewards.mixture import (
    MODEL_SOURCES,
    ComponentSpec,
    RewardMixture,
    RewardStats,
    check_components,
    default_components,
    uses_domain_routing,
)
from glmpost.rewards.verifiers import VerifierTable
from glmpost.stage import MetricsWriter, check_same_options, complete_shard, log, shard_outputs, write_stage_json

STAGE = "judge"
# What judging reads from each record (all produced by `glmpost rollout`).
ROLLOUT_FIELDS = ("prompt_token_ids", "response_token_ids", "action_mask", "status", "tokenizer_revision")
# Options that may differ between the tasks (and reruns) writing one output directory; all others must agree.
PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "device", "config", "zstd_level")


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
    domains: dict[str, str] | None = setting(
        None, 'Domain-to-verifier table, as the recipe\'s [judge.domains] (e.g. \'{gsm8k = "math"}\'). '
        "Domains named like a built-in verifier need no entry.")
    default_verifier: str | None = setting(
        None, "Verifier for records whose domain has none (or no domain); without it such a record is an error.")
    device: str = shared("device")
    batch_size: int = setting(64, "Records handed to the reward mixture at a time (models batch within it).", min=1)
    shard_index: int = shared("shard_index")
    num_shards: int = shared("num_shards")
    zstd_level: int = shared("zstd_level")
    overwrite: bool = shared("overwrite")
    options: dict[str, Any] = field(default_factory=dict)


class JudgeRun:
    """One run: ``JudgeRun(config).run()`` judges this task's pending shards and returns the summary;
    ``specs`` are the reward mixture's components (rewards, then penalties)."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.specs = check_components([*(config.rewards or default_components()), *config.penalties])
        self.options = {
            **config.options,
            "rewards": [s.to_json() for s in self.specs if s.kind == "reward"],
            "penalties": [s.to_json() for s in self.specs if s.kind == "penalty"],
            "verifiers": [f"{d}={v}" for d, v in config.verifiers],
        }

    def run(self) -> dict[str, Any]:
        """Check every pending input, then judge it; the run's summary."""
        c = self.config
        paths = select_shards(resolve_shard_paths(c.inputs), c.shard_index, c.num_shards)
        targets = shard_outputs(paths, c.out, what="judged shards")
        check_same_options(c.out, STAGE, self.options, ignore=PER_TASK_OPTIONS, overwrite=c.overwrite)
        tokenizer, revision = load_tokenizer(c.checkpoint)
        table = VerifierTable({**(c.domains or {}), **dict(c.verifiers)}, c.default_verifier)

        pending, skipped = [], []
        for path in paths:
            if not c.overwrite and complete_shard(targets[path], STAGE, redo="judging again"):
                skipped.append(path)
            else:
                pending.append(path)
        routing = table if uses_domain_routing(self.specs) else None
        counts = {path: check_input(path, revision, routing) for path in pending}

        totals = RewardStats(self.specs)
        if pending:

            needs_model = any(spec.source in MODEL_SOURCES for spec in self.specs)
            mixture = RewardMixture(self.specs, tokenizer=tokenizer, tokenizer_revision=revision, verifiers=table,
                                    device=resolve_device(c.device) if needs_model else "cpu")
            c.out.mkdir(parents=True, exist_ok=True)
            write_stage_json(c.out, STAGE, self.options, tokenizer_revision=revision)
            progress = tqdm(total=sum(counts.values()), desc="judge", unit="rec", leave=False, disable=None)
            with MetricsWriter(c.out / "metrics.jsonl") as metrics, progress:
                for path in pending:
                    stats = self.judge_shard(path, targets[path], mixture, progress)
                    metrics.write(shard=targets[path].name, input=str(path), **stats.metrics())
                    totals.merge(stats)
        if skipped:
            log(f"kept {len(skipped)} complete output shard(s) in {c.out} (--overwrite judges them again)")
        if not paths:
            log(f"--shard-index {c.shard_index} of --num-shards {c.num_shards} selects no input shard; nothing to do")
        return {
            "out": str(c.out),
            "shards": len(pending),
            "skipped": len(skipped),
            **{key.removeprefix("judge/"): value for key, value in totals.metrics().items()},
        }

    def judge_shard(self, path: Path, target: Path, mixture: RewardMixture, progress: tqdm) -> RewardStats:
        """Judge one input shard into ``target`` (written atomically: a crash leaves no partial shard)."""
        stats = RewardStats(mixture.specs)
        shard_options = {**self.options, "input_shard": str(path)}
        with ShardWriter(target, stage=STAGE, options=shard_options, tokenizer_revision=mixture.tokenizer_revision,
                         level=self.config.zstd_level) as writer:
            for batch in batches(iter(ShardReader(path)), self.config.batch_size):
                for record in mixture.judge(batch):
                    writer.write(record)
                    stats.add(record)
                progress.update(len(batch))
        return stats


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
