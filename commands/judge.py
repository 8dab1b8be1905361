"""Score rollout shards: add reward components, the scalar reward and failure reasons to every record.

Each record's response is decoded with --checkpoint's tokenizer (the one the rollout used) and
scored by the reward mixture R = sum_k w_k R_k - sum_j lambda_j P_j: rewards (--reward) and
penalties (--penalty) drawn from the record's domain verifier (math, count, or any
package.module:function), format / length / truncation rules, an Outcome Reward Model and a
generative judge. With no component given, the reward is the domain verifier alone ("correct",
weight 1). Every component value is kept in `rewards`; a component that fails makes `reward` NaN
with the reason in `reward_info["failure"]`, never a silent 0.

One output shard per input shard (same file name) holds every input field plus `rewards`,
`reward` and `reward_info`; inputs are never modified. A rerun keeps output shards that are already
complete (crash-resume); --overwrite redoes them. DIR/metrics.jsonl has one line per shard
(reward mean/std/min/max, failures, per-component means). Slurm array tasks given --shard-index
and --num-shards share DIR; every task (and every rerun without --overwrite) must use the options
recorded in DIR/stage.json, and each output shard's header holds them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer
from tqdm import tqdm

from glmpost.checkpoints import load_tokenizer
from glmpost.commands.common import (
    config_option,
    effective_options,
    option_flag,
    print_summary,
)
from glmpost.commands.options import json_option
from glmpost.config import domain_assignment
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import (
    ShardReader,
    ShardWriter,
    require_fields,
    resolve_shard_paths,
    select_shards,
)
from glmpost.rewards.mixture import (
    MODEL_SOURCES,
    ComponentSpec,
    RewardMixture,
    RewardStats,
    check_components,
    default_components,
    parse_component,
    parse_spec_string,
    uses_domain_routing,
)
from glmpost.rewards.verifiers import VerifierTable
from glmpost.stage import MetricsWriter, check_same_options, complete_shard, log, shard_outputs, write_stage_json

STAGE = "judge"
# What judging reads from each record (all produced by `glmpost rollout`).
ROLLOUT_FIELDS = ("prompt_token_ids", "response_token_ids", "action_mask", "status", "tokenizer_revision")
# Options that may differ between the tasks (and reruns) writing one --out; all others must agree.
PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "device", "config", "zstd_level")

SPEC_HELP = (
    "name=NAME,source=SOURCE,weight=W[,OPTION=VALUE...] or a TOML inline table; sources: verifier "
    "[verifier=math|pkg.mod:fn], format pattern=REGEX, length max_tokens=N [ramp_tokens=N], truncated, "
    "orm checkpoint=DIR [activation=sigmoid|none, batch_size=N], judge checkpoint=DIR [template=TEXT, "
    "max_new_tokens=N, score_pattern=REGEX, max_score=X, batch_size=N]. Repeatable; recipe: [[judge.{table}]]."
)


# --------------------------------------------------------------------------------------------
# Option parsers: a recipe gives TOML tables, the command line strings; both end up the same.


class ComponentOption:
    """Parses one --reward / --penalty value (a recipe table or a flag string) into a ComponentSpec."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, value: Any) -> ComponentSpec:
        if isinstance(value, ComponentSpec):
            return value
        if not isinstance(value, (str, dict)):
            raise UsageError(f"--{self.kind} {value!r}: expected a table or KEY=VALUE,... string")
        try:
            return parse_component(value, kind=self.kind)
        except ValueError as exc:
            raise UsageError(f"--{self.kind} {_show(value)}: {exc}") from None


def parse_verifier_route(value: Any) -> tuple[str, str]:
    """``DOMAIN=VERIFIER`` (VERIFIER a built-in name or package.module:function)."""
    return domain_assignment(value, flag="--verifier",
                             example="DOMAIN=VERIFIER, e.g. --verifier gsm8k=math or mydomain=pkg.mod:fn")


def parse_domains(value: Any) -> dict[str, str]:
    """The [judge.domains] table, or --domains as a TOML inline table / DOMAIN=VERIFIER,... string."""
    if isinstance(value, str):
        try:
            value = parse_spec_string(value)
        except ValueError as exc:
            raise UsageError(f"--domains {value!r}: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
        raise UsageError(f"--domains / [judge.domains]: expected DOMAIN = \"VERIFIER\" entries, got {value!r}")
    return dict(value)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def judge(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(
        ..., metavar="SHARDS", help="Rollout shards: files, directories of *.msgpack.zst shards, or globs."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output directory; gets one judged shard per input shard, with the same file name."
    ),
    checkpoint: Path = typer.Option(
        ...,
        "--checkpoint",
        help="Checkpoint (root or version) whose tokenizer decodes the responses; records with another "
        "tokenizer revision are refused.",
    ),
    rewards: List[str] = typer.Option(
        [], "--reward", metavar="SPEC", parser=ComponentOption("reward"),
        help="A reward term w_k R_k: " + SPEC_HELP.format(table="rewards") + " Default: name=correct,source=verifier,weight=1.",
    ),
    penalties: List[str] = typer.Option(
        [], "--penalty", metavar="SPEC", parser=ComponentOption("penalty"),
        help="A penalty term lambda_j P_j, subtracted (weight = lambda_j): same SPEC as --reward. "
        "Recipe: [[judge.penalties]].",
    ),
    verifiers: List[str] = typer.Option(
        [], "--verifier", metavar="DOMAIN=VERIFIER", parser=parse_verifier_route,
        help="Route records of DOMAIN to a verifier: a built-in (math, count) or package.module:function "
        "taking a VerifyContext and returning a score in [0, 1]. Repeatable; wins over --domains.",
    ),
    domains: Optional[str] = typer.Option(
        None, "--domains", metavar="TABLE", parser=parse_domains,
        help='Domain-to-verifier table, as the recipe\'s [judge.domains] (e.g. \'{gsm8k = "math"}\'). '
        "Domains named like a built-in verifier need no entry.",
    ),
    default_verifier: Optional[str] = typer.Option(
        None, "--default-verifier", metavar="VERIFIER",
        help="Verifier for records whose domain has none (or no domain); without it such a record is an error.",
    ),
    device: str = typer.Option(
        "auto", "--device", help="Where ORM and judge models run: auto, cpu, cuda[:I], npu[:I]."
    ),
    batch_size: int = typer.Option(
        64, "--batch-size", min=1, help="Records handed to the reward mixture at a time (models batch within it)."
    ),
    shard_index: int = typer.Option(0, "--shard-index", min=0, help="This task's index among --num-shards (Slurm arrays)."),
    num_shards: int = typer.Option(1, "--num-shards", min=1, help="Split the input shards round-robin over this many tasks."),
    zstd_level: int = typer.Option(3, "--zstd-level", min=1, max=22, help="zstd compression level of the output shards."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Judge again shards whose output already exists."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
) -> None:
    specs = check_components([*(rewards or default_components()), *penalties])
    options = _json_options(ctx, specs)
    paths = select_shards(resolve_shard_paths(inputs), shard_index, num_shards)
    targets = shard_outputs(paths, out, what="judged shards")
    check_same_options(out, STAGE, options, ignore=PER_TASK_OPTIONS, overwrite=overwrite,
                       flag_name=lambda name: option_flag(ctx, name))
    tokenizer, revision = load_tokenizer(checkpoint)
    routes = {**(domains or {}), **dict(verifiers)}
    table = VerifierTable(routes, default_verifier)

    pending, skipped = [], []
    for path in paths:
        if not overwrite and complete_shard(targets[path], STAGE, redo="judging again"):
            skipped.append(path)
        else:
            pending.append(path)
    counts = {path: _check_input(path, revision, checkpoint, table if uses_domain_routing(specs) else None) for path in pending}

    totals = RewardStats(specs)
    if pending:
        from glmpost.npu import resolve_device

        needs_model = any(spec.source in MODEL_SOURCES for spec in specs)
        mixture = RewardMixture(
            specs,
            tokenizer=tokenizer,
            tokenizer_revision=revision,
            verifiers=table,
            device=resolve_device(device) if needs_model else "cpu",
        )
        out.mkdir(parents=True, exist_ok=True)
        write_stage_json(out, STAGE, options, tokenizer_revision=revision)
        progress = tqdm(total=sum(counts.values()), desc="judge", unit="rec", leave=False, disable=None)
        with MetricsWriter(out / "metrics.jsonl") as metrics, progress:
            for path in pending:
                stats = _judge_shard(path, targets[path], mixture, options, zstd_level, batch_size, progress)
                metrics.write(shard=targets[path].name, input=str(path), **stats.metrics())
                totals.merge(stats)
    if skipped:
        log(f"kept {len(skipped)} complete output shard(s) in {out} (--overwrite judges them again)")
    if not paths:
        log(f"--shard-index {shard_index} of --num-shards {num_shards} selects no input shard; nothing to do")

    summary = {
        "out": str(out),
        "shards": len(pending),
        "skipped": len(skipped),
        **{key.removeprefix("judge/"): value for key, value in totals.metrics().items()},
    }
    print_summary(summary, as_json=as_json, human=_human(summary, specs))


# --------------------------------------------------------------------------------------------
# Steps


def _json_options(ctx: typer.Context, specs: list[ComponentSpec]) -> dict[str, Any]:
    """Effective options, JSON-safe: components as tables, routes as DOMAIN=VERIFIER strings."""
    options = effective_options(ctx)
    options["rewards"] = [s.to_json() for s in specs if s.kind == "reward"]
    options["penalties"] = [s.to_json() for s in specs if s.kind == "penalty"]
    options["verifiers"] = [f"{d}={v}" for d, v in ctx.params.get("verifiers") or []]
    return options


def _check_input(path: Path, revision: str, checkpoint: Path, table: VerifierTable | None) -> int:
    """Read one input shard through before anything is written: tokenizer revision, the rollout
    fields, and a verifier for every record's domain. Returns its record count."""
    reader = ShardReader(path)
    theirs = reader.header["tokenizer_revision"]
    if theirs != revision:
        raise GlmpostError(
            f"{path}: tokenizer revision {theirs} differs from --checkpoint {checkpoint}'s {revision}; "
            "decode with the checkpoint the rollout used"
        )
    count = 0
    for record in reader:
        require_fields(record, ROLLOUT_FIELDS, where=f"judge: {path}")
        if table is not None:
            if table.default is None:
                require_fields(record, ("domain",), where=f"judge: {path}")
            try:
                table.lookup(record.get("domain"))
            except UsageError as exc:
                raise UsageError(f"{path}: record {record['id']!r}: {exc}") from None
        count += 1
    return count


def _batches(records: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for record in records:
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _judge_shard(
    path: Path, target: Path, mixture: RewardMixture, options: dict[str, Any], level: int, batch_size: int, progress: tqdm
) -> RewardStats:
    """Judge one input shard into ``target`` (written atomically: a crash leaves no partial shard)."""
    stats = RewardStats(mixture.specs)
    shard_options = {**options, "input_shard": str(path)}
    with ShardWriter(target, stage=STAGE, options=shard_options, tokenizer_revision=mixture.tokenizer_revision, level=level) as writer:
        for batch in _batches(iter(ShardReader(path)), batch_size):
            for record in mixture.judge(batch):
                writer.write(record)
                stats.add(record)
            progress.update(len(batch))
    return stats


def _human(summary: dict[str, Any], specs: list[ComponentSpec]) -> str:
    lines = [f"{summary['out']}: judged {summary['records']} records in {summary['shards']} shard(s)"
             + (f", kept {summary['skipped']} complete shard(s)" if summary["skipped"] else "")]
    if summary["records"]:
        mean = summary["reward_mean"]
        lines.append(
            f"reward mean {mean:.4f} (std {summary['reward_std']:.4f}, min {summary['reward_min']:.4f}, max {summary['reward_max']:.4f})"
            if mean is not None else "reward: every record failed"
        )
        lines.append(f"failed records: {summary['failures']}")
        for spec in specs:
            value = summary[f"components/{spec.name}/mean"]
            sign = "+" if spec.kind == "reward" else "-"
            shown = f"{value:.4f}" if value is not None else "n/a"
            lines.append(
                f"  {sign}{spec.weight:g} x {spec.name} ({spec.source}): mean {shown}, "
                f"{summary[f'components/{spec.name}/failures']} failed"
            )
    return "\n".join(lines)
