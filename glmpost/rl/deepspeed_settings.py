"""The DeepSpeed config a training run uses: the user's ``--deepspeed`` file completed with the
trainer's optimizer, clipping, ZeRO stage and bounded buffers (what it must not hold refused)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from glmpost.config import ConfigError
from glmpost.memory.buckets import zero_bucket_elements

# DeepSpeed's buffers in elements. Its defaults (5e8-element reduce and all-gather buckets, up to 1e9
# gathered ZeRO-3 parameters kept live for reuse) hold a whole model of a few hundred million
# parameters on every rank: a 2-rank ZeRO-3 update of 252.7M float32 parameters peaked at 1.5x one
# process (benchmarks/bench_scale.py). These are the caps (80 MB of float32); a model gets 2 % of
# its size, at least 1e6 elements (glmpost.memory.buckets.zero_bucket_elements).
ZERO_BUFFERS = {"reduce_bucket_size": 20_000_000, "allgather_bucket_size": 20_000_000,
                "stage3_prefetch_bucket_size": 20_000_000, "stage3_max_live_parameters": 20_000_000,
                "stage3_max_reuse_distance": 20_000_000, "sub_group_size": 20_000_000}


def deepspeed_config(config: Any, *, zero_stage: int | None, path: Path | None, own_optimizer: bool = False,
                     parameters: int | None = None) -> dict:
    """The DeepSpeed config: the user's file if given, completed with the trainer's settings
    (``own_optimizer``: ``config``'s learning rate, weight decay and clipping win over the file's)
    and :data:`ZERO_BUFFERS` sized for a model of ``parameters`` (:func:`zero_bucket_elements`)."""
    ds: dict[str, Any] = {}
    if path is not None:
        try:
            ds = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError("{deepspeed_config} {path}: no such file", path=path) from None
        except json.JSONDecodeError as exc:
            raise ConfigError("{deepspeed_config} {path}: invalid JSON ({reason})", path=path, reason=exc) from None
    if zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = zero_stage
    ds.setdefault("zero_optimization", {"stage": 1})
    stage = ds["zero_optimization"].get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        source = "{deepspeed_config} {path}: zero_optimization.stage" if path is not None and zero_stage is None else "{zero_stage}"
        raise ConfigError(source + " {stage!r}: ZeRO stages are 0, 1, 2 and 3", path=path, stage=stage)
    if any(isinstance(ds.get(mode), dict) and ds[mode].get("enabled") for mode in ("bf16", "fp16")):
        raise ConfigError("{deepspeed_config} {path}: remove its bf16 / fp16 section; glmpost trains float32 master weights "
                          "and computes in bf16 with {precision} bf16", path=path)
    if "scheduler" in ds:  # it would step after each of glmpost's, which sets every step's rate first
        raise ConfigError("{deepspeed_config} {path}: remove its scheduler section; glmpost schedules the learning rate "
                          "({lr_schedule}, {lr_warmup_steps}, {lr_decay_steps}, {min_lr_ratio})", path=path)
    for key, value in ZERO_BUFFERS.items():  # a file's own sizes win
        ds["zero_optimization"].setdefault(key, zero_bucket_elements(parameters, value))
    ds.setdefault("train_micro_batch_size_per_gpu", 1)  # glmpost feeds its own micro-batches
    ds.setdefault("gradient_accumulation_steps", 1)
    ds["managed_gradient_accumulation"] = False
    ds.setdefault("gradient_clipping", config.grad_clip)
    ds.setdefault(
        "optimizer",
        {
            "type": "AdamW",
            "params": {
                "lr": config.lr,
                "betas": [config.adam_beta1, config.adam_beta2],
                "weight_decay": config.weight_decay,
                "torch_adam": True,
            },
        },
    )
    ds.setdefault("steps_per_print", 10**9)
    if own_optimizer:
        ds["optimizer"].setdefault("params", {}).update(lr=config.lr, weight_decay=config.weight_decay)
        ds["gradient_clipping"] = config.grad_clip
    return ds


@contextlib.contextmanager
def zero3_init(ds: dict):
    """transformers' ``from_pretrained`` partitions what it creates while this holds the config (a
    weak reference in transformers: dropping it ends the partitioning)."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig  # needs accelerate; DeepSpeed runs only

    held = HfDeepSpeedConfig(ds)
    try:
        yield
    finally:
        del held


def share_master_partitions(optimizer: Any) -> int:
    """Let DeepSpeed ZeRO-3's optimizer update the parameters' own float32 partitions instead of a
    second float32 copy of them; returns the elements no longer copied.

    ZeRO-3 keeps each rank's share of the parameters in flat buffers and, for the optimizer, a
    float32 master copy of each. When the parameters are float32 already (glmpost trains float32
    masters, autocast computing in bf16) DeepSpeed means to reuse them, but its check compares a
    ``torch.device`` with a device name string, which is never equal, so every rank holds its share
    twice. Shared here only while nothing has stepped (no optimizer state), without offload, and for
    buffers of the same dtype, device and size: the step then writes the parameters in place and
    its copy back to them is a copy onto itself."""
    low = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    high = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    inner = getattr(optimizer, "optimizer", None)
    if not low or not high or len(low) != len(high) or getattr(optimizer, "offload_optimizer", False) \
            or getattr(optimizer, "swap_optimizer", False) or inner is None or any(inner.state.values()):
        return 0
    shared = 0
    for params, masters in zip(low, high):
        if params is None or params is masters or params.data_ptr() == masters.data_ptr():
            continue
        if params.dtype == masters.dtype and params.device == masters.device and params.shape == masters.shape:
            masters.data = params.data
            shared += params.numel()
    return shared
