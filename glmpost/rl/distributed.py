"""Training processes: one local process, or DeepSpeed ZeRO ranks under ``deepspeed``/``torchrun``.

A :class:`TrainingSession` reads the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), resolves this rank's device and the distributed backend for it (hccl / nccl /
gloo), and builds the optimisation backend the trainer calls: :class:`TorchBackend` (torch AdamW) or
:class:`DeepSpeedBackend` (ZeRO 0-3). Both expose the same methods, so the trainer's loss code is
the same in one process and in many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmpost.config import ConfigError, SettingError, setting
from glmpost.errors import GlmpostError
from glmpost.memory.process import release_freed_memory, trim_heap
from glmpost.npu import distributed_backend, resolve_device, set_deterministic
from glmpost.rl.deepspeed_settings import deepspeed_config, share_master_partitions, zero3_init
from glmpost.rl.precision import compute_context, resolve_precision, save_weights
from glmpost.rl.schedules import LR_SCHEDULES, scheduled_lr
from glmpost.rl.sharded_save import DEFAULT_SHARD_BYTES, save_partitioned


@dataclass
class OptimizerConfig:
    """What the optimisation backends read (AdamW and gradient clipping); trainer configs extend it."""

    lr: float = setting(1e-6, "AdamW learning rate.")
    weight_decay: float = setting(0.0, "AdamW weight decay.")
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = setting(1.0, "Clip the global gradient norm to this; 0 disables.", min=0.0)
    lr_schedule: str = setting("constant", "After the warmup: constant, linear or cosine decay of the learning rate "
                               "to --lr x --min-lr-ratio at --lr-decay-steps (counted in optimizer steps across "
                               "versions, as the optimizer state carries them).")
    lr_warmup_steps: int = setting(0, "Optimizer steps of linear warmup: step s takes --lr x (s+1)/N.", min=0)
    lr_decay_steps: int = setting(0, "The optimizer step a linear or cosine decay ends at (warmup included); "
                                  "needed by both.", min=0)
    min_lr_ratio: float = setting(0.0, "The learning rate a decay ends at, as a fraction of --lr.", min=0.0, max=1.0)

    def validate(self) -> None:
        """Every field within the ``min`` / ``max`` its setting declares (the bounds the command line
        enforces too), and the rules a bound cannot say; subclasses add theirs."""
        self._require({"lr": self.lr > 0, "lr_schedule": self.lr_schedule in LR_SCHEDULES,
                       "lr_decay_steps": self.lr_schedule == "constant" or self.lr_decay_steps > self.lr_warmup_steps},
                      lr="> 0")
        for f in dataclasses.fields(self):
            low, high, value = f.metadata.get("min"), f.metadata.get("max"), getattr(self, f.name)
            if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
                raise SettingError(f.name, value, "is out of range: must be " + (
                    f"in [{low:g}, {high:g}]" if low is not None and high is not None else
                    f">= {low:g}" if low is not None else f"<= {high:g}"))

    def _require(self, checks: dict[str, bool], **ranges: str) -> None:
        """Refuse the first of ``checks`` (field -> whether its value is good) that fails; ``ranges``:
        the range a field must be in, as the message says it (``lr="> 0"``)."""
        reasons = {"lr_schedule": f"is not one of {', '.join(LR_SCHEDULES)}",
                   "lr_decay_steps": f"must be above the warmup's {self.lr_warmup_steps} steps for a {self.lr_schedule} decay",
                   **{name: f"is out of range: must be {bound}" for name, bound in ranges.items()}}
        for name, ok in checks.items():
            if not ok:
                raise SettingError(name, getattr(self, name), reasons.get(name, "is out of range"))

    def learning_rate(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (:func:`glmpost.rl.schedules.scheduled_lr`)."""
        return scheduled_lr(step, lr=self.lr, schedule=self.lr_schedule, warmup_steps=self.lr_warmup_steps,
                            decay_steps=self.lr_decay_steps, min_lr_ratio=self.min_lr_ratio)


class TorchBackend:
    """Single-process optimisation with torch AdamW (over float32 master weights under ``bf16``)."""

    rank = 0
    world_size = 1

    def __init__(self, model: torch.nn.Module, config: Any, *, precision: str = "fp32"):
        self.model = model
        self.config = config
        self.precision = precision
        self.reset_optimizer()

    def compute(self):
        """The context a forward of the trained model runs in (:func:`compute_context`)."""
        return compute_context(self.precision, next(self.model.parameters()).device)

    def reset_optimizer(self) -> None:
        """AdamW with no state (moments and step count from zero)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        config = self.config
        self.optimizer = torch.optim.AdamW(
            trainable, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay
        )

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        trim_heap()  # what the forward and backward passes freed, before AdamW's states
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        set_learning_rate(self.optimizer, self.config.learning_rate(self.optimizer_steps()))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    @property
    def learning_rate(self) -> float:
        """The learning rate the last step took (the scheduled one)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def optimizer_steps(self) -> int:
        """Steps AdamW has taken, from its state (carried over with a loaded optimizer state)."""
        return max((int(state["step"]) for state in self.optimizer.state.values() if "step" in state), default=0)

    def save_model(self, directory: Path, *, dtype: torch.dtype | None = None, masters: Path | None = None,
                   shard_bytes: int | None = None) -> None:
        """The model's Hugging Face files in ``dtype`` (None: as they are) in shards of at most
        ``shard_bytes``, and with ``masters`` its float32 master weights there too (:func:`save_masters`)."""
        save_weights(self.model, directory, None, dtype=dtype, masters=masters, shard_bytes=shard_bytes)

    def save_optimizer(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"kind": "torch-adamw", "state": self.optimizer.state_dict()}, path)

    def load_optimizer(self, path: Path) -> bool:
        if not path.is_file():
            return False
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved.get("kind") != "torch-adamw":
            return False
        self.optimizer.load_state_dict(saved["state"])
        return True

    def save_resume_state(self, path: Path, step: int, history: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step, "history": history}, tmp)
        os.replace(tmp, path)

    def load_resume_state(self, path: Path) -> tuple[int, list[dict]]:
        saved = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        return int(saved["step"]), list(saved["history"])


class DeepSpeedBackend:
    """DeepSpeed ZeRO: the engine owns the optimizer; gradients are reduced across ranks in ``step``.

    Gradient accumulation is unmanaged (``managed_gradient_accumulation: false``): the trainer calls
    ``backward`` once per micro-batch and ``step`` once per mini-batch, whatever the number of
    micro-batches on each rank. DeepSpeed *averages* gradients over ranks; the trainer's loss is
    already a sum over the global batch divided by its global token count, so each rank's loss is
    multiplied by the world size to make the reduced gradient that sum.
    """

    saves_frozen = True  # its checkpoints hold frozen parameters too (a LoRA backend's leave the base out)

    def __init__(self, model: torch.nn.Module, config: Any, *, ds_config: dict, world_size: int, rank: int,
                 precision: str = "fp32"):
        import deepspeed

        self.model = model
        self.config = config
        self.precision = precision
        self.world_size = world_size
        self.rank = rank
        self.zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
        trainable = [p for p in model.parameters() if p.requires_grad]
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints op builds; stdout is for results
            self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
        if self.zero_stage == 3:
            share_master_partitions(self.engine.optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer runs the module itself, not ``engine(...)``, whose forward starts each micro-
        # batch by clearing the ZeRO optimizer's backward flag. ZeRO-3 counts micro-batches there:
        # without it every backward *overwrites* the reduced gradient partitions (copy semantics of
        # micro-step 0) and a mini-batch trains on its last micro-batch only. Nothing runs backward
        # between the forward and here, so clearing it now is the same. (DeepSpeed before the flag
        # existed counted micro-batches in the backward itself.)
        clear_flag = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear_flag is not None:
            clear_flag()
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def compute(self):
        """The context a forward of the trained model runs in (:func:`compute_context`): the
        parameters DeepSpeed partitions are the float32 masters, autocast computes in bfloat16."""
        return compute_context(self.precision, next(self.model.parameters()).device)

    def step(self) -> float:
        trim_heap()  # what the forward and backward passes freed, before the optimizer's states
        set_learning_rate(self.engine.optimizer, self.config.learning_rate(self.optimizer_steps()))
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    @property
    def learning_rate(self) -> float:
        """The learning rate the last step took (the scheduled one)."""
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def optimizer_steps(self) -> int:
        """Steps the engine's optimizer has taken (carried over with a loaded checkpoint)."""
        return int(self.engine.global_steps)

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        device = next(self.model.parameters()).device
        reduced = values.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        return reduced.cpu()

    def save_model(self, directory: Path, *, dtype: torch.dtype | None = None, masters: Path | None = None,
                   shard_bytes: int | None = None) -> None:
        """The weights as :class:`TorchBackend` saves them, written by rank 0; under ZeRO-3 gathered
        a parameter at a time, rank 0 holding at most a shard (:func:`save_partitioned`)."""
        from transformers import PreTrainedModel  # a critic (ValueModel) writes its own files

        if self.zero_stage == 3 and isinstance(self.model, PreTrainedModel):
            save_partitioned(self.model, directory, dtype=dtype, masters=masters, shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES,
                             rank=self.rank)
            return
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.zero_stage == 3 else None
        if self.rank == 0:
            save_weights(self.model, directory, state, dtype=dtype, masters=masters, shard_bytes=shard_bytes)

    def save_optimizer(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path.parent / "deepspeed"), tag="optimizer", client_state={"world_size": self.world_size},
                                    exclude_frozen_parameters=not self.saves_frozen)

    def load_optimizer(self, path: Path) -> bool:
        directory = path.parent / "deepspeed"
        if not (directory / "optimizer").is_dir():
            return False
        _, client = self.engine.load_checkpoint(
            str(directory), tag="optimizer", load_optimizer_states=True, load_lr_scheduler_states=False, load_module_only=False,
            load_module_strict=self.saves_frozen)
        return client is not None

    def save_resume_state(self, path: Path, step: int, history: list[dict]) -> None:
        """Every rank writes its partition under a new tag; only then does ``path`` (written
        atomically by rank 0) name that tag, and the previous tag is removed. A kill during a save
        leaves ``path`` naming the last complete one (rewriting one tag in place would leave ranks'
        partitions from different steps)."""
        directory, tag = path.parent / "resume-deepspeed", f"step-{step:08d}"
        previous = self._resume_tag(path) if path.exists() else None
        self.engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step, "history": history},
                                    exclude_frozen_parameters=not self.saves_frozen)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if self.rank == 0:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"deepspeed": True, "step": step, "tag": tag}))
            os.replace(tmp, path)
            if previous not in (None, tag):
                shutil.rmtree(directory / previous, ignore_errors=True)

    @staticmethod
    def _resume_tag(path: Path) -> str:
        return json.loads(path.read_text()).get("tag", "resume")

    def load_resume_state(self, path: Path) -> tuple[int, list[dict]]:
        directory = path.parent / "resume-deepspeed"
        _, client = self.engine.load_checkpoint(str(directory), tag=self._resume_tag(path), load_module_strict=self.saves_frozen)
        if client is None:
            raise GlmpostError(f"{directory}: no DeepSpeed resume checkpoint")
        return int(client["step"]), list(client["history"])


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """Every parameter group of ``optimizer`` (torch's, or DeepSpeed's ZeRO wrapper) steps with ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def uses_deepspeed(*, zero_stage: int | None, deepspeed_config: Path | None) -> bool:
    """Whether a session trains with DeepSpeed: under a multi-process launcher, or when a ZeRO stage
    or a DeepSpeed config is given."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or zero_stage is not None or deepspeed_config is not None


@dataclass
class TrainingSession:
    """This process's place in the job: rank, world size, device, and which backend trains."""

    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    use_deepspeed: bool
    zero_stage: int | None
    deepspeed_path: Path | None
    deterministic: dict
    precision: str = "fp32"  # resolved: bf16 or fp32

    @classmethod
    def start(cls, *, device: str, deterministic: bool, zero_stage: int | None, deepspeed_config: Path | None,
              precision: str = "fp32") -> "TrainingSession":
        release_freed_memory()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        resolved = resolve_device(device)
        if resolved.type in ("cuda", "npu") and resolved.index is None:
            resolved = torch.device(resolved.type, local_rank)
        precision = resolve_precision(precision, resolved)
        settings = set_deterministic(True, resolved) if deterministic else {}
        use_deepspeed = uses_deepspeed(zero_stage=zero_stage, deepspeed_config=deepspeed_config)
        if use_deepspeed:
            if resolved.type == "cpu":
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            try:
                import deepspeed
            except ImportError:
                raise ConfigError("DeepSpeed is not installed: pip install deepspeed (needed for {zero_stage}, {deepspeed_config} or several ranks)") from None
            if world == 1:  # a single DeepSpeed process without a launcher: a one-rank group on loopback
                os.environ.setdefault("RANK", "0")
                os.environ.setdefault("LOCAL_RANK", "0")
                os.environ.setdefault("WORLD_SIZE", "1")
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(_free_port()))
            with contextlib.redirect_stdout(sys.stderr):
                deepspeed.init_distributed(dist_backend=distributed_backend(resolved), verbose=False)
        return cls(resolved, rank, world, local_rank, use_deepspeed, zero_stage, deepspeed_config, settings, precision)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def partitioned_loading(self, config: Any):
        """The context to load the trained model in: under ZeRO-3, transformers' DeepSpeed integration
        creates its parameters already partitioned over the ranks (DeepSpeed's ``zero.Init``) and
        fills each rank's share, so no rank holds the whole model; otherwise nothing. Only the model
        loaded inside is partitioned (a frozen reference loaded later is not)."""
        if not self.use_deepspeed:
            return contextlib.nullcontext()
        ds = deepspeed_config(config, zero_stage=self.zero_stage, path=self.deepspeed_path)
        if ds["zero_optimization"].get("stage") != 3:
            return contextlib.nullcontext()
        return zero3_init(ds)

    def backend(self, model: torch.nn.Module, config: Any, *, own_optimizer: bool = False, kinds: tuple | None = None):
        """The optimisation backend of ``model``; ``own_optimizer``: a second model's (SAO's critic),
        whose learning rate, weight decay and clipping are ``config``'s whatever a --deepspeed file says;
        ``kinds``: the (one process, DeepSpeed) backend classes (a LoRA run's, :mod:`glmpost.rl.lora_training`)."""
        local, ranks = kinds or (TorchBackend, DeepSpeedBackend)
        if not self.use_deepspeed:
            return local(model, config, precision=self.precision)
        parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        ds = deepspeed_config(config, zero_stage=self.zero_stage, path=self.deepspeed_path, own_optimizer=own_optimizer,
                              parameters=parameters)
        return ranks(model, config, ds_config=ds, world_size=self.world_size, rank=self.rank, precision=self.precision)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.use_deepspeed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
