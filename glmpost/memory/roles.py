"""The memory plan's roles (``glmpost plan``): what a recipe runs (:class:`Workload`), the peak
per object of an RL / OPD run (:func:`plan_memory`, from the terms of :mod:`glmpost.memory.plan`
and, for the native attention, :mod:`glmpost.memory.native`), and what each object is
(:data:`OBJECTS`: layout, producer, consumer, owner, lifetime; brief: "内存不是“参数量乘位宽”").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from glmpost.memory.buckets import DEFAULT_ALLGATHER_BUCKET, DEFAULT_REDUCE_BUCKET, zero_bucket_elements
from glmpost.memory.lora import experts_delta_bytes, lora_parameter_count, lora_state_bytes
from glmpost.memory.native import native_cache_bytes, native_gather_workspace_bytes
from glmpost.memory.plan import (
    COMPONENTS,
    GIB,
    ModelShape,
    attention_workspace_bytes,
    checkpointed_activation_terms,
    head_workspace_bytes,
    indexer_cache_bytes,
    indexer_workspace_bytes,
    kv_cache_bytes,
    model_state_bytes,
    saved_activation_terms,
    teacher_payload_bytes,
    train_io_bytes,
    weight_sync_bytes,
)
from glmpost.memory.units import dtype_bytes


@dataclass
class Workload:
    """What a recipe runs (training micro-batch, rollout batch, payloads), with glmpost defaults."""

    micro_batch: int = 8
    seq: int = 576  # prompt + response tokens of one trajectory
    response_tokens: int = 64
    chunk_size: int = 512
    dtype: str = "bfloat16"  # the checkpoint's: frozen models, the rollout, the published versions
    precision: str = "bf16"  # training arithmetic over float32 masters: activations in bf16, or fp32
    activation_checkpointing: bool = False
    zero_stage: int = 0
    ranks: int = 1
    attention: str = "native"  # native (glmpost), or the reference kernels: math, eager, fused
    rollout_batch: int = 32
    rollout_prompt: int = 512
    rollout_dtype: str = "bfloat16"
    records_per_update: int = 64
    reference: bool = False
    teacher: bool = False
    critic: bool = False
    training: bool = True
    rollout: bool = True
    teacher_payload: str = "sampled"
    teacher_topk: int = 0
    sync_quantize: str = "none"
    sync: bool = False
    reduce_bucket: int = DEFAULT_REDUCE_BUCKET
    allgather_bucket: int = DEFAULT_ALLGATHER_BUCKET
    margin: float = 0.0
    routing: bool = False  # rollout --record-routing / a trainer's --routing-replay (issue 33)
    micro_batch_tokens: int = 0  # a token budget instead of micro_batch sequences
    pack_sequences: bool = False
    lora_rank: int = 0  # the actor trains a LoRA adapter of this rank (0: every weight; issue 45)
    lora_targets: tuple[str, ...] | None = None  # None: the adapter's default targets

    def micro_rows(self) -> int:
        """Trajectories of ``seq`` tokens in a training micro-batch: ``micro_batch``, or as many as
        the token budget holds (padded: rows x ``seq``; packed: the row's tokens, the same count)."""
        return max(1, self.micro_batch_tokens // self.seq) if self.micro_batch_tokens > 0 else self.micro_batch

    def indexer_geometry(self) -> dict[str, int]:
        """The DSA indexer's scores in training: each row's queries against its keys (a packed row's
        every query against the whole row, the other sequences masked)."""
        if self.pack_sequences:
            return {"batch": 1, "queries": self.micro_rows() * self.seq, "keys": self.micro_rows() * self.seq}
        return {"batch": self.micro_rows(), "queries": self.seq, "keys": self.seq}


@dataclass
class RoleMemory:
    role: str
    used: bool
    model_state: int = 0
    saved_activations: int = 0
    workspace: int = 0
    communication: int = 0
    live_io: int = 0
    margin: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(getattr(self, c) for c in COMPONENTS) + self.margin

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["peak"] = self.peak
        return out


def plan_memory(shape: ModelShape, w: Workload) -> list[RoleMemory]:
    """One :class:`RoleMemory` per role in :data:`ROLES` (unused roles are present with used=False)."""
    rows = [*_model_roles(shape, w), *_rollout_roles(shape, w), *_transfer_roles(shape, w)]
    for row in rows:
        row.margin = int(w.margin * sum(getattr(row, c) for c in COMPONENTS))
    return rows


def _model_roles(shape: ModelShape, w: Workload) -> list[RoleMemory]:
    """The actor, the reference, the teacher and the critic."""
    deepspeed = w.zero_stage > 0 or w.ranks > 1
    counts = shape.parameter_count()
    rows: list[RoleMemory] = []

    def comm_buffers(train: bool) -> int:
        if not deepspeed:
            return 0
        b = 4 if train else dtype_bytes(w.dtype)  # a trained model's parameters and gradients are float32
        reduce = min(zero_bucket_elements(counts["total"], w.reduce_bucket), counts["trainable"]) * b if train else 0
        return reduce + min(zero_bucket_elements(counts["total"], w.allgather_bucket), counts["total"]) * b

    # Actor: the policy being trained (train-grpo / opd-merge / qat): float32 master weights, gradients
    # and AdamW states whatever the checkpoint's dtype; activations in the precision's dtype.
    full_state = model_state_bytes(shape, dtype="float32", trainable=True, zero_stage=w.zero_stage, ranks=w.ranks)
    act_dtype = w.dtype if w.precision == "bf16" else "float32"
    state = full_state if not w.lora_rank else lora_state_bytes(shape, rank=w.lora_rank, targets=w.lora_targets,
                                                                base_dtype=act_dtype, zero_stage=w.zero_stage, ranks=w.ranks)
    lora = {"lora_parameters": lora_parameter_count(shape, w.lora_rank, w.lora_targets)["total"]} if w.lora_rank else {}
    activations = checkpointed_activation_terms if w.activation_checkpointing else saved_activation_terms
    acts = activations(shape, batch=w.micro_rows(), seq=w.seq, dtype=act_dtype, attention=w.attention)
    ws = {
        "logprob_head": head_workspace_bytes(shape, chunk=w.chunk_size, dtype="float32", grad=True),
        "attention": attention_workspace_bytes(shape, batch=w.micro_rows(), seq=w.seq, attention=w.attention, grad=True,
                                               dtype=act_dtype),
        "dsa_indexer": indexer_workspace_bytes(shape, **w.indexer_geometry(), attention=w.attention),
        **({"lora_experts_delta": experts_delta_bytes(shape, rank=w.lora_rank, targets=w.lora_targets)} if w.lora_rank else {}),
    }
    rows.append(RoleMemory(
        "actor", w.training, sum(state.values()), sum(acts.values()), max(ws.values()), comm_buffers(True),
        train_io_bytes(batch=w.micro_rows(), seq=w.seq), details={**state, **lora, "activations": acts, "workspace": ws},
    ))
    # Reference and teacher: frozen forward passes without autograd.
    frozen = model_state_bytes(shape, dtype=w.dtype, trainable=False)
    frozen_ws = {
        "logprob_head": head_workspace_bytes(shape, chunk=w.chunk_size, dtype=w.dtype, grad=False),
        "attention": attention_workspace_bytes(shape, batch=w.micro_rows(), seq=w.seq, attention=w.attention, grad=False,
                                               dtype=w.dtype),
        "dsa_indexer": indexer_workspace_bytes(shape, **w.indexer_geometry(), attention=w.attention),
    }
    io = train_io_bytes(batch=w.micro_rows(), seq=w.seq)
    rows.append(RoleMemory("reference", w.reference, sum(frozen.values()), 0, max(frozen_ws.values()),
                           comm_buffers(False) if w.reference else 0, io, details={**frozen, "workspace": frozen_ws}))
    payload_micro = teacher_payload_bytes(records=w.micro_rows(), tokens=w.response_tokens, payload=w.teacher_payload, topk=w.teacher_topk)
    rows.append(RoleMemory("teacher", w.teacher, sum(frozen.values()), 0, max(frozen_ws.values()), 0, io + payload_micro,
                           details={**frozen, "workspace": frozen_ws}))
    # Critic (SAO): the body plus a scalar value head instead of the LM head.
    critic_params_saved = (shape.vocab * shape.hidden - shape.hidden - 1) if not shape.tie_word_embeddings else 0
    critic_state = {k: max(v - critic_params_saved * (4 if k != "optimizer" else 8), 0) for k, v in full_state.items()}
    rows.append(RoleMemory("critic", w.critic, sum(critic_state.values()), sum(acts.values()) - acts["head"],
                           max(ws["attention"], ws["dsa_indexer"]), comm_buffers(True),
                           train_io_bytes(batch=w.micro_rows(), seq=w.seq), details=critic_state))
    return rows


def _rollout_roles(shape: ModelShape, w: Workload) -> list[RoleMemory]:
    """The rollout's KV cache and the DSA index."""
    rows: list[RoleMemory] = []
    # Rollout KV cache: the whole rollout batch at prompt + max-new-tokens.
    rollout_seq = w.rollout_prompt + w.response_tokens
    native = w.attention == "native" and shape.native_attention
    if native:  # LatentCache buffers: their doubled capacity, not just the tokens written
        cache = native_cache_bytes(shape, batch=w.rollout_batch, prompt=w.rollout_prompt, new_tokens=w.response_tokens,
                                   dtype=w.rollout_dtype)
        kv, index_cache = cache["latent"], cache["indexer_keys"]
    else:
        kv = kv_cache_bytes(shape, batch=w.rollout_batch, seq=rollout_seq, dtype=w.rollout_dtype)
        index_cache = indexer_cache_bytes(shape, batch=w.rollout_batch, seq=rollout_seq, dtype=w.rollout_dtype)
    rows.append(RoleMemory(
        "rollout_kv", w.rollout, 0, kv,
        # decode: [B, V] float32 logits, scaled copy and softmax / sort buffers
        3 * w.rollout_batch * shape.vocab * 4,
        0, w.rollout_batch * rollout_seq * 8 * 2 + w.rollout_batch * w.response_tokens * 4,
        details={"batch": w.rollout_batch, "seq": rollout_seq, "per_token": kv // max(w.rollout_batch * rollout_seq, 1)},
    ))
    # DSA index: indexer key cache in rollout, top-k indices and scoring workspace in training.
    topk = min(shape.index_topk, w.seq)
    rows.append(RoleMemory(
        "dsa_index", w.rollout or w.training, 0, index_cache,
        max(indexer_workspace_bytes(shape, batch=w.rollout_batch, queries=w.rollout_prompt, keys=w.rollout_prompt,
                                    attention=w.attention),
            indexer_workspace_bytes(shape, **w.indexer_geometry(), attention=w.attention)),
        0, 2 * w.micro_rows() * w.seq * topk * 4,  # int32 top-k of this layer and the previous one
        details={"rollout_key_cache": index_cache, **({"rollout_gather_workspace": native_gather_workspace_bytes(
            shape, batch=w.rollout_batch, queries=w.rollout_prompt, keys=w.rollout_prompt, dtype=w.rollout_dtype)}
            if native else {})},
    ))
    return rows


def routing_bytes_per_token(shape: ModelShape) -> int:
    """A record's ``routed_experts`` per token before compression (formats/SPEC.md "Routing"):
    MoE layers x experts per token x 1 byte (uint8: up to 255 routed experts, or 256 with k >= 2,
    GLM-5's) or 2 (uint16)."""
    if not shape.experts or not shape.experts_per_token:
        return 0
    narrow = shape.experts <= 0xFF or (shape.experts == 0x100 and shape.experts_per_token >= 2)
    return shape.moe_layers * shape.experts_per_token * (1 if narrow else 2)


def _transfer_roles(shape: ModelShape, w: Workload) -> list[RoleMemory]:
    """The teacher payload of an update and the weight sync's buffers."""
    rows: list[RoleMemory] = []
    payload = teacher_payload_bytes(records=w.records_per_update, tokens=w.response_tokens, payload=w.teacher_payload, topk=w.teacher_topk)
    rows.append(RoleMemory("teacher_payload", w.teacher, 0, 0, 0, 0, payload,
                           details={"records": w.records_per_update, "kind": w.teacher_payload}))
    per_token = routing_bytes_per_token(shape)
    rows.append(RoleMemory("routed_experts", w.routing and per_token > 0, 0, 0, 0, 0,
                           w.micro_rows() * w.seq * per_token,  # the trainer's copy for one micro-batch
                           details={"bytes_per_token": per_token, "moe_layers": shape.moe_layers,
                                    "experts_per_token": shape.experts_per_token,
                                    "per_update": w.records_per_update * w.response_tokens * per_token}))
    sync = weight_sync_bytes(shape, quantize=w.sync_quantize, dtype=w.rollout_dtype)
    rows.append(RoleMemory("weight_sync", w.sync, 0, 0, 0, sync, 0, details={"quantize": w.sync_quantize}))
    return rows


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_table(rows: list[RoleMemory]) -> str:
    """Rows = roles, columns = components, peak per role; unused roles read '-'."""
    headers = ["role", *COMPONENTS, "margin", "peak"]
    table = [headers]
    for row in rows:
        if not row.used:
            table.append([row.role] + ["-"] * (len(headers) - 1))
            continue
        table.append([row.role, *(format_bytes(getattr(row, c)) for c in COMPONENTS), format_bytes(row.margin), format_bytes(row.peak)])
    used = [r for r in rows if r.used]
    table.append(["all roles co-located", *(format_bytes(sum(getattr(r, c) for r in used)) for c in COMPONENTS),
                  format_bytes(sum(r.margin for r in used)), format_bytes(sum(r.peak for r in used))])
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(line)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryObject:
    """What one object of the plan is (brief: each object "may reside on different NPUs, processes or
    time spans"): its tensors' layout, which stage produces and which consumes it, the process that
    owns it, and how long it lives."""

    layout: str
    producer: str
    consumer: str
    owner: str
    lifetime: str


def memory_objects(attention: str = "native") -> dict[str, MemoryObject]:
    """One :class:`MemoryObject` per role of :data:`~glmpost.memory.plan.ROLES`; the KV cache and DSA
    index as the ``attention`` path (native or a reference kernel) keeps them."""
    if attention == "native":
        kv_layout = ("per layer a LatentCache: normalised MLA latent c_kv [B, capacity, kv_lora_rank] and roped "
                     "k_rot [B, capacity, qk_rope_head_dim], appended in place, capacity doubling")
        index_layout = ("per indexer layer: keys [B, capacity, index_head_dim] beside the latents (rollout); int32 "
                        "top-k [B, S, index_topk] per layer and one query chunk of float32 scores [B, C, H_idx, T]")
    else:
        kv_layout = ("per layer a transformers DynamicCache: compressed latents [B, 1, T, kv_lora_rank] and "
                     "[B, 1, T, qk_rope_head_dim], concatenated per step")
        index_layout = ("per indexer layer: keys [B, T, index_head_dim] (rollout); dense float32 scores "
                        "[B, S, H_idx, T] and a [B, S, T] mask per forward")
    return {
        "actor": MemoryObject(
            "weights, gradients and AdamW moments per trainable parameter (ZeRO partitions them over ranks); "
            "saved activations of one micro-batch [B, S, ...] per layer",
            "train-grpo / opd-merge / qat / train-sao load --checkpoint", "the optimizer step; the next version "
            "directory (then sync-weights)", "the training process of each rank (DeepSpeed's engine under ZeRO)",
            "the stage run (one policy update); activations from a micro-batch's forward to its backward"),
        "reference": MemoryObject(
            "frozen weights in the checkpoint dtype; no gradients or optimizer state",
            "train-grpo --ref-checkpoint (default --checkpoint) when --kl-coef > 0",
            "the KL term: log-probs of each micro-batch", "the training process",
            "the stage run; its forward's workspace one micro-batch"),
        "teacher": MemoryObject(
            "frozen teacher weights; per token log-probs [B, S] (or top-k)", "score-teacher (local engine, or a "
            "teacher's SGLang server)", "the teacher payload it writes into scored shards",
            "the score-teacher process (or the server)", "the score-teacher run"),
        "critic": MemoryObject(
            "the body with a scalar value head: weights, gradients, AdamW moments; values [B, S] float32",
            "train-sao", "SAO's advantages (per-token values)", "the train-sao process", "the train-sao run"),
        "rollout_kv": MemoryObject(
            kv_layout, "the rollout engine's prefill and each decode step (rollout --engine local, glmpost serve)",
            "the next decode step's attention over the selected keys; a trajectory's next turn (TurnCaches)",
            "the rollout engine (LocalEngine), per batch", "one engine batch (prompt + max-new-tokens); kept across "
            "a trajectory's turns (rollout --env) or for --prefix-cache-batches batches (serve)"),
        "dsa_index": MemoryObject(
            index_layout, "each layer's DSA indexer, under no_grad (frozen in RL)",
            "the same layer's attention (the selected-key gather); a 'shared' indexer layer's successor",
            "the engine (cached keys) / the forward (top-k, scores)",
            "keys: the rollout batch; top-k: one forward; scores: one query chunk"),
        "teacher_payload": MemoryObject(
            "per action token a float32 sampled log-prob, or top-k int32 ids + float32 log-probs, in zstd shards",
            "score-teacher", "opd-merge's distillation loss", "the shard files; opd-merge holds one micro-batch's",
            "on disk until the merge; in memory one micro-batch"),
        "routed_experts": MemoryObject(
            "per token and MoE layer the k expert ids the router chose, uint8 (< 255 experts) or uint16, in zstd "
            "shards (formats/SPEC.md Routing)", "the rollout engine (rollout --record-routing)",
            "diff-logprobs --routing; the trainers' --routing-replay (each micro-batch's copy)",
            "the shard files; a trainer holds one micro-batch's", "on disk with the records; in memory one micro-batch"),
        "weight_sync": MemoryObject(
            "a full copy of the weights in the rollout format (train dtype, fp8 block scales or int4 + bf16 scales)",
            "sync-weights (or the trainer publishing a version)", "glmpost serve / SGLang update_weights_from_disk",
            "the sync-weights process, then the servers", "one sync: written, loaded by the servers, released"),
    }


def format_objects(objects: dict[str, MemoryObject]) -> str:
    """One block per object: its layout, producer, consumer, owner and lifetime."""
    lines = []
    for role, facts in objects.items():
        lines.append(f"{role}:")
        lines.extend(f"  {name:<9} {value}" for name, value in asdict(facts).items())
    return "\n".join(lines)
