"""glmpost's native GLM-5 attention against transformers' reference modules (same weights, same
deterministic top-k): identical top-k selections, log-probs within 1e-5 on prefill, incremental
decode across turns and training, gradients within 1e-5 relative; the fast top-k equals the sort.

Tolerances: the native path absorbs MLA's up-projection into the query (``q·W_uk·c`` for ``q·(W_uk·c)``),
so fp32 results differ by rounding (~1e-6), never by a selection."""

from __future__ import annotations

import copy

import pytest
import torch

from glmpost.kernel.continuation import TurnCaches
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.models import native_attention
from glmpost.models.native_attention import LatentCache, attention_of, set_attention
from glmpost.models.tiny import build_model, tiny_glm5_config
from glmpost.npu.topk import composite_topk, deterministic_topk, install_deterministic_topk, sorted_deterministic_topk

NAN, INF = float("nan"), float("inf")


def _pair(**overrides):
    reference = build_model(tiny_glm5_config(**overrides), seed=0)
    install_deterministic_topk(reference)
    native = copy.deepcopy(reference)
    assert set_attention(native, "native") == reference.config.num_hidden_layers
    return reference, native


class _Selections:
    """Every attention layer's returned top-k indices ``[B, S, k]``, per forward, in call order."""

    def __init__(self, model):
        self.calls: list[torch.Tensor] = []
        self.handles = [layer.self_attn.register_forward_hook(lambda m, a, out: self.calls.append(out[2].clone()))
                        for layer in model.model.layers]

    def close(self):
        for handle in self.handles:
            handle.remove()


def _batch(seed: int, rows: int, length: int, *, right_pad: bool):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (rows, length), generator=generator)
    mask = torch.ones((rows, length), dtype=torch.long)
    for row in range(1, rows):
        pad = int(torch.randint(0, length // 2 + 1, (1,), generator=generator))
        if pad:
            mask[row, length - pad:] = 0 if right_pad else 1
            if not right_pad:
                mask[row, :pad] = 0
    return ids, mask


# ------------------------------------------------------------------------------------------------
# The top-k rule without a full sort


def test_fast_topk_equals_the_sorted_rule_on_ties_nan_signed_zero_and_infinities():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows, length = int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(1, 90, (1,), generator=generator))
        scores = torch.randint(-3, 4, (rows, length), generator=generator).float()
        draw = torch.rand(rows, length, generator=generator)
        scores[draw < 0.05] = NAN
        scores[(draw >= 0.05) & (draw < 0.1)] = -INF
        scores[(draw >= 0.1) & (draw < 0.15)] = -0.0
        scores[(draw >= 0.15) & (draw < 0.18)] = INF
        if trial % 3 == 0:
            scores = torch.randn(rows, length, generator=generator)  # no ties: torch.topk's answer stands
        for k in {0, 1, length // 9, length // 2, length}:
            for tensor in (scores, scores.bfloat16(), scores.half()):
                expected = sorted_deterministic_topk(tensor, k)
                assert torch.equal(deterministic_topk(tensor, k), expected), (trial, k, tensor.dtype)
                assert deterministic_topk(tensor, k).dtype == torch.int32
            if k:
                assert torch.equal(composite_topk(scores, k), sorted_deterministic_topk(scores, k))


def test_fast_topk_hand_cases_and_the_integer_fallback():
    # Ties at the boundary go to the lower position; order is score first, then position.
    assert deterministic_topk(torch.tensor([0.0, 2.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), 4).tolist() == [1, 3, 4, 0]
    assert deterministic_topk(torch.tensor([-0.0, 0.0, -0.0]), 3).tolist() == [0, 1, 2]
    assert deterministic_topk(torch.tensor([NAN, -INF, 5.0]), 3).tolist() == [2, 1, 0]
    assert deterministic_topk(torch.tensor([1, 3, 3, 2]), 2).tolist() == [1, 2]  # int64: the sort itself
    with pytest.raises(ValueError, match="out of range"):
        deterministic_topk(torch.zeros(3), 4)


# ------------------------------------------------------------------------------------------------
# Prefill and training: the same selections, log-probs and gradients


@pytest.mark.parametrize("length", [5, 8, 40])  # shorter than, equal to and longer than index_topk (8)
@pytest.mark.parametrize("chunked", [False, True])
def test_prefill_selects_the_same_keys_and_scores_within_1e_5(length, chunked, monkeypatch):
    reference, native = _pair()
    if chunked:  # a few queries per indexer chunk: the chunk loop and its causal key limit run
        monkeypatch.setattr(native_attention, "INDEXER_CHUNK_ELEMENTS", 3 * 4 * length)
    ids, mask = _batch(length, 3, length, right_pad=True)
    seen_reference, seen_native = _Selections(reference), _Selections(native)
    with torch.no_grad():
        expected = sequence_log_probs(reference, ids, mask).log_probs
        got = sequence_log_probs(native, ids, mask).log_probs
    seen_reference.close(), seen_native.close()
    assert len(seen_native.calls) == len(seen_reference.calls) == 2
    for a, b in zip(seen_reference.calls, seen_native.calls):
        assert a.shape == b.shape == (3, length, min(8, length))
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)  # fill-ins for short rows included
    scored = mask[:, 1:].bool()
    assert (expected - got)[scored].abs().max() < 1e-5


@pytest.mark.parametrize("length", [6, 48])
def test_training_gradients_agree_within_1e_5_relative(length):
    reference, native = _pair()
    ids, mask = _batch(7, 2, length, right_pad=True)
    for model in (reference, native):
        model.train()
        out = sequence_log_probs(model, ids, mask)
        (out.log_probs * mask[:, 1:]).sum().backward()
    compared = 0
    for (name, a), b in zip(reference.named_parameters(), native.parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        compared += 1
        assert (a.grad - b.grad).norm() <= 1e-5 * a.grad.norm() + 1e-12, name
    assert compared > 20
    assert all(p.grad is None for n, p in native.named_parameters() if ".indexer." in n)  # the indexer is frozen


def test_a_shared_indexer_layer_reuses_the_previous_selection():
    reference, native = _pair(indexer_types=["full", "shared"])
    ids, mask = _batch(3, 2, 30, right_pad=True)
    with torch.no_grad():
        a = sequence_log_probs(reference, ids, mask).log_probs
        b = sequence_log_probs(native, ids, mask).log_probs
    assert (a - b)[mask[:, 1:].bool()].abs().max() < 1e-5


# ------------------------------------------------------------------------------------------------
# Incremental decode in the engine, across turns


def test_engine_decode_across_turns_samples_the_same_tokens():
    reference, native = _pair()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11]  # shorter and longer than index_topk
    sessions = ["a", "b", "c"]
    engines = [LocalEngine(reference, batch_size=4), LocalEngine(native, batch_size=4)]
    caches = [TurnCaches(), TurnCaches()]
    turns = [prompts, prompts]
    for turn in range(3):
        keys = [f"{s}#{turn}" for s in sessions]
        results = [engine.generate(p, keys, params, sessions=sessions, caches=c) for engine, p, c in zip(engines, turns, caches)]
        for a, b in zip(*results):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < 1e-5
        turns = [[p + r.token_ids + [40, 41, 42, 43] for p, r in zip(ps, rs)] for ps, rs in zip(turns, results)]
    assert caches[1].reused_tokens == caches[0].reused_tokens > 0
    assert isinstance(caches[1].batches[0].cache, LatentCache)


def test_decode_step_selections_equal_the_reference():
    reference, native = _pair()
    ids, mask = _batch(11, 3, 14, right_pad=False)  # left padded, as the engine batches
    seen = []
    for model in (reference, native):
        capture = _Selections(model)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache, step_mask, step_ids = out.cache, mask, ids[:, -1:]
            positions = (mask.sum(-1, keepdim=True) - 1)
            for _ in range(12):  # past index_topk: the selection starts to leave keys out
                step_mask = torch.cat([step_mask, torch.ones((3, 1), dtype=mask.dtype)], dim=-1)
                positions = positions + 1
                out = model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions, cache=cache, use_cache=True)
                cache, step_ids = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        capture.close()
        seen.append(capture.calls)
    assert len(seen[0]) == len(seen[1]) == 2 * 13
    for a, b in zip(*seen):
        # Sets: the decode GEMMs read the cache with other strides, so two near-equal scores may
        # swap their order (rounding), never which keys are in.
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)


# ------------------------------------------------------------------------------------------------
# The cache and the switch


def test_latent_cache_appends_in_place_with_doubling_capacity_and_selects_rows():
    cache = LatentCache()
    reallocations, buffer = 0, None
    for step in range(100):
        views = cache.append(0, latent=torch.full((2, 1, 3), float(step)), rot=torch.zeros((2, 1, 2)))
        if views["latent"].data_ptr() != buffer:
            reallocations, buffer = reallocations + 1, views["latent"].data_ptr()
    assert cache.get_seq_length() == 100 and reallocations <= 5  # 16, 34, 70, 142: O(log n) copies
    assert views["latent"][1, :, 0].tolist() == [float(s) for s in range(100)]
    copied = copy.deepcopy(cache)
    copied.batch_select_indices(torch.tensor([1]))
    assert copied.buffers[0]["latent"].shape[0] == 1 and cache.buffers[0]["latent"].shape[0] == 2


def test_switching_back_and_forth_keeps_weights_and_outputs(tmp_path):
    reference, native = _pair()
    assert attention_of(native) == "native" and attention_of(reference) == "reference"
    assert list(native.state_dict()) == list(reference.state_dict())
    ids = torch.randint(3, 500, (2, 20))
    with torch.no_grad():
        before = reference(input_ids=ids).logits
        set_attention(native, "reference")
        assert attention_of(native) == "reference"
        assert torch.equal(native(input_ids=ids).logits, before)  # transformers' own modules again
        set_attention(native, "native")
        native.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert attention_of(loaded) == "reference"
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values()))
    with pytest.raises(ValueError, match="expected one of native, reference"):
        set_attention(native, "flash")


def test_native_refuses_transformers_caches_with_a_clear_message():
    from transformers import DynamicCache

    _, native = _pair()
    with pytest.raises(TypeError, match="LatentCache.*attention 'reference'"):
        native(input_ids=torch.tensor([[5, 6]]), cache=DynamicCache(config=native.config), use_cache=True)
