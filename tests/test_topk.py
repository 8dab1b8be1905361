"""Deterministic DSA top-k: the tie, NaN and dtype rules, and what they buy for RL (train = rollout)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from glmpost.checkpoints import load_model
from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.logprobs import sequence_log_probs
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
