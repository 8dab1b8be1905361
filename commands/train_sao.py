"""Train the policy and its critic with SAO on judged rollout shards; publish the next version of both.

SAO, single-rollout asynchronous optimisation (brief, "SAO：一条轨迹完成就训练"): group size 1, so
every finished trajectory trains as it is, and a value model V_phi (the critic, --critic) restores
the baseline. One run is one update: the critic's values of the trajectories, the reward at each
trajectory's last action token, skip-observation GAE over the action tokens only (the last action
token of a turn bootstraps from the first of the next, observations never enter the recursion:
delta = r + gamma V(a_{i+1,0}) - V(a_{i,N}), A(a_{i,N}) = delta + gamma lambda A(a_{i+1,0})) giving
advantages and returns; then for every policy optimizer step, --critic-steps (K; the paper's 2)
critic optimizer steps on the same mini-batch (0.5 (V - R)^2, --value-clip optional), and the policy
step: the DIS mask (a token is kept iff 1 - eps-low < pi_theta / pi_rollout < 1 + eps-high on the
weights of that step), -r A on the kept tokens, the loss averaged over the mini-batch's trusted (or
all, --loss-denominator action) action tokens whatever the data-parallel split. The critic's
attention (and the DSA indexer) stays frozen, only its MLP / MoE projections and value head train;
--critic-train attention is the opt-out. Records with a NaN reward or a failed rollout are excluded
and counted; records without a reward are refused (run `glmpost judge` first).

Records that `rollout --compaction` compacted (CompactionRL) train as one example per context
window, each scored on exactly the rebuilt context the engine saw: GAE runs within each window (the
reward at its last action token, a summary's window ending with the summary), the policy's
advantages of window s are then scaled by (gamma * lambda)^N_later (N_later: the trajectory's
trainable tokens in later windows), and --loss-normalization token (the default) weighs every
trusted token the same. Metrics: compaction/* per step and one line per compacted segment (window,
trainable tokens, N_later, factor) after the steps'.

--critic ROOT is the critic's checkpoint root (`glmpost init-critic --from POLICY --out ROOT` makes
it; --init-critic makes it from --checkpoint when ROOT holds no version). The policy's new version
v(N+1) goes under --out and the critic trained with it under ROOT as v(N+1), each with LATEST,
stage.json (the critic's lists its frozen tensors), its optimizer state and metrics.jsonl. A critic
of another architecture or tokenizer is refused. --save-every / --resume / --overwrite, --follow
and DeepSpeed ZeRO (both models, under `deepspeed` or `torchrun`; a --deepspeed file's optimizer serves the critic
with --critic-lr, --critic-weight-decay and --critic-grad-clip) work as in train-grpo. Metrics
per step: sao/value_loss (after K - 1 critic steps; sao/value_loss_first before them),
sao/explained_variance, sao/advantage_mean/std, sao/return_mean/std, sao/value_mean,
sao/critic_optimizer_steps and sao/actor_optimizer_steps (counted by the optimizers), sao/critic_s
(the critic's share of the step), train/trusted_fraction (the DIS kept fraction), the policy
loss, reward mean, version-lag histogram and stale-dropped counts.
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
from glmpost.rl.follow import FollowConfig, follow_line
from glmpost.rl.follow_session import sao_follow
from glmpost.rl.run import RunOptions
from glmpost.rl.run_once import RunOnce
from glmpost.rl.sao import SAOConfig
from glmpost.rl.updates import sao_update

STAGE = "train-sao"


@with_config(FollowConfig)
@with_options(RunOptions, TRAINING_RUN_OPTIONS + ("reset_optimizer", "deterministic_topk") + LORA_OPTIONS)
@with_config(SAOConfig, exclude=('icepop', 'advantage_eps'))
def train_sao(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(None, help="Judged rollout shards (files, directories or globs); none with --follow."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Policy to update: a checkpoint root (its LATEST) or a version directory."),
    critic: Path = typer.Option(..., "--critic", help="The critic's checkpoint root: its LATEST is updated, the result published there as v(N+1)."),
    init_critic: bool = typer.Option(False, "--init-critic", help="Make the critic from --checkpoint (as `glmpost init-critic`, --seed seeds its head) when --critic holds no version."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the policy's new version v(N+1) and its LATEST pointer."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **shared: Any,
) -> None:
    follow = follow_from(ctx, FollowConfig, inputs, name="INPUTS", what="judged shards to train on")
    if follow is not None:
        summary = sao_follow(follow, checkpoint=checkpoint, out=out, critic_root=critic, init_critic=init_critic,
                             options=config_from(ctx, RunOptions), config=config_from(ctx, SAOConfig),
                             stage_options=effective_options(ctx))
        return print_summary(summary, as_json=as_json, human=follow_line(summary))
    with RunOnce(checkpoint, out, config_from(ctx, RunOptions), stage=STAGE) as run:
        summary = sao_update(run, inputs, config_from(ctx, SAOConfig), critic_root=critic, init_critic=init_critic,
                             stage_options=effective_options(ctx))
    report_update(summary, as_json=as_json, human=lambda s: (
        f"{s['out']}: policy v{s['policy_version']} from {run.parent.name} and critic {s['critic']}, {s['trained_records']} "
        f"of {s['records']} trajectories, reward mean {s['reward_mean']:.4f}, {s['steps']} policy step(s) after "
        f"{s['critic_steps']} critic step(s) each on {s['world_size']} rank(s), loss {s['loss']:.5f}, value loss {s['value_loss']:.5f}, "
        f"DIS kept {s['trusted_fraction']:.1%}"
    ))
