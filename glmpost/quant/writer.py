"""Writing a (quantized) checkpoint: the one writer ``glmpost quantize`` and ``sync-weights`` share.

Both turn a stream of ``(name, float tensor)`` into a deployable Hugging Face directory:

1. :func:`layer_plan`: which layers the scheme quantizes (:mod:`glmpost.quant.targets`), every
   shape checked against the scheme before anything is written, and the linear layers left in float
   (the ``ignore`` list of ``quantization_config``);
2. :func:`encode_tensor`: one tensor to the tensors it is stored as — a chosen layer through THE
   quantizer (:func:`glmpost.quant.formats.encode_weight`, or ``quantize_weight`` + ``encode_layer``
   when its error is measured), anything else as it is;
3. :class:`SafetensorsWriter`: safetensors files readable by other users (an inference server often
   runs as one) and fsynced, named after the input's files or cut at a size;
4. :func:`write_config`: ``config.json`` with its ``quantization_config`` (or msModelSlim's
   ``quant_model_description.json``) and ``model.safetensors.index.json`` when there are several files.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmpost.checkpoints import (
    MANIFEST,
    CheckpointManifest,
    check_finite_weight,
    read_manifest,
    tokenizer_revision,
    write_manifest,
)
from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.fsutil import current_umask, fsync_path
from glmpost.models.skeleton import model_skeleton
from glmpost.quant.core import check_shape, dequant, quantize_weight
from glmpost.quant.formats import (
    MODELSLIM_DESCRIPTION,
    encode_layer,
    encode_weight,
    modelslim_description,
    quantization_config,
)
from glmpost.quant.targets import candidates_from_model, select_targets


def readable_mode() -> int:
    """0644 under the usual umask: files others may read (safetensors itself writes 0600)."""
    return 0o666 & ~current_umask()


@dataclass
class LayerPlan:
    chosen: list[str] = field(default_factory=list)  # on-disk module names the scheme quantizes
    ignore: list[str] = field(default_factory=list)  # linear layers / experts kept in float


def layer_plan(skeleton, shapes: dict[str, tuple[int, ...]], spec, *, targets: str = "all", include=(), exclude=()) -> LayerPlan:
    """The layers ``spec`` quantizes among ``shapes`` (on-disk name -> shape); a shape the scheme
    cannot take is an error before anything is written."""

    if spec.scheme == "none":
        return LayerPlan()
    candidates = candidates_from_model(skeleton, shapes)
    chosen = select_targets(candidates, targets=targets, include=include, exclude=exclude)
    for module in chosen:
        check_shape(shapes[f"{module}.weight"], spec, module)
    linear_like = {c.module for c in candidates if c.kind in ("linear", "expert")}
    return LayerPlan(chosen, sorted(linear_like - set(chosen)))


def sqnr_db(w, wq) -> float | None:
    """``10 log10(|w|^2 / |w - wq|^2)``; None when exact (JSON has no inf)."""
    signal = float(w.double().pow(2).sum())
    noise = float((w.double() - wq.double()).pow(2).sum())
    if noise == 0.0:
        return None
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _module(name: str) -> str | None:
    return name[: -len(".weight")] if name.endswith(".weight") else None


def encode_tensor(name: str, tensor, *, spec, fmt: str | None, chosen: set[str], measure: bool = False):
    """``(stored tensors, quantized module or None, error row or None)`` for one input tensor.

    ``measure`` adds the layer's SQNR and max |w - dequant(quantize(w))| (what ``quantize`` reports).
    """
    module = _module(name)
    if module not in chosen:
        return {name: tensor}, None, None

    if not measure:
        return encode_weight(module, tensor, spec, fmt), module, None

    codes, scale = quantize_weight(tensor, spec)
    wq = dequant(codes, scale, spec, tensor.dtype)
    error = float((tensor.float() - wq.float()).abs().max()) if tensor.numel() else 0.0
    row = {"layer": module, "shape": list(tensor.shape), "sqnr_db": sqnr_db(tensor, wq), "max_abs_err": error}
    return encode_layer(module, codes, scale, spec, fmt), module, row


class SafetensorsWriter:
    """Output tensors into ``directory`` as fsynced safetensors files readable by other users.

    With ``max_bytes`` the files are cut at that size and named ``model.safetensors`` (one) or
    ``model-XXXXX-of-YYYYY.safetensors``; without, each tensor goes into the file :meth:`add` names
    (the input checkpoint's layout), written by :meth:`close_file`.
    """

    def __init__(self, directory: Path, *, max_bytes: int | None = None):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.pending: dict[str, Any] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.max_bytes is not None and self.pending and self.pending_bytes + size > self.max_bytes:
            self.close_file(f".shard-{len(self.written):05d}.safetensors")
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def close_file(self, file_name: str) -> None:
        """Write the pending tensors as ``file_name``."""
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.directory / file_name
        save_file(self.pending, str(path), metadata={"format": "pt"})
        os.chmod(path, readable_mode())
        fsync_path(path)
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> tuple[list[str], dict[str, str]]:
        """The files' final names and the weight map (tensor -> file)."""
        if self.max_bytes is None:
            return [p.name for p, _ in self.written], {k: p.name for p, keys in self.written for k in keys}
        self.close_file(f".shard-{len(self.written):05d}.safetensors")
        count = len(self.written)
        names, weight_map = [], {}
        for i, (path, keys) in enumerate(self.written):
            name = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.directory / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        return names, weight_map


def write_json_fsynced(path: Path, payload: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_config(staging: Path, model_config: dict, *, spec, fmt: str | None, plan: LayerPlan,
                 weight_map: dict[str, str], total_bytes: int, index: bool) -> None:
    """``config.json`` (with ``quantization_config`` unless the scheme is ``none``), msModelSlim's
    description for ``fmt = "msmodelslim"``, and the index when ``index``."""

    if index:
        write_json_fsynced(staging / "model.safetensors.index.json", {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    if fmt == "msmodelslim":  # vLLM-Ascend reads the per-tensor type map, not config.json
        write_json_fsynced(staging / MODELSLIM_DESCRIPTION, modelslim_description(weight_map, plan.chosen))
    elif spec.scheme != "none":
        model_config["quantization_config"] = quantization_config(spec, fmt, plan.ignore)
    write_json_fsynced(staging / "config.json", model_config)


# --------------------------------------------------------------------------------------------
# `glmpost quantize`: a float checkpoint directory to a quantized one, file by file


@dataclass
class QuantizeResult:
    layers: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    rows: list[dict] = field(default_factory=list)  # per layer: SQNR and max abs error
    policy_version: int = 0


def _open_weights(path: Path):
    """``safe_open`` with an unreadable or truncated file reported in one line."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as exc:
        raise GlmpostError(f"{path}: cannot read safetensors ({exc})") from None


def plan_checkpoint(src: Path, spec, *, targets: str, include=(), exclude=()) -> tuple[list[Path], LayerPlan]:
    """The weight files of float checkpoint ``src`` and the layers ``spec`` quantizes in them."""

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise GlmpostError(f"checkpoint {src}: no *.safetensors weight files")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with _open_weights(f) as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[key] = tuple(sf.get_slice(key).get_shape())
    plan = LayerPlan()
    if spec.scheme != "none":
        plan = layer_plan(model_skeleton(src), shapes, spec, targets=targets, include=include, exclude=exclude)
        if not plan.chosen:
            raise ConfigError("no layer selected for quantization (check {targets}/{include}/{exclude})")
    return files, plan


def quantize_checkpoint(src: Path, staging: Path, files: list[Path], plan: LayerPlan, spec, fmt: str, *,
                        model_config: dict, on_row=None) -> QuantizeResult:
    """Write ``src`` quantized by ``spec`` into ``staging``, one output file per input file, with its
    config, the other files of the checkpoint and a manifest (policy version kept, stage quantize)."""
    import shutil

    result = QuantizeResult(layers=len(plan.chosen))
    chosen = set(plan.chosen)
    writer = SafetensorsWriter(staging)
    for f in files:
        with _open_weights(f) as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                t = sf.get_tensor(key)
                result.bytes_in += t.numel() * t.element_size()
                check_finite_weight(f, key, t, use="quantized or served")  # every weight, packed or copied
                encoded, _, row = encode_tensor(key, t, spec=spec, fmt=fmt, chosen=chosen, measure=True)
                if row is not None:
                    result.rows.append(row)
                    if on_row is not None:
                        on_row(row)
                for name, value in encoded.items():
                    writer.add(name, value)
        writer.close_file(f.name)
    names, weight_map = writer.finish()
    result.bytes_out = writer.total
    skip = {MANIFEST, "stage.json", "metrics.jsonl", "config.json", "model.safetensors.index.json"}
    for item in sorted(src.iterdir()):
        if item.is_file() and item.name not in skip and item.suffix != ".safetensors":
            shutil.copy2(item, staging / item.name)
    write_config(staging, model_config, spec=spec, fmt=fmt, plan=plan, weight_map=weight_map, total_bytes=writer.total,
                 index=len(files) > 1 or (src / "model.safetensors.index.json").is_file())
    parent = read_manifest(src) if (src / MANIFEST).is_file() else None
    result.policy_version = parent.policy_version if parent else 0
    merged_from = parent.extra.get("merged_from") if parent else None  # src: a LoRA version merged into scratch
    write_manifest(staging, CheckpointManifest(
        policy_version=result.policy_version, tokenizer_revision=tokenizer_revision(staging), stage="quantize",
        step=parent.step if parent else 0, parent=merged_from["lora_version"] if merged_from else str(src),
        extra={"scheme": spec.scheme, "format": fmt if spec.scheme != "none" else None, "spec": spec.to_json(),
               "layers": len(plan.chosen), **({"merged_from": merged_from} if merged_from else {})},
    ))
    return result
