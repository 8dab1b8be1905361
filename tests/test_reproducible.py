"""Two runs of the tiny chain with one seed agree exactly: every checkpoint file byte for byte and
every shard record field by field (the promise the architecture changes are held to, README)."""

from __future__ import annotations

from pathlib import Path

from run_compare import differences

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-reasoning-rl.toml"
PROMPTS = ROOT / "recipes" / "data" / "count-train.jsonl"


def _chain(glmpost_cli, out: Path) -> None:
    steps = [
        ("init-model", "--out", out / "model", "--seed", "3"),
        ("rollout", PROMPTS, "--config", RECIPE, "--checkpoint", out / "model", "--out", out / "rollout",
         "--group-size", "4", "--seed", "1", "--batch-size", "40"),
        ("judge", out / "rollout", "--config", RECIPE, "--checkpoint", out / "model", "--out", out / "judged"),
        ("train-grpo", out / "judged", "--config", RECIPE, "--checkpoint", out / "model", "--out", out / "policy",
         "--micro-batch-size", "10"),
        ("rollout", PROMPTS, "--config", RECIPE, "--checkpoint", out / "policy", "--out", out / "rollout-2",
         "--group-size", "2", "--seed", "2", "--batch-size", "20"),
        ("quantize", out / "policy", "--out", out / "policy-w4a16", "--scheme", "w4a16", "--group-size", "16"),
    ]
    for step in steps:
        result = glmpost_cli(*step)
        assert result.exit_code == 0, f"{step[0]}: {result.stderr}"


def test_two_runs_with_one_seed_agree_exactly(glmpost_cli, tmp_path):
    _chain(glmpost_cli, tmp_path / "a")
    _chain(glmpost_cli, tmp_path / "b")
    found, compared = differences(tmp_path / "a", tmp_path / "b")
    assert found == []
    # init, v1, its rollout-quantized copy: 3 checkpoints; 3 datasets of shards, 40 + 40 + 20 records
    assert compared == {"checkpoint_files": 3, "shards": 3, "records": 100}
