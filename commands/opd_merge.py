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

Same machinery as train-grpo: old log-probs recomputed on the same weights, IcePop mask, PPO clip,
a loss averaged over the batch's trusted action tokens whatever the data-parallel split, DeepSpeed
ZeRO under `deepspeed`/`torchrun`, the new version under --out with LATEST moved to it, --resume
after an interruption, metrics.jsonl beside the version and in the root.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, report_update
from glmpost.errors import UsageError
from glmpost.rl.run import RunOptions, TrainingRun
from glmpost.rl.trainer import OPD_LOSSES, OPDConfig
from glmpost.rl.updates import opd_update

STAGE = "opd-merge"


def opd_merge(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., help="Teacher-scored rollout shards (`glmpost score-teacher` output)."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Student to update: a checkpoint root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the new version v(N+1) and its LATEST pointer."),
    loss: str = typer.Option("sampled", "--loss", help="sampled: OPD advantage in the policy-gradient loss; topk: MOPD top-k reverse KL."),
    task_advantage_weight: float = typer.Option(
        0.0, "--task-advantage-weight", min=0.0, help="Weight of the GRPO task advantage added to the OPD advantage (needs judged shards; 0 = pure distillation)."
    ),
    topk_correction: bool = typer.Option(
        True, "--topk-correction/--no-topk-correction", help="Add MOPD's pi_T - pi_theta term to the top-k loss (the optimum is then teacher = student on the set)."
    ),
    lr: float = typer.Option(1e-6, "--lr", help="AdamW learning rate."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    epochs: int = typer.Option(1, "--epochs", min=1, help="Passes over the batch."),
    mini_batches: int = typer.Option(1, "--mini-batches", min=1, help="Optimizer steps per epoch (the batch is split into this many mini-batches)."),
    micro_batch_size: int = typer.Option(8, "--micro-batch-size", min=1, help="Trajectories per forward/backward on each rank (gradient accumulation)."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", min=0.0, help="Clip the global gradient norm to this; 0 disables."),
    eps_low: float = typer.Option(0.2, "--eps-low", help="PPO clip below 1 (GLM-5: 0.2)."),
    eps_high: float = typer.Option(0.28, "--eps-high", help="PPO clip above 1 (GLM-5: 0.28)."),
    icepop: bool = typer.Option(True, "--icepop/--no-icepop", help="Mask tokens whose train/infer probability ratio leaves [1/beta, beta]."),
    icepop_beta: float = typer.Option(2.0, "--icepop-beta", help="IcePop beta (GLM-5: 2)."),
    advantage_eps: float = typer.Option(1e-6, "--advantage-eps", help="eps in the task advantage (R - mean) / (std + eps)."),
    entropy_coef: float = typer.Option(0.0, "--entropy-coef", min=0.0, help="Entropy bonus weight (0 = off, the default)."),
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
    if loss not in OPD_LOSSES:
        raise UsageError(f"--loss {loss!r}: expected one of {', '.join(OPD_LOSSES)}")
    run = TrainingRun(checkpoint, out, RunOptions(
        device=device, deterministic=deterministic, zero_stage=zero_stage, deepspeed_config=deepspeed_config,
        deterministic_topk=deterministic_topk, save_every=save_every, resume=resume, overwrite=overwrite,
        reset_optimizer=reset_optimizer,
    ))
    opd = OPDConfig(
        lr=lr, weight_decay=weight_decay, epochs=epochs, mini_batches=mini_batches, micro_batch_size=micro_batch_size,
        grad_clip=grad_clip, eps_low=eps_low, eps_high=eps_high, icepop=icepop, icepop_beta=icepop_beta,
        advantage_eps=advantage_eps, entropy_coef=entropy_coef, chunk_size=chunk_size, seed=seed,
        loss=loss, task_advantage_weight=task_advantage_weight, topk_correction=topk_correction,
    )
    summary = opd_update(run, inputs, opd, stage_options=effective_options(ctx))

    def human(s: dict) -> str:
        text = (f"{s['out']}: student v{s['policy_version']} from {run.parent.name}, {s['trained_records']} of {s['records']} "
                f"trajectories, {s['steps']} step(s) on {s['world_size']} rank(s), {loss} loss {s['loss']:.5f}, "
                f"trusted {s['trusted_fraction']:.1%}")
        for domain, value in sorted(s["teacher_kl"].items()):
            text += (f"\n  {domain}: teacher {', '.join(s['teachers'].get(domain, {}))}, "
                     f"sampled reverse KL before the update {value:.4f}")
        return text

    report_update(summary, as_json=as_json, human=human)
