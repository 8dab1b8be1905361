"""A ZeRO-3 version published a parameter at a time: Hugging Face safetensors shards, size-bounded,
with their index, in the checkpoint's dtype, no rank ever holding the whole state dict.

Every rank takes part in gathering each parameter (DeepSpeed's ``GatheredParameters``: one
parameter whole at a time); rank 0 keeps a copy in the published dtype until its decoder layer is
complete, maps it back to the on-disk names and layout the checkpoint was loaded from
(transformers' ``revert_weight_conversion``: fused MoE experts back to per-expert tensors), and
writes a shard whenever the next layer would take it over the bound. The float32 masters go the
same way into ``trainer_state`` under the model's own names (what :func:`load_masters` reads).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

WEIGHTS_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 << 30  # transformers writes up to 50 GB; a smaller bound keeps rank 0 small
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def source_shard_bytes(checkpoint: Path) -> int:
    """The bound a version's shards keep: its parent's largest safetensors file (a version is
    sharded as the checkpoint it came from), at most :data:`DEFAULT_SHARD_BYTES`, which is also the
    bound of a parent without safetensors."""
    sizes = [path.stat().st_size for path in Path(checkpoint).glob("*.safetensors")]
    return min(max(sizes), DEFAULT_SHARD_BYTES) if sizes else DEFAULT_SHARD_BYTES


class ShardWriter:
    """Tensors into ``{prefix}-NNNNN-of-MMMMM.safetensors`` files of at most ``bound`` bytes each
    (a single larger group alone), then the index (one file: ``{prefix}.safetensors``, no index)."""

    def __init__(self, directory: Path, prefix: str, bound: int):
        self.directory, self.prefix, self.bound = Path(directory), prefix, bound
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.directory.mkdir(parents=True, exist_ok=True)

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in group.values())
        held = sum(t.numel() * t.element_size() for t in self.pending.values())
        if self.pending and held + size > self.bound:
            self._flush()
        self.pending.update(group)
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.directory / f".{self.prefix}-{len(self.files) + 1:05d}.partial"
        save_file({name: t.contiguous() for name, t in self.pending.items()}, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending = {}

    def finish(self) -> list[Path]:
        """Write what is pending; name the files and write the index. Returns the files."""
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        if count == 1:
            final = self.directory / f"{self.prefix}.safetensors"
            os.replace(self.files[0][0], final)
            return [final]
        weight_map, finals = {}, []
        for number, (path, names) in enumerate(self.files, start=1):
            final = self.directory / f"{self.prefix}-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, final)
            finals.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / f"{self.prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return finals


def _layer_groups(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The model's parameters (each storage once: tied weights under their first name) grouped by
    decoder layer, everything outside the layers one group per parameter, in module order."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    current = None
    for name, parameter in model.named_parameters():
        match = _LAYER.match(name)
        key = match.group(1) if match else name
        if key != current:
            groups.append([])
            current = key
        groups[-1].append((name, parameter))
    return groups


def save_partitioned(model: torch.nn.Module, directory: Path, *, dtype: torch.dtype | None, masters: Path | None,
                     shard_bytes: int, rank: int) -> None:
    """Publish a ZeRO-3 model (every rank calls this): weights and config into ``directory`` as the
    module doc says; with ``masters`` (``trainer_state/masters.safetensors``) the float32 masters too."""
    import deepspeed
    from transformers.core_model_loading import revert_weight_conversion

    main = rank == 0
    weights = ShardWriter(directory, "model", shard_bytes) if main else None
    master_writer = ShardWriter(masters.parent, masters.name.removesuffix(".safetensors"), shard_bytes) \
        if main and masters is not None else None
    for group in _layer_groups(model):
        published, kept = {}, {}
        for name, parameter in group:
            with deepspeed.zero.GatheredParameters([parameter]):
                if main:
                    value = parameter.data.detach()
                    published[name] = value.to(dtype, copy=True) if dtype is not None and value.is_floating_point() \
                        else value.clone()
                    if master_writer is not None:
                        kept[name] = value.clone()
        if main:
            weights.add(revert_weight_conversion(model, published))
            if master_writer is not None:
                master_writer.add(kept)
    if not main:
        return
    persistent = set(model.state_dict())
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if name in persistent}
    if buffers:
        weights.add(revert_weight_conversion(model, buffers))
    weights.finish()
    if master_writer is not None:
        master_writer.finish()
    _save_config(model, directory, dtype)


def _save_config(model: torch.nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
    """``config.json`` (its ``dtype`` the published one) and the generation config, as ``save_pretrained`` writes them."""
    model.config.save_pretrained(directory)
    if dtype is not None:
        path = Path(directory) / "config.json"
        config = json.loads(path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(directory)


def master_files(path: Path) -> list[Path]:
    """The files of the float32 masters saved at ``path`` (``masters.safetensors``): that file, or
    the shards its index names; empty when there are none."""
    if path.is_file():
        return [path]
    index = path.with_name(path.name + ".index.json")
    if not index.is_file():
        return []
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [path.with_name(name) for name in names]
