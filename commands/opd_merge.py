"""Train the student on teacher-scored rollout shards with on-policy distillation (OPD / MOPD); publish v(N+1).

The advantage of each sampled action token is the teacher's log-ratio (brief, "OPD：把教师变成逐 token
优势"): A_t = sg(log pi_T(y_t|s_t) - log pi_theta(y_t|s_t)), with log pi_theta recomputed by the
training engine on the weights before the update; group size 1, policy-gradient form (--loss
sampled), plus --task-advantage-weight times the GRPO group advantage of the judged reward if given.
--loss topk minimises the reverse KL over the teacher's top-k set with the MOPD correction
pi_T(v) - pi_theta(v) (shards from `score-teacher --payload topk`). Observation tokens never enter
the loss. One batch may mix domains routed to different teachers (MOPD, cross-stage OPD); every step's
metrics carry teacher_kl/<domain> (mean log pi_theta - log pi_T over that domain's action tokens,
before the update), so a lagging capability shows.

Same machinery as train-grpo: old log-probs recomputed on the same weights, of the distribution
the records' rollout_log_probs are of (sampling.log_prob_kind, temperature, top-k, top-p; greedy
records refused), IcePop mask, PPO clip, a loss averaged over the batch's trusted (or, with
--loss-denominator action, all) action tokens whatever the data-parallel split, DeepSpeed
ZeRO under `deepspeed`/`torchrun`, the new version under --out with LATEST moved to it, --resume
after an interruption, metrics.jsonl beside the version and in the root.

--follow SPOOL consumes teacher-scored shards from a spool as they land (asynchronous OPD): one
update per --follow-records records on a trainer kept in memory, a version every --publish-every
updates, each trajectory id trained at most once, exactly as `train-grpo --follow` (see its --help
and formats/SPEC.md §12).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary, report_update
from glmpost.commands.options import (
    LORA_OPTIONS,
    TRAINING_RUN_OPTIONS,
    config_from,
    follow_from,
    json_option,
    with_config,
    with_options,
)
from glmpost.errors import UsageError
from glmpost.rl.configs import OPD_LOSSES, OPDConfig
from glmpost.rl.follow import FollowConfig, follow_line
from glmpost.rl.follow_session import opd_follow
from glmpost.rl.run import RunOptions
from glmpost.rl.run_once import RunOnce
from glmpost.rl.updates import opd_update

STAGE = "opd-merge"


@with_config(FollowConfig)
@with_options(RunOptions, TRAINING_RUN_OPTIONS + ("reset_optimizer", "deterministic_topk") + LORA_OPTIONS)
@with_config(OPDConfig, exclude=('loss_normalization',))
def opd_merge(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(None, help="Teacher-scored rollout shards (`glmpost score-teacher` output); none with --follow."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Student to update: a checkpoint root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the new version v(N+1) and its LATEST pointer."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **shared: Any,
) -> None:
    loss = ctx.params["loss"]
    if loss not in OPD_LOSSES:
        raise UsageError(f"--loss {loss!r}: expected one of {', '.join(OPD_LOSSES)}")
    follow = follow_from(ctx, FollowConfig, inputs, name="INPUTS", what="teacher-scored shards to train on")
    if follow is not None:
        summary = opd_follow(follow, checkpoint=checkpoint, out=out, options=config_from(ctx, RunOptions),
                             config=config_from(ctx, OPDConfig), stage_options=effective_options(ctx))
        return print_summary(summary, as_json=as_json, human=follow_line(summary))
    with RunOnce(checkpoint, out, config_from(ctx, RunOptions), stage=STAGE) as run:
        summary = opd_update(run, inputs, config_from(ctx, OPDConfig), stage_options=effective_options(ctx))

    def human(s: dict) -> str:
        text = (f"{s['out']}: student v{s['policy_version']} from {run.parent.name}, {s['trained_records']} of {s['records']} "
                f"trajectories, {s['steps']} step(s) on {s['world_size']} rank(s), {loss} loss {s['loss']:.5f}, "
                f"trusted {s['trusted_fraction']:.1%}")
        for domain, value in sorted(s["teacher_kl"].items()):
            text += (f"\n  {domain}: teacher {', '.join(s['teachers'].get(domain, {}))}, "
                     f"sampled reverse KL before the update {value:.4f}")
        return text

    report_update(summary, as_json=as_json, human=human)
