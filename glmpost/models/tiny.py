"""The embedded default model: a tiny GLM-5-architecture causal LM built from a config.

``GlmMoeDsaForCausalLM`` (transformers >= 5.2) with every GLM-5 part present at toy size: MLA
attention (q/kv low-rank projections, rope/nope split), the DSA lightning indexer with a small
``index_topk`` (so sparse top-k selection really happens on short sequences), MoE layers with routed
and shared experts after ``first_k_dense_replace`` dense layers. Dimensions follow
``shared/notes/tiny-glm5-rl-facts.md`` (~180k parameters at vocab 512): a size that learns a toy
task with GRPO on one CPU in under a minute.
"""

from __future__ import annotations

from typing import Any

import torch

TINY_GLM5: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "index_topk": 8,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny-glm5": TINY_GLM5}


def tiny_glm5_config(**overrides: Any):
    """A ``GlmMoeDsaConfig`` for the tiny preset; keyword arguments override any field."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(**{**TINY_GLM5, **overrides})


def build_model(config, *, seed: int):
    """A randomly initialised ``GlmMoeDsaForCausalLM``, identical for the same config and seed."""
    from transformers import GlmMoeDsaForCausalLM

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = GlmMoeDsaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.float().eval()
