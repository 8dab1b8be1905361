"""A ZeRO-3 version published a parameter at a time: Hugging Face safetensors shards, size-bounded,
with their index, in the checkpoint's dtype, no rank ever holding the whole state dict.

Every rank takes part in gathering each parameter (DeepSpeed's ``GatheredParameters``: one
parameter whole at a time); rank 0 keeps a copy in the published dtype until its decoder layer is
complete, maps it back to the on-disk names and layout the checkpoint was loaded from
(transformers' ``revert_weight_conversion``: fused MoE experts back to per-expert tensors), and
writes each tensor into its place in files planned beforehand (:class:`PlannedShards`). The
float32 masters go the same way into ``trainer_state`` under the model's own names (what
:func:`load_masters` reads).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from glmpost.memory.process import trim_heap

DEFAULT_SHARD_BYTES = 5 << 30  # transformers writes up to 50 GB; a smaller bound keeps rank 0 small
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def source_shard_bytes(checkpoint: Path) -> int:
    """The bound a version's shards keep: its parent's largest safetensors file (a version is
    sharded as the checkpoint it came from), at most :data:`DEFAULT_SHARD_BYTES`, which is also the
    bound of a parent without safetensors."""
    sizes = [path.stat().st_size for path in Path(checkpoint).glob("*.safetensors")]
    return min(max(sizes), DEFAULT_SHARD_BYTES) if sizes else DEFAULT_SHARD_BYTES


SAFETENSORS_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                     torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                     torch.bool: "BOOL"}


class PlannedShards:
    """Safetensors files written a tensor at a time: every tensor's name, shape and dtype are known
    before any value is (``plan``: in order, cut into ``{prefix}-NNNNN-of-MMMMM.safetensors`` files of
    at most ``bound`` bytes, a larger tensor alone; one file: ``{prefix}.safetensors``, no index), so
    each file's header is written first and each value goes to its place as it arrives. safetensors'
    own writer takes a whole file's tensors at once: rank 0 would hold a shard of values."""

    def __init__(self, directory: Path, prefix: str, bound: int, plan: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        files: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        held = 0
        for name, shape, dtype in plan:
            size = math.prod(shape) * dtype.itemsize
            if files[-1] and held + size > bound:
                files.append([])
                held = 0
            files[-1].append((name, shape, dtype))
            held += size
        count = len(files)
        self.names = [self.directory / (f"{prefix}.safetensors" if count == 1 else
                                        f"{prefix}-{number:05d}-of-{count:05d}.safetensors") for number in range(1, count + 1)]
        self.place: dict[str, tuple[int, int, int]] = {}  # name -> (file, absolute offset, bytes)
        weight_map, total = {}, 0
        for number, (path, entries) in enumerate(zip(self.names, files)):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype in entries:
                size = math.prod(shape) * dtype.itemsize
                header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
                offset += size
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            with open(path.with_name("." + path.name + ".partial"), "wb") as f:
                f.write(len(text).to_bytes(8, "little") + text)
            for name, _, _ in entries:
                first, last = header[name]["data_offsets"]
                self.place[name] = (number, 8 + len(text) + first, last - first)
                weight_map[name] = path.name
            total += offset
        self.index = None if count == 1 else {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        self.index_path = self.directory / f"{prefix}.safetensors.index.json"

    def write(self, values: dict[str, torch.Tensor]) -> None:
        """Each value into its planned place (its size checked against the plan)."""
        for name, value in values.items():
            number, offset, size = self.place.pop(name)
            path = self.names[number]
            data = value.detach().contiguous().view(torch.uint8).numpy()
            if data.nbytes != size:
                raise RuntimeError(f"sharded save: {name} is {data.nbytes} bytes, planned {size}")
            with open(path.with_name("." + path.name + ".partial"), "r+b") as f:
                f.seek(offset)
                f.write(memoryview(data))

    def finish(self) -> list[Path]:
        """Name the files and write the index; every planned tensor must have been written."""
        if self.place:
            missing = sorted(self.place)
            raise RuntimeError(f"sharded save: {len(missing)} planned tensor(s) never written, e.g. {missing[0]}")
        for path in self.names:
            os.replace(path.with_name("." + path.name + ".partial"), path)
        if self.index is not None:
            self.index_path.write_text(json.dumps(self.index, indent=2) + "\n")
        return self.names


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
    module doc says; with ``masters`` (``trainer_state/masters.safetensors``) the float32 masters too.
    The files are planned first (transformers' conversion run on shapes alone, meta tensors), then
    filled a layer at a time: rank 0 holds one layer's values, never a shard's."""
    import deepspeed
    from transformers.core_model_loading import revert_weight_conversion

    main = rank == 0
    groups = _layer_groups(model)
    persistent = set(model.state_dict())
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if name in persistent}

    def published_dtype(t_dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype

    if main:
        meta = [{name: torch.empty(p.ds_shape, dtype=published_dtype(p.dtype), device="meta") for name, p in group}
                for group in groups] + ([{name: torch.empty(b.shape, dtype=published_dtype(b.dtype), device="meta")
                                          for name, b in buffers.items()}] if buffers else [])
        plan = [(name, tuple(t.shape), t.dtype) for group in meta for name, t in revert_weight_conversion(model, group).items()]
        weights = PlannedShards(directory, "model", shard_bytes, plan)
        kept = None if masters is None else PlannedShards(
            masters.parent, masters.name.removesuffix(".safetensors"), shard_bytes,
            [(name, tuple(p.ds_shape), p.dtype) for group in groups for name, p in group])
    for group in groups:
        published = {}
        for name, parameter in group:
            with deepspeed.zero.GatheredParameters([parameter]):
                if main:
                    value = parameter.data.detach()
                    if kept is not None:
                        kept.write({name: value})
                    published[name] = value.to(published_dtype(value.dtype), copy=True)
        if main:
            weights.write(revert_weight_conversion(model, published))
        del published
        trim_heap()  # the gathers' small allocations
    if not main:
        return
    if buffers:
        weights.write(revert_weight_conversion(model, {n: b.to(published_dtype(b.dtype)) for n, b in buffers.items()}))
    weights.finish()
    if kept is not None:
        kept.finish()
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
