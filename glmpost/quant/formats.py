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

from glmpost.errors import GlmpostError
from glmpost.quant.core import dequant, pack_int32, unpack_int32
from glmpost.quant.spec import QuantSpec, make_spec

FORMATS = ("compressed-tensors", "fp8")


def default_format(scheme: str) -> str:
    return "fp8" if scheme == "fp8-block" else "compressed-tensors"


def check_format(scheme: str, fmt: str) -> None:
    from glmpost.errors import UsageError

    if fmt == "msmodelslim":
        raise UsageError("--format msmodelslim: Ascend msModelSlim W8A8_DYNAMIC output is not supported yet; use --format compressed-tensors")
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: unknown format (known: {', '.join(FORMATS)})")
    ok = {"compressed-tensors": ("w4a16", "w8a16", "w8a8-dynamic"), "fp8": ("fp8-block",)}[fmt]
    if scheme not in ok:
        raise UsageError(f"--format {fmt} cannot hold scheme {scheme} (it holds {', '.join(ok)})")


def _ct_format(spec: QuantSpec) -> str:
    return "int-quantized" if spec.activations else "pack-quantized"


def encode_layer(module: str, codes: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The tensors one quantized layer is stored as (see the module docstring)."""
    if spec.code_kind == "float8_e4m3fn":
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale_inv": scale.float().contiguous()}
    if _ct_format(spec) == "int-quantized":
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale": scale.contiguous()}
    return {
        f"{module}.weight_packed": pack_int32(codes, spec.bits),
        f"{module}.weight_scale": scale.contiguous(),
        f"{module}.weight_shape": torch.tensor(list(codes.shape), dtype=torch.int32),
    }


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
        return make_spec("w4a16", group_size=w["group_size"])
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


def load_quantized_state(directory: Path | str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a quantized checkpoint with every quantized layer dequantized back to a
    float ``<m>.weight`` (in ``dtype``, default the checkpoint's ``dtype``/``torch_dtype``); the other
    tensors as stored. This is the same ``dequant`` QAT's fake quant runs."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    qc = config.get("quantization_config")
    if qc is None:
        raise GlmpostError(f"{directory}: config.json has no quantization_config (not a quantized checkpoint)")
    spec = spec_from_config(qc)
    if dtype is None:
        dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
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
