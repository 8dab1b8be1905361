"""Agentic RL learns tool use: after a weak SFT warm start, three rollout -> judge -> train-grpo
iterations in the calculator environment (recipes/tiny-agentic.toml) raise the held-out tool-use reward.

The real CLI stages run in this process (the ``glmpost_cli`` fixture). The tiny model never copies
the observation into ``<answer>``, so the reward it can reach is the recipe's ``tool_reward`` (1 per
well-formed ``<calc>`` call, at most 2 per trajectory); the warm start (56 SFT steps on
recipes/data/calc-demo.jsonl) leaves sampled calls rare. "Before" is measured right after the warm
start, "after" after the RL iterations, both on recipes/data/calc-heldout.jsonl sampled at the
recipe's temperature (greedy decoding of this model hardly depends on the prompt: it is one sample).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-agentic.toml"
DATA = ROOT / "recipes" / "data"
ITERATIONS = 3


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]


def env_reward(run, prompts: Path, checkpoint: Path, out: Path, *options) -> float:
    """``glmpost rollout`` of ``prompts`` with the recipe (plus ``options``): its rollout/env_reward_mean."""
    done = run("rollout", prompts, "--config", RECIPE, "--checkpoint", checkpoint, "--out", out, *options)
    assert done.exit_code == 0, done.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "rollout/env_reward_mean" in line][-1]["rollout/env_reward_mean"]


def test_rl_iterations_raise_the_held_out_tool_use_reward(glmpost_cli, tiny_checkpoint, tmp_path):
    run = glmpost_cli
    assert run("shards", "import", DATA / "calc-demo.jsonl", "--checkpoint", tiny_checkpoint,
               "--out", tmp_path / "demo").exit_code == 0
    sft = tmp_path / "sft"
    warmed = run("qat", tmp_path / "demo", "--config", RECIPE, "--checkpoint", tiny_checkpoint, "--out", sft)
    assert warmed.exit_code == 0, warmed.stderr

    def held_out(checkpoint: Path, name: str) -> float:
        return env_reward(run, DATA / "calc-heldout.jsonl", checkpoint, tmp_path / name, "--group-size", "4",
                          "--seed", "1000")

    before = held_out(sft, "eval-before")
    policy, sampled = tmp_path / "policy", []
    for i in range(1, ITERATIONS + 1):
        checkpoint = policy if (policy / "LATEST").exists() else sft
        sampled.append(env_reward(run, DATA / "calc-train.jsonl", checkpoint, tmp_path / f"rollout-{i}", "--seed", i))
        judged = run("judge", tmp_path / f"rollout-{i}", "--config", RECIPE, "--checkpoint", checkpoint,
                     "--out", tmp_path / f"judged-{i}")
        assert judged.exit_code == 0, judged.stderr
        trained = run("train-grpo", tmp_path / f"judged-{i}", "--config", RECIPE, "--checkpoint", checkpoint,
                      "--out", policy)
        assert trained.exit_code == 0, trained.stderr
    after = held_out(policy, "eval-after")
    print(json.dumps({"held_out_before": before, "held_out_after": after, "sampled_per_iteration": sampled}))
    assert before < 0.2  # the warm start is weak: well-formed calls are rare
    assert after >= before + 0.1 and after >= 2 * before, (before, after, sampled)
