"""`glmpost plan`: the brief's peak-memory decomposition checked against the tiny model.

Tolerances: parameter counts, weights, gradients, AdamW states and KV / indexer cache bytes must
match exactly. Saved activations are an estimate per operator of transformers' GlmMoeDsa forward
and must lie within 5 % of the bytes autograd actually saves (counted tensor by tensor with
``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters excluded) for float32
and bfloat16 micro-batches of the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glmpost.kernel.continuation import TurnCaches
from glmpost.memory.native import latent_cache_capacity, native_cache_bytes
from glmpost.memory.plan import (
    ModelShape,
    indexer_cache_bytes,
    kv_cache_bytes,
    model_state_bytes,
    saved_activation_bytes,
)
from glmpost.models.native_attention import set_attention
from glmpost.models.tiny import build_model, tiny_glm5_config

ROOT = Path(__file__).resolve().parents[1]
ACTIVATION_TOLERANCE = 0.05


def _meta_parameters(config) -> tuple[int, int]:
    from transformers import GlmMoeDsaForCausalLM

    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    indexer = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)
    return total, indexer


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": True, "q_lora_rank": 24},
    {"num_hidden_layers": 3, "first_k_dense_replace": 0, "n_shared_experts": 2, "tie_word_embeddings": True},
], ids=["tiny", "bias", "tied-3-layers"])
def test_parameter_count_is_exact(overrides):
    config = tiny_glm5_config(**overrides)
    counts = ModelShape.from_config(config).parameter_count()
    assert (counts["total"], counts["indexer"]) == _meta_parameters(config)
    assert counts["trainable"] == counts["total"] - counts["indexer"]


def test_parameter_count_at_glm5_dimensions():
    """GLM-5's own dimensions (transformers' GlmMoeDsaConfig defaults), cut to 4 layers to stay fast,
    match exactly; all 78 layers give the brief's "744B-A40B" total."""
    from transformers import GlmMoeDsaConfig

    short = GlmMoeDsaConfig(num_hidden_layers=4)
    assert ModelShape.from_config(short).parameter_count()["total"] == _meta_parameters(short)[0]
    total = ModelShape.from_config(GlmMoeDsaConfig()).parameter_count()["total"]
    assert round(total / 1e9) == 744


def test_model_state_of_one_train_step_is_exact():
    """Weights, gradients and AdamW moments after one micro-step of the trainer's local backend."""
    from glmpost.kernel.logprobs import sequence_log_probs
    from glmpost.rl.configs import GRPOConfig
    from glmpost.rl.distributed import TorchBackend

    config = tiny_glm5_config()
    model = build_model(config, seed=0).train()
    backend = TorchBackend(model, GRPOConfig(lr=1e-3))
    ids = torch.randint(0, config.vocab_size, (8, 48), generator=torch.Generator().manual_seed(0))
    backend.backward(sequence_log_probs(model, ids, chunk_size=64).log_probs.sum())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    backend.step()
    weights = sum(p.nbytes for p in model.parameters())
    moments = sum(s[k].nbytes for s in backend.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    plan = model_state_bytes(ModelShape.from_config(config), dtype="float32", trainable=True)
    assert plan == {"weights": weights, "grads": grads, "optimizer": moments}
    # the DSA indexer gets no gradient (transformers runs it under no_grad): it has no Adam state
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)


def test_zero_stages_divide_the_model_state_hand_computed():
    shape = ModelShape.from_config(tiny_glm5_config())
    counts = shape.parameter_count()  # 179,552 total, 162,528 trainable, 768 kept in float32
    assert (counts["total"], counts["trainable"], counts["fp32_kept"]) == (179552, 162528, 768)
    weights = (179552 - 768) * 2 + 768 * 4
    grads, optimizer = 162528 * 2, 162528 * 12  # bf16 grads; fp32 master + m + v
    expected = {
        0: (weights, grads, optimizer),
        1: (weights, grads, optimizer // 4),
        2: (weights, grads // 4, optimizer // 4),
        3: (weights // 4, grads // 4, optimizer // 4),
    }
    for stage, (w, g, o) in expected.items():
        assert model_state_bytes(shape, dtype="bfloat16", trainable=True, zero_stage=stage, ranks=4) == {
            "weights": w, "grads": g, "optimizer": o}


def _saved_bytes(model, ids) -> int:
    from glmpost.kernel.logprobs import sequence_log_probs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sequence_log_probs(model, ids, chunk_size=16)
    return sum(seen.values())


@pytest.mark.parametrize("attention", ["math", "native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch,seq", [(4, 40), (2, 64), (1, 6)])
def test_saved_activations_within_tolerance(dtype, batch, seq, attention):
    config = tiny_glm5_config()
    model = build_model(config, seed=0).to(getattr(torch, dtype)).train()
    set_attention(model, "native" if attention == "native" else "reference")
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    measured = _saved_bytes(model, ids)
    planned = saved_activation_bytes(ModelShape.from_config(config), batch=batch, seq=seq, dtype=dtype, attention=attention)
    assert abs(planned - measured) <= ACTIVATION_TOLERANCE * measured, (planned, measured)


def test_native_saved_activations_grow_linearly_where_the_reference_grows_quadratically():
    shape = ModelShape.from_config(tiny_glm5_config())
    native = [saved_activation_bytes(shape, batch=1, seq=s, dtype="float32", attention="native") for s in (2048, 4096, 8192)]
    math = [saved_activation_bytes(shape, batch=1, seq=s, dtype="float32", attention="math") for s in (2048, 4096, 8192)]
    assert native[2] / native[1] == pytest.approx(2.0, rel=1e-3) and native[1] / native[0] == pytest.approx(2.0, rel=1e-3)
    assert math[2] / math[1] > 3.0  # the [B, heads, S, S] probabilities


def test_native_latent_cache_bytes_are_exact():
    """Prefill P tokens and decode through the engine: the LatentCache buffers hold exactly the
    planned capacity (doubling) of latents, roped keys and indexer keys."""
    from glmpost.kernel.engine import LocalEngine, SamplingParams

    config = tiny_glm5_config()
    model = build_model(config, seed=0)
    set_attention(model, "native")
    shape = ModelShape.from_config(config)
    for prompt, new in ((10, 6), (10, 30), (40, 1)):
        caches = TurnCaches()
        engine = LocalEngine(model, batch_size=3)
        engine.generate([[5] * prompt] * 3, ["a", "b", "c"], SamplingParams(max_new_tokens=new, stop_token_ids=[]),
                        sessions=["a", "b", "c"], caches=caches)
        cache = caches.batches[0].cache
        planned = native_cache_bytes(shape, batch=3, prompt=prompt, new_tokens=new, dtype="float32")
        assert cache.nbytes() == planned["latent"] + planned["indexer_keys"], (prompt, new)
        assert cache.get_seq_length() == prompt + new - 1
    assert [latent_cache_capacity(p, n) for p, n in ((10, 6), (10, 30), (100, 1), (100, 101))] == [20, 42, 200, 200]


PEAK_CHILD = """
import sys, torch
sys.path.insert(0, {benchmarks!r})
from memory import PeakMemory
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.models.native_attention import set_attention
from glmpost.models.tiny import build_model, tiny_glm5_config
torch.set_num_threads(1)
model = build_model(tiny_glm5_config(max_position_embeddings={seq}), seed=0).train()
set_attention(model, "native")
sequence_log_probs(model, torch.randint(0, 512, (1, 64)), chunk_size={chunk}).log_probs.sum().backward()
model.zero_grad(set_to_none=True)
ids = torch.randint(0, 512, ({batch}, {seq}), generator=torch.Generator().manual_seed(0))
with PeakMemory() as peak:
    sequence_log_probs(model, ids, chunk_size={chunk}).log_probs.sum().backward()
print(peak.hwm_bytes if peak.hwm_bytes is not None else peak.peak_bytes)
"""


def test_native_training_step_peak_matches_the_plan_within_10_percent():
    """The actor's planned saved activations + workspace + gradients against the measured peak of one
    native training step (a fresh process; glibc returns every tensor above 64 KiB to the OS when
    freed, so the kernel's RSS high-water mark follows the tensors alive)."""
    import os
    import subprocess
    import sys

    from glmpost.memory.roles import Workload, plan_memory

    batch, seq, chunk = 1, 4096, 512
    script = PEAK_CHILD.format(benchmarks=str(ROOT / "benchmarks"), batch=batch, seq=seq, chunk=chunk)
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
                         capture_output=True, text=True, check=True)
    measured = int(out.stdout.strip().splitlines()[-1])
    shape = ModelShape.from_config(tiny_glm5_config())
    actor = plan_memory(shape, Workload(micro_batch=batch, seq=seq, chunk_size=chunk, dtype="float32", attention="native"))[0]
    planned = actor.saved_activations + actor.workspace + actor.details["grads"]
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)


def test_rollout_kv_and_indexer_cache_are_exact():
    """Prefill P tokens then decode T: the cache holds exactly the MLA latents and indexer keys planned."""
    config = tiny_glm5_config()
    model = build_model(config, seed=0)
    batch, prompt, new = 3, 10, 6
    ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        for _ in range(new):
            out = model(input_ids=ids[:, :1], cache=cache, use_cache=True)
            cache = out.past_key_values
    latents = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    indexer = sum(layer.indexer_keys.nbytes for layer in cache.layers)
    shape = ModelShape.from_config(config)
    assert latents == kv_cache_bytes(shape, batch=batch, seq=prompt + new, dtype="float32")
    assert indexer == indexer_cache_bytes(shape, batch=batch, seq=prompt + new, dtype="float32")


def test_plan_cli_table_and_json(glmpost_cli, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = glmpost_cli("plan", "recipes/tiny-reasoning-rl.toml", "--dtype", "float32", "--prompt-tokens", "8", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    actor = plan["roles"]["actor"]
    assert actor["used"] and not plan["roles"]["reference"]["used"]  # kl-coef 0: no reference model
    assert actor["model_state"] == 179552 * 4 + 162528 * 4 + 162528 * 8
    assert actor["peak"] == sum(actor[c] for c in ("model_state", "saved_activations", "workspace", "communication", "live_io"))
    # micro-batch 80 x (8 prompt + 8 new tokens) from [train-grpo] and [rollout]
    assert (plan["workload"]["micro_batch"], plan["workload"]["seq"]) == (80, 16)
    kv = plan["roles"]["rollout_kv"]["saved_activations"]
    assert kv == 320 * 16 * 2 * (32 + 16) * 4  # rollout batch 320, 2 layers, kv_lora 32 + rope 16, fp32
    table = glmpost_cli("plan", "recipes/tiny-reasoning-rl.toml")
    assert table.exit_code == 0, table.stderr
    for role in ("actor", "reference", "teacher", "critic", "rollout_kv", "dsa_index", "teacher_payload", "weight_sync"):
        assert any(line.startswith(role + " ") for line in table.stdout.splitlines()), role
        assert set(plan["objects"][role]) == {"layout", "producer", "consumer", "owner", "lifetime"}, role
        assert all(plan["objects"][role].values()), role
        assert f"\n{role}:\n  layout " in table.stdout, role
    assert "model_state  saved_activations" in table.stdout
    assert plan["workload"]["attention"] == "native" and "LatentCache" in plan["objects"]["rollout_kv"]["layout"]
    reference = json.loads(glmpost_cli("plan", "recipes/tiny-reasoning-rl.toml", "--attention", "math", "--json").stdout)
    assert "DynamicCache" in reference["objects"]["rollout_kv"]["layout"]


def test_plan_section_and_flags(glmpost_cli, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[plan]\ndtype = "float32"\nprompt-tokens = 100\n[train-grpo]\nmicro-batch-size = 2\nzero-stage = 1\n')
    result = glmpost_cli("plan", recipe, "--json", "--ranks", "4")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["workload"]["dtype"] == "float32" and plan["workload"]["seq"] == 164  # 100 + rollout default 64
    assert plan["roles"]["actor"]["details"]["optimizer"] == 162528 * 8 // 4  # ZeRO-1 over 4 ranks
    flagged = json.loads(glmpost_cli("plan", recipe, "--json", "--dtype", "bfloat16").stdout)
    assert flagged["workload"]["dtype"] == "bfloat16"  # a flag wins over [plan]


def test_plan_errors_are_one_line(glmpost_cli, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train-grpo]\nmini-batchez = 2\n")
    result = glmpost_cli("plan", recipe)
    assert result.exit_code == 2 and "unknown key 'mini-batchez'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    recipe.write_text("[train-grpo]\n")
    result = glmpost_cli("plan", recipe, "--model", tmp_path / "nothing")
    assert result.exit_code == 2
    assert "--model" in result.stderr and "not a preset" in result.stderr


def test_plan_of_token_budgets_and_packed_rows(glmpost_cli, tmp_path):
    """A token budget of 4 x seq computes what 4 padded sequences do; packed, the same activations,
    and the native DSA indexer scores the whole row's queries against its keys (the other sequences masked)."""
    plans = {}
    for name, section in (("count", "micro-batch-size = 4"), ("budget", "micro-batch-tokens = 656"),
                          ("packed", "micro-batch-tokens = 656\npack-sequences = true")):
        recipe = tmp_path / f"{name}.toml"
        recipe.write_text(f'[plan]\ndtype = "float32"\nprompt-tokens = 100\n[train-grpo]\n{section}\n')
        result = glmpost_cli("plan", recipe, "--json")
        assert result.exit_code == 0, result.stderr
        plans[name] = json.loads(result.stdout)
    seq = plans["count"]["workload"]["seq"]
    assert seq == 164 and plans["packed"]["workload"]["pack_sequences"] is True  # 656 = 4 x 164
    actors = {name: plan["roles"]["actor"] for name, plan in plans.items()}
    assert actors["budget"]["saved_activations"] == actors["count"]["saved_activations"] == actors["packed"]["saved_activations"]
    assert actors["budget"]["workspace"] == actors["count"]["workspace"]
    indexer = {name: plan["roles"]["actor"]["details"]["workspace"]["dsa_indexer"] for name, plan in plans.items()}
    assert indexer["packed"] > indexer["count"]
