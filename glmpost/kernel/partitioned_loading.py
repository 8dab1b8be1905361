"""A model created partitioned under DeepSpeed ZeRO-3, each parameter read from the safetensors
files alone: no rank ever holds more than its share and one parameter.

transformers' own ZeRO-3 loading reads every shard whole on rank 0 before it scatters the values
(a 252.7M-parameter model: rank 0 peaked at 1.5 GiB above its start, 1.6x the float32 model). Here
the model is built by transformers under ``zero.Init`` (its parameters partitioned as they are
made), then each rank reads its own share of each parameter from the file's bytes: no gathering,
no communication, nothing read twice. This needs the checkpoint's tensor names and shapes to be
the model's own (dense models: Llama, Qwen3, GLM-4); a checkpoint stored in another layout (fused
MoE experts on disk per expert) returns None and transformers loads it its way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def checkpoint_tensors(directory: Path) -> dict[str, Path]:
    """Each tensor name of a safetensors checkpoint and the file holding it (its index, or its files)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    return {name: path for path in sorted(directory.glob("*.safetensors")) for name in TensorFile(path).header}


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class TensorFile:
    """One safetensors file read by byte range: the header (the format's 8-byte length and JSON:
    each tensor's dtype, shape and data offsets), then any flat range of a tensor with plain reads.
    safetensors' own reader maps the file, and every page read stays in the process's resident set
    while it is open; a rank reading its share of each tensor needs neither."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(length))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + length

    def numel(self, name: str) -> int:
        count = 1
        for size in self.header[name]["shape"]:
            count *= size
        return count

    def read_flat(self, name: str, start: int, count: int):
        """Elements ``[start, start + count)`` of tensor ``name`` flattened (a 1-D torch tensor in its file dtype)."""
        import torch

        entry = self.header[name]
        dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
        size = torch.empty(0, dtype=dtype).element_size()
        out = torch.empty(count, dtype=dtype)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + entry["data_offsets"][0] + start * size)
            f.readinto(memoryview(out.view(torch.uint8).numpy()))
        return out


def fill_shares(parameters: list[tuple[str, Any]], files: dict[str, Path],
                readers: dict[Path, TensorFile] | None = None) -> None:
    """Each ZeRO-3 partitioned parameter's share on this rank read from the file ``files`` names for
    it (ZeRO-3 keeps elements ``[rank * n, (rank + 1) * n)`` of a flattened parameter on rank
    ``rank``, the last share zero-padded): no gathering, no communication."""
    import torch

    readers = {} if readers is None else readers
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with torch.no_grad():
        for name, parameter in parameters:
            if files[name] not in readers:
                readers[files[name]] = TensorFile(files[name])
            share = parameter.ds_tensor
            start = rank * share.numel()
            count = max(0, min(share.numel(), parameter.ds_numel - start))
            share.zero_()
            if count:
                share[:count].copy_(readers[files[name]].read_flat(name, start, count))


def _partitioned_skeleton(config: Any, dtype: Any) -> Any:
    """The model of ``config`` created under ``zero.Init`` in the context ``from_pretrained`` uses
    (transformers' ``get_init_context``: its weights not initialised, since every one is read next),
    not ``from_config``'s, which initialises every module again, gathered, and held each gathered
    module beside the rank's share."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils.generic import ContextManagers

    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    if not isinstance(torch_dtype, torch.dtype):
        torch_dtype = getattr(torch, str(config.dtype).removeprefix("torch.")) if config.dtype else torch.float32
    with ContextManagers(model_class.get_init_context(torch_dtype, False, False, None)):
        model = model_class(config)
        patch_output_recorders(model)
    return model


def load_partitioned(directory: Path, dtype: Any) -> Any:
    """The model of ``directory`` created partitioned, each rank filling its own share of every
    parameter from the files (:func:`fill_shares`); every rank calls it under an active ZeRO-3
    config. None when the checkpoint's names or sizes are not the model's."""
    import torch
    from transformers import AutoConfig, GenerationConfig

    files = checkpoint_tensors(directory)
    config = AutoConfig.from_pretrained(str(directory))
    model = _partitioned_skeleton(config, dtype)
    parameters = list(model.named_parameters())
    persistent = set(model.state_dict())
    buffers = [(name, b) for name, b in model.named_buffers() if name in persistent]
    if any(name not in files for name, _ in parameters + buffers):
        return None
    readers = {path: TensorFile(path) for path in set(files.values())}
    if any(readers[files[name]].numel(name) != getattr(p, "ds_numel", p.numel()) for name, p in parameters + buffers):
        return None
    fill_shares(parameters, files, readers)
    with torch.no_grad():
        for name, buffer in buffers:  # not partitioned: every rank reads its own copy
            buffer.copy_(readers[files[name]].read_flat(name, 0, buffer.numel()).view(buffer.shape))
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    return model
