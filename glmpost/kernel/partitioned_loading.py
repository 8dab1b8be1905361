"""A model created partitioned under DeepSpeed ZeRO-3, each parameter read from the safetensors
files alone: no rank ever holds more than its share and one parameter.

transformers' own ZeRO-3 loading reads every shard whole on rank 0 before it scatters the values
(a 252.7M-parameter model: rank 0 peaked at 1.5 GiB above its start, 1.6x the float32 model). Here
the model is built by transformers under ``zero.Init`` (its parameters partitioned as they are
made), then each parameter is gathered alone, rank 0 reading just that tensor from its file
(``safe_open`` maps one file at a time), and partitioned again. This needs the checkpoint's tensor names to be
the model's own (dense models: Llama, Qwen3, GLM-4); a checkpoint stored in another layout (fused
MoE experts on disk per expert) returns None and transformers loads it its way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def checkpoint_tensors(directory: Path) -> dict[str, Path]:
    """Each tensor name of a safetensors checkpoint and the file holding it (its index, or its files)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            found.update({name: path for name in f.keys()})
    return found


def load_partitioned(directory: Path, dtype: Any) -> Any:
    """The model of ``directory`` created partitioned and filled a parameter at a time (every rank
    calls it, under an active ZeRO-3 config); None when the checkpoint's names are not the model's."""
    import deepspeed
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    files = checkpoint_tensors(directory)
    config = AutoConfig.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype if dtype not in (None, "auto") else config.dtype)
    parameters = list(model.named_parameters())
    persistent = set(model.state_dict())
    buffers = [(name, b) for name, b in model.named_buffers() if name in persistent]
    if any(name not in files for name, _ in parameters + buffers):
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    opened: dict[Path, Any] = {}
    try:
        def read(name: str):
            path = files[name]
            if path not in opened:  # one file mapped at a time: the pages read of the others are let go
                opened.clear()
                opened[path] = safe_open(str(path), "pt")
            return opened[path].get_tensor(name)

        with torch.no_grad():
            for name, parameter in parameters:
                with deepspeed.zero.GatheredParameters([parameter], modifier_rank=0):
                    if rank == 0:
                        parameter.data.copy_(read(name))
            for name, buffer in buffers:  # not partitioned: every rank reads its own copy
                buffer.copy_(read(name))
    finally:
        opened.clear()
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    return model
