"""Deterministic DSA top-k: the tie, NaN and dtype rules, and what they buy for RL (train = rollout)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.npu.topk import deterministic_topk, install_deterministic_topk

NAN, INF = float("nan"), float("inf")


def test_ties_go_to_the_lower_position_and_indices_are_int32():
    indices = deterministic_topk(torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.5], [3.0, 3.0, 3.0, 3.0, 3.0]]), 3)
    assert indices.dtype == torch.int32
    assert indices.tolist() == [[2, 4, 0], [0, 1, 2]]


def test_nan_ranks_after_every_number_including_minus_infinity():
    scores = torch.tensor([NAN, 1.0, NAN, 0.0, -INF, 2.0])
    assert deterministic_topk(scores, 3).tolist() == [5, 1, 3]
    assert deterministic_topk(scores, 6).tolist() == [5, 1, 3, 4, 0, 2]
    with pytest.raises(ValueError, match="out of range"):
        deterministic_topk(scores, 7)


def test_selection_does_not_depend_on_left_padding_or_batch_layout():
    torch.manual_seed(0)
    row = torch.relu(torch.randn(40)).round(decimals=1)  # many exact zeros and ties, like the indexer's relu
    selected = deterministic_topk(row, 12)
    for pad in (1, 5, 17):
        padded = torch.cat([torch.full((pad,), -INF), row])
        assert torch.equal(deterministic_topk(padded, 12) - pad, selected)
    batch = torch.stack([row, row.flip(0), row])
    assert torch.equal(deterministic_topk(batch, 12)[2], selected)


def test_installed_into_the_glm5_indexers(tiny_checkpoint):
    model = load_model(tiny_checkpoint, deterministic_topk=False)
    assert install_deterministic_topk(model) == 2  # one DSA indexer per layer of the tiny model
    assert install_deterministic_topk(model) == 0  # idempotent
    assert torch.Tensor.topk(torch.tensor([0.0, 0.0]), 1).indices.tolist() == [0]  # torch.topk itself untouched


def _max_mismatch(glmpost_cli, checkpoint, tmp_path, flag: str) -> float:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "messages": [{"role": "system", "content": "be brief" * (d % 3)},
                                                                          {"role": "user", "content": f"count: {d}"}]}) + "\n"
                               for d in range(8)))
    out = tmp_path / flag
    result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", out, "--group-size", "2",
                         "--max-new-tokens", "16", "--stop-token-ids", "none", flag)
    assert result.exit_code == 0, result.stderr
    model = load_model(checkpoint, deterministic_topk=flag == "--deterministic-topk")
    worst = 0.0
    for path in resolve_shard_paths([out]):
        for record in ShardReader(path):
            ids = torch.tensor([record["prompt_token_ids"].tolist() + record["response_token_ids"].tolist()])
            with torch.no_grad():
                recomputed = sequence_log_probs(model, ids, response_start=len(record["prompt_token_ids"])).log_probs[0]
            delta = recomputed[-len(record["response_token_ids"]):].numpy() - record["rollout_log_probs"]
            worst = max(worst, float(np.abs(delta).max()))
    return worst


def test_rollout_and_trainer_log_probs_agree_only_with_the_deterministic_rule(glmpost_cli, tiny_checkpoint, tmp_path):
    # index_topk 8 < sequence length: the indexer really selects, and its relu scores tie. The engine
    # decodes left-padded batches incrementally; the trainer scores whole right-padded sequences.
    assert _max_mismatch(glmpost_cli, tiny_checkpoint, tmp_path, "--deterministic-topk") < 1e-4
    assert _max_mismatch(glmpost_cli, tiny_checkpoint, tmp_path, "--torch-topk") > 1e-3


# --------------------------------------------------------------------------------------------
# The indexer comparison's pure functions (glmpost.diff.mismatch), on hand-computed cases


def test_set_overlap_hand_computed():
    from glmpost.diff.indexer_probe import topk_set_overlap

    a = torch.tensor([[3, 1, 2, -1], [0, 1, 2, 3], [5, 4, -1, -1], [-1, -1, -1, -1], [7, -1, -1, -1]])
    b = torch.tensor([[1, 3, 2, -1], [0, 1, 2, 4], [5, 4, -1, -1], [-1, -1, -1, -1], [8, 9, -1, -1]])
    overlap = topk_set_overlap(a, b)
    # row 1: {0,1,2,3} vs {0,1,2,4}: 3 shared of 5 -> 0.6; row 4: {7} vs {8,9}: 0 of 3.
    assert overlap["jaccard"].tolist() == [1.0, 0.6, 1.0, 1.0, 0.0]
    assert overlap["same_set"].tolist() == [True, False, True, True, False]
    assert overlap["same_order"].tolist() == [False, False, True, True, False]  # row 0: same set, other order
    # Different widths (index_topk 2 vs 3): empty slots pad the narrower side.
    narrow = topk_set_overlap(torch.tensor([[4, 2]]), torch.tensor([[4, 2, -1]]))
    assert narrow["same_set"].tolist() == [True] and narrow["same_order"].tolist() == [True]


def test_boundary_ties_and_valid_selection_hand_computed():
    from glmpost.diff.indexer_probe import boundary_ties, valid_selection

    scores = torch.tensor([
        [3.0, 0.0, 0.0, 0.0, -INF],  # k=2: s(2) = s(3) = 0 -> tie; k=3 too
        [3.0, 2.0, 1.0, 0.0, 0.0],   # k=2: 2 != 1; k=3: 1 != 0
        [1.0, 1.0, 1.0, NAN, -INF],  # three usable keys: k=2 ties, k=3 selects all (no tie)
        [1.0, -INF, -INF, -INF, -INF],
    ])
    assert boundary_ties(scores, 2).tolist() == [True, False, True, False]
    assert boundary_ties(scores, 3).tolist() == [True, False, False, False]
    assert boundary_ties(scores, 5).tolist() == [False] * 4  # k >= T: everything selected
    # Keys masked by causality (-inf) or NaN scores are selected by top-k but never attended: -1.
    picked = torch.tensor([[0, 4], [0, 1], [3, 0], [0, 2]])
    assert valid_selection(scores, picked).tolist() == [[0, -1], [0, 1], [-1, 0], [0, -1]]


def test_bf16_equal_scores_select_identical_sets_and_tie_at_the_boundary():
    from glmpost.diff.indexer_probe import boundary_ties, topk_set_overlap

    # Distinct in float32, all equal to 1.0 once rounded to bfloat16 (8 mantissa bits).
    scores = torch.tensor([1.0, 1.001, 1.002, 0.5, 1.003, 0.25]).repeat(3, 1)
    assert len(set(scores[0].tolist())) == 6 and len(set(scores[0].bfloat16().tolist())) == 3
    low = scores.bfloat16()
    assert boundary_ties(low, 2).tolist() == [True] * 3 and not boundary_ties(scores, 2).any()
    selected = deterministic_topk(low, 2)
    assert selected.tolist() == [[0, 1]] * 3  # the lower positions among the four tied 1.0s
    # The same rule on a wider (left-padded) row, in another batch: the same set.
    padded = torch.cat([torch.full((1, 3), -INF, dtype=torch.bfloat16), low[:1]], dim=-1)
    assert (deterministic_topk(padded, 2) - 3).tolist() == [[0, 1]]
    overlap = topk_set_overlap(selected, deterministic_topk(low.flip(0), 2))
    assert overlap["same_set"].all() and overlap["same_order"].all()


def test_observers_see_every_indexer_selection_under_either_rule(tiny_checkpoint):
    from glmpost.npu.topk import observe_indexer_topk, set_indexer_topk

    model = load_model(tiny_checkpoint, deterministic_topk=True)
    seen = []
    ids = torch.arange(3, 23).unsqueeze(0)
    for deterministic in (True, False):
        assert set_indexer_topk(model, deterministic=deterministic) == (0 if deterministic else 2)
        with torch.no_grad(), observe_indexer_topk(model, lambda m, s, i: seen.append((m.layer_idx, s.shape, i.shape))) as n:
            model(input_ids=ids)
        assert n == 2
    assert seen == [(0, (1, 20, 20), (1, 20, 8)), (1, (1, 20, 20), (1, 20, 8))] * 2
    with torch.no_grad():
        model(input_ids=ids)  # observers removed when the context closed
    assert len(seen) == 4
