"""The Reasoning RL stages chained as a user chains them: rollout -> judge -> train-grpo, twice."""

from __future__ import annotations

import json
from pathlib import Path

from glmpost.checkpoints import CheckpointRoot, read_manifest
from glmpost.formats import iter_records

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-reasoning-rl.toml"
PROMPTS = Path(__file__).resolve().parents[1] / "recipes" / "data" / "count-train.jsonl"


def test_two_iterations_through_the_cli(glmpost_cli, tiny_checkpoint, tmp_path):
    root = tmp_path / "policy"
    checkpoint = tiny_checkpoint
    for iteration in (1, 2):
        run = tmp_path / f"iter{iteration}"
        rollout = glmpost_cli("rollout", PROMPTS, "--config", RECIPE, "--checkpoint", checkpoint, "--out", run / "rollout",
                              "--seed", iteration, "--json")
        assert rollout.exit_code == 0, rollout.stderr
        assert json.loads(rollout.stdout)["records"] == 320
        judged = glmpost_cli("judge", run / "rollout", "--config", RECIPE, "--checkpoint", checkpoint, "--out", run / "judged")
        assert judged.exit_code == 0, judged.stderr
        records = list(iter_records([run / "judged"]))
        assert all(r["rewards"].keys() == {"correct"} and 0.0 <= r["reward"] <= 1.0 for r in records)
        assert {int(r["policy_versions"][0]) for r in records} == {iteration - 1}
        trained = glmpost_cli("train-grpo", run / "judged", "--config", RECIPE, "--checkpoint", checkpoint, "--out", root, "--json")
        assert trained.exit_code == 0, trained.stderr
        summary = json.loads(trained.stdout)
        assert summary["policy_version"] == iteration and summary["steps"] == 8 and summary["trusted_fraction"] > 0.9
        checkpoint = root
    assert CheckpointRoot(root).versions() == [1, 2] and CheckpointRoot(root).latest() == 2
    assert read_manifest(root / "v000002").parent == str(root / "v000001")
    history = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/policy_version"] for m in history] == [1] * 8 + [2] * 8
    options = json.loads((root / "v000002" / "stage.json").read_text())["options"]
    assert options["lr"] == 3e-3 and options["mini_batches"] == 4 and options["config"] == str(RECIPE)
