"""LoRA's parameters as ``glmpost plan`` counts them (issue 45): for every layer an adapter targets,
``r x (in + out)`` (``lora_A`` [r, in] and ``lora_B`` [out, r]); for the routed experts' fused 3-D
weights (PEFT's ``ParamWrapper``) ``r x E x (in + out)`` per weight, ``in`` and ``out`` one expert's.
Exact against PEFT on every architecture ``plan`` knows (tests/test_plan_lora.py). The targets are
the adapter's (:mod:`glmpost.kernel.lora`): by default every linear layer of attention and MLP the
model has, and ``experts`` where it has routed experts.
"""

from __future__ import annotations

from glmpost.kernel.lora import DEFAULT_CANDIDATES, EXPERTS
from glmpost.memory.plan import ModelShape, model_state_bytes

# A name -> [(in, out, copies)]: the layers (or per-expert weights) a target names across the model.
TargetShapes = dict[str, list[tuple[int, int, int]]]


def _attention(shape: ModelShape) -> TargetShapes:
    h, heads, n = shape.hidden, shape.heads, shape.layers
    if shape.attention_kind == "gqa":
        q, kv = heads * shape.head_dim, shape.kv_heads * shape.head_dim
        return {"q_proj": [(h, q, n)], "k_proj": [(h, kv, n)], "v_proj": [(h, kv, n)], "o_proj": [(q, h, n)]}
    q_out = heads * shape.qk_head_dim
    found: TargetShapes = ({"q_a_proj": [(h, shape.q_lora_rank, n)], "q_b_proj": [(shape.q_lora_rank, q_out, n)]}
                           if shape.q_lora_rank else {"q_proj": [(h, q_out, n)]})
    found["kv_a_proj_with_mqa"] = [(h, shape.kv_lora_rank + shape.qk_rope_head_dim, n)]
    found["kv_b_proj"] = [(shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim), n)]
    found["o_proj"] = [(heads * shape.v_head_dim, h, n)]
    return found


def _mlp(shape: ModelShape) -> TargetShapes:
    """The dense layers' MLPs and the shared experts (one MLP of moe_intermediate x shared experts)."""
    h = shape.hidden
    mlps = [(shape.intermediate, shape.dense_layers)]
    if shape.experts and shape.shared_experts:
        mlps.append((shape.moe_intermediate * shape.shared_experts, shape.moe_layers))
    found: TargetShapes = {}
    for inner, copies in mlps:
        if not copies:
            continue
        if shape.model_type == "glm4":  # GLM-4's MLP computes gate and up with one fused linear layer
            found.setdefault("gate_up_proj", []).append((h, 2 * inner, copies))
        else:
            found.setdefault("gate_proj", []).append((h, inner, copies))
            found.setdefault("up_proj", []).append((h, inner, copies))
        found.setdefault("down_proj", []).append((inner, h, copies))
    return found


def target_shapes(shape: ModelShape) -> TargetShapes:
    """Every target the model has, with its layers' shapes (``experts``: per routed expert, both weights)."""
    found = {**_attention(shape), **_mlp(shape)}
    if shape.experts and shape.moe_layers:
        e, h, i = shape.experts, shape.hidden, shape.moe_intermediate
        found[EXPERTS] = [(h, 2 * i, e * shape.moe_layers), (i, h, e * shape.moe_layers)]
    return found


def default_target_names(shape: ModelShape) -> tuple[str, ...]:
    """What :func:`glmpost.kernel.lora.default_targets` picks on the built model, from the shape alone."""
    found = target_shapes(shape)
    return (*(n for n in DEFAULT_CANDIDATES if n in found), *((EXPERTS,) if EXPERTS in found else ()))


def lora_parameter_count(shape: ModelShape, rank: int, targets: tuple[str, ...] | None = None) -> dict[str, int]:
    """The adapter's parameters per target and their ``total`` (rank 0: none). ``targets`` None: the
    defaults; a name the model lacks counts 0 (training refuses it)."""
    if rank <= 0:
        return {"total": 0}
    shapes = target_shapes(shape)
    names = default_target_names(shape) if targets is None else targets
    counts = {name: sum(rank * (i + o) * copies for i, o, copies in shapes.get(name, [])) for name in names}
    return {**counts, "total": sum(counts.values())}


def lora_state_bytes(shape: ModelShape, *, rank: int, targets: tuple[str, ...] | None, base_dtype: str, zero_stage: int = 0,
                     ranks: int = 1) -> dict[str, int]:
    """The actor's model state per rank when it trains a LoRA adapter: ``weights`` = the frozen base in
    ``base_dtype`` (the training stage's: its saved dtype under bf16, float32 under fp32) + the adapter
    in float32 (its own masters); ``grads`` and ``optimizer`` (AdamW m, v in float32) of the adapter
    alone. ZeRO divides as for full training (stage 3 the base too: partitioned)."""
    adapter = lora_parameter_count(shape, rank, targets)["total"]
    base = model_state_bytes(shape, dtype=base_dtype, trainable=False)["weights"]
    n = max(ranks, 1)
    weights = base + 4 * adapter
    return {
        "weights": -(-weights // n) if zero_stage >= 3 else weights,
        "grads": -(-4 * adapter // n) if zero_stage >= 2 else 4 * adapter,
        "optimizer": -(-8 * adapter // n) if zero_stage >= 1 else 8 * adapter,
    }


def experts_delta_bytes(shape: ModelShape, *, rank: int, targets: tuple[str, ...] | None) -> int:
    """PEFT's ParamWrapper materialises ``scale · B A`` over one MoE layer's whole expert stack and, in
    the backward, its gradient (float32): the workspace a LoRA on ``experts`` adds (0 without one)."""
    names = default_target_names(shape) if targets is None else targets
    if rank <= 0 or EXPERTS not in names or not shape.experts:
        return 0
    return 2 * 4 * shape.experts * 3 * shape.hidden * shape.moe_intermediate
