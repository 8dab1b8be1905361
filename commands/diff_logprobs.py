"""Measure how far two numerical paths' log-probs are apart on the same action tokens.

Path A is always the trainer's forward of --checkpoint (in --dtype, on --device, with its DSA
top-k rule and --attention). Path B is, by what you pass:

\b
  (shards only)    the rollout_log_probs the engine recorded (the IcePop view);
  --against CKPT   another checkpoint, e.g. the FP8 / W4A16 rollout checkpoint
                   (dequantized);
  --against-dtype, --against-device, --against-topk, --against-attention,
  --against-batch-size
                   the same checkpoint in another dtype, device, DSA top-k
                   rule, GLM-5 attention (native / reference) or batch size;
  --against-server URL
                   a `glmpost serve` / SGLang server (prefill log-probs;
                   --api-key KEY if it wants one, never recorded);
                   --against-engine vllm: a vLLM (or vLLM-Ascend) server's
                   prompt_logprobs.

delta = log p_A - log p_B per action token. Reports mean / p50 / p99 / max |delta|, k1 and k3
estimates of KL(p_B || p_A), the fraction IcePop keeps at --icepop-beta and DIS at --dis-low/--dis-high,
sampled-token agreement (both paths resample every action position with the record's own seeded
uniforms; the fraction where they pick the same token), a breakdown by response position and by
status, and the worst tokens with their decoded context. --indexer also compares the GLM-5 DSA
indexer's selected key sets between two local paths (mean Jaccard, identical sets and orders,
boundary ties). --routing compares each action token's MoE experts (per layer) between the record
(rollout --record-routing) and path A: the fraction that differ per layer and overall, path A's
router-score margin at the k-th expert where they differ, and the log-prob delta of those tokens
beside the rest's; --routing-replay makes path A route every recorded token to the record's
experts (R3, as the trainers' --routing-replay). Writes DIR/report.json, plots (delta_hist.png, abs_delta_vs_position.png,
scatter.png), DIR/metrics.jsonl and DIR/stage.json; prints a table (or --json).

--by-version ROOT (against the rollout log-probs) separates the two ratios asynchronous RL mixes:
each action token is re-scored with the checkpoint of the version that sampled it (ROOT keeps
them), so per version lag (A's version - v) the report gives the pure engine mismatch
(log pi_v - log pi_rollout) apart from the lag effect (log pi_A - log pi_v), and the fractions DIS
and IcePop keep.

Records of a rollout that kept KV caches across a weight switch (rollout --follow --kv-on-switch
keep; extra.kv_cache.stale_turns) get the slices kv-fresh / kv-stale: the tokens sampled on keys
and values an older version computed, apart from the rest (with --by-version, their engine
mismatch at the version that sampled them).

--fail-above METRIC=VALUE turns it into a CI gate: exit 1 when the metric exceeds the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.commands.options import config_from, json_option, with_config, with_deprecated_aliases
from glmpost.config import ConfigError
from glmpost.diff.report import diff_table
from glmpost.diff.run import STAGE, DiffConfig, LogprobDiff
from glmpost.kernel.sglang_client import check_api_key, without_api_key


@with_deprecated_aliases({"beta": "icepop_beta", "eps_low": "dis_low", "eps_high": "dis_high"})
@with_config(DiffConfig)
def diff_logprobs(
    ctx: typer.Context,
    inputs: list[str] = typer.Argument(..., help="Trajectory shards (files, directories or globs); without --against* they need rollout_log_probs."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Path A: the trainer's weights, a root (its LATEST) or a version."),
    out: Path = typer.Option(..., "--out", help="Directory for report.json, plots, metrics.jsonl and stage.json (created; never silently replaced)."),
    as_json: bool = json_option("the report"),
    config: Path | None = config_option(),
    **settings: Any,
) -> None:
    api_key = ctx.params["api_key"]
    overwrite = ctx.params["overwrite"]
    check_api_key(api_key)  # before path A is scored
    diff = LogprobDiff(config_from(ctx, DiffConfig))
    report = diff.measure()
    options = without_api_key(effective_options(ctx))
    with staged_output_dir(out, overwrite=overwrite, complete_marker="stage.json", stage=STAGE,
                           options=options) as staging:
        if staging is None:
            raise ConfigError("{out} {out_dir} already holds a report; pass {overwrite} to replace it", out_dir=out)
        diff.write(staging, options)
    print_summary(report, as_json=as_json, human=diff_table(report, out))
    diff.check_gates()
