"""Training arithmetic, activation checkpointing, and the weights a version is published with.

``precision`` bf16 runs a training forward under autocast to bfloat16 over float32 master weights
(AdamW's states float32 too); the kernel turns autocast off around the LM head and value head, so
log-probs and losses are float32 either way. A version is published in its parent's dtype (bf16 in,
bf16 out: what the rollout engine loads), with the float32 masters beside it in
``trainer_state/masters.safetensors`` for the next version to train from. Activation checkpointing
keeps each decoder layer's input and recomputes the layer in the backward pass.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from glmpost.checkpoints import CheckpointError
from glmpost.config import ConfigError
from glmpost.kernel.loading import partitioned
from glmpost.kernel.partitioned_loading import TensorFile, fill_shares
from glmpost.rl.sharded_save import master_files

PRECISIONS = ("auto", "bf16", "fp32")
MASTERS = "masters.safetensors"  # a version's float32 weights when it is published in a lower dtype


def resolve_precision(precision: str, device: torch.device) -> str:
    """``bf16`` or ``fp32``: ``auto`` is bf16 on an accelerator and fp32 on a CPU. Unknown names are
    a ConfigError naming ``precision``."""
    if precision not in PRECISIONS:
        raise ConfigError("{precision} {value!r}: expected auto, bf16 or fp32", value=precision)
    if precision == "auto":
        return "fp32" if device.type == "cpu" else "bf16"
    return precision


def compute_context(precision: str, device: torch.device):
    """Where a training forward runs: ``bf16`` autocasts the model's matmuls to bfloat16 over its
    float32 master weights (the LM head and value head, log-probs and losses stay float32: the
    kernel turns autocast off around them), ``fp32`` runs as it is."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def save_weights(model: torch.nn.Module, directory: Path, state: dict[str, torch.Tensor] | None, *,
                 dtype: torch.dtype | None, masters: Path | None, shard_bytes: int | None = None) -> None:
    """``model.save_pretrained`` of ``state`` (None: the model's own) with its floating tensors in
    ``dtype`` and ``config.json`` saying so, in shards of at most ``shard_bytes`` (None:
    transformers' bound); ``masters``: ``state`` as it is (the float32 masters) to that file as well."""
    if masters is not None:
        save_masters(model.state_dict() if state is None else state, masters)
    shards = {} if shard_bytes is None else {"max_shard_size": shard_bytes}
    if dtype is None or dtype == model.dtype:
        model.save_pretrained(directory, state_dict=state, **shards)
        return
    state = model.state_dict() if state is None else state
    model.save_pretrained(directory, state_dict={name: t.detach().to(dtype) if t.is_floating_point() else t
                                                 for name, t in state.items()}, **shards)
    config_path = Path(directory) / "config.json"  # save_pretrained writes the parameters' dtype, not the tensors'
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_masters(state: dict[str, torch.Tensor], path: Path) -> None:
    """The float32 master weights beside a version published in a lower dtype, for the next version
    to train from (tensors that share storage, tied embeddings, saved once)."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    unique = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.device.type != "meta" else (id(tensor), 0)
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(unique, str(path))


def load_masters(model: torch.nn.Module, path: Path) -> None:
    """Load :func:`save_masters` output (or a ZeRO-3 version's sharded masters,
    :func:`~glmpost.rl.sharded_save.master_files`) into ``model``; a tensor it lacks must share
    storage with one it holds (tied weights), anything else is a CheckpointError."""
    from safetensors.torch import load_file

    files = master_files(path)
    if partitioned(model):
        _load_partitioned(model, files)
        return
    state = {name: tensor for file in files for name, tensor in load_file(str(file)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded = {own[name].untyped_storage().data_ptr() for name in state if name in own}
    untied = [name for name in missing if own[name].untyped_storage().data_ptr() not in loaded]
    if unexpected or untied:
        raise CheckpointError(f"{path}: master weights do not fit the model (unexpected {unexpected[:3]}, missing {untied[:3]})")


def _load_partitioned(model: torch.nn.Module, files: list[Path]) -> None:
    """:func:`load_masters` into a ZeRO-3 model: each rank reads its own share of every parameter
    the files hold (:func:`~glmpost.kernel.partitioned_loading.fill_shares`; no rank holds the whole
    model); a parameter the files lack keeps its values."""
    held = {name: path for path in files for name in TensorFile(path).header}
    fill_shares([(name, p) for name, p in model.named_parameters() if name in held], held)


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Activation checkpointing per decoder layer (transformers' non-reentrant one, whichever
    attention path runs: the native GLM-5 forward calls the same layer modules): a layer's
    activations are recomputed in the backward pass instead of kept, the gradients unchanged (the
    recomputation is deterministic: the DSA top-k and the MoE routing choose the same again)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError("{activation_checkpointing}: %s does not support it" % type(model).__name__)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
