"""Measure how far the trainer's log-probs are from the rollout engine's on the same weights.

For every action token of the input rollout shards, the checkpoint recomputes log pi_train(y_t|s_t)
with glmpost's training path and subtracts the rollout_log_probs the engine recorded (the IcePop
view: same weights, two implementations). Reports mean / p50 / p99 / max |delta log p|, k1 and k3
estimates of KL(pi_rollout || pi_train), the fraction of tokens IcePop keeps at --beta and DIS keeps
at --eps-low/--eps-high, a breakdown by response position and by status, and the worst tokens.
Writes DIR/report.json, DIR/metrics.jsonl and DIR/stage.json; prints a table (or --json).

--fail-above METRIC=VALUE turns it into a CI gate: exit 1 when the metric exceeds the value.
Compare --deterministic-topk (glmpost's default DSA top-k) with --torch-topk to see what DSA ties cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.checkpoints import load_model, load_tokenizer, resolve_checkpoint
from glmpost.commands.common import (
    MetricsWriter,
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
    write_json_atomic,
    write_stage_json,
)
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import ShardReader, require_fields, resolve_shard_paths
from glmpost.mismatch import mismatch_report, parse_gates, token_deltas
from glmpost.npu import resolve_device

STAGE = "diff-logprobs"


def diff_logprobs(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., help="Rollout shards (files, directories or globs) with rollout_log_probs."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="The weights the rollouts were sampled with: a root (its LATEST) or a version."),
    out: Path = typer.Option(..., "--out", help="Directory for report.json, metrics.jsonl and stage.json (created; never silently replaced)."),
    beta: float = typer.Option(2.0, "--beta", help="IcePop beta: a token is kept when 1/beta <= pi_train / pi_rollout <= beta."),
    eps_low: float = typer.Option(0.2, "--eps-low", help="DIS lower epsilon: kept when 1 - eps_low < ratio."),
    eps_high: float = typer.Option(0.28, "--eps-high", help="DIS upper epsilon: kept when ratio < 1 + eps_high."),
    fail_above: List[str] = typer.Option([], "--fail-above", help="METRIC=VALUE (mean_abs, p50_abs, p99_abs, max_abs, k1, k3): exit 1 when exceeded; repeatable."),
    worst: int = typer.Option(10, "--worst", min=0, help="How many of the worst tokens to list."),
    deterministic_topk: bool = typer.Option(True, "--deterministic-topk/--torch-topk", help="DSA indexer top-k rule of the recomputation (see `glmpost rollout --help`)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Trajectories per forward pass."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda[:N] or npu[:N]."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    config: Optional[Path] = config_option(),
) -> None:
    try:
        gates = parse_gates(fail_above)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    version_dir = resolve_checkpoint(checkpoint)
    _, revision = load_tokenizer(version_dir)
    records, temperatures = [], set()
    for path in resolve_shard_paths(inputs):
        for index, record in enumerate(ShardReader(path)):
            where = f"{STAGE}: {path}: record {index}"
            require_fields(record, ["rollout_log_probs", "sampling"], where=where)
            if record["tokenizer_revision"] != revision:
                raise GlmpostError(f"{where}: tokenizer revision {record['tokenizer_revision']} differs from the checkpoint's {revision}")
            temperatures.add(float(record["sampling"].get("temperature", 1.0)))
            records.append(record)
    if len(temperatures) > 1:
        raise GlmpostError(f"{STAGE}: records were sampled at different temperatures {sorted(temperatures)}; compare them separately")
    temperature = temperatures.pop() if temperatures else 1.0
    if temperature == 0:
        raise GlmpostError(f"{STAGE}: greedy rollouts (temperature 0) record no sampling log-probs to compare")
    model = load_model(version_dir, device=resolve_device(device), deterministic_topk=deterministic_topk)
    deltas = token_deltas(model, records, temperature=temperature, batch_size=batch_size)
    report = mismatch_report(deltas, worst=worst, beta=beta, eps_low=eps_low, eps_high=eps_high)
    report.update({"checkpoint": str(version_dir), "records": len(records), "temperature": temperature,
                   "deterministic_topk": deterministic_topk})
    failed = [f"{name} {report['overall'].get(name, 0.0):.6g} > {limit:g}" for name, limit in gates.items()
              if report["overall"].get(name, 0.0) > limit]
    report["gates"] = {"fail_above": gates, "failed": failed}

    with staged_output_dir(out, overwrite=overwrite, complete_marker="stage.json") as staging:
        if staging is None:
            raise UsageError(f"--out {out} already holds a report; pass --overwrite to replace it")
        write_json_atomic(staging / "report.json", report)
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            metrics.write(**{f"mismatch/{k}": v for k, v in report["overall"].items()})
        write_stage_json(staging, STAGE, effective_options(ctx), checkpoint=str(version_dir))
    overall = report["overall"]
    lines = [f"{out}: {overall.get('tokens', 0)} action tokens of {len(records)} trajectories, {version_dir}"]
    lines.append(f"{'slice':12} {'tokens':>7} {'mean|d|':>9} {'p99|d|':>9} {'max|d|':>9} {'k3':>9} {'icepop':>7} {'dis':>7}")
    for label, stats in [("all", overall), *report["by_position"].items(), *report["by_status"].items()]:
        if stats.get("tokens"):
            lines.append(f"{label:12} {stats['tokens']:>7} {stats['mean_abs']:9.2e} {stats['p99_abs']:9.2e} {stats['max_abs']:9.2e} "
                         f"{stats['k3']:9.2e} {stats['icepop_kept']:7.1%} {stats['dis_kept']:7.1%}")
    print_summary(report, as_json=as_json, human="\n".join(lines))
    if failed:
        raise GlmpostError(f"{STAGE}: gate failed: {'; '.join(failed)} (report in {out / 'report.json'})")
