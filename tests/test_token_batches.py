"""Micro-batches by a token budget (issue 31): first-fit decreasing by hand, every rank's plan known
to all, and the update equal to the count-based one (the loss's denominators are global)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_train_grpo import _judged

from glmpost.rl.micro_batches import micro_batch_plan


def test_first_fit_decreasing_by_hand():
    lengths = [10, 50, 20, 40, 10, 90, 30]
    # Budget 100: 90 alone (2 x 90 > 100); 50 + 40 (2 x 50); 30, 20, 10 (3 x 30 = 90; a 4th: 4 x 30 > 100); 10.
    assert micro_batch_plan(lengths, range(7), size=8, tokens=100) == [[5], [1, 3], [6, 2, 0], [4]]
    assert micro_batch_plan(lengths, [0, 2, 4], size=8, tokens=100) == [[2, 0, 4]]  # one rank's share: 3 x 20 = 60
    assert micro_batch_plan([500, 5], [0, 1], size=8, tokens=100) == [[0], [1]]  # longer than the budget: alone
    # Without a budget: the count, in order (the trainer's plan before token budgets).
    assert micro_batch_plan(lengths, range(7), size=3, tokens=0) == [[0, 1, 2], [3, 4, 5], [6]]
    plan = micro_batch_plan(lengths, range(7), size=8, tokens=120)
    assert sorted(i for chunk in plan for i in chunk) == list(range(7))  # every example once
    assert all(len(c) * max(lengths[i] for i in c) <= 120 or len(c) == 1 for c in plan)


def test_token_budget_update_equals_the_count_based_one(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path, rollout_args=("--max-new-tokens", "12", "--stop-token-ids", "default"))
    common = ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--lr", "1e-3", "--mini-batches", "2", "--json"]
    count = glmpost_cli(*common, "--out", tmp_path / "count", "--micro-batch-size", "3")
    budget = glmpost_cli(*common, "--out", tmp_path / "budget", "--micro-batch-tokens", "40")
    assert count.exit_code == 0 and budget.exit_code == 0, (count.stderr, budget.stderr)
    steps = {name: [json.loads(line) for line in (tmp_path / name / "v000001" / "metrics.jsonl").read_text().splitlines()]
             for name in ("count", "budget")}
    for before, after in zip(steps["count"], steps["budget"], strict=True):  # the same loss and gradient, split otherwise
        for key in ("train/loss", "train/grad_norm", "train/trusted_tokens", "train/entropy"):
            assert after[key] == pytest.approx(before[key], rel=1e-6, abs=1e-9), key
    one, two = (load_file(tmp_path / name / "v000001" / "model.safetensors") for name in ("count", "budget"))
    for key in one:  # AdamW's normalisation amplifies rounding where a gradient is tiny (as in the ZeRO test)
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
    stage = json.loads((tmp_path / "budget" / "v000001" / "stage.json").read_text())
    assert stage["options"]["micro_batch_tokens"] == 40
