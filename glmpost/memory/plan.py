"""Peak-memory accounting per role of a GLM-style RL / OPD run (``glmpost plan``).

The brief (section "内存不是“参数量乘位宽”", memory is not "parameters x bit width") writes the
peak as

    M_peak = M_model_state + M_saved_activations + M_operator_workspace
             + M_communication_buffers + M_live_IO + M_allocator + M_runtime_margin

and asks that every object (Actor, Reference, Teacher, Critic, rollout KV, DSA index, teacher
logits, weight-reshard buffer) be placed in one of those categories, since they "may reside on
different NPUs, processes or time spans". :func:`plan_memory` returns one :class:`RoleMemory` per
object with the first five terms in bytes; the allocator term is not modelled (caching allocators
add fragmentation that only a measurement shows) and the runtime margin is ``margin`` x the sum.

Exact terms (tested byte for byte against the tiny model, ``tests/test_plan.py``):

- parameters of a ``GlmMoeDsaForCausalLM`` config (:meth:`ModelShape.parameter_count`);
- weights ``P * b_w``, gradients ``P_train * b_g`` and AdamW moments ``2 * P_train * 4`` of one
  local process. ``P_train`` excludes the DSA indexer, whose forward runs under ``no_grad`` in
  transformers (brief: "RL 默认冻结 Indexer"), so it never gets a gradient or an optimizer state;
- the rollout KV cache: MLA caches the compressed latent, ``kv_lora_rank + qk_rope_head_dim``
  values per token and layer, and the DSA indexer caches ``index_head_dim`` per token and layer.

ZeRO (Rajbhandari et al. 2020, section 3): with ``N`` ranks stage 1 divides the optimizer states
(AdamW moments, plus the fp32 master copy when weights are 16-bit: K = 12 bytes per parameter) by
``N``, stage 2 also the gradients, stage 3 also the weights.

Estimated terms (within the tolerance stated in ``tests/test_plan.py``):

- saved activations of one training micro-batch, summed per operator of transformers'
  GlmMoeDsa forward (:func:`saved_activation_terms`); the ``[C, H]`` inputs of the chunked log-prob
  head (glmpost/kernel/logprobs.py checkpoints each chunk, so ``[T, V]`` logits are never saved);
- workspace: the largest transient of one operator (the chunked head's ``[C, V]`` float32 buffers,
  attention scores, the DSA indexer's ``[B, S, H_idx, S]`` float32 scores), not their sum;
- communication buffers: DeepSpeed's reduce and all-gather buckets (glmpost's: 2 % of the model,
  1e6 to 2e7 elements, :mod:`glmpost.memory.buckets`, unless the DeepSpeed config says otherwise);
  the weight-sync buffer holds a full copy of the weights in the rollout format;
- live IO: the micro-batch tensors the trainer builds (ids, masks, rollout / old log-probs) and
  the teacher payload (sampled log-prob, or top-k ids + log-probs per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmpost.memory.architectures import gqa_attention_saved_bytes, other_model_fields
from glmpost.memory.native import (
    native_attention_saved_bytes,
    native_gather_workspace_bytes,
    native_indexer_workspace_bytes,
)
from glmpost.memory.units import dtype_bytes

GIB = 2**30

COMPONENTS = ("model_state", "saved_activations", "workspace", "communication", "live_io")
ROLES = ("actor", "reference", "teacher", "critic", "rollout_kv", "dsa_index", "teacher_payload", "routed_experts", "weight_sync")


GLM5_MODEL_TYPE = "glm_moe_dsa"


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a causal LM config that memory depends on: GLM-5 (``GlmMoeDsaForCausalLM``:
    MLA, DSA indexer, MoE) with exact formulas, and any other transformers causal LM
    (:meth:`from_config`): MLA without an indexer (DeepSeek-V3) or grouped-query attention (Llama,
    Qwen3, Qwen3-MoE, GLM-4, GLM-4.5), dense or MoE, its parameters counted on the meta device."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    intermediate: int
    moe_intermediate: int
    experts: int
    experts_per_token: int
    shared_experts: int
    dense_layers: int
    indexer_layers: int
    index_topk: int
    index_head_dim: int
    index_heads: int
    n_group: int = 1
    topk_group: int = 1
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = GLM5_MODEL_TYPE
    attention_kind: str = "mla"  # mla (q / kv low-rank projections, GLM-5, DeepSeek-V3) or gqa
    kv_heads: int = 0  # gqa: key / value heads
    head_dim: int = 0  # gqa: per head
    qk_norm: bool = False  # gqa: RMSNorm over each query and key head (Qwen3, GLM-4.5)
    norms_per_layer: int = 2  # GLM-4 also norms after attention and after the MLP
    counted: tuple[tuple[str, int], ...] | None = None  # parameter counts of a model without a formula here

    @property
    def native_attention(self) -> bool:  # glmpost's native attention runs GLM-5 only
        return self.model_type == GLM5_MODEL_TYPE

    def kernel(self, attention: str) -> str:
        """The kernel for ``attention``: ``native`` on another model is its own SDPA, fused, or its math
        path for MLA (whose value head size differs from the query's; measured on a CPU)."""
        return attention if attention != "native" or self.native_attention else ("math" if self.attention_kind == "mla" else "fused")

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config object or its ``config.json`` dict."""
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        if get("model_type", GLM5_MODEL_TYPE) != GLM5_MODEL_TYPE:
            return cls(**other_model_fields(config, get))
        layers = int(get("num_hidden_layers"))
        mlp_types = get("mlp_layer_types")
        if mlp_types:
            dense = sum(1 for t in mlp_types[:layers] if t == "dense")
        else:
            dense = min(int(get("first_k_dense_replace", 0) or 0), layers)
        indexer_types = get("indexer_types")
        indexer_layers = sum(1 for t in indexer_types[:layers] if t == "full") if indexer_types else layers
        return cls(
            vocab=int(get("vocab_size")),
            hidden=int(get("hidden_size")),
            layers=layers,
            heads=int(get("num_attention_heads")),
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            v_head_dim=int(get("v_head_dim")),
            intermediate=int(get("intermediate_size")),
            moe_intermediate=int(get("moe_intermediate_size")),
            experts=int(get("n_routed_experts")),
            experts_per_token=int(get("num_experts_per_tok")),
            shared_experts=int(get("n_shared_experts", 0) or 0),
            dense_layers=dense,
            indexer_layers=indexer_layers,
            index_topk=int(get("index_topk")),
            index_head_dim=int(get("index_head_dim")),
            index_heads=int(get("index_n_heads")),
            n_group=int(get("n_group", 1) or 1),
            topk_group=int(get("topk_group", 1) or 1),
            attention_bias=bool(get("attention_bias", False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        )

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def indexer_parameters_per_layer(self) -> int:
        """wq_b [H_idx*D_idx, q_lora], wk [D_idx, H], k_norm LayerNorm (weight + bias), weights_proj [H_idx, H]."""
        q_in = self.q_lora_rank or self.hidden
        d, h = self.index_head_dim, self.hidden
        return q_in * self.index_heads * d + h * d + 2 * d + h * self.index_heads

    def attention_parameters_per_layer(self) -> int:
        """MLA: q_a / q_a_norm / q_b (or q_proj), kv_a_with_mqa / kv_a_norm / kv_b, o_proj."""
        h, heads, bias = self.hidden, self.heads, int(self.attention_bias)
        if self.q_lora_rank:
            q = h * self.q_lora_rank + bias * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        else:
            q = h * heads * self.qk_head_dim
        kv_a = self.kv_lora_rank + self.qk_rope_head_dim
        kv = h * kv_a + bias * kv_a + self.kv_lora_rank + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = heads * self.v_head_dim * h + bias * h
        return q + kv + o

    def moe_parameters_per_layer(self) -> int:
        """Routed experts (gate_up [E, 2I, H], down [E, H, I]), router [E, H], shared experts MLP."""
        h, i = self.hidden, self.moe_intermediate
        return 3 * self.experts * h * i + self.experts * h + 3 * h * i * self.shared_experts

    def parameter_count(self) -> dict[str, int]:
        """Exact parameter counts: ``total``, ``trainable`` (all but the indexer), ``indexer``,
        ``fp32_kept`` (router weights, indexer weights_proj: kept in float32 by transformers)."""
        if self.counted is not None:
            return dict(self.counted)
        h = self.hidden
        embeddings = self.vocab * h * (1 if self.tie_word_embeddings else 2)
        per_layer_norms = 2 * h
        dense = self.dense_layers * (3 * h * self.intermediate + per_layer_norms)
        moe = self.moe_layers * (self.moe_parameters_per_layer() + per_layer_norms)
        attention = self.layers * self.attention_parameters_per_layer()
        indexer = self.indexer_layers * self.indexer_parameters_per_layer()
        total = embeddings + dense + moe + attention + indexer + h  # + final norm
        fp32_kept = self.moe_layers * self.experts * h + self.indexer_layers * h * self.index_heads
        return {"total": total, "trainable": total - indexer, "indexer": indexer, "fp32_kept": fp32_kept}


# ----------------------------------------------------------------------------------------------
# Pure per-object formulas (bytes)


def model_state_bytes(
    shape: ModelShape, *, dtype: str, trainable: bool, zero_stage: int = 0, ranks: int = 1
) -> dict[str, int]:
    """``{weights, grads, optimizer}`` per rank.

    weights = (P - P_fp32) * b + P_fp32 * 4; grads = P_train * b; optimizer = P_train * K with
    K = 8 (AdamW m, v in float32) plus 4 for a float32 master copy when b < 4. ZeRO stage >= 1
    divides the optimizer term by ``ranks``, >= 2 the gradients, 3 the weights.
    """
    b = dtype_bytes(dtype)
    counts = shape.parameter_count()
    fp32_kept = counts["fp32_kept"] if b != 4 else 0
    weights = (counts["total"] - fp32_kept) * b + fp32_kept * 4
    if not trainable:
        return {"weights": weights, "grads": 0, "optimizer": 0}
    grads = counts["trainable"] * b
    optimizer = counts["trainable"] * (8 + (4 if b < 4 else 0))
    n = max(ranks, 1)
    return {
        "weights": _ceil_div(weights, n) if zero_stage >= 3 else weights,
        "grads": _ceil_div(grads, n) if zero_stage >= 2 else grads,
        "optimizer": _ceil_div(optimizer, n) if zero_stage >= 1 else optimizer,
    }


def saved_activation_terms(
    shape: ModelShape, *, batch: int, seq: int, dtype: str = "float32", attention: str = "math",
    scored_tokens: int | None = None,
) -> dict[str, int]:
    """Bytes autograd keeps for backward for one micro-batch ``[batch, seq]``, per operator group.

    N = batch * seq tokens, a = activation bytes. Per layer, following transformers' GlmMoeDsa forward:
    RMSNorm(d) keeps its float32 input, rsqrt and the normalised output: N*d*(4 + a) + 4N; a linear
    keeps its input; MLA keeps the norm output (q_a/kv_a input), q_a-normed (q_b input), kv_a-normed
    (kv_b input), query and key [N, heads, qk_head], value and o_proj input [N, heads, v_head];
    attention "native" (glmpost's, the default) keeps [N, k] selected keys instead of any [S, S]
    term (:func:`glmpost.memory.native.native_attention_saved_bytes`);
    attention "math" (torch SDPA math path, CPU) keeps probabilities [B, heads, S, S] in a,
    "eager" also their float32 softmax, "fused" (flash / memory-efficient) only a float32
    logsumexp [B, heads, S]; the DSA indexer runs under no_grad and keeps nothing. A dense MLP keeps
    its input, act input, act and up outputs, down input (N*H*a + 4*N*I*a); a MoE layer keeps the
    router input (float32) and small routing tensors, per routed (token, expert) pair the gathered
    input and its expert output, gate_up output, act output, product, 3 int64 indices and a float32
    weight, and the shared-expert MLP. The chunked log-prob head keeps its [scored, H] input rows,
    int64 targets and the bool mask (glmpost/kernel/logprobs.py checkpoints each [C, V] chunk).
    """
    a = dtype_bytes(dtype)
    n = batch * seq
    h = shape.hidden
    heads = shape.heads
    attention = shape.kernel(attention)

    def rms(d: int) -> int:
        return n * d * (4 + a) + 4 * n

    q_in = shape.q_lora_rank or 0
    attn_layer = (
        n * h * a  # the input norm's output: q_a_proj / kv_a_proj input
        + (rms(q_in) + n * q_in * a if q_in else 0)  # q_a_layernorm, q_b_proj input
        + rms(shape.kv_lora_rank) + n * shape.kv_lora_rank * a  # kv_a_layernorm, kv_b_proj input
        + n * heads * shape.v_head_dim * a  # o_proj input
    )
    qkv = n * heads * (2 * shape.qk_head_dim + shape.v_head_dim)  # query, key, value elements
    if attention == "math":  # torch's SDPA math path computes (and saves) in float32 on CPU
        scores = qkv * 4 + batch * heads * seq * seq * 4
    elif attention == "eager":  # transformers' eager: float32 softmax, then a copy in a 16-bit model dtype
        scores = qkv * a + batch * heads * seq * seq * (4 + (a if a != 4 else 0))
    elif attention == "fused":  # flash / memory-efficient: q, k, v, output and a float32 logsumexp
        scores = qkv * a + n * heads * shape.v_head_dim * a + batch * heads * seq * 4
    elif attention != "native":
        raise ValueError(f"attention must be native, math, eager or fused; got {attention!r}")
    rope = 2 * seq * shape.qk_rope_head_dim * a  # cos, sin halves for q and k
    norms = shape.norms_per_layer * rms(h)
    dense_mlp = n * h * a + 4 * n * shape.intermediate * a
    pairs = n * shape.experts_per_token
    e, im = shape.experts, shape.moe_intermediate
    router = n * h * 4 + (n * h * a if a != 4 else 0) + n * (
        5 * e + 16 * shape.n_group + 8 * shape.topk_group + 4 + 12 * shape.experts_per_token
    )
    experts = pairs * (2 * h * a + 4 * im * a + 3 * 8 + 4) + 4 * e
    shared = 4 * n * im * shape.shared_experts * a
    scored = n - batch if scored_tokens is None else scored_tokens
    head = scored * (h * a + 8) + batch * (seq - 1) + rms(h)  # rows, targets, mask, final norm
    if attention == "native":  # glmpost's MLA over the selected keys: no [S, S] term (glmpost.memory.native)
        attention_bytes, scores_bytes = native_attention_saved_bytes(shape, batch=batch, seq=seq, dtype=dtype), 0
    elif shape.attention_kind == "gqa":
        attention_bytes, scores_bytes = gqa_attention_saved_bytes(shape, batch=batch, seq=seq, a=a, attention=attention)
    else:
        attention_bytes, scores_bytes = shape.layers * (attn_layer + rope), shape.layers * scores
    return {
        "embedding_ids": n * 8,
        "norms": shape.layers * norms,
        "attention": attention_bytes,
        "attention_scores": scores_bytes,
        "dense_mlp": shape.dense_layers * dense_mlp,
        "moe": shape.moe_layers * (router + experts + shared),
        "head": head,
    }


def checkpointed_activation_terms(shape: ModelShape, *, batch: int, seq: int, dtype: str = "float32",
                                  attention: str = "math", scored_tokens: int | None = None) -> dict[str, int]:
    """Saved bytes of one micro-batch with activation checkpointing per decoder layer: every layer's
    input (the residual stream, float32 over float32 masters), the activations of the one layer the
    backward pass recomputes at a time (the largest: dense or MoE), the head's and the ids."""
    full = saved_activation_terms(shape, batch=batch, seq=seq, dtype=dtype, attention=attention, scored_tokens=scored_tokens)
    shared = (full["norms"] + full["attention"] + full["attention_scores"]) / shape.layers
    mlp = max(full["dense_mlp"] / max(shape.dense_layers, 1), full["moe"] / max(shape.moe_layers, 1))
    return {"embedding_ids": full["embedding_ids"], "layer_inputs": shape.layers * batch * seq * shape.hidden * 4,
            "one_layer_recomputed": int(shared + mlp), "head": full["head"]}


def saved_activation_bytes(shape: ModelShape, **kwargs: Any) -> int:
    return sum(saved_activation_terms(shape, **kwargs).values())


def kv_cache_bytes(shape: ModelShape, *, batch: int, seq: int, dtype: str) -> int:
    """GLM-5's MLA latent cache: batch * seq * layers * (kv_lora_rank + qk_rope_head_dim) * b; a
    grouped-query model's keys and values, 2 * kv_heads * head_dim per token and layer; another MLA
    model (DeepSeek-V3 in transformers) caches its expanded keys and values, heads * (qk_head_dim +
    v_head_dim)."""
    if shape.attention_kind == "gqa":
        per_token = 2 * shape.kv_heads * shape.head_dim
    elif shape.native_attention:
        per_token = shape.kv_lora_rank + shape.qk_rope_head_dim
    else:
        per_token = shape.heads * (shape.qk_head_dim + shape.v_head_dim)
    return batch * seq * shape.layers * per_token * dtype_bytes(dtype)


def indexer_cache_bytes(shape: ModelShape, *, batch: int, seq: int, dtype: str) -> int:
    """DSA indexer key cache: batch * seq * indexer_layers * index_head_dim * b."""
    return batch * seq * shape.indexer_layers * shape.index_head_dim * dtype_bytes(dtype)


def indexer_workspace_bytes(shape: ModelShape, *, batch: int, queries: int, keys: int, attention: str = "math") -> int:
    """One indexer call: float32 scores [B, Sq, H_idx, Sk], index scores [B, Sq, Sk] and the bool
    index mask [B, Sq, Sk] (transformers' indexer); the native path scores one query chunk at a time
    (:func:`glmpost.memory.native.native_indexer_workspace_bytes`). A model without an indexer: 0."""
    if shape.indexer_layers == 0:
        return 0
    if attention == "native":
        return native_indexer_workspace_bytes(shape, batch=batch, queries=queries, keys=keys)
    return batch * queries * keys * (shape.index_heads * 4 + 4 + 1)


def head_workspace_bytes(shape: ModelShape, *, chunk: int, dtype: str, grad: bool) -> int:
    """The chunked log-prob head: two float32 [C, V] buffers without autograd; with autograd
    backward holds three [C, V] float32 buffers and one [V, H] partial weight gradient."""
    cv = chunk * shape.vocab * 4
    if not grad:
        return 2 * cv
    return 3 * cv + shape.vocab * shape.hidden * dtype_bytes(dtype)


def attention_workspace_bytes(shape: ModelShape, *, batch: int, seq: int, attention: str, grad: bool,
                              dtype: str = "float32") -> int:
    """Transient attention scores: float32 [B, heads, S, S] (x2 in backward) on the math / eager path;
    one query chunk's selected-key gather on the native path."""
    attention = shape.kernel(attention)
    if attention == "native":
        return native_gather_workspace_bytes(shape, batch=batch, queries=seq, keys=seq, dtype=dtype)
    if attention == "fused":
        return 0
    return batch * shape.heads * seq * seq * 4 * (2 if grad else 1)


def train_io_bytes(*, batch: int, seq: int) -> int:
    """A trainer micro-batch: int64 ids and attention mask [B, S]; bool action mask, float32 rollout
    and old log-probs, bool trust mask [B, S-1]; advantages [B]; output log-probs and entropy."""
    t = seq - 1
    return batch * seq * 16 + batch * t * (1 + 4 + 4 + 1) + batch * 4 + batch * t * (4 + 4 + 1)


def teacher_payload_bytes(*, records: int, tokens: int, payload: str, topk: int) -> int:
    """Per token: float32 sampled log-prob, or top-k int32 ids + float32 log-probs (+ the sampled one)."""
    per_token = 4 if payload == "sampled" else 4 + topk * 8
    return records * tokens * per_token


def weight_sync_bytes(shape: ModelShape, *, quantize: str, dtype: str) -> int:
    """A full copy of the weights in the rollout format: the train dtype, fp8 with one float32 scale
    per 128x128 block, or int4 with one bf16 scale per 128 inputs."""
    p = shape.parameter_count()["total"]
    if quantize == "fp8-block":
        return p + _ceil_div(p, 128 * 128) * 4
    if quantize == "w4a16":
        return _ceil_div(p, 2) + _ceil_div(p, 128) * 2
    return p * dtype_bytes(dtype)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
