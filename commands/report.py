"""Write a run report: one static HTML page (OUT/report.html) with PNG plots of the curves people look
at, for one run or several side by side (one line per run on each plot, the legend naming it).

A RUN_DIR is a directory of glmpost outputs (a pipeline's folder, a checkpoint root or one of its
versions, a rollout or eval output); every metrics.jsonl under it is read. A checkpoint root's holds
the trainer's history: reward (train/reward_mean), trusted fraction (train/trusted_fraction: the
IcePop / DIS mask's kept share), version lag (from train/version_lag/N), train / rollout log-prob
mismatch (train/mismatch_*), learning rate (train/lr, sft/lr) and loss (train/loss, sft/loss),
drawn against the optimizer step over all its versions. Rollout, judge and eval outputs give
response lengths (rollout/response_length_*), the judged reward (judge/reward_mean) and eval's
avg@n, pass@k, maj@n and score, drawn against the policy version. A run with several checkpoint
roots has a line per root (with the outputs it trained on, followed through the stage.json inputs,
and those made with it as --checkpoint, such as its evals) and one for the rest. A plot no run has
keys for is left out, and the page says so.

The page also holds a table of each line's last values and each run's files and stage.json options;
the PNGs lie beside it. OUT/metrics.jsonl holds one line (what was plotted), OUT/stage.json the
options; a rerun writes the report again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.report.run import ReportConfig, run_report


@with_config(ReportConfig)
def report(
    ctx: typer.Context,
    runs: List[Path] = typer.Argument(..., metavar="RUN_DIR", help="Directories of glmpost outputs, one line each per plot."),
    out: Path = typer.Option(..., "--out", help="Output directory: report.html, its PNGs, metrics.jsonl, stage.json."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    summary = run_report(config_from(ctx, ReportConfig), options=effective_options(ctx))
    left = f"; not plotted (no run has their keys): {', '.join(summary['not_plotted'])}" if summary["not_plotted"] else ""
    print_summary(summary, as_json=as_json, human=(
        f"{summary['page']}: {len(summary['plots'])} plots of {len(summary['runs'])} run(s) "
        f"({', '.join(summary['lines'])}){left}"))
