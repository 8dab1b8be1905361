"""Memory terms of glmpost's native GLM-5 attention (:mod:`glmpost.models.native_attention`) for
``glmpost plan`` (checked against a measured training step in ``tests/test_plan.py``).

Per layer and micro-batch ``[B, S]`` (N = B * S tokens, a bytes per activation, H heads, c =
kv_lora_rank, r = qk_rope_head_dim, k = min(index_topk, S)):

- the latent cache (:class:`~glmpost.models.native_attention.LatentCache`) holds ``c + r`` values per
  token and layer plus the indexer's ``index_head_dim`` keys, in buffers whose capacity doubles:
  :func:`latent_cache_capacity` replays its growth exactly;
- saved activations: MLA's projections as in the reference, then the absorbed query
  ``[N, H, c]`` and its per-head copy, the roped query ``[N, H, r]``, the gathered keys
  ``[N, k, c + r]`` (the selected-key gather: linear in S), int64 indices and a bool mask
  ``[N, k]``, float32 probabilities ``[N, H, k]``, the latent output ``[N, H, c]`` and o_proj's
  input; no ``[S, S]`` term (:func:`native_attention_saved_bytes`, within 5 % of what autograd
  saves, ``tests/test_plan.py``);
- workspace: one indexer query chunk of at most ``INDEXER_CHUNK_ELEMENTS`` float32 scores per head
  (:func:`native_indexer_workspace_bytes`) and, without autograd, one chunk's gathered keys and
  probabilities (:func:`native_gather_workspace_bytes`).
"""

from __future__ import annotations

from glmpost.memory.units import dtype_bytes
from glmpost.models.native_attention import INDEXER_CHUNK_ELEMENTS


def native_attention_saved_bytes(shape, *, batch: int, seq: int, dtype: str) -> int:
    """Bytes autograd keeps for the native attention of every layer of one micro-batch (see module doc)."""
    a = dtype_bytes(dtype)
    n = batch * seq
    heads, c, r = shape.heads, shape.kv_lora_rank, shape.qk_rope_head_dim
    q_in, k = shape.q_lora_rank or 0, min(shape.index_topk, seq)

    def rms(d: int) -> int:  # float32 input (a copy unless the input is float32), rsqrt, output
        return n * d * (4 + a) + 4 * n

    per_layer = (
        n * shape.hidden * a  # q_a_proj / kv_a_proj input
        + (rms(q_in) + n * q_in * a if q_in else 0)  # q_a_layernorm, q_b_proj input
        + n * (c + r) * a + rms(c) - (n * c * 4 if a == 4 else 0)  # kv_a_proj output (the norm's input, k_rot)
        + n * heads * shape.qk_head_dim * a  # q_b_proj output (q_nope and the rope halves)
        + n * heads * shape.qk_nope_head_dim * a  # q_nope per head, for the W_uk product
        + n * heads * (c + r) * a  # absorbed query, roped query
        + n * k * (c + r) * a  # the selected keys gathered from the latent cache
        + n * k * (8 + 1)  # their int64 positions and the readable mask
        + n * heads * k * 4 + (n * heads * k * a if a != 4 else 0)  # float32 softmax (+ its model-dtype copy)
        + n * heads * c * a  # latent attention output, per head for W_uv
        + n * heads * shape.v_head_dim * a  # o_proj input
    )
    return shape.layers * per_layer + seq * r * a  # + the rope cos / sin halves, shared by the layers


def native_indexer_chunk(shape, *, batch: int, keys: int, queries: int) -> int:
    """Queries per indexer chunk (the model's rule: at most ``INDEXER_CHUNK_ELEMENTS`` scores per head)."""
    return max(1, min(queries, INDEXER_CHUNK_ELEMENTS // max(1, batch * shape.index_heads * keys)))


def native_indexer_workspace_bytes(shape, *, batch: int, queries: int, keys: int) -> int:
    """One indexer chunk: float32 per-head scores ``[B, C, H_idx, T]`` (relu in place), the weighted
    sum and its masked copy ``[B, C, T]`` float32, the bool mask, and the top-k's int64 keys where a
    row ties (bounded by one ``[B, C, T]`` int64)."""
    chunk = native_indexer_chunk(shape, batch=batch, keys=keys, queries=queries)
    return batch * chunk * keys * (shape.index_heads * 4 + 4 + 4 + 1 + 8)


def native_gather_workspace_bytes(shape, *, batch: int, queries: int, keys: int, dtype: str) -> int:
    """One chunk's selected-key gather without autograd: ``[B, C, k, c + r]`` keys and ``[B, C, H, k]``
    logits, masked logits and probabilities (float32), the latent output ``[B, C, H, c]``."""
    a = dtype_bytes(dtype)
    chunk = native_indexer_chunk(shape, batch=batch, keys=keys, queries=queries)
    k = min(shape.index_topk, keys)
    c, r, heads = shape.kv_lora_rank, shape.qk_rope_head_dim, shape.heads
    return batch * chunk * (k * (c + r) * a + heads * k * (2 * a + 4) + heads * c * a)


def latent_cache_capacity(prompt: int, new_tokens: int) -> int:
    """Token slots a :class:`~glmpost.models.native_attention.LatentCache` layer holds after a
    ``prompt``-token prefill and ``new_tokens - 1`` one-token decode steps (the last sampled token
    is never fed): it grows to ``max(2 * needed, 16)`` whenever an append does not fit."""
    capacity = length = 0
    for step in [prompt] + [1] * max(new_tokens - 1, 0):
        if length + step > capacity:
            capacity = max(2 * (length + step), 16)
        length += step
    return capacity


def native_cache_bytes(shape, *, batch: int, prompt: int, new_tokens: int, dtype: str) -> dict[str, int]:
    """``{"latent": ..., "indexer_keys": ...}`` bytes the rollout's latent caches hold (capacity)."""
    slots = batch * latent_cache_capacity(prompt, new_tokens)
    a = dtype_bytes(dtype)
    return {"latent": slots * shape.layers * (shape.kv_lora_rank + shape.qk_rope_head_dim) * a,
            "indexer_keys": slots * shape.indexer_layers * shape.index_head_dim * a}
