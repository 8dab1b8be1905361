"""Mixed precision (issue 31): bf16 autocast over float32 master weights against fp32 on the same
batch, versions published in the parent's dtype with their float32 masters kept, and the next
version trained from the masters, not from the rounded weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_train_grpo import _judged

from glmpost.kernel.loading import saved_dtype
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.rl.distributed import TorchBackend
from glmpost.rl.precision import compute_context, resolve_precision


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from conftest import run_glmpost

    out = tmp_path_factory.mktemp("bf16") / "ckpt"
    assert run_glmpost("init-model", "--out", out, "--seed", "0", "--dtype", "bfloat16").exit_code == 0
    return out


def _dtypes(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


def test_auto_is_bf16_on_an_accelerator_and_fp32_on_a_cpu():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("auto", SimpleNamespace(type="npu")) == "bf16"  # torch.device("npu") needs torch_npu
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_bf16_gradients_match_fp32_on_the_same_batch():
    """The summed log-likelihood of a batch, its gradient taken with fp32 arithmetic and with bf16
    autocast over the same float32 weights, on a dense model (MoE routing and the DSA top-k make
    discrete choices that bf16 rounding can flip: a different computation, not a rounding error).
    bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3 per matmul input); through two
    layers the gradient's relative L2 error stays within 2e-2 (measured 3.9e-3) and the log-probs,
    the head in float32 under both, within 1e-2 absolute (measured 1.6e-3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(3, 500, (4, 40), generator=torch.Generator().manual_seed(0))
    grads, log_probs = {}, {}
    for precision in ("fp32", "bf16"):
        model.zero_grad(set_to_none=True)
        with compute_context(precision, torch.device("cpu")):
            result = sequence_log_probs(model, ids)
        assert result.log_probs.dtype == torch.float32  # the head and log-probs in float32 under autocast too
        result.log_probs.sum().backward()
        grads[precision] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        log_probs[precision] = result.log_probs.detach()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters stay float32
    error = float((grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm())
    assert 1e-5 < error < 2e-2  # bf16 really ran (not fp32 again), and stays close
    assert float((log_probs["bf16"] - log_probs["fp32"]).abs().max()) < 1e-2
    config = SimpleNamespace(lr=1e-3, adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0)
    with TorchBackend(model, config, precision="bf16").compute():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_a_bf16_parent_publishes_bf16_and_the_next_version_trains_from_the_masters(glmpost_cli, bf16_checkpoint, tmp_path):
    assert saved_dtype(bf16_checkpoint) == "bfloat16"
    judged = _judged(glmpost_cli, bf16_checkpoint, tmp_path)
    root = tmp_path / "root"
    first = glmpost_cli("train-grpo", judged, "--checkpoint", bf16_checkpoint, "--out", root, "--lr", "1e-3", "--precision", "bf16")
    assert first.exit_code == 0, first.stderr
    v1 = root / "v000001"
    assert _dtypes(v1 / "model.safetensors") == {"BF16"} and json.loads((v1 / "config.json").read_text())["dtype"] == "bfloat16"
    extra = json.loads((v1 / "glmpost.json").read_text())["extra"]
    assert extra["dtype"] == "bfloat16" and extra["precision"] == "bf16" and extra["masters"] == "trainer_state/masters.safetensors"
    masters, weights = load_file(v1 / "trainer_state" / "masters.safetensors"), load_file(v1 / "model.safetensors")
    assert _dtypes(v1 / "trainer_state" / "masters.safetensors") == {"F32"}
    common = [k for k in masters if k in weights]  # (fused MoE experts are saved under per-expert names)
    assert len(common) > 10 and all(torch.equal(masters[k].to(torch.bfloat16), weights[k]) for k in common)  # rounded
    rounding = max(float((masters[k] - weights[k].float()).abs().max()) for k in common)
    assert rounding > 1e-5

    # A step of 1e-12 barely moves the weights: v2's masters equal v1's to far below bf16's rounding,
    # which they could not if v2 had started from the rounded v1.
    second = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--lr", "1e-12", "--max-version-lag", "1")
    assert second.exit_code == 0, second.stderr
    masters2 = load_file(root / "v000002" / "trainer_state" / "masters.safetensors")
    assert max(float((masters2[k] - masters[k]).abs().max()) for k in masters) < rounding / 100


def test_a_float32_parent_publishes_float32_without_masters(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    result = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root", "--precision", "bf16")
    assert result.exit_code == 0, result.stderr
    v1 = tmp_path / "root" / "v000001"
    assert _dtypes(v1 / "model.safetensors") == {"F32"} and not (v1 / "trainer_state" / "masters.safetensors").exists()
    assert json.loads((v1 / "glmpost.json").read_text())["extra"]["masters"] is None


def test_a_deepspeed_file_in_bf16_mode_is_refused(tmp_path):
    from glmpost.config import ConfigError
    from glmpost.rl.deepspeed_settings import deepspeed_config
    from glmpost.rl.distributed import OptimizerConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    with pytest.raises(ConfigError, match="remove its bf16 / fp16 section"):
        deepspeed_config(OptimizerConfig(), zero_stage=3, path=path)
