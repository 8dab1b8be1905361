"""Train the policy with GRPO + IcePop on judged rollout shards; publish the next policy version.

One run is one policy update of GLM-5's Reasoning RL: group advantages (R - mean) / (std + eps) per
group_id; old log-probs of the exact rollout tokens recomputed by the training engine on the same
weights; the IcePop mask keeps a token iff 1/beta <= pi_train_old / pi_infer <= beta (a mask, not
a clamp); PPO clip eps_low / eps_high; the loss is averaged over the whole batch's trusted action
tokens (--loss-denominator trusted: the survivors of a heavy mask are up-weighted) or all its
action tokens (action), so it does not depend on the data-parallel split. Records with a NaN
reward or a failed rollout are excluded and counted.

Records that `rollout --compaction` compacted (CompactionRL) train as one example per context
window, each scored on exactly the rebuilt context the engine saw (the pairs it copied are
context, never trained twice; the policy's summaries are actions); every window takes the
trajectory's advantage, times --segment-decay^N_later (N_later: the trajectory's trainable tokens
in later windows; 1 = off). --loss-normalization token (CompactionRL's, the default) weighs every
trusted token the same, so a trajectory compacted into more windows is not up-weighted; segment
averages each window first. Metrics: compaction/* per step (trajectories compacted, compactions,
segments, trainable tokens per segment, the factor's range) and one line per compacted segment
(window, trainable tokens, N_later, factor) after the steps'.

Every log-prob the trainer computes is of the distribution the records' rollout_log_probs are of
(their sampling.log_prob_kind at their temperature, top-k and top-p: a top-k / top-p rollout is
scored under the same truncated, renormalised distribution; SGLang's pre-filter log-probs under
the tempered one), so IcePop compares like with like. Greedy records (temperature 0), records
that differ in these settings, and records of another policy version than --checkpoint (unless
--max-version-lag accepts the lag) are refused.

The new version (parent's policy version + 1) is written under --out (a checkpoint root) and LATEST
moves to it. A run interrupted after --save-every steps continues with --resume; a version that
already exists is not trained again. Multi-process training runs under `deepspeed` or `torchrun`
with DeepSpeed ZeRO (--zero-stage or --deepspeed ds.json); rank 0 alone writes files.

--follow SPOOL makes it a long-running stage of asynchronous RL: it claims judged shards from the
spool as they land (oldest first), trains one update per --follow-records records on a model it
keeps in memory (set up once from --out's newest version, the --checkpoint before the first), and
publishes a version every --publish-every updates (--reset-optimizer then starts AdamW fresh after
each). Each batch is committed exactly once by trajectory id: the version's glmpost.json lists the
shards and ids it trained, then the spool's ledger and done/ area record them; a record trained
before is skipped, a batch with nothing left to train is committed as dropped. Staleness and DIS
are this stage's --max-staleness, --max-version-lag and --trust-mask, in published versions; the
KL reference is --ref-checkpoint or the version the run started from. A crash loses the updates
since the last version (a restart trains them again and finishes an interrupted commit); its lease
(--lease-s) returns a dead trainer's claims to the spool. It stops on SIGTERM / SIGINT after the
update in progress, at --max-steps updates or --max-versions versions, or after --idle-timeout
seconds without a new shard, publishing the updates since the last version first; unused claims go
back to ready/. The published version is the unit of durability, so --save-every, --resume and
--overwrite do not apply there. Metrics (root metrics.jsonl, follow/*): per version the staleness histogram
(version_lag/L), records trained, stale-dropped count, queue depth and idle fraction; per dropped
batch its records' lengths and rewards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary, report_update
from glmpost.commands.options import (
    LORA_OPTIONS,
    TRAINING_RUN_OPTIONS,
    bounded,
    config_from,
    follow_from,
    json_option,
    with_config,
    with_options,
)
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.follow import FollowConfig, follow_line
from glmpost.rl.follow_session import grpo_follow
from glmpost.rl.run import RunOptions
from glmpost.rl.run_once import RunOnce
from glmpost.rl.updates import grpo_update

STAGE = "train-grpo"


@with_config(FollowConfig)
@with_options(RunOptions, TRAINING_RUN_OPTIONS + ("reset_optimizer", "deterministic_topk") + LORA_OPTIONS)
@with_config(GRPOConfig)
def train_grpo(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(None, help="Judged rollout shards (files, directories or globs); none with --follow."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Policy to update: a checkpoint root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the new version v(N+1) and its LATEST pointer."),
    ref_checkpoint: Optional[Path] = typer.Option(None, "--ref-checkpoint", help="Reference policy for the KL term (default: --checkpoint)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Temperature of the log-probs; default: the one the records were sampled at (their log-prob kind, top-k and top-p always apply).", callback=bounded(above=0.0)),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **shared: Any,
) -> None:
    follow = follow_from(ctx, FollowConfig, inputs, name="INPUTS", what="judged shards to train on")
    if follow is not None:
        summary = grpo_follow(follow, checkpoint=checkpoint, out=out, options=config_from(ctx, RunOptions),
                              config=config_from(ctx, GRPOConfig), temperature=temperature, ref_checkpoint=ref_checkpoint,
                              stage_options=effective_options(ctx))
        return print_summary(summary, as_json=as_json, human=follow_line(summary))
    with RunOnce(checkpoint, out, config_from(ctx, RunOptions), stage=STAGE) as run:
        summary = grpo_update(run, inputs, config_from(ctx, GRPOConfig), temperature=temperature,
                              ref_checkpoint=ref_checkpoint, stage_options=effective_options(ctx))
    report_update(summary, as_json=as_json, human=lambda s: (
        f"{s['out']}: policy v{s['policy_version']} from {run.parent.name}, {s['trained_records']} of {s['records']} trajectories, "
        f"reward mean {s['reward_mean']:.4f}, {s['steps']} step(s) on {s['world_size']} rank(s), "
        f"loss {s['loss']:.5f}, trusted {s['trusted_fraction']:.1%}"
    ))
