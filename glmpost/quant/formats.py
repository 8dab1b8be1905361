"""On-disk formats of quantized checkpoints: writers (per layer tensors + ``quantization_config``)
and the reader back to float (:func:`load_quantized_state`).

``compressed-tensors`` (vLLM, SGLang), ``quant_method: "compressed-tensors"``:

* ``pack-quantized`` (``w4a16``, ``w8a16``): ``<m>.weight_packed`` int32 ``[out, in * bits / 32]``
  (see :func:`glmpost.quant.core.pack_int32`), ``<m>.weight_scale`` ``[out, in / group]`` (group) or
  ``[out, 1]`` (channel), ``<m>.weight_shape`` int32 ``[out, in]``;
* ``int-quantized`` (``w8a8-dynamic``): ``<m>.weight`` int8 ``[out, in]``, ``<m>.weight_scale``
  ``[out, 1]``; activations are quantized per token at run time (``input_activations`` dynamic).

The config has one ``config_groups.group_0`` targeting ``Linear`` and lists every *unquantized*
``Linear`` in ``ignore`` (as llm-compressor writes it).

``msmodelslim`` (Ascend msModelSlim, as vLLM-Ascend loads it; ``w8a8-dynamic`` only): no
``quantization_config`` in ``config.json``; instead ``quant_model_description.json`` maps *every*
tensor name to its type (``"W8A8_DYNAMIC"`` for the three tensors of a quantized layer, ``"FLOAT"``
for the rest) plus ``"model_quant_type": "W8A8_DYNAMIC"``, ``"version": "1.0.0"``,
``"group_size": 0`` (per channel). A quantized layer is ``<m>.weight`` int8 ``[out, in]``,
``<m>.weight_scale`` float32 ``[out, 1]`` (the multiplier: ``w = weight * weight_scale``) and
``<m>.weight_offset`` float32 ``[out, 1]`` (zeros: symmetric). Sources (vllm-project/vllm-ascend):
``vllm_ascend/quantization/configs/modelslim_config.py`` (``MODELSLIM_CONFIG_FILENAME``, a
``"FLOAT"`` entry means unquantized, expert shards gate/up/down must share one type) and
``vllm_ascend/quantization/methods/w8a8/w8a8_dynamic.py`` (``AscendW8A8DynamicLinearMethod``:
int8 ``weight [out, in]``, per-channel ``weight_scale`` / ``weight_offset [out, 1]``, activations
``npu_dynamic_quant`` per token, ``npu_quant_matmul(x_q, weight, weight_scale, pertoken_scale)``).
vLLM-Ascend casts ``weight_scale`` to the model dtype on load; our stored scale is already a value
of the master weight's dtype (bf16 master: a bf16 value, stored exactly in float32), so serving at
the checkpoint's dtype multiplies by the same number QAT did.

``fp8`` (SGLang/DeepSeek-V3 block FP8), ``quant_method: "fp8"``: ``<m>.weight`` float8_e4m3fn
``[out, in]`` and ``<m>.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]`` — despite its
name the *multiplier*: ``w = fp8 * weight_scale_inv`` (per block). Unquantized Linears are listed
in ``ignored_layers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.quant.core import (
    dequant,
    pack_int32,
    quantize_weight,
    quantize_weight_packed,
    unpack_int32,
)
from glmpost.quant.spec import QuantSpec, make_spec

FORMATS = ("compressed-tensors", "fp8", "msmodelslim")
MODELSLIM_DESCRIPTION = "quant_model_description.json"
MODELSLIM_TYPE = "W8A8_DYNAMIC"


def default_format(scheme: str) -> str:
    return "fp8" if scheme == "fp8-block" else "compressed-tensors"


def check_format(scheme: str, fmt: str) -> None:
    """Refuse a format that is unknown or cannot hold ``scheme``, naming the config field ``fmt``."""

    if fmt not in FORMATS:
        raise ConfigError("{fmt} {value!r}: unknown format (known: {known})", value=fmt, known=", ".join(FORMATS))
    ok = {"compressed-tensors": ("w4a16", "w8a16", "w8a8-dynamic"), "fp8": ("fp8-block",), "msmodelslim": ("w8a8-dynamic",)}[fmt]
    if scheme not in ok:
        raise ConfigError("{fmt} {value} cannot hold scheme {scheme_name} (it holds {holds})", value=fmt, scheme_name=scheme,
                          holds=", ".join(ok))


def _ct_format(spec: QuantSpec) -> str:
    return "int-quantized" if spec.activations else "pack-quantized"


def encode_layer(module: str, codes: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, fmt: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors one quantized layer is stored as in ``fmt`` (default by scheme; see the module docstring)."""
    if fmt == "msmodelslim":
        if spec.scheme != "w8a8-dynamic":
            raise ValueError(f"msmodelslim holds w8a8-dynamic only, not {spec.scheme}")
        scale32 = scale.float().reshape(codes.shape[-2], 1)  # exact: the stored scale is a bf16/fp16/fp32 value
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale": scale32.contiguous(),
                f"{module}.weight_offset": torch.zeros_like(scale32)}
    if spec.code_kind == "float8_e4m3fn":
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale_inv": scale.float().contiguous()}
    if _ct_format(spec) == "int-quantized":
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale": scale.contiguous()}
    return {
        f"{module}.weight_packed": pack_int32(codes, spec.bits),
        f"{module}.weight_scale": scale.contiguous(),
        f"{module}.weight_shape": torch.tensor(list(codes.shape), dtype=torch.int32),
    }


def encode_weight(module: str, weight: torch.Tensor, spec: QuantSpec, fmt: str | None = None) -> dict[str, torch.Tensor]:
    """``encode_layer(module, *quantize_weight(weight, spec), spec, fmt)``: the float weight of one
    layer straight to its stored tensors (int4 codes packed while they are computed; equal bit for bit)."""
    if fmt is None and spec.code_kind == "int" and _ct_format(spec) == "pack-quantized":
        packed, scale = quantize_weight_packed(weight, spec)
        return {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale,
                f"{module}.weight_shape": torch.tensor(list(weight.shape), dtype=torch.int32)}
    codes, scale = quantize_weight(weight, spec)
    return encode_layer(module, codes, scale, spec, fmt)


def _args(spec: QuantSpec) -> dict[str, Any]:
    return {
        "num_bits": spec.bits,
        "type": "int",
        "symmetric": True,
        "strategy": spec.granularity,
        "group_size": spec.group_size if spec.granularity == "group" else None,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(spec: QuantSpec, fmt: str, ignore: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ``spec`` in ``fmt``; ``ignore`` = unquantized Linears."""
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(spec.block_size),
            "activation_scheme": "dynamic",
            "ignored_layers": sorted(ignore),
        }
    inputs = None
    if spec.activations:
        inputs = {**_args(spec), "strategy": "token", "dynamic": True, "observer": None}
    return {
        "quant_method": "compressed-tensors",
        "format": _ct_format(spec),
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _args(spec),
                "input_activations": inputs,
                "output_activations": None,
                "format": _ct_format(spec),
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        # glmpost's own record of the exact numerics (loaders ignore unknown keys)
        "glmpost_spec": spec.to_json(),
    }


def modelslim_description(tensor_names, quantized_modules) -> dict[str, Any]:
    """``quant_model_description.json``: every tensor's type, ``W8A8_DYNAMIC`` for the tensors of a
    quantized layer (``<m>.weight``, ``<m>.weight_scale``, ``<m>.weight_offset``), ``FLOAT`` otherwise."""
    quantized = set(quantized_modules)
    description: dict[str, Any] = {"model_quant_type": MODELSLIM_TYPE, "version": "1.0.0", "group_size": 0}
    for name in sorted(tensor_names):
        module = name.rsplit(".", 1)[0]
        description[name] = MODELSLIM_TYPE if module in quantized else "FLOAT"
    return description


def is_quantized_checkpoint(directory: Path, config: dict[str, Any]) -> str | None:
    """The quantization method a checkpoint already carries, or None for a float checkpoint."""
    if "quantization_config" in config:
        return str(config["quantization_config"].get("quant_method", "?"))
    if (Path(directory) / MODELSLIM_DESCRIPTION).is_file():
        return "msmodelslim"
    return None


def spec_from_config(qc: dict[str, Any]) -> QuantSpec:
    """The spec a saved ``quantization_config`` was written with (for dequantizing)."""
    if qc.get("quant_method") == "fp8":
        if list(qc.get("weight_block_size") or []) != [128, 128]:
            raise GlmpostError(f"fp8 weight_block_size {qc.get('weight_block_size')} is not supported (128x128 only)")
        return make_spec("fp8-block")
    if qc.get("quant_method") != "compressed-tensors":
        raise GlmpostError(f"quantization_config: unsupported quant_method {qc.get('quant_method')!r}")
    group = qc["config_groups"]["group_0"]
    w = group["weights"]
    if group.get("input_activations"):
        return make_spec("w8a8-dynamic")
    if w["num_bits"] == 4:
        return make_spec("w4a16", group_size=w["group_size"] if w.get("strategy") == "group" else -1)
    return make_spec("w8a16")


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise GlmpostError(f"{directory}: no *.safetensors weight files")
    return files


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(directory)):
        out.update(load_file(str(f)))
    return out


def load_quantized_state(directory: Path | str, dtype: torch.dtype | str | None = None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a quantized checkpoint with every quantized layer dequantized back to a
    float ``<m>.weight`` (in ``dtype``, default the checkpoint's ``dtype``/``torch_dtype``); the other
    tensors as stored. This is the same ``dequant`` QAT's fake quant runs."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    if isinstance(dtype, str):  # "float32", "bfloat16", ... as transformers spells them; "auto" = the checkpoint's
        dtype = None if dtype == "auto" else getattr(torch, dtype.removeprefix("torch."))
    if dtype is None:
        dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    if (directory / MODELSLIM_DESCRIPTION).is_file() and "quantization_config" not in config:
        return _load_modelslim(directory, dtype)
    qc = config.get("quantization_config")
    if qc is None:
        raise GlmpostError(f"{directory}: config.json has no quantization_config and there is no {MODELSLIM_DESCRIPTION} (not a quantized checkpoint)")
    spec = spec_from_config(qc)
    tensors = read_tensors(directory)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            shape = [int(x) for x in tensors[f"{m}.weight_shape"].tolist()]
            codes = unpack_int32(t, spec.bits, shape[-1]).reshape(shape)
            out[f"{m}.weight"] = dequant(codes, tensors[f"{m}.weight_scale"], spec, dtype)
        elif name.endswith(".weight_scale_inv"):
            m = name[: -len(".weight_scale_inv")]
            out[f"{m}.weight"] = dequant(tensors[f"{m}.weight"], t, spec, dtype)
        elif name.endswith(".weight_scale") and f"{name[:-len('_scale')]}" in tensors:
            m = name[: -len(".weight_scale")]
            out[f"{m}.weight"] = dequant(tensors[f"{m}.weight"], t, spec, dtype)
    for name, t in tensors.items():
        if name in out or name.endswith((".weight_packed", ".weight_shape", ".weight_scale", ".weight_scale_inv")):
            continue
        out[name] = t
    return out


def _load_modelslim(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """msModelSlim W8A8_DYNAMIC: ``weight * weight_scale`` (the same ``dequant``) for every layer the
    description types ``W8A8_DYNAMIC``; a non-zero ``weight_offset`` (asymmetric) is refused."""
    path = directory / MODELSLIM_DESCRIPTION
    try:
        description = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GlmpostError(f"{path}: invalid JSON ({exc})") from None
    kind = description.get("model_quant_type")
    if kind != MODELSLIM_TYPE:
        raise GlmpostError(f"{path}: model_quant_type {kind!r} is not supported ({MODELSLIM_TYPE} only)")
    spec = make_spec("w8a8-dynamic")
    tensors = read_tensors(directory)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_offset")):
            continue
        kind = description.get(name)
        if kind is None:
            raise GlmpostError(f"{path}: tensor {name} is not described")
        if kind == "FLOAT":
            out[name] = t
            continue
        if kind != MODELSLIM_TYPE or not name.endswith(".weight"):
            raise GlmpostError(f"{path}: {name} has type {kind!r}; only {MODELSLIM_TYPE} weights and FLOAT are supported")
        module = name[: -len(".weight")]
        scale, offset = tensors.get(f"{module}.weight_scale"), tensors.get(f"{module}.weight_offset")
        if scale is None or t.dtype != torch.int8:
            raise GlmpostError(f"{directory}: {name} is typed {MODELSLIM_TYPE} but is not int8 with a {module}.weight_scale")
        if offset is not None and bool(offset.ne(0).any()):
            raise GlmpostError(f"{directory}: {module}.weight_offset is not zero (asymmetric W8A8 is not supported)")
        out[name] = dequant(t, scale.reshape(t.shape[-2], 1), spec, dtype)
    return out


def dequantize_checkpoint(src: Path | str, dst: Path | str, dtype: torch.dtype | None = None) -> Path:
    """Write the float checkpoint a quantized one stands for: every quantized layer dequantized by
    :func:`load_quantized_state` (bit for bit the QAT forward weight), ``quantization_config`` dropped,
    every other file copied. ``dst`` must not exist; it is built beside itself and renamed into place."""
    import shutil

    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    state = load_quantized_state(src, dtype)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)  # msmodelslim: its description file is not copied below
    staging = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for item in src.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json", "model.safetensors.index.json", MODELSLIM_DESCRIPTION):
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in state.items()}, str(staging / "model.safetensors"), metadata={"format": "pt"})
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst
