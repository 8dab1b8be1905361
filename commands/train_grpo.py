"""Train the policy with GRPO + IcePop on judged rollout shards; publish the next policy version.

One run is one policy update of GLM-5's Reasoning RL: group advantages (R - mean) / (std + eps) per
group_id; old log-probs of the exact rollout tokens recomputed by the training engine on the same
weights; the IcePop mask keeps a token iff 1/beta <= pi_train_old / pi_infer <= beta (a mask, not
a clamp); PPO clip eps_low / eps_high; the loss is averaged over the trusted action tokens of the
whole batch, so it does not depend on the data-parallel split. Records with a NaN reward or a
failed rollout are excluded and counted.

The new version (parent's policy version + 1) is written under --out (a checkpoint root) and LATEST
moves to it. A run interrupted after --save-every steps continues with --resume; a version that
already exists is not trained again. Multi-process training runs under `deepspeed` or `torchrun`
with DeepSpeed ZeRO (--zero-stage or --deepspeed ds.json); rank 0 alone writes files.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, report_update
from glmpost.rl.run import RunOptions, TrainingRun
from glmpost.rl.trainer import GRPOConfig
from glmpost.rl.updates import grpo_update

STAGE = "train-grpo"


def train_grpo(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., help="Judged rollout shards (files, directories or globs)."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Policy to update: a checkpoint root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the new version v(N+1) and its LATEST pointer."),
    lr: float = typer.Option(1e-6, "--lr", help="AdamW learning rate."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    epochs: int = typer.Option(1, "--epochs", min=1, help="Passes over the batch (PPO epochs)."),
    mini_batches: int = typer.Option(1, "--mini-batches", min=1, help="Optimizer steps per epoch (the batch is split into this many mini-batches)."),
    micro_batch_size: int = typer.Option(8, "--micro-batch-size", min=1, help="Trajectories per forward/backward on each rank (gradient accumulation)."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", min=0.0, help="Clip the global gradient norm to this; 0 disables."),
    eps_low: float = typer.Option(0.2, "--eps-low", help="PPO clip below 1 (GLM-5: 0.2)."),
    eps_high: float = typer.Option(0.28, "--eps-high", help="PPO clip above 1 (GLM-5: 0.28)."),
    icepop: bool = typer.Option(True, "--icepop/--no-icepop", help="Mask tokens whose train/infer probability ratio leaves [1/beta, beta]."),
    icepop_beta: float = typer.Option(2.0, "--icepop-beta", help="IcePop beta (GLM-5: 2)."),
    advantage_eps: float = typer.Option(1e-6, "--advantage-eps", help="eps in (R - mean) / (std + eps)."),
    kl_coef: float = typer.Option(0.0, "--kl-coef", min=0.0, help="Weight of the k3 KL to --ref-checkpoint (0 = off, the default)."),
    ref_checkpoint: Optional[Path] = typer.Option(None, "--ref-checkpoint", help="Reference policy for the KL term (default: --checkpoint)."),
    entropy_coef: float = typer.Option(0.0, "--entropy-coef", min=0.0, help="Entropy bonus weight (0 = off, the default)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Temperature of the log-probs; default: the one the records were sampled at."),
    chunk_size: int = typer.Option(512, "--chunk-size", min=1, help="Positions per chunk of the log-prob computation (bounds [chunk, V] memory)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the mini-batch shuffling."),
    reset_optimizer: bool = typer.Option(False, "--reset-optimizer", help="Start AdamW fresh instead of from the parent version's optimizer state."),
    zero_stage: Optional[int] = typer.Option(None, "--zero-stage", min=0, max=3, help="Train with DeepSpeed ZeRO at this stage (default under a multi-process launcher: 1)."),
    deepspeed_config: Optional[Path] = typer.Option(None, "--deepspeed", help="DeepSpeed JSON config (its optimizer, ZeRO and clipping settings are used)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda[:N] or npu[:N] (under a launcher: this rank's local device)."),
    deterministic_topk: bool = typer.Option(
        True, "--deterministic-topk/--torch-topk",
        help="DSA indexer top-k with ties to the lower position (the same keys in rollout and training); --torch-topk keeps torch.topk's tie order.",
    ),
    deterministic: bool = typer.Option(False, "--deterministic", help="Deterministic algorithms (torch, cuBLAS, HCCL switches)."),
    save_every: int = typer.Option(0, "--save-every", min=0, help="Save resumable training state every N optimizer steps (0 = only at the end)."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run from its saved state without repeating a step."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard an interrupted run's state and start the update over."),
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Optional[Path] = config_option(),
) -> None:
    run = TrainingRun(checkpoint, out, RunOptions(
        device=device, deterministic=deterministic, zero_stage=zero_stage, deepspeed_config=deepspeed_config,
        deterministic_topk=deterministic_topk, save_every=save_every, resume=resume, overwrite=overwrite,
        reset_optimizer=reset_optimizer,
    ))
    grpo = GRPOConfig(
        lr=lr, weight_decay=weight_decay, epochs=epochs, mini_batches=mini_batches, micro_batch_size=micro_batch_size,
        grad_clip=grad_clip, eps_low=eps_low, eps_high=eps_high, icepop=icepop, icepop_beta=icepop_beta,
        advantage_eps=advantage_eps, kl_coef=kl_coef, entropy_coef=entropy_coef, chunk_size=chunk_size, seed=seed,
    )
    summary = grpo_update(run, inputs, grpo, temperature=temperature, ref_checkpoint=ref_checkpoint,
                          stage_options=effective_options(ctx))
    report_update(summary, as_json=as_json, human=lambda s: (
        f"{s['out']}: policy v{s['policy_version']} from {run.parent.name}, {s['trained_records']} of {s['records']} trajectories, "
        f"reward mean {s['reward_mean']:.4f}, {s['steps']} step(s) on {s['world_size']} rank(s), "
        f"loss {s['loss']:.5f}, trusted {s['trusted_fraction']:.1%}"
    ))
