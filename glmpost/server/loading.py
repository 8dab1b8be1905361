"""The checkpoint a server serves: its engine, tokenizer and identity (version directory, tokenizer
revision, policy version, config, tensor shapes), loaded at start and again at each weight update."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmpost.checkpoints import CheckpointError, read_manifest, resolve_checkpoint
from glmpost.errors import GlmpostError
from glmpost.kernel.continuation import TurnCaches
from glmpost.kernel.engine import LocalEngine
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.kernel.lora_versions import model_dir


@dataclass
class LoadedCheckpoint:
    engine: LocalEngine
    tokenizer: Any
    version_dir: Path
    revision: str
    policy_version: int | None
    config: dict
    tensors: dict[str, tuple[int, ...]]
    caches: TurnCaches | None = None  # KV caches of these weights that later requests may extend
    routing_layout: Any = None  # its RoutingLayout, read on the first return_routed_experts (EngineServer)
    adapter: str | None = None  # the adapter folder applied onto these weights (glmpost.server.adapters)


def model_tensors(model) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a loaded model's parameters and buffers (quantized checkpoints are
    dequantized on load, so a float and a quantized version of one model compare equal)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_checkpoint(checkpoint: str | Path, *, device: Any, batch_size: int, deterministic_topk: bool,
                    prefix_cache_batches: int = 0, attention: str = "native",
                    adapter: str | Path | None = None) -> LoadedCheckpoint:
    """Model, tokenizer and identity of a checkpoint root or version directory, with a prefix cache
    of ``prefix_cache_batches`` engine batches (0: none); with ``adapter`` (a PEFT adapter folder) applied
    unmerged onto its weights (:func:`~glmpost.kernel.loading.load_model`)."""

    version_dir = resolve_checkpoint(checkpoint)
    tokenizer, revision = load_tokenizer(version_dir)
    try:
        policy_version: int | None = read_manifest(version_dir).policy_version
    except CheckpointError:
        policy_version = None
    try:
        config = json.loads((model_dir(version_dir) / "config.json").read_text())  # a LoRA version: its base's
    except (OSError, json.JSONDecodeError) as exc:
        raise GlmpostError(f"{version_dir}/config.json: unreadable ({exc})") from None
    model = load_model(version_dir, device=device, deterministic_topk=deterministic_topk, attention=attention, adapter=adapter)
    tensors = model_tensors(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine = LocalEngine(model, batch_size=batch_size, pad_token_id=pad)
    caches = TurnCaches(retain=prefix_cache_batches) if prefix_cache_batches else None
    return LoadedCheckpoint(engine, tokenizer, version_dir, revision, policy_version, config, tensors, caches,
                            adapter=None if adapter is None else str(adapter))
