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

from glmpost.memory_plan import (
    ModelShape,
    indexer_cache_bytes,
    kv_cache_bytes,
    model_state_bytes,
    saved_activation_bytes,
)
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
    from glmpost.rl.distributed import LocalBackend
    from glmpost.closure.logprobs import sequence_log_probs
    from glmpost.rl.trainer import GRPOConfig

    config = tiny_glm5_config()
    model = build_model(config, seed=0).train()
    backend = LocalBackend(model, GRPOConfig(lr=1e-3))
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
    from glmpost.closure.logprobs import sequence_log_probs

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch,seq", [(4, 40), (2, 64)])
def test_saved_activations_within_tolerance(dtype, batch, seq):
    config = tiny_glm5_config()
    model = build_model(config, seed=0).to(getattr(torch, dtype)).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    measured = _saved_bytes(model, ids)
    planned = saved_activation_bytes(ModelShape.from_config(config), batch=batch, seq=seq, dtype=dtype, attention="math")
    assert abs(planned - measured) <= ACTIVATION_TOLERANCE * measured, (planned, measured)


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
    assert "model_state  saved_activations" in table.stdout


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
