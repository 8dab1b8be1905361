"""SAO learns a multi-step task with group size 1: after a weak SFT warm start, three rollout -> judge ->
train-sao iterations in the kv-lookup environment (recipes/tiny-sao.toml: two chained look-ups, then the
answer) raise the held-out reward, each iteration on 64 prompts it has not seen.

The real CLI stages run in this process (the ``glmpost_cli`` fixture); every trajectory is its own
group (``group-size = 1``), so the baseline comes from the critic alone (made from the warm start by
``--init-critic`` on the first update). The reward the tiny model can reach is 1 per successful
look-up (a well-formed ``<get>XY</get>``; the store holds every key) plus 1 for the right answer.
"Before" is measured right after the warm start, "after" after the iterations, both on
recipes/data/kv-heldout.jsonl sampled at the recipe's temperature (4 samples per prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-sao.toml"
DATA = ROOT / "recipes" / "data"
ITERATIONS = 3


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def env_reward(run, prompts: Path, checkpoint: Path, out: Path, *options) -> float:
    done = run("rollout", prompts, "--config", RECIPE, "--checkpoint", checkpoint, "--out", out, *options)
    assert done.exit_code == 0, done.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "rollout/env_reward_mean" in line][-1]["rollout/env_reward_mean"]


def test_sao_iterations_with_group_size_one_raise_the_held_out_kv_lookup_reward(glmpost_cli, tiny_checkpoint, tmp_path):
    run = glmpost_cli
    assert run("shards", "import", DATA / "kv-demo.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "demo").exit_code == 0
    sft = tmp_path / "sft"
    warmed = run("qat", tmp_path / "demo", "--config", RECIPE, "--checkpoint", tiny_checkpoint, "--out", sft)
    assert warmed.exit_code == 0, warmed.stderr

    def held_out(checkpoint: Path, name: str) -> float:
        return env_reward(run, DATA / "kv-heldout.jsonl", checkpoint, tmp_path / name, "--group-size", "4", "--seed", "1000")

    before = held_out(sft, "eval-before")
    policy, critic, sampled, explained = tmp_path / "policy", tmp_path / "critic", [], []
    for i in range(1, ITERATIONS + 1):
        checkpoint = policy if (policy / "LATEST").exists() else sft
        sampled.append(env_reward(run, DATA / "kv-train.jsonl", checkpoint, tmp_path / f"rollout-{i}", "--seed", i,
                                  "--num-shards", ITERATIONS, "--shard-index", i - 1))  # 64 fresh prompts each time
        judged = run("judge", tmp_path / f"rollout-{i}", "--config", RECIPE, "--checkpoint", checkpoint,
                     "--out", tmp_path / f"judged-{i}")
        assert judged.exit_code == 0, judged.stderr
        trained = run("train-sao", tmp_path / f"judged-{i}", "--config", RECIPE, "--checkpoint", checkpoint,
                      "--critic", critic, "--init-critic", "--out", policy, "--json")
        assert trained.exit_code == 0, trained.stderr
        summary = json.loads(trained.stdout)
        assert summary["records"] == 64 and summary["trained_records"] >= 60 and summary["critic_steps"] == 2
        explained.append(summary["explained_variance"])
    after = held_out(policy, "eval-after")
    print(json.dumps({"held_out_before": before, "held_out_after": after, "sampled_per_iteration": sampled,
                      "explained_variance": explained}))
    assert before < 0.35  # the warm start is weak
    assert after >= before + 0.1 and after >= 1.5 * before, (before, after, sampled)
