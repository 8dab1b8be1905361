"""Loading a checkpoint for computation: its tokenizer and its model (quantized checkpoints
dequantized, the GLM-5 attention implementation and the deterministic DSA top-k selected)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from glmpost.checkpoints import MANIFEST, CheckpointError, check_finite_weight, read_manifest, resolve_checkpoint, tokenizer_revision
from glmpost.config import ConfigError
from glmpost.errors import first_line
from glmpost.kernel.lora import apply_adapter
from glmpost.kernel.lora_versions import is_lora_version, model_dir, read_lora_base
from glmpost.kernel.partitioned_loading import load_partitioned
from glmpost.kernel.routing import install_routing
from glmpost.models.native_attention import ATTENTION_CHOICES, set_attention
from glmpost.models.packed_attention import use_packed_sdpa
from glmpost.npu.topk import install_deterministic_topk
from glmpost.quant.formats import is_quantized_checkpoint, load_quantized_state
from glmpost.stage import log


def load_tokenizer(checkpoint: Path | str):
    """The checkpoint's tokenizer and its revision, refusing tokenizer files edited after the manifest."""
    from transformers import AutoTokenizer

    directory = resolve_checkpoint(checkpoint)
    revision = tokenizer_revision(directory)
    if (directory / MANIFEST).is_file():
        recorded = read_manifest(directory).tokenizer_revision
        if recorded != revision:
            raise CheckpointError(
                f"{directory}: tokenizer files have revision {revision} but {MANIFEST} records {recorded}"
            )
    if is_lora_version(directory):  # its copy of the base's tokenizer (glmpost.kernel.lora_versions)
        base = read_lora_base(directory)
        if (theirs := tokenizer_revision(base)) != revision:
            raise CheckpointError(f"LoRA version {directory}: tokenizer revision {revision} differs from its base {base}'s {theirs}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{directory}: tokenizer does not load ({first_line(exc)})") from None
    return tokenizer, revision


def load_model(checkpoint: Path | str, *, device: Any = "cpu", dtype: Any = None, deterministic_topk: bool = True,
               attention: str = "native", adapter: Path | str | None = None):
    """``AutoModelForCausalLM`` from a root or version directory, in eval mode.

    A quantized checkpoint (``glmpost quantize`` / ``sync-weights --quantize`` output: a
    ``quantization_config`` or msModelSlim description) is dequantized with the one quantizer's
    ``dequant`` (:func:`glmpost.quant.formats.load_quantized_state`): the float weights a rollout
    engine computes with. A tensor the architecture needs but the checkpoint lacks is an error, never
    a random initialisation.

    A LoRA version (:mod:`glmpost.kernel.lora_versions`) loads its base, checked to hold the weights
    the adapter was trained on, and applies its adapter unmerged (:func:`glmpost.kernel.lora.apply_adapter`):
    the adapted layers compute ``W x + scale · B (A x)`` as the trainer's PEFT model does, so the
    engine samples with the trainer's own function (no merged ``W + scale · B A`` rounded to the
    weights' dtype), and a new adapter replaces only the adapter's tensors. ``adapter`` (a PEFT adapter
    folder, or a LoRA version) is applied the same way onto the full version ``checkpoint``, whatever
    base it names (as a serving engine applies an adapter onto the base it serves: ``glmpost serve``).

    With ``deterministic_topk`` (the default) a GLM-5 DSA indexer selects keys by
    :func:`glmpost.npu.topk.deterministic_topk` (ties to the lower position), so the rollout engine
    and the trainer attend to the same keys for the same tokens; MoE routers select experts by the same
    rule (:func:`glmpost.kernel.routing.install_routing`). ``attention`` ``native`` (the
    default) runs GLM-5 attention through :mod:`glmpost.models.native_attention`, ``reference``
    through transformers' modules (ConfigError naming ``attention`` for anything else).
    """
    directory = resolve_checkpoint(checkpoint)
    lora = is_lora_version(directory)
    if lora and adapter is not None:
        raise CheckpointError(f"{directory} is a LoRA version: an adapter applies onto a full version (its base)")
    model = load_weights(read_lora_base(directory) if lora else directory, dtype)
    if lora or adapter is not None:
        model = apply_adapter(model, directory if lora else adapter)
    return ready_model(model, directory, device=device, deterministic_topk=deterministic_topk, attention=attention)


def ready_model(model, directory: Path, *, device: Any = "cpu", deterministic_topk: bool = True, attention: str = "native"):
    """The rest of :func:`load_model` for a ``model`` loaded from ``directory`` (an adapter already
    injected: a trainer's fresh one too): weights checked finite, the deterministic DSA top-k and
    MoE routing, the attention implementation, on ``device`` (ZeRO-3: where it was partitioned), in eval mode."""
    check_finite(model, directory)
    if deterministic_topk:
        install_deterministic_topk(model)
        install_routing(model)  # MoE routers: the same rule (ties to the lower expert id), recordable, replayable
    apply_attention(model, attention)
    if partitioned(model):  # ZeRO-3 created its parameters in place, partitioned over the ranks
        return model.eval()
    return model.to(device).eval()


def load_weights(directory: Path, dtype: Any = None):
    """The model of a full version directory (:func:`load_model` without the adapter, checks and
    settings): float, quantized (dequantized) or ZeRO-3 partitioned; every tensor present."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        config_json = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{directory}/config.json: unreadable ({first_line(exc)})") from None
    try:
        if is_quantized_checkpoint(directory, config_json):
            state = load_quantized_state(directory, dtype)
            config = AutoConfig.from_pretrained(str(directory))
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            # from_pretrained maps on-disk names to in-memory ones (per-expert -> fused MoE weights).
            model_class = AutoModelForCausalLM._model_mapping[type(config)]
            model, info = model_class.from_pretrained(
                None, config=config, state_dict=state, dtype=dtype or "auto", output_loading_info=True
            )
        elif zero3_partitioning() and (model := load_partitioned(directory, dtype)) is not None:
            info = {}
        else:
            model, info = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype or "auto", output_loading_info=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise CheckpointError(f"{directory}: model does not load ({first_line(exc)})") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{directory}: missing tensors {', '.join(missing[:3])}{more}")
    return model


def import_architecture(checkpoint: Path | str) -> None:
    """Import the transformers module of ``checkpoint``'s architecture (tens of MiB of code, the same
    for any size), so that memory measured after it is what the model itself adds. Nothing when the
    config does not resolve: :func:`load_model` reports that."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(model_dir(resolve_checkpoint(checkpoint)))))]
    except (OSError, ValueError, KeyError, CheckpointError):
        return


def zero3_partitioning() -> bool:
    """Whether models are being created partitioned (a ZeRO-3 config is active for transformers)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def partitioned(model) -> bool:
    """Whether ``model``'s parameters are partitioned by DeepSpeed ZeRO-3 (each rank holds a share)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def check_finite(model, directory: Path) -> None:
    """Refuse a checkpoint holding NaN or infinite weights, naming the first tensor
    (:func:`~glmpost.checkpoints.check_finite_weight`), before anything samples or trains from it."""
    import torch

    with torch.no_grad():
        for name, tensor in model.named_parameters():
            check_finite_weight(directory, name, getattr(tensor, "ds_tensor", tensor))  # ZeRO-3: this rank's share


def apply_attention(model, attention: str) -> int:
    """Run ``model``'s GLM-5 attention ``native`` or ``reference``
    (:func:`glmpost.models.native_attention.set_attention`); an unknown name is a ConfigError naming
    the ``attention`` field. Returns the number of attention layers switched. Any other model on
    transformers' SDPA runs it as :data:`~glmpost.models.packed_attention.PACKED_SDPA` (the same,
    but a packed row's sequences attended one at a time)."""
    if attention not in ATTENTION_CHOICES:
        raise ConfigError("{attention} {value!r}: expected native or reference", value=attention)
    layers = set_attention(model, attention)
    if layers == 0:
        use_packed_sdpa(model)
    if layers == 0 and attention == "native" and type(model).__name__ not in _SAID_REFERENCE:
        _SAID_REFERENCE.add(type(model).__name__)  # once per architecture and process
        log(f"{type(model).__name__} has no GLM-5 attention for --attention native: its own (transformers') attention runs")
    return layers


_SAID_REFERENCE: set[str] = set()

GLM5_MODEL_TYPE = "glm_moe_dsa"
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def saved_dtype(checkpoint: Path | str) -> str:
    """The dtype a checkpoint's floating weights are stored in (``float32``, ``bfloat16``, ...): the
    first floating tensor of its first safetensors file, read from the header alone; without one
    (``.bin`` weights) its ``config.json`` ``dtype`` / ``torch_dtype``; float32 when nothing says."""
    from safetensors import safe_open

    directory = model_dir(resolve_checkpoint(checkpoint))  # a LoRA version: its base's
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                found = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype())
                if found:
                    return found
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    found = config.get("dtype") or config.get("torch_dtype")
    return found if found in _SAFETENSORS_DTYPES.values() else "float32"


def attention_ran(checkpoint: Path | str, attention: str) -> str:
    """The attention a model from ``checkpoint`` runs under ``--attention attention``, as stage.json
    records it: ``native`` or ``reference`` for a GLM-5 model, ``transformers`` (its own) for any
    other, whichever was asked. Read from ``config.json``, without loading the model."""
    try:
        config_json = json.loads((model_dir(resolve_checkpoint(checkpoint)) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{checkpoint}/config.json: unreadable ({first_line(exc)})") from None
    return attention if config_json.get("model_type") == GLM5_MODEL_TYPE else "transformers"
