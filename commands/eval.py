"""Evaluate a checkpoint: sample --n responses per prompt, judge them, report avg@n, pass@k and maj@n.

PROMPTS are rollout prompts (JSONL with `prompt` or `messages`, `domain`, `task`; parquet, CSV or JSON
files or datasets directories, their columns named by --prompt-column etc. as in rollout; or shards). Every
prompt is sampled --n times with the rollout's sampling settings and engine (the embedded engine, or
--engine sglang|vllm --server URL,...) into OUT/rollout, and every response is judged by its domain's
verifier (math, count, env, --domains, --default-verifier; the judge's verifiers) into OUT/judged.

A sample is correct when its verifier score is at least --threshold (a failed judgement is
incorrect and counted in `failures`). Per prompt with c correct of n samples:


  avg@n  = c / n
  pass@k = 1 - C(n - c, k) / C(n, k)   (the unbiased estimator of Chen et al. 2021; each --k, default 1 and n)
  maj@n  = 1 when the most frequent answer among the n samples is correct (ties: the answer seen first);
           the answer is the verifier's canonical answer (math: the final answer as one string, equal
           for equal answers by --math-checker), else the whole response text; a sample without one
           does not vote

Each is averaged over the prompts of each domain and over all prompts, with the mean verifier score
(score_mean). OUT/report.json holds them (`overall`, `domains`), OUT/metrics.jsonl one line of the
same scalars (eval/METRIC, eval/DOMAIN/METRIC), OUT/stage.json the options. A rerun keeps the rollout
parts and judged shards that are complete (--overwrite redoes them) and writes the report again;
only --k, --threshold and how it runs (--batch-size, --device, ...) may differ from OUT/stage.json's.

--follow ROOT (instead of --checkpoint) evaluates every version of a checkpoint root as it is
published, for asynchronous RL or a loop of train-grpo runs: each version vNNNNNN (a multiple of
--every) into OUT/vNNNNNN/ as above, one OUT/metrics.jsonl line per version (policy_version, the
trackers' x-axis). It looks at the root every --poll-s seconds and stops after --idle-timeout
seconds without a new version (0: once every published version is evaluated), or on SIGTERM or
Ctrl-C between two versions; a restart skips the versions already evaluated.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.errors import UsageError
from glmpost.evaluation.follow import EvalFollowConfig, follow_eval
from glmpost.evaluation.run import EvalConfig, run_eval
from glmpost.kernel.sglang_client import without_api_key
from glmpost.rollout.settings import RolloutConfig

# The rollout settings that eval sets itself (--n is the group size; one task writes everything).
NOT_FROM_ROLLOUT = ("group_size", "shard_index", "num_shards", "refill_rounds")


@with_config(EvalFollowConfig)
@with_config(EvalConfig)
@with_config(RolloutConfig, exclude=NOT_FROM_ROLLOUT)
def eval_command(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., metavar="PROMPTS", help="Prompt JSONL, parquet, CSV or JSON files or datasets directories, or shards / shard directories / globs."),
    checkpoint: Optional[Path] = typer.Option(
        None, "--checkpoint", help="Policy checkpoint: a root (its LATEST) or a version directory; or --follow ROOT."),
    out: Path = typer.Option(..., "--out", help="Output directory: rollout/, judged/, report.json, metrics.jsonl, stage.json."),
    as_json: bool = json_option("the report"),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    follow = config_from(ctx, EvalFollowConfig)
    if (checkpoint is None) == (follow.follow is None):
        raise UsageError("give --checkpoint CKPT (evaluate it) or --follow ROOT (evaluate its versions as they come)")
    options = without_api_key(effective_options(ctx))
    if follow.follow is not None:
        summary = follow_eval(config_from(ctx, EvalConfig), follow, config_from(ctx, RolloutConfig), options=options)
        print_summary(summary, as_json=as_json, human=follow_table(summary))
        return
    summary = run_eval(config_from(ctx, EvalConfig), config_from(ctx, RolloutConfig), options=options)
    print_summary(summary["report"], as_json=as_json, human=table(summary))


def follow_table(summary: dict[str, Any]) -> str:
    """One line per version evaluated by this run."""
    lines = [f"{summary['out']}: {len(summary['evaluated'])} versions of {summary['root']} evaluated"]
    for name, overall in summary["reports"].items():
        lines.append(f"  {name}  " + "  ".join(f"{key} {value:.4f}" for key, value in overall.items()
                                              if isinstance(value, float) and not math.isnan(value)))
    return "\n".join(lines)


def table(summary: dict[str, Any]) -> str:
    """The report as a short table: one row overall, one per domain."""
    report = summary["report"]
    columns = [f"avg@{report['n']}", *[f"pass@{k}" for k in report["k"]], f"maj@{report['n']}", "score_mean"]
    rows = [("overall", report["overall"]), *report["domains"].items()]
    width = max(len(name or "(none)") for name, _ in rows)
    lines = [f"{summary['out']}: {summary['records']} samples, n = {report['n']}, policy v{report['policy_version']}",
             f"{'domain':<{width}}  {'prompts':>7}  " + "  ".join(f"{c:>10}" for c in columns)]
    for name, values in rows:
        cells = [values.get(c) for c in columns]
        lines.append(f"{name or '(none)':<{width}}  {values['prompts']:>7}  "
                     + "  ".join(f"{'n/a' if v is None or (isinstance(v, float) and math.isnan(v)) else f'{v:.4f}':>10}"
                                 for v in cells))
    return "\n".join(lines)
