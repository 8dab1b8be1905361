"""``glmpost diff-logprobs``: the train-vs-rollout mismatch report and its CI gate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from glmpost.mismatch import parse_gates, summarize


def test_summary_statistics_hand_computed():
    ratios = np.array([1.2, 3.5, 0.3, 1.0])
    delta = np.log(ratios)
    stats = summarize(delta, beta=2.0, eps_low=0.2, eps_high=0.28)
    assert stats["tokens"] == 4
    assert stats["icepop_kept"] == 0.5  # 1.2 and 1.0 kept; 3.5 and 0.3 masked (brief's examples)
    assert stats["dis_kept"] == 0.5  # 1.2 and 1.0 inside (0.8, 1.28)
    assert stats["max_abs"] == pytest.approx(math.log(3.5))
    assert stats["k1"] == pytest.approx(-delta.mean())
    assert stats["k3"] == pytest.approx(np.mean(ratios - 1 - delta))
    assert summarize(np.zeros(0)) == {"tokens": 0}
    with pytest.raises(ValueError, match="METRIC=VALUE"):
        parse_gates(["max=1"])
    assert parse_gates(["max_abs=1e-3", "k3=0.5"]) == {"max_abs": 1e-3, "k3": 0.5}


def _rollout(glmpost_cli, checkpoint, tmp_path, topk_flag):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": "count: " + " ".join(str(d) * (1 + d % 3))}) + "\n" for d in range(6)))
    out = tmp_path / f"rollout{topk_flag}"
    result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", out, "--group-size", "2",
                         "--max-new-tokens", "12", "--stop-token-ids", "none", topk_flag)
    assert result.exit_code == 0, result.stderr
    return out


def test_deterministic_topk_passes_a_tight_gate_and_torch_topk_fails_it(glmpost_cli, tiny_checkpoint, tmp_path):
    shards = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "--deterministic-topk")
    passed = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "ok",
                         "--fail-above", "max_abs=1e-4", "--json")
    assert passed.exit_code == 0, passed.stderr
    report = json.loads(passed.stdout)
    assert report["overall"]["tokens"] == 6 * 2 * 12 and report["overall"]["icepop_kept"] == 1.0
    assert json.loads((tmp_path / "ok" / "report.json").read_text())["gates"]["failed"] == []

    shards = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "--torch-topk")
    failed = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad",
                         "--torch-topk", "--fail-above", "max_abs=1e-4")
    assert failed.exit_code == 1 and "gate failed: max_abs" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert report["overall"]["max_abs"] > 1e-3 and report["worst"][0]["delta"] != 0.0


def test_refuses_shards_without_rollout_log_probs(glmpost_cli, tiny_checkpoint, tmp_path):
    imported = tmp_path / "imported"
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "count: 1", "response": "1111"}\n')
    assert glmpost_cli("shards", "import", data, "--checkpoint", tiny_checkpoint, "--out", imported).exit_code == 0
    result = glmpost_cli("diff-logprobs", imported, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "has no rollout_log_probs: run `glmpost rollout` first" in result.stderr
    assert not (tmp_path / "r").exists()
