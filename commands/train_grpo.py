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

import json
import math
import shutil
from pathlib import Path
from typing import List, Optional

import typer
from tqdm import tqdm

from glmpost.checkpoints import (
    CheckpointManifest,
    NextVersion,
    load_model,
    load_tokenizer,
)
from glmpost.commands.common import (
    config_option,
    effective_options,
    log,
    print_summary,
    skip_published,
    write_stage_json,
)
from glmpost.rl.distributed import TrainingSession
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import ShardReader, require_fields, resolve_shard_paths
from glmpost.rl.trainer import GRPOConfig, GRPOTrainer, prepare_batch

STAGE = "train-grpo"


def read_judged_records(inputs: List[str], revision: str) -> tuple[list[dict], float | None]:
    """Every record of the inputs; they must carry rollout fields and rewards, and match ``revision``."""
    records, temperatures = [], set()
    for path in resolve_shard_paths(inputs):
        for index, record in enumerate(ShardReader(path)):
            where = f"{STAGE}: {path}: record {index}"
            require_fields(record, ["rollout_log_probs", "sampling"], where=where)
            require_fields(record, ["reward"], where=where)
            if record["tokenizer_revision"] != revision:
                raise GlmpostError(
                    f"{where}: tokenizer revision {record['tokenizer_revision']} differs from the checkpoint's {revision}"
                )
            temperatures.add(float(record["sampling"].get("temperature", 1.0)))
            records.append(record)
    if not records:
        raise GlmpostError(f"{STAGE}: no records in {' '.join(inputs)}")
    if len(temperatures) > 1:
        raise GlmpostError(f"{STAGE}: records were sampled at different temperatures {sorted(temperatures)}; train them separately")
    return records, temperatures.pop()


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
    plan = begin_update(checkpoint, out, resume=resume, overwrite=overwrite, as_json=as_json)
    if plan is None:
        return
    parent, version, target = plan.parent, plan.version, plan.target

    tokenizer, revision = load_tokenizer(parent)
    records, sampled_temperature = read_judged_records(inputs, revision)
    grpo = GRPOConfig(
        lr=lr, weight_decay=weight_decay, epochs=epochs, mini_batches=mini_batches, micro_batch_size=micro_batch_size,
        grad_clip=grad_clip, eps_low=eps_low, eps_high=eps_high, icepop=icepop, icepop_beta=icepop_beta,
        advantage_eps=advantage_eps, kl_coef=kl_coef, entropy_coef=entropy_coef,
        temperature=temperature if temperature is not None else sampled_temperature, chunk_size=chunk_size, seed=seed,
    )
    try:
        grpo.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if temperature is not None and not math.isclose(temperature, sampled_temperature):
        log(f"warning: --temperature {temperature} differs from the sampling temperature {sampled_temperature}; "
            "IcePop will compare different distributions")

    batch = prepare_batch(records, advantage_eps=grpo.advantage_eps)
    if not batch.examples:
        raise GlmpostError(f"{STAGE}: no usable records (excluded: {batch.excluded})")
    step_metrics = {
        "train/reward_mean": float(batch.rewards.mean()),
        "train/reward_std": float(batch.rewards.std()),
        "train/zero_advantage_groups": batch.zero_advantage_groups,
        "train/groups": batch.groups,
        "train/excluded_nan_reward": batch.excluded["nan_reward"],
        "train/excluded_status": batch.excluded["status"],
        "train/policy_version": version,
    }
    result = run_policy_update(
        ctx, stage=STAGE, plan=plan, tokenizer=tokenizer, revision=revision, config=grpo, trainer_cls=GRPOTrainer,
        examples=batch.examples, step_metrics=step_metrics, device=device, deterministic=deterministic,
        zero_stage=zero_stage, deepspeed_config=deepspeed_config, deterministic_topk=deterministic_topk,
        ref_checkpoint=ref_checkpoint, reset_optimizer=reset_optimizer, save_every=save_every, resume=resume,
        overwrite=overwrite, manifest_extra={"records": len(records), "trained_records": len(batch.examples)},
        stage_extra={"excluded": batch.excluded, "zero_advantage_groups": batch.zero_advantage_groups},
    )
    if result is None:
        return
    history, world_size, steps = result
    last = history[-1] if history else {}
    summary = {
        "out": str(target),
        "policy_version": version,
        "parent": str(parent),
        "records": len(records),
        "trained_records": len(batch.examples),
        "excluded": batch.excluded,
        "zero_advantage_groups": batch.zero_advantage_groups,
        "reward_mean": float(batch.rewards.mean()),
        "steps": steps,
        "world_size": world_size,
        "loss": last.get("train/loss"),
        "trusted_fraction": last.get("train/trusted_fraction"),
    }
    human = (
        f"{target}: policy v{version} from {parent.name}, {len(batch.examples)} of {len(records)} trajectories, "
        f"reward mean {summary['reward_mean']:.4f}, {summary['steps']} step(s) on {world_size} rank(s), "
        f"loss {summary['loss']:.5f}, trusted {summary['trusted_fraction']:.1%}"
    )
    print_summary(summary, as_json=as_json, human=human)


# --------------------------------------------------------------------------------------------
# The policy-update machinery train-grpo shares with opd-merge


def begin_update(checkpoint: Path, out: Path, *, resume: bool, overwrite: bool, as_json: bool) -> NextVersion | None:
    """Where the update publishes; None (after reporting the skip) when that version already exists."""
    plan = NextVersion.plan(checkpoint, out)
    if skip_published(plan.target, plan.version, as_json=as_json):
        return None
    if plan.staging.exists() and not (resume or overwrite):
        raise UsageError(f"an interrupted run left {plan.staging}; pass --resume to continue it or --overwrite to start over")
    return plan


def run_policy_update(
    ctx: typer.Context,
    *,
    stage: str,
    plan: NextVersion,
    tokenizer,
    revision: str,
    config: GRPOConfig,
    trainer_cls: type,
    examples: list,
    step_metrics: dict,
    device: str,
    deterministic: bool,
    zero_stage: Optional[int],
    deepspeed_config: Optional[Path],
    deterministic_topk: bool,
    ref_checkpoint: Optional[Path],
    reset_optimizer: bool,
    save_every: int,
    resume: bool,
    overwrite: bool,
    manifest_extra: dict,
    stage_extra: dict,
) -> tuple[list[dict], int, int] | None:
    """Train ``examples`` with ``trainer_cls`` (a :class:`GRPOTrainer`) on this process's rank and publish
    the new version: DeepSpeed session, parent optimizer state, old log-probs before any resume,
    per-step metrics (``step_metrics`` added to each), resumable state every ``save_every`` steps,
    ``stage.json``, the manifest and ``LATEST``. Returns ``(history, world size, steps)`` on rank 0,
    None on the other ranks."""
    parent, version, root, staging = plan.parent, plan.version, plan.root, plan.staging
    resume_state = staging / "trainer_state" / "resume.pt"
    session = TrainingSession.start(device=device, deterministic=deterministic, zero_stage=zero_stage, deepspeed_config=deepspeed_config)
    model = load_model(parent, device=session.device, dtype="float32" if session.device.type == "cpu" else None,
                       deterministic_topk=deterministic_topk)
    reference = None
    if config.kl_coef > 0:
        reference = load_model(ref_checkpoint or parent, device=session.device, deterministic_topk=deterministic_topk)
    backend = session.backend(model, config)
    optimizer_state = parent / "trainer_state" / "optimizer.pt"
    if not reset_optimizer and not (resume and resume_state.exists()):
        backend.load_optimizer(optimizer_state)
    trainer = trainer_cls(model, config, pad_token_id=tokenizer.pad_token_id, backend=backend, reference=reference)

    options = effective_options(ctx)
    start_step, history = 0, []
    if session.is_main:
        if staging.exists() and overwrite:
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
    session.barrier()
    metrics_path = staging / "metrics.jsonl"
    prepared = trainer.prepare(examples)  # old log-probs on the parent's weights, before any resume
    if resume and resume_state.exists():
        start_step, history = backend.load_resume_state(resume_state)
        log(f"resuming at optimizer step {start_step} of {trainer.total_steps()}")
        if session.is_main:  # drop lines of steps that ran after the last saved state
            metrics_path.write_text("".join(json.dumps(m, sort_keys=True) + "\n" for m in history))

    progress = tqdm(total=trainer.total_steps(), initial=start_step, desc=stage, unit="step", leave=False,
                    disable=None if session.is_main else True)

    def on_step(step: int, metrics: dict) -> None:
        metrics.update(step_metrics)
        history.append(metrics)
        if session.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
        progress.update(1)
        if save_every and (step + 1) % save_every == 0 and step + 1 < trainer.total_steps():
            backend.save_resume_state(resume_state, step + 1, history)

    with progress:
        trainer.train(prepared, start_step=start_step, on_step=on_step)

    manifest = CheckpointManifest(
        policy_version=version, tokenizer_revision=revision, stage=stage, step=trainer.total_steps(),
        parent=str(parent), extra=manifest_extra,
    )
    backend.save_model(staging)
    backend.save_optimizer(staging / "trainer_state" / "optimizer.pt")
    if session.is_main:
        resume_state.unlink(missing_ok=True)
        write_stage_json(staging, stage, options, parent=str(parent), world_size=session.world_size, **stage_extra)
        plan.publish(manifest)
        with open(root.path / "metrics.jsonl", "a") as f:  # the run's history across versions
            for metrics in history:
                f.write(json.dumps(metrics, sort_keys=True) + "\n")
    session.barrier()
    session.close()
    if not session.is_main:
        return None
    return history, session.world_size, trainer.total_steps()
