"""glmpost's GLM-5 attention: MLA over its compressed KV cache, the DSA indexer over cached keys, and
attention over the selected keys only (brief, "NPU 原生" layer one: "算子原生：Attention、DSA Top-k …";
DSA: "Indexer 根据当前 query 和历史 key 表示产生长度为 L_t 的相关性分数，再返回 k 个位置", "正式
Attention 只读取 K_I 和 V_I").

:func:`set_attention` swaps the classes of a loaded ``GlmMoeDsaForCausalLM``'s base model and
attention modules for :class:`NativeGlmMoeDsaModel` / :class:`NativeGlmMoeDsaAttention` (``native``)
or back (``reference``: transformers' own modules). The weights, their names and the checkpoints
are the same either way; the MoE layers, norms and head run unchanged.

What differs from the reference, per layer and forward of ``S`` new tokens over ``T`` cached ones:

* the cache (:class:`LatentCache`) holds MLA's normalised latent ``c_kv`` ``[B, T, kv_lora_rank]``, its
  roped key ``k_rot`` ``[B, T, qk_rope_head_dim]`` and the indexer's keys ``[B, T, index_head_dim]``,
  appended in place into buffers whose capacity doubles (no per-step copy of the cache);
* the indexer scores each query against the cached keys (``O(T)`` per query), in query chunks of at
  most :data:`INDEXER_CHUNK_ELEMENTS` scores, each chunk against the keys causality lets it see;
* each query's top-k (``min(index_topk, T)`` keys, the indexer's rule: :func:`~glmpost.npu.topk.
  deterministic_topk` when installed, else ``torch.topk``) is gathered from the latent cache and
  attended with the key up-projection absorbed into the query (``q_nope·W_uk`` against ``c_kv``) and
  the value up-projection applied after (``W_uv·Σ p·c_kv``): ``[B, S, k]`` work and memory, never a
  dense ``[S, T]`` mask or a per-head expansion of the cache.

Numerics: the same selected keys as the reference for the same scores, softmax in float32 as the
reference; the absorbed products round differently (fp32: log-probs within ~1e-6).

Ops used (what an Ascend build must have natively, see ``npu/OPS.md``): matmul, relu, masked_fill,
softmax, topk on float32 and int64, advanced-index gather and its backward (index_put accumulate),
cat, arange, bitwise and/xor/shift on int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glmpost.npu.topk import deterministic_topk, original_topk

ATTENTION_CHOICES = ("native", "reference")
DEFAULT_ATTENTION = "native"
# Indexer scores held at once per layer (float32 [B, chunk, index_heads, keys]): 1 Mi entries = 4 MiB.
INDEXER_CHUNK_ELEMENTS = 1 << 20


@dataclass
class KeyMask:
    """Which keys a forward's queries may read: ``valid`` bool ``[B, T]`` (real tokens, the cache's
    and the new ones) and ``past`` (cached tokens before this forward); query ``s`` sits at cache
    position ``past + s`` and reads key ``j`` iff ``valid[b, j]`` and ``j <= past + s`` and, for
    packed rows (``segments`` int ``[B, T]``, which sequence each position belongs to), the two
    are of the same sequence."""

    valid: torch.Tensor
    past: int
    segments: torch.Tensor | None = None

    def same_sequence(self, keys: torch.Tensor, queries: slice) -> torch.Tensor | bool:
        """Bool ``[B, C, K]``: key positions ``keys`` (``[K]``, or ``[B, C, K]`` per query) of queries
        ``queries`` in their sequence; True when the rows are not packed."""
        if self.segments is None:
            return True
        mine = self.segments[:, queries][:, :, None]
        if keys.dim() == 1:
            return self.segments[:, None, keys] == mine
        return self.segments.gather(1, keys.flatten(1)).view(keys.shape) == mine

    def first_key(self, query: int) -> int:
        """The first key position query ``query`` of any row may read: where its sequence starts in
        a packed row (the keys before are other sequences'), else 0."""
        if self.segments is None or self.past:
            return 0
        return int((self.segments < self.segments[:, query:query + 1]).sum(-1).min())


def packed_segments(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Which sequence each position of packed rows belongs to (``[B, T]``: a new one wherever the
    position is not the previous one's + 1), or None when no row restarts (transformers' rule,
    ``masking_utils.find_packed_sequence_indices``)."""
    if position_ids is None or position_ids.shape[1] < 2:
        return None
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(restarts.any()):
        return None
    segments = torch.cat([torch.zeros_like(position_ids[:, :1]), restarts.long().cumsum(-1)], dim=1)
    return segments.expand(batch, -1)


class LatentCache:
    """Per layer, the compressed MLA cache and the indexer's keys, appended in place.

    Duck-types what :class:`glmpost.kernel.engine.LocalEngine` and
    :mod:`glmpost.kernel.continuation` use of a transformers cache (``get_seq_length``,
    ``batch_select_indices``, ``copy.deepcopy``). Buffers grow by doubling, so appending ``n`` tokens
    one at a time copies ``O(n)`` entries in all.
    """

    def __init__(self) -> None:
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.lengths: dict[int, int] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths.get(layer_idx, 0)

    def append(self, layer_idx: int, **parts: torch.Tensor) -> dict[str, torch.Tensor]:
        """Append ``parts`` (each ``[B, S, d]``) to layer ``layer_idx``; views ``[B, T + S, d]`` of all."""
        length = self.lengths.get(layer_idx, 0)
        new = next(iter(parts.values())).shape[1]
        stored = self.buffers.get(layer_idx)
        if stored is None or length + new > next(iter(stored.values())).shape[1]:
            capacity = max(2 * (length + new), 16)
            grown = {}
            for name, part in parts.items():
                buffer = part.new_empty((part.shape[0], capacity, part.shape[2]))
                if stored is not None:
                    buffer[:, :length].copy_(stored[name][:, :length])
                grown[name] = buffer
            self.buffers[layer_idx] = stored = grown
        for name, part in parts.items():
            stored[name][:, length : length + new].copy_(part.detach())
        self.lengths[layer_idx] = length + new
        return {name: buffer[:, : length + new] for name, buffer in stored.items()}

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only batch rows ``indices`` (in that order)."""
        for layer_idx, stored in self.buffers.items():
            self.buffers[layer_idx] = {name: buffer.index_select(0, indices.to(buffer.device)) for name, buffer in stored.items()}

    def nbytes(self) -> int:
        """Bytes the buffers hold (capacity, not length)."""
        return sum(b.numel() * b.element_size() for stored in self.buffers.values() for b in stored.values())


def key_mask(attention_mask, batch: int, total: int, past: int, device) -> KeyMask:
    """A :class:`KeyMask` from a 2-D ``[B, T]`` padding mask (1 = real token) or None (all real)."""
    if attention_mask is None:
        return KeyMask(torch.ones((batch, total), dtype=torch.bool, device=device), past)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError("native attention takes a 2-D [batch, keys] padding mask (attention_mask); "
                         "load the model with attention 'reference' to pass transformers' prepared masks")
    if tuple(attention_mask.shape) != (batch, total):
        raise ValueError(f"attention_mask is {tuple(attention_mask.shape)}, expected [batch, cached + new] = {(batch, total)}")
    return KeyMask(attention_mask.bool(), past)


def indexer_queries(indexer, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings):
    """The indexer's roped queries ``[B, S, H, D]`` (float32), keys ``[B, S, D]`` and head weights
    ``[B, S, H]`` (float32, scaled by ``H**-0.5``), computed as transformers' ``GlmMoeDsaIndexer``."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    batch, seq, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, seq, indexer.n_heads, indexer.head_dim)
    q_rot, q_pass = torch.split(q, [rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1).float()
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * (indexer.n_heads ** -0.5)
    return q, k, weights


def index_scores(indexer, queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``Σ_h w_h · relu(scale · q_h·k)`` ``[B, C, K]`` for queries ``[B, C, H, D]`` and keys ``[B, K, D]``,
    ``-inf`` where ``allowed`` (bool ``[B, C, K]``) is False (the reference indexer's formula; its
    products round as another GEMM shape does, so near-equal scores may swap order, not sets)."""
    batch, chunk, heads, dim = queries.shape
    # One [C*H, D] x [D, K] product per row: broadcasting the keys over the chunk would copy them C times.
    scores = torch.bmm(queries.reshape(batch, chunk * heads, dim), keys.transpose(-1, -2).float())
    scores = scores.view(batch, chunk, heads, -1).mul_(indexer.softmax_scale).relu_()
    scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    return scores.masked_fill_(~allowed, float("-inf"))


def select_topk(indexer, scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's top-k of ``scores`` by its rule (int32), observers told as the reference's are."""

    if getattr(indexer, "_glmpost_deterministic_topk", False):
        indices = deterministic_topk(scores, k)
    else:
        indices = original_topk(scores, k, dim=-1).indices.to(torch.int32)
    for observer in list(getattr(indexer, "_glmpost_topk_observers", ())):
        observer(indexer, scores, indices)
    return indices


def _query_chunk(indexer, batch: int, total: int, seq: int) -> int:
    if getattr(indexer, "_glmpost_topk_observers", None):
        return seq  # observers see every query's scores over all keys at once, as the reference shows them
    heads = indexer.n_heads if indexer is not None else 1
    return max(1, min(seq, INDEXER_CHUNK_ELEMENTS // max(1, batch * heads * total)))


def _absorbed_weights(attention) -> tuple[torch.Tensor, torch.Tensor]:
    """``W_uk`` ``[H, nope, c]`` and ``W_uv`` ``[H, v, c]`` of ``kv_b_proj``, read through the module when
    ZeRO-3 partitioned (its forward gathers it) or LoRA-adapted (PEFT's ``weight`` is the frozen part
    alone): ``kv_b_proj(I) = Wᵀ`` exactly, or ``(W + scale · B A)ᵀ`` with the adapter's gradient."""
    proj = attention.kv_b_proj
    weight = proj.weight
    if hasattr(weight, "ds_id") or hasattr(proj, "base_layer"):
        eye = torch.eye(attention.kv_lora_rank, dtype=weight.dtype, device=weight.device)
        weight = proj(eye).transpose(0, 1)
    weight = weight.view(attention.num_heads, attention.qk_nope_head_dim + attention.v_head_dim, attention.kv_lora_rank)
    return weight[:, : attention.qk_nope_head_dim], weight[:, attention.qk_nope_head_dim :]


def _import_reference():
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as reference

    return reference


class _Native:
    """Marker base: a module whose class :func:`set_attention` swapped."""

    reference_class: type


def _queries_and_keys(self, hidden_states: torch.Tensor, position_embeddings):
    """A layer's queries (``q_pass``, rotated ``q_rot``), this forward's cache entries (``latent``,
    rotated ``rot`` and the indexer's ``index`` keys) and the indexer's queries and head weights."""
    reference = _import_reference()
    batch, seq, _ = hidden_states.shape
    nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
    q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_states = self.q_b_proj(q_resid).view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, rope], dim=-1)
    latent = self.kv_a_layernorm(kv_pass)
    cos, sin = position_embeddings
    q_rot, k_rot = reference.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(batch, 1, seq, rope), cos, sin)
    k_rot = k_rot.squeeze(1)

    index_q = index_w = None
    parts = {"latent": latent, "rot": k_rot}
    if self.indexer is not None:
        with torch.no_grad():
            index_q, index_k, index_w = indexer_queries(self.indexer, hidden_states, q_resid, position_embeddings)
        parts["index"] = index_k
    return q_pass, q_rot, parts, index_q, index_w


def _keys_so_far(cache: LatentCache | None, layer: int, parts: dict[str, torch.Tensor], *, past: int) -> dict[str, torch.Tensor]:
    """The keys of every position up to this forward's: ``parts`` appended to ``cache`` (when
    there is one) after its ``past`` positions."""
    if cache is None:
        return parts
    # The cache keeps detached copies; this forward's own keys stay in the autograd graph.
    stored = cache.append(layer, **parts)
    if past == 0:
        return parts
    return {name: torch.cat([stored[name][:, :past], parts[name]], dim=1) if parts[name].requires_grad
            else stored[name] for name in parts}


def native_attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: KeyMask,
                             cache: LatentCache | None = None, position_ids=None, prev_topk_indices=None, **kwargs):
    """One GLM-5 attention layer over its latent cache; ``(output, None, topk_indices [B, S, k])``."""
    if not isinstance(attention_mask, KeyMask):
        raise TypeError("native GLM-5 attention runs inside its base model's forward (a KeyMask, not a 4-D mask)")
    batch, seq, _ = hidden_states.shape
    heads = self.num_heads
    past = attention_mask.past
    total = past + seq

    q_pass, q_rot, parts, index_q, index_w = _queries_and_keys(self, hidden_states, position_embeddings)
    stored = _keys_so_far(cache, self.layer_idx, parts, past=past)

    w_uk, w_uv = _absorbed_weights(self)
    q_latent = torch.einsum("bhsn,hnc->bshc", q_pass, w_uk)  # [B, S, H, c]
    q_rot = q_rot.transpose(1, 2)  # [B, S, H, r]
    if self.indexer is None and prev_topk_indices is None:
        raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
    k = min(self.indexer.index_topk, total) if self.indexer is not None else prev_topk_indices.shape[-1]
    chunk = _query_chunk(self.indexer, batch, total, seq)
    observed = bool(getattr(self.indexer, "_glmpost_topk_observers", None))  # they see scores over every key
    rows = torch.arange(batch, device=hidden_states.device)[:, None, None]
    key_positions = torch.arange(total, device=hidden_states.device)
    outputs, selections = [], []
    for start in range(0, seq, chunk):
        stop = min(seq, start + chunk)
        query_positions = past + torch.arange(start, stop, device=hidden_states.device)
        if self.indexer is not None:
            width = min(total, max(past + stop, k))  # causality hides every later key; -inf fill-ins up to k
            # Packed rows: keys before the chunk's first sequence are scored by no query (variable length).
            low = 0 if observed else max(0, min(attention_mask.first_key(start), width - k))
            window = key_positions[low:width]
            allowed = attention_mask.valid[:, None, low:width] & (window[None, None, :] <= query_positions[None, :, None])
            allowed = allowed & attention_mask.same_sequence(window, slice(start, stop))
            with torch.no_grad():
                scores = index_scores(self.indexer, index_q[:, start:stop], index_w[:, start:stop],
                                      stored["index"][:, low:width], allowed)
                selected = select_topk(self.indexer, scores, k) + low
        else:
            selected = prev_topk_indices[:, start:stop]
        selections.append(selected)
        index = selected.long()
        readable = attention_mask.valid.gather(1, index.flatten(1)).view(index.shape) & (index <= query_positions[None, :, None])
        readable = readable & attention_mask.same_sequence(index, slice(start, stop))
        keys_latent = stored["latent"][rows, index]  # [B, C, k, c]
        keys_rot = stored["rot"][rows, index]  # [B, C, k, r]
        logits = (torch.matmul(q_latent[:, start:stop], keys_latent.transpose(-1, -2))
                  + torch.matmul(q_rot[:, start:stop], keys_rot.transpose(-1, -2))) * self.scaling
        logits = logits.masked_fill(~readable[:, :, None, :], torch.finfo(logits.dtype).min)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
        if self.training and self.attention_dropout:
            probs = F.dropout(probs, p=self.attention_dropout)
        outputs.append(torch.matmul(probs, keys_latent))  # [B, C, H, c]
    out_latent = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    attn_output = torch.einsum("bshc,hvc->bshv", out_latent, w_uv).reshape(batch, seq, heads * self.v_head_dim)
    topk_indices = selections[0] if len(selections) == 1 else torch.cat(selections, dim=1)
    return self.o_proj(attn_output), None, topk_indices


def native_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                         use_cache=None, past_key_values=None, **kwargs):
    """``GlmMoeDsaModel.forward`` over :class:`LatentCache` and a :class:`KeyMask` (no 4-D mask is built)."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    cache = cache if cache is not None else past_key_values
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if cache is not None and not isinstance(cache, LatentCache):
        raise TypeError(f"native GLM-5 attention keeps a LatentCache, got {type(cache).__name__}: load the model with "
                        "attention 'reference' to use transformers' caches (e.g. GenerationMixin.generate)")
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        raise ValueError("native GLM-5 attention does not return attentions or hidden states: use attention 'reference'")
    embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    batch, seq = embeds.shape[:2]
    use_cache = self.config.use_cache if use_cache is None else use_cache
    if use_cache and cache is None:
        cache = LatentCache()
    past = cache.get_seq_length() if cache is not None else 0
    if position_ids is None:
        position_ids = torch.arange(past, past + seq, device=embeds.device).unsqueeze(0)
    keys = key_mask(attention_mask, batch, past + seq, past, embeds.device)
    if attention_mask is None and past == 0:
        keys.segments = packed_segments(position_ids, batch)
    position_embeddings = self.rotary_emb(embeds, position_ids=position_ids)
    hidden, topk_indices = embeds, None
    for layer in self.layers[: self.config.num_hidden_layers]:
        hidden, topk_indices = layer(hidden, attention_mask=keys, position_embeddings=position_embeddings,
                                     position_ids=position_ids, cache=cache, use_cache=use_cache,
                                     prev_topk_indices=topk_indices)
    return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=cache if use_cache else None)


def _native_class(base: type, forward) -> type:
    name = f"Native{base.__name__}"
    cls = type(name, (base, _Native), {"forward": forward, "reference_class": base, "__module__": __name__,
                                       "__qualname__": name})
    globals()[name] = cls  # picklable by name once made
    return cls


_CLASSES: dict[type, type] = {}


def _swap(module: torch.nn.Module, forward) -> None:
    base = type(module)
    if base not in _CLASSES:
        _CLASSES[base] = _native_class(base, forward)
    module.__class__ = _CLASSES[base]


def set_attention(model: torch.nn.Module, kind: str) -> int:
    """Run ``model``'s GLM-5 attention ``native`` (this module) or ``reference`` (transformers').

    Returns the number of attention layers the choice applies to (0 for a model without GLM-5
    attention: it runs as it is). Unknown ``kind`` raises ValueError naming the choices.
    """
    if kind not in ATTENTION_CHOICES:
        raise ValueError(f"attention {kind!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
    reference = _import_reference()
    count = 0
    for module in model.modules():
        current = type(module).reference_class if isinstance(module, _Native) else type(module)
        if issubclass(current, reference.GlmMoeDsaAttention):
            count += 1
        elif not issubclass(current, reference.GlmMoeDsaModel):
            continue
        if kind == "reference":
            module.__class__ = current
        elif not isinstance(module, _Native):
            _swap(module, native_attention_forward if issubclass(current, reference.GlmMoeDsaAttention) else native_model_forward)
    return count


def attention_of(model: torch.nn.Module) -> str | None:
    """``native``/``reference`` for a model with GLM-5 attention, else None."""
    reference = _import_reference()
    for module in model.modules():
        if isinstance(module, _Native) and issubclass(type(module), reference.GlmMoeDsaAttention):
            return "native"
        if isinstance(module, reference.GlmMoeDsaAttention):
            return "reference"
    return None
