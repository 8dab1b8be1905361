"""MoE routing records and server payloads, as arrays: the record's id dtype and its "not recorded"
row (:func:`compact_ids`, :func:`recorded_rows`), the MoE layers a model config names
(:func:`moe_layer_indices`), the :class:`RoutingLayout` a server's payload must hold, and the
translation between SGLang's / vLLM's all-layer payloads and the record's MoE-layer rows
(:func:`routed_from_sglang`, :func:`select_moe_rows`, :func:`all_layer_rows`). The routers
themselves, recording and replay are :mod:`glmpost.kernel.routing`'s.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

# The record's "not recorded" row (formats/SPEC.md, ``routed_experts``): the dtype's largest value.
NOT_RECORDED = {np.dtype(np.uint8): 0xFF, np.dtype(np.uint16): 0xFFFF}


def routing_dtype(experts: int, k: int) -> np.dtype:
    """The record's id dtype: the narrowest of uint8 / uint16 whose largest value can mean "not
    recorded": a row of it is no real row when it is no expert id (``experts`` below it) or when
    ``k >= 2`` (a layer's ids are distinct), so GLM-5's 256 experts, 8 per token, fit uint8."""
    for dtype in (np.dtype(np.uint8), np.dtype(np.uint16)):
        largest = int(np.iinfo(dtype).max)
        if experts <= largest or (experts == largest + 1 and k >= 2):
            return dtype
    raise ValueError(f"{experts} experts do not fit a uint16 routing record")


def compact_ids(ids: torch.Tensor | np.ndarray, experts: int) -> np.ndarray:
    """Expert ids ``[..., k]`` as the record stores them: each layer's set in ascending id order (a
    set: replay recomputes the gate weights; sorted ids compress better), in :func:`routing_dtype`;
    a row of ``-1`` is "not recorded"."""
    values = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    dtype = routing_dtype(experts, values.shape[-1])
    return np.where(values < 0, NOT_RECORDED[dtype], np.sort(values, axis=-1)).astype(dtype)


def recorded_rows(routed: np.ndarray) -> np.ndarray:
    """``[T]`` bool: the record's rows that hold experts (not the "not recorded" value)."""
    return ~(routed == NOT_RECORDED[routed.dtype]).all(axis=tuple(range(1, routed.ndim)))


def config_field(config, name: str, default=None):
    """``config.name`` of a transformers config or a ``config.json`` dict (``default`` when absent or None)."""
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def moe_layer_indices(config) -> tuple[int, ...] | None:
    """The decoder layers ``0 .. num_hidden_layers - 1`` whose MLP is a routed MoE, in order, as
    the model ``config`` (a transformers config or a ``config.json`` dict) says; None for a model
    without routed experts. The rules are transformers' own (the decoder layer's ``__init__``), in
    this order:

    * ``mlp_layer_types`` (GLM-5 ``glm_moe_dsa``, Kimi-Linear, HY-V3, ...): layer ``i`` is MoE
      where the entry is ``"sparse"`` (``models/glm_moe_dsa/modeling_glm_moe_dsa.py``);
    * ``decoder_sparse_step`` / ``mlp_only_layers`` (Qwen2/3-MoE): MoE where ``i`` is not in
      ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (``models/qwen3_moe/modeling_qwen3_moe.py``);
    * ``first_k_dense_replace`` (GLM-4.5/4.7 ``glm4_moe``, DeepSeek-V3): MoE from layer
      ``first_k_dense_replace`` on (``models/deepseek_v3/modeling_deepseek_v3.py``), every
      ``moe_layer_freq``-th where a config sets one (DeepSeek-V2's rule, SGLang ``models/deepseek_v2.py``);
    * otherwise every layer, when the config has routed experts (``n_routed_experts``,
      ``num_experts`` or ``num_local_experts``; Mixtral and the like).

    SGLang and vLLM return routed experts for all ``num_hidden_layers`` (their capturers size the
    buffer ``[tokens, num_hidden_layers, num_experts_per_tok]`` and leave dense layers' rows 0),
    so these indices pick the MoE layers' rows (:func:`select_moe_rows`).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(config_field(text, "num_hidden_layers", 0))
    experts = int(config_field(text, "n_routed_experts") or config_field(text, "num_experts")
                  or config_field(text, "num_local_experts") or 0)
    types = config_field(text, "mlp_layer_types")
    if types is not None:
        chosen = [i for i, kind in enumerate(list(types)[:layers]) if kind == "sparse"]
    elif experts <= 0:
        return None
    elif config_field(text, "decoder_sparse_step") is not None or config_field(text, "mlp_only_layers") is not None:
        step, dense = int(config_field(text, "decoder_sparse_step", 1)), set(config_field(text, "mlp_only_layers", []))
        chosen = [i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0]
    elif config_field(text, "first_k_dense_replace") is not None:
        first, freq = int(config_field(text, "first_k_dense_replace")), int(config_field(text, "moe_layer_freq", 1))
        chosen = [i for i in range(first, layers) if i % freq == 0]
    else:
        chosen = list(range(layers))
    return tuple(chosen) or None


@dataclass(frozen=True)
class RoutingLayout:
    """What a routing payload of a server must hold: ``k`` experts (of ``experts``) per token in
    each of ``hidden_layers`` decoder layers, of which ``moe_layers`` (indices) are MoE layers."""

    hidden_layers: int
    moe_layers: tuple[int, ...]
    k: int
    experts: int

    @classmethod
    def of(cls, shape) -> "RoutingLayout":
        """A layout as it is, or from a ``(moe_layers, k, experts)`` tuple (:func:`moe_shape`: every layer MoE)."""
        if isinstance(shape, RoutingLayout):
            return shape
        layers, k, experts = shape
        return cls(int(layers), tuple(range(int(layers))), int(k), int(experts))


def select_moe_rows(rows: np.ndarray, layout: RoutingLayout) -> np.ndarray:
    """The MoE layers' experts ``[P, len(moe_layers), k]`` of a server's ``rows`` ``[P, W, k]``:
    ``W`` all ``hidden_layers`` (SGLang, vLLM: a dense layer's rows are 0; any other value there
    says the config is not the served model's, and is refused) or the MoE layers only (older
    servers, the stand-in before issue 42). Raises ValueError (one line) for any other width."""
    moe = len(layout.moe_layers)
    if rows.ndim == 3 and rows.shape[1] == layout.hidden_layers and rows.shape[2] == layout.k:
        dense = [i for i in range(layout.hidden_layers) if i not in set(layout.moe_layers)]
        filled = [i for i in dense if rows[:, i].any()]
        if filled:
            at = filled[0]
            raise ValueError(f"routed_experts has experts in layer {at}, dense in the model config "
                             f"(MoE layers {list(layout.moe_layers)}): the server serves another model")
        return rows[:, list(layout.moe_layers)]
    if rows.ndim == 3 and rows.shape[1:] == (moe, layout.k):
        return rows
    raise ValueError(f"routed_experts rows of {list(rows.shape[1:])} per position are neither "
                     f"{layout.hidden_layers} hidden layers x {layout.k} nor {moe} MoE layers x {layout.k}")


def routed_from_sglang(encoded: str, prompt_tokens: int, tokens: int, shape) -> np.ndarray:
    """The record's ``routed_experts`` ``[tokens, L, k]`` from SGLang's ``meta_info.routed_experts``
    (``return_routed_experts``: base64 of int32 ``[prompt + output - 1, W, k]``, row ``i`` the
    experts of position ``i``, ``W`` = ``num_hidden_layers`` with zero rows for dense layers:
    SGLang ``python/sglang/srt/state_capturer/routed_experts.py`` @30dbb06 sizes its capture
    buffer so; read in slime's ``sglang_rollout.py``): the MoE layers' rows (:func:`select_moe_rows`;
    ``shape`` a :class:`RoutingLayout` or ``(moe_layers, k, experts)``) of the positions whose
    logits sampled the output tokens, ``prompt_tokens - 1`` on. Raises ValueError (one line) when
    the payload does not hold them."""
    layout = RoutingLayout.of(shape)
    moe, k = len(layout.moe_layers), layout.k
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype=np.int32)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"routed_experts is not base64 of int32 ids ({exc})") from None
    positions = prompt_tokens + tokens - 1
    widths = {w for w in (moe, layout.hidden_layers) if positions * w * k == flat.size}
    if positions < 1 or not widths:  # another layout (another k, another layer count) is refused, never guessed
        also = f" nor x {layout.hidden_layers} hidden layers x {k}" if layout.hidden_layers != moe else ""
        raise ValueError(f"routed_experts holds {flat.size} ids, not {positions} positions x {moe} MoE layers x {k}{also}")
    rows = flat.reshape(positions, max(widths), k)
    return compact_ids(select_moe_rows(rows, layout)[prompt_tokens - 1 :], layout.experts)


def all_layer_rows(rows: np.ndarray, layout: RoutingLayout) -> np.ndarray:
    """int32 ``[P, hidden_layers, k]`` from the MoE layers' ``rows`` ``[P, len(moe_layers), k]``,
    zero rows for the dense layers: the payload SGLang's and vLLM's capturers return (the
    inverse of :func:`select_moe_rows`)."""
    out = np.zeros((rows.shape[0], layout.hidden_layers, layout.k), dtype=np.int32)
    out[:, list(layout.moe_layers)] = rows
    return out
