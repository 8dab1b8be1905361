"""Activation checkpointing (issue 31): per decoder layer, on both GLM-5 attention paths and a dense
model, the gradients of the run without it (fp32: 1e-6 relative); train-grpo with it publishes the
weights of the run without it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_train_grpo import _judged

from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.models.native_attention import set_attention
from glmpost.rl.precision import checkpoint_layers


def _gradients(model, ids) -> tuple[torch.Tensor, int]:
    """The gradient of the summed log-likelihood, and how many decoder-layer forwards ran."""
    calls = []
    # a module inside each layer: its hooks run again when the backward pass recomputes the layer
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    model.zero_grad(set_to_none=True)
    sequence_log_probs(model, ids).log_probs.sum().backward()
    for hook in hooks:
        hook.remove()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), len(calls)


@pytest.mark.parametrize("attention", ["native", "reference", "llama"])
def test_checkpointed_layers_give_the_same_gradients(tiny_checkpoint, attention):
    if attention == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    else:
        model = load_model(tiny_checkpoint, dtype="float32")
        set_attention(model, attention)
    model.train()
    ids = torch.randint(3, 500, (3, 48), generator=torch.Generator().manual_seed(1))
    plain, plain_calls = _gradients(model, ids)
    checkpoint_layers(model)
    checkpointed, calls = _gradients(model, ids)
    layers = len(model.model.layers)
    assert plain_calls == layers and calls == 2 * layers  # each layer ran again in the backward pass
    assert float((checkpointed - plain).norm() / plain.norm()) <= 1e-6


def test_train_grpo_with_checkpointing_publishes_the_same_weights(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    common = ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--lr", "1e-3", "--mini-batches", "2"]
    for name, extra in (("plain", []), ("checkpointed", ["--activation-checkpointing"])):
        result = glmpost_cli(*common, "--out", tmp_path / name, *extra)
        assert result.exit_code == 0, result.stderr
    plain, checkpointed = (load_file(tmp_path / name / "v000001" / "model.safetensors") for name in ("plain", "checkpointed"))
    for key in plain:
        torch.testing.assert_close(checkpointed[key], plain[key], rtol=1e-5, atol=1e-7, msg=key)


def test_train_sao_checkpoints_the_critic_too_and_publishes_the_same_weights(glmpost_cli, tiny_checkpoint, tmp_path):
    from test_train_sao import sao_variants

    weights = sao_variants(glmpost_cli, tiny_checkpoint, tmp_path, {"plain": [], "checkpointed": ["--activation-checkpointing"]})
    for part, plain in weights["plain"].items():
        for key in plain:
            torch.testing.assert_close(torch.from_numpy(weights["checkpointed"][part][key]), torch.from_numpy(plain[key]),
                                       rtol=1e-5, atol=1e-7, msg=f"{part} {key}")
