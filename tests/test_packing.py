"""Sequence packing (issue 31): several examples in one row, positions restarting per example and
attention kept within each; the log-probs, gradients and the whole update of the padded layout.

Tolerance: float32, 1e-6 relative on gradients (the packed row runs other GEMM shapes and a
block-diagonal mask; nothing else changes). Published weights as the token-budget test: AdamW's
normalisation amplifies rounding where a gradient is tiny.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_plan_architectures import CONFIGS, _model
from test_train_grpo import _judged

from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.models.native_attention import packed_segments, set_attention
from glmpost.models.packed_attention import sequence_bounds, use_packed_sdpa
from glmpost.rl.batches import TrainExample
from glmpost.rl.micro_batches import collate, micro_batch_plan, pack


def _example(length: int, prompt: int, seed: int) -> TrainExample:
    rng = np.random.default_rng(seed)
    response = length - prompt
    return TrainExample(input_ids=rng.integers(3, 500, length).tolist(), prompt_length=prompt,
                        action_mask=rng.random(response) < 0.8, rollout_log_probs=-rng.random(response).astype(np.float32),
                        advantage=float(seed) - 1.5, group_id="g", later_tokens=seed,
                        token_fields={"teacher": rng.random((response, 2)).astype(np.float32)})


def test_packed_plan_by_hand():
    lengths = [10, 50, 20, 40, 10, 90, 30]
    # Budget 100 of summed tokens: 90 + 10; 50 + 40 + 10; 30 + 20.
    assert micro_batch_plan(lengths, range(7), size=8, tokens=100, pack=True) == [[5, 0], [1, 3, 4], [6, 2]]
    assert micro_batch_plan([500, 5], [0, 1], size=8, tokens=100, pack=True) == [[0], [1]]  # longer than the budget: alone
    assert micro_batch_plan(lengths, range(7), size=3, pack=True) == [[0, 1, 2], [3, 4, 5], [6]]  # a count: in order


def test_pack_lays_every_field_where_collate_does():
    examples = [_example(7, 3, 1), _example(4, 2, 2), _example(9, 5, 3)]
    padded = collate(examples, pad_token_id=0, device=torch.device("cpu"))
    packed = pack(examples, pad_token_id=0, device=torch.device("cpu"))
    assert packed.input_ids.shape == (1, 20) and packed.attention_mask is None
    assert packed.position_ids.tolist() == [list(range(7)) + list(range(4)) + list(range(9))]
    assert packed_segments(packed.position_ids, 1).tolist() == [[0] * 7 + [1] * 4 + [2] * 9]
    assert sequence_bounds(packed.position_ids, 20) == [[(0, 7), (7, 11), (11, 20)]]
    assert sequence_bounds(torch.arange(20)[None], 20) is None and packed_segments(torch.arange(20)[None], 1) is None
    for name in ("action_mask", "rollout_log_probs"):
        for a, b in zip(padded.per_example(getattr(padded, name)), packed.per_example(getattr(packed, name)), strict=True):
            torch.testing.assert_close(a, b, equal_nan=True)
    for a, b in zip(padded.per_example(padded.token_fields["teacher"]), packed.per_example(packed.token_fields["teacher"])):
        torch.testing.assert_close(a, b, equal_nan=True)
    # The entry that ends an example and scores the next one's first token is never an action.
    assert not packed.action_mask[0, 6] and not packed.action_mask[0, 10]
    assert [float(a[0]) for a in packed.per_example(packed.advantages)] == [e.advantage for e in examples]
    assert [float(a[0]) for a in packed.per_example(packed.later_tokens)] == [1.0, 2.0, 3.0]
    values = [torch.arange(len(e.input_ids) - 1, dtype=torch.float32) for e in examples]
    for layout in (padded, packed):  # lay / per_example round trip
        assert all(torch.equal(a, b) for a, b in zip(layout.per_example(layout.lay(values)), values, strict=True))


def _packed_vs_padded(model, lengths=(23, 9, 31, 4)):
    """Per-example log-probs and the gradient of their sum, padded then packed."""
    examples = [_example(n, 2, seed) for seed, n in enumerate(lengths)]
    results = []
    for layout in (collate, pack):
        batch = layout(examples, pad_token_id=0, device=torch.device("cpu"))
        model.zero_grad(set_to_none=True)
        scored = torch.ones_like(batch.action_mask) if layout is collate else batch.lay(
            [torch.ones(len(e.input_ids) - 1, dtype=torch.bool) for e in examples], fill=False)
        result = sequence_log_probs(model, batch.input_ids, batch.attention_mask, position_ids=batch.position_ids,
                                    score_mask=scored)
        result.log_probs.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((batch.per_example(result.log_probs), grads))
    return results


@pytest.mark.parametrize("name", ["native", "reference", "llama-block-diagonal", *sorted(CONFIGS)])
def test_packed_rows_give_the_padded_log_probs_and_gradients(name, tiny_checkpoint):
    """GLM-5: glmpost's segments (native), transformers' packed mask (reference); the others as
    load_model runs them (PACKED_SDPA: each sequence alone), and Llama on transformers' SDPA with its
    block-diagonal mask."""
    if name in ("native", "reference"):
        model = load_model(tiny_checkpoint, dtype="float32").train()
        set_attention(model, name)
    elif name == "llama-block-diagonal":
        model = _model("llama")
    else:
        model = _model(name)
        assert use_packed_sdpa(model)
    (padded, padded_grads), (packed, packed_grads) = _packed_vs_padded(model)
    for a, b in zip(padded, packed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6)
    assert float((packed_grads - padded_grads).norm() / padded_grads.norm()) <= 1e-6


def test_native_indexer_scores_only_each_chunks_own_sequences(tiny_checkpoint, monkeypatch):
    """Variable length on the native GLM-5 path: in query chunks of 5, a chunk's indexer scores only
    keys from its first query's sequence on (not the row's earlier sequences), and the result is still
    the padded one."""
    from glmpost.models import native_attention

    model = load_model(tiny_checkpoint, dtype="float32").train()
    set_attention(model, "native")
    heads = next(m for m in model.modules() if hasattr(m, "index_topk")).n_heads
    monkeypatch.setattr(native_attention, "INDEXER_CHUNK_ELEMENTS", 5 * heads * 67)  # 67 tokens packed, 5 queries a chunk
    scored, index_scores = [], native_attention.index_scores
    monkeypatch.setattr(native_attention, "index_scores",
                        lambda indexer, q, w, keys, allowed: scored.append(keys.shape[1]) or index_scores(indexer, q, w, keys, allowed))
    (padded, padded_grads), (packed, packed_grads) = _packed_vs_padded(model)
    for a, b in zip(padded, packed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-6)
    assert float((packed_grads - padded_grads).norm() / padded_grads.norm()) <= 1e-6
    # Sequences at 0, 23, 32, 63 of 67 tokens, top-8: chunk i (queries 5i..5i+4) scores keys from its
    # first query's sequence start up to its last query (at least 8: -inf fill-ins for the top-k).
    # Chunk 5 (queries 25..29, sequence from 23): keys 22..29; chunk 12 (60..64, from 32): 32..64.
    assert scored[-14:] == [8, 10, 15, 20, 25, 8, 12, 8, 13, 18, 23, 28, 33, 8]  # the whole row: 8, 10, 15, ..., 65, 67


def test_packing_is_not_attention_across_examples(tiny_checkpoint):
    """The packed mask is load-bearing: the second example's log-probs do not change with the first's tokens."""
    model = load_model(tiny_checkpoint, dtype="float32").eval()
    first, second = _example(12, 2, 1), _example(10, 2, 2)
    other = _example(12, 2, 7)
    outs = []
    for head in (first, other):
        batch = pack([head, second], pad_token_id=0, device=torch.device("cpu"))
        with torch.no_grad():
            lp = sequence_log_probs(model, batch.input_ids, position_ids=batch.position_ids).log_probs
        outs.append(batch.per_example(lp)[1])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    with torch.no_grad():  # and without positions the row is one sequence: the second example sees the first
        batch = pack([first, second], pad_token_id=0, device=torch.device("cpu"))
        unpacked = batch.per_example(sequence_log_probs(model, batch.input_ids).log_probs)[1]
    assert float((unpacked - outs[0]).abs().max()) > 1e-3


def _steps(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / name / "v000001" / "metrics.jsonl").read_text().splitlines()]


def test_train_grpo_packed_equals_padded(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path, rollout_args=("--max-new-tokens", "12", "--stop-token-ids", "default"))
    common = ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--lr", "1e-3", "--mini-batches", "2", "--json"]
    padded = glmpost_cli(*common, "--out", tmp_path / "padded", "--micro-batch-size", "3")
    packed = glmpost_cli(*common, "--out", tmp_path / "packed", "--micro-batch-tokens", "60", "--pack-sequences")
    assert padded.exit_code == 0 and packed.exit_code == 0, (padded.stderr, packed.stderr)
    for before, after in zip(_steps(tmp_path, "padded"), _steps(tmp_path, "packed"), strict=True):
        for key in ("train/loss", "train/grad_norm", "train/trusted_tokens", "train/entropy", "train/mismatch_abs_logp_mean"):
            assert after[key] == pytest.approx(before[key], rel=1e-6, abs=1e-9), key
    one, two = (load_file(tmp_path / name / "v000001" / "model.safetensors") for name in ("padded", "packed"))
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
    stage = json.loads((tmp_path / "packed" / "v000001" / "stage.json").read_text())
    assert stage["options"]["pack_sequences"] is True


def test_train_sao_packs_the_policy_and_equals_padded(glmpost_cli, tiny_checkpoint, tmp_path):
    from test_train_sao import sao_variants

    weights = sao_variants(glmpost_cli, tiny_checkpoint, tmp_path,
                           {"padded": [], "packed": ["--pack-sequences", "--micro-batch-tokens", "50"]})
    for part, one in weights["padded"].items():
        for key in one:
            np.testing.assert_allclose(weights["packed"][part][key], one[key], rtol=1e-4, atol=1e-5, err_msg=f"{part} {key}")


def test_qat_packed_by_a_token_budget_equals_padded(glmpost_cli, tiny_checkpoint, tmp_path):
    """The SFT loss of QAT (int4 fake quant) packs the same way: the same losses, eval and weights."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "recipes" / "data"
    common = ["qat", data / "sft-train.jsonl", "--checkpoint", tiny_checkpoint, "--scheme", "w4a16", "--group-size", "16",
              "--lr", "3e-3", "--batch-size", "16", "--eval", data / "sft-heldout.jsonl", "--json"]
    padded = glmpost_cli(*common, "--out", tmp_path / "padded", "--micro-batch-size", "4")
    packed = glmpost_cli(*common, "--out", tmp_path / "packed", "--micro-batch-tokens", "120", "--pack-sequences")
    assert padded.exit_code == 0 and packed.exit_code == 0, (padded.stderr, packed.stderr)
    before, after = json.loads(padded.stdout), json.loads(packed.stdout)
    for key in ("eval_loss_before", "eval_loss_after"):
        assert after[key] == pytest.approx(before[key], rel=1e-5), key
    for one, two in zip(_steps(tmp_path, "padded"), _steps(tmp_path, "packed"), strict=True):
        if "sft/loss" in one:
            assert two["sft/loss"] == pytest.approx(one["sft/loss"], rel=1e-5)
            assert two["sft/grad_norm"] == pytest.approx(one["sft/grad_norm"], rel=1e-4)
    one, two = (load_file(tmp_path / name / "v000001" / "model.safetensors") for name in ("padded", "packed"))
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
