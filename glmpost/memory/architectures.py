"""What ``glmpost plan`` knows of causal LMs other than GLM-5 (:class:`~glmpost.memory.plan.ModelShape`
holds the result): their dimensions read from a transformers config (grouped-query or MLA attention,
dense or MoE layers: Llama, Qwen3, Qwen3-MoE, GLM-4, GLM-4.5, DeepSeek-V3, ...), their parameters
counted exactly on the meta device, and grouped-query attention's saved activations (checked against
autograd in ``tests/test_plan_architectures.py``).
"""

from __future__ import annotations

from typing import Any, Callable


def other_model_fields(config: Any, get: Callable[..., Any]) -> dict[str, Any]:
    """The :class:`~glmpost.memory.plan.ModelShape` fields of a causal LM other than GLM-5 (``get``
    reads ``config``'s values): its dimensions, and its parameters counted on the meta device."""
    model_type = get("model_type")
    layers, heads, hidden = int(get("num_hidden_layers")), int(get("num_attention_heads")), int(get("hidden_size"))
    experts = int(get("n_routed_experts") or get("num_experts") or get("num_local_experts") or 0)
    intermediate = int(get("intermediate_size"))
    if not experts:
        dense = layers
    elif get("first_k_dense_replace") is not None:
        dense = min(int(get("first_k_dense_replace")), layers)
    else:  # Qwen3-MoE: mlp_only_layers, and a MoE layer every decoder_sparse_step layers
        only, step = set(get("mlp_only_layers") or ()), int(get("decoder_sparse_step") or 1)
        dense = sum(1 for i in range(layers) if i in only or (i + 1) % step != 0)
    mla = get("kv_lora_rank") is not None
    return dict(
        vocab=int(get("vocab_size")), hidden=hidden, layers=layers, heads=heads,
        q_lora_rank=get("q_lora_rank") if mla else None,
        kv_lora_rank=int(get("kv_lora_rank") or 0), qk_rope_head_dim=int(get("qk_rope_head_dim") or 0),
        qk_nope_head_dim=int(get("qk_nope_head_dim") or 0), v_head_dim=int(get("v_head_dim") or 0),
        intermediate=intermediate, moe_intermediate=int(get("moe_intermediate_size") or intermediate),
        experts=experts, experts_per_token=int(get("num_experts_per_tok") or 0) if experts else 0,
        shared_experts=int(get("n_shared_experts") or 0), dense_layers=dense, indexer_layers=0, index_topk=0,
        index_head_dim=0, index_heads=0, n_group=int(get("n_group") or 1), topk_group=int(get("topk_group") or 1),
        attention_bias=bool(get("attention_bias", False)), tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        model_type=model_type, attention_kind="mla" if mla else "gqa",
        kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim") or hidden // heads),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(get("use_qk_norm", False)),
        norms_per_layer=4 if model_type == "glm4" else 2,
        counted=tuple(sorted(meta_parameter_count(config).items())),
    )


def meta_parameter_count(config: Any) -> dict[str, int]:
    """Exact parameter counts of the transformers model of ``config``, built on the meta device (no
    memory): ``total``, ``trainable`` (all of them), ``indexer`` 0 and ``fp32_kept`` (the modules
    the model keeps in float32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, dict):
        values = {k: v for k, v in config.items() if k != "model_type"}
        try:
            config = AutoConfig.for_model(config["model_type"], **values)
        except Exception as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers refuses configs in many ways (assertions included)
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    kept = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    total, fp32 = 0, 0
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        fp32 += parameter.numel() if any(k in name.split(".") for k in kept) else 0
    return {"total": total, "trainable": total, "indexer": 0, "fp32_kept": fp32}


def gqa_attention_saved_bytes(shape: Any, *, batch: int, seq: int, a: int, attention: str) -> tuple[int, int]:
    """Grouped-query attention's saved bytes of every layer, ``(projections, kernel)``: the shared
    q / k / v projection input, the per-head query and key norms (Qwen3, GLM-4.5), rope's cos / sin
    (one pair for all layers); ``fused`` (SDPA's flash kernel) keeps the roped query, key and value
    at their own head counts, the output (o_proj's input) and a float32 logsumexp ``[B, H, S]``;
    ``eager`` / ``math`` keep the query, the key and value repeated to every head and o_proj's input,
    and the float32 probabilities ``[B, H, S, S]`` (plus their copy in a 16-bit dtype)."""
    n, heads, kv, d = batch * seq, shape.heads, shape.kv_heads, shape.head_dim
    per_head_norms = (n * heads * d * (4 + a) + 4 * n * heads + n * kv * d * (4 + a) + 4 * n * kv) if shape.qk_norm else 0
    projections = shape.layers * (n * shape.hidden * a + per_head_norms) + 2 * seq * d * a
    if attention == "fused":
        kernel = n * (2 * heads + 2 * kv) * d * a + batch * heads * seq * 4
    else:
        kernel = 3 * n * heads * d * a + batch * heads * seq * seq * (4 + (a if a != 4 else 0))
    return projections, shape.layers * kernel
