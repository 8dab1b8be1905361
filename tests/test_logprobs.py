"""Chunked log-probs equal the naive full-logits computation (values, entropy, gradients)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from glmpost.kernel.chunked import chunked_log_probs
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.heads import plain_linear
from glmpost.kernel.logprobs import TokenLogProbs, sequence_log_probs, token_log_probs_from_hidden
from glmpost.models.tiny import build_model, tiny_glm5_config

LENGTHS = (23, 17, 9)  # right-padded rows of one batch; L = 23 is divisible by no chunk size used


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_glm5_config(), seed=0)


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 512, (len(LENGTHS), max(LENGTHS)), generator=generator)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(LENGTHS):
        attention_mask[row, :length] = 1
        input_ids[row, length:] = 0  # pad id
    return input_ids, attention_mask


def naive(model, input_ids, attention_mask, temperature=1.0):
    """log_softmax of the model's own full forward: (log_probs, entropy, valid) [B, L-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    log_softmax = torch.log_softmax(logits.float()[:, :-1] / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    valid = attention_mask[:, 1:].bool()
    return log_probs, entropy, valid


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [1, 5, 7, 64, 4096])
def test_sequence_log_probs_match_full_forward(model, batch, chunk_size, temperature):
    input_ids, attention_mask = batch
    with torch.no_grad():
        ref_lp, ref_ent, valid = naive(model, input_ids, attention_mask, temperature)
        out = sequence_log_probs(
            model,
            input_ids,
            attention_mask,
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=True,
        )
    assert isinstance(out, TokenLogProbs)
    assert out.log_probs.shape == (3, 22) and out.log_probs.dtype == torch.float32
    assert torch.equal(out.mask, valid)
    torch.testing.assert_close(out.log_probs[valid], ref_lp[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[valid], ref_ent[valid], atol=1e-5, rtol=0)
    assert torch.all(out.log_probs[~valid] == 0) and torch.all(out.entropy[~valid] == 0)
    # The temperature really changes the numbers (guards against it being ignored).
    if temperature != 1.0:
        plain, _, _ = naive(model, input_ids, attention_mask)
        assert (plain[valid] - out.log_probs[valid]).abs().max() > 1e-2


def test_gradients_match_naive_path(model, batch):
    input_ids, attention_mask = batch
    temperature = 0.7
    weights = torch.randn(3, 22, generator=torch.Generator().manual_seed(2))
    params = {
        "lm_head": model.lm_head.weight,
        "embed": model.model.embed_tokens.weight,
        "layer0.q_a_proj": model.model.layers[0].self_attn.q_a_proj.weight,
    }

    def grads(loss):
        return [g.clone() for g in torch.autograd.grad(loss, list(params.values()))]

    ref_lp, ref_ent, valid = naive(model, input_ids, attention_mask, temperature)
    ref = grads(((ref_lp + 0.1 * ref_ent) * weights)[valid].sum())
    out = sequence_log_probs(
        model, input_ids, attention_mask, temperature=temperature, chunk_size=5, return_entropy=True
    )
    got = grads(((out.log_probs + 0.1 * out.entropy) * weights)[out.mask].sum())
    for name, g_ref, g_got in zip(params, ref, got):
        assert g_ref.abs().max() > 0, name
        torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=0, msg=name)


def _checkpointed(hidden, weight, targets, **kwargs):
    """The path of a head module that is not a bare linear layer (per-chunk checkpoints)."""
    distribution = ScoredDistribution(kwargs.pop("temperature", 1.0), kwargs.pop("top_k", 0), kwargs.pop("top_p", 1.0))
    return chunked_log_probs(hidden, functools.partial(F.linear, weight=weight, bias=kwargs.pop("lm_head_bias", None)),
                              weight.shape[0], targets, mask=kwargs.pop("mask", None), distribution=distribution,
                              return_entropy=kwargs.pop("return_entropy", False), **kwargs)


def _fused(hidden, weight, targets, **kwargs):
    return token_log_probs_from_hidden(hidden, weight, targets, **kwargs)


@pytest.mark.parametrize("path", [_fused, _checkpointed], ids=["fused", "checkpointed"])
def test_backward_keeps_no_chunk_logits_alive(path):
    """Under autograd no [chunk, V] tensor is saved for backward: the fused path saves its inputs
    (the weight by reference), the checkpointed path only each chunk's inputs."""
    vocab, rows, chunk = 512, 40, 4
    hidden = torch.randn(rows, 16, requires_grad=True)
    weight = torch.randn(vocab, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    saved: list[int] = []

    def pack(tensor):
        if tensor.data_ptr() != weight.data_ptr():
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = path(hidden, weight, targets, chunk_size=chunk, temperature=1.0, return_entropy=True)
    assert max(saved) < chunk * vocab
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert weight.grad is not None and hidden.grad is not None


@pytest.mark.parametrize("use", ["log_probs", "entropy", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_backward_equals_the_checkpointed_path(use, dtype):
    """Values bit for bit, gradients (rows, weight, bias) to float rounding: 13 rows in chunks of 4
    (a partial last chunk), temperature 1.3, a mask, either output alone or both."""
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 13, 24, generator=generator).to(dtype).requires_grad_(True)
    weight = torch.randn(300, 24, generator=generator).to(dtype).requires_grad_(True)
    bias = torch.randn(300, generator=generator).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 300, (2, 13), generator=generator)
    mask = torch.rand(2, 13, generator=generator) > 0.3
    weights = torch.randn(2, 13, generator=generator)
    results = []
    for path in (_fused, _checkpointed):
        out = path(hidden, weight, targets, lm_head_bias=bias, mask=mask, temperature=1.3, chunk_size=4, return_entropy=True)
        loss = {"log_probs": out.log_probs, "entropy": out.entropy, "both": out.log_probs - 0.3 * out.entropy}[use]
        results.append((out.log_probs.detach(), out.entropy.detach(), torch.autograd.grad((loss * weights).sum(), (hidden, weight, bias))))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for name, a, b in zip(("hidden", "weight", "bias"), grads_a, grads_b):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, msg=name, **tolerance)


def test_fused_backward_makes_one_weight_gradient_buffer():
    """The point of the fused path: backward allocates one [V, H] buffer and adds each chunk's
    contribution into it, where the checkpointed path allocates a [V, H] partial per chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountWeightShaped(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.new = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            aliases = func._schema.is_mutable or any(r.alias_info is not None for r in func._schema.returns)  # add_, detach
            if not aliases and isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
                self.new += 1
            return out

    vocab, width, rows, chunk = 256, 8, 24, 4
    counts = {}
    for path in (_fused, _checkpointed):
        hidden = torch.randn(rows, width, requires_grad=True)
        weight = torch.randn(vocab, width, requires_grad=True)
        out = path(hidden, weight, torch.randint(0, vocab, (rows,)), chunk_size=chunk, temperature=1.0)
        with CountWeightShaped((vocab, width)) as counter:
            out.log_probs.sum().backward()
        counts[path.__name__] = counter.new
    assert counts["_fused"] == 1, counts
    assert counts["_checkpointed"] >= rows // chunk, counts


def test_only_a_bare_linear_head_takes_the_fused_path():
    from torch.nn.utils import parametrize

    assert plain_linear(torch.nn.Linear(4, 6))
    hooked = torch.nn.Linear(4, 6)
    hooked.register_forward_pre_hook(lambda module, args: None)  # as DeepSpeed ZeRO-3 gathers weights
    parametrized = torch.nn.Linear(4, 6)
    parametrize.register_parametrization(parametrized, "weight", torch.nn.Identity())  # as QAT's fake quant

    class Scaled(torch.nn.Linear):
        pass

    assert not any(plain_linear(head) for head in (hooked, parametrized, Scaled(4, 6)))


def test_response_start_and_score_mask(model, batch):
    input_ids, attention_mask = batch
    start = torch.tensor([5, 3, 20])  # row 2 has 9 real tokens: nothing left to score
    score_mask = torch.ones(3, 22, dtype=torch.bool)
    score_mask[0, 10] = False
    with torch.no_grad():
        ref_lp, _, valid = naive(model, input_ids, attention_mask)
        out = sequence_log_probs(
            model,
            input_ids,
            attention_mask,
            response_start=start,
            score_mask=score_mask,
            chunk_size=3,
        )
    expected = valid & (torch.arange(1, 23)[None, :] >= start[:, None]) & score_mask
    assert torch.equal(out.mask, expected)
    assert not out.mask[2].any() and out.mask[0, 4] and not out.mask[0, 3]
    torch.testing.assert_close(out.log_probs[expected], ref_lp[expected], atol=1e-5, rtol=0)
    assert torch.all(out.log_probs[~expected] == 0)
    # An int start applies to every row.
    with torch.no_grad():
        same = sequence_log_probs(model, input_ids, attention_mask, response_start=4)
    assert torch.equal(same.mask, valid & (torch.arange(1, 23)[None, :] >= 4))


def test_nothing_to_score_still_backpropagates(model, batch):
    input_ids, attention_mask = batch
    out = sequence_log_probs(model, input_ids, attention_mask, response_start=input_ids.shape[1])
    assert not out.mask.any() and torch.all(out.log_probs == 0)
    assert out.log_probs.requires_grad
    out.log_probs.sum().backward()  # a micro-batch with no action tokens must not crash the step
    model.zero_grad(set_to_none=True)


def test_hand_computed_two_by_three():
    """Two rows, vocabulary 3, identity head: the hidden rows are the logits."""
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, math.log(2.0), math.log(5.0)]])
    out = token_log_probs_from_hidden(
        logits, torch.eye(3), torch.tensor([1, 2]), chunk_size=1, return_entropy=True
    )
    p = [1 / 8, 2 / 8, 5 / 8]
    torch.testing.assert_close(out.log_probs, torch.tensor([-math.log(3.0), math.log(5 / 8)]))
    torch.testing.assert_close(
        out.entropy, torch.tensor([math.log(3.0), -sum(q * math.log(q) for q in p)])
    )
    # Temperature 2 halves the logits: probabilities proportional to 1, sqrt(2), sqrt(5).
    hot = token_log_probs_from_hidden(
        logits, torch.eye(3), torch.tensor([1, 2]), temperature=2.0, return_entropy=True
    )
    z = 1 + math.sqrt(2) + math.sqrt(5)
    q = [1 / z, math.sqrt(2) / z, math.sqrt(5) / z]
    torch.testing.assert_close(hot.log_probs, torch.tensor([-math.log(3.0), math.log(q[2])]))
    torch.testing.assert_close(hot.entropy[1], torch.tensor(-sum(x * math.log(x) for x in q)))


def test_pure_function_random_tensors_with_bias_and_mask():
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 13, 24, generator=generator, requires_grad=True)
    weight = torch.randn(300, 24, generator=generator, requires_grad=True)
    bias = torch.randn(300, generator=generator, requires_grad=True)
    targets = torch.randint(0, 300, (2, 13), generator=generator)
    mask = torch.rand(2, 13, generator=generator) > 0.3
    targets[~mask] = -100  # ignored ids outside the vocabulary are fine where masked out

    log_softmax = torch.log_softmax((hidden @ weight.T + bias) / 1.3, dim=-1)
    ref_lp = log_softmax.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    ref_ent = -(log_softmax.exp() * log_softmax).sum(-1)
    ref_grads = torch.autograd.grad(
        (ref_lp - ref_ent)[mask].sum(), (hidden, weight, bias)
    )
    out = token_log_probs_from_hidden(
        hidden,
        weight,
        targets,
        lm_head_bias=bias,
        mask=mask,
        temperature=1.3,
        chunk_size=4,
        return_entropy=True,
    )
    assert out.log_probs.shape == (2, 13) and torch.equal(out.mask, mask)
    torch.testing.assert_close(out.log_probs[mask], ref_lp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[mask], ref_ent[mask], atol=1e-5, rtol=0)
    assert torch.all(out.log_probs[~mask] == 0)
    got_grads = torch.autograd.grad(
        (out.log_probs - out.entropy)[mask].sum(), (hidden, weight, bias)
    )
    for ref, got in zip(ref_grads, got_grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_bfloat16_head_is_upcast_after_the_matmul():
    """Like model(...).logits.float(): the head runs in the weight dtype, softmax in float32."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 32, generator=generator).bfloat16()
    weight = torch.randn(200, 32, generator=generator).bfloat16()
    targets = torch.randint(0, 200, (9,), generator=generator)
    ref = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, targets[:, None])[:, 0]
    out = token_log_probs_from_hidden(hidden, weight, targets, chunk_size=2)
    assert out.log_probs.dtype == torch.float32
    torch.testing.assert_close(out.log_probs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan")])
def test_non_positive_temperature_is_refused(model, batch, temperature):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_log_probs_from_hidden(
            torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), temperature=temperature
        )
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sequence_log_probs(model, *batch, temperature=temperature)


@pytest.mark.parametrize(
    ("hidden", "weight", "targets", "kwargs", "message"),
    [
        ((2, 4), (5, 3), (2,), {}, "hidden size mismatch"),
        ((2, 4), (5, 4), (3,), {}, "targets must have the leading shape"),
        ((2, 4), (5, 4), (2,), {"mask": torch.ones(3, dtype=torch.bool)}, "mask must be bool"),
        ((2, 4), (5, 4), (2,), {"lm_head_bias": torch.zeros(4)}, "lm_head_bias must be"),
        ((2, 4), (5, 4), (2,), {"chunk_size": 0}, "chunk_size must be a positive int"),
    ],
)
def test_bad_shapes_are_refused(hidden, weight, targets, kwargs, message):
    with pytest.raises(ValueError, match=message):
        token_log_probs_from_hidden(
            torch.randn(hidden),
            torch.randn(weight),
            torch.zeros(targets, dtype=torch.long),
            **kwargs,
        )


def test_out_of_vocabulary_target_is_refused():
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 5\)"):
        token_log_probs_from_hidden(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 5]))


def test_bad_model_inputs_are_refused(model, batch):
    input_ids, attention_mask = batch
    with pytest.raises(ValueError, match="input_ids must be"):
        sequence_log_probs(model, input_ids[0])
    with pytest.raises(ValueError, match="attention_mask must match"):
        sequence_log_probs(model, input_ids, attention_mask[:, :-1])
    left_padded = attention_mask.flip(1)
    with pytest.raises(ValueError, match="right-padded"):
        sequence_log_probs(model, input_ids, left_padded)
    with pytest.raises(ValueError, match="response_start"):
        sequence_log_probs(model, input_ids, attention_mask, response_start=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="score_mask"):
        sequence_log_probs(
            model, input_ids, attention_mask, score_mask=torch.ones(3, 23, dtype=torch.bool)
        )


def test_logit_postprocessing_models_are_refused(model, batch):
    model.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            sequence_log_probs(model, *batch)
    finally:
        del model.config.final_logit_softcapping
