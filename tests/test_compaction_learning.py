"""CompactionRL learns to carry a fact through its own summaries (slow tier: ``bin/test -m slow``).

kv-recall (recipes/tiny-compaction.toml): the value of key ``aa`` is shown once, by the reset
observation; four ``<next>`` calls later the question needs it. The context budget of 128 cannot hold
the 150-token trajectory, so the context is rebuilt after the third step: the prompt's turns, the
policy's summary, the last pair. Tasks differ in the value alone, so only a summary that carries it
can answer; rebuilding without a summary (``--compaction drop``) is left at chance (1 in 10), and
without compaction the budget ends every trajectory before the question.

The tiny GLM-5 with dense attention (``--index-topk 256``: its top-8 DSA keys never reach the stored
value) learns from the recipe's SFT warm start on recipes/data/recall-demo.jsonl (each trajectory
turn, a summary turn, the turns after a rebuilt context), then one rollout -> judge -> train-grpo
iteration with compaction. Held-out success (recipes/data/recall-heldout.jsonl, 2 samples per
prompt): the untrained model's with compaction, then the trained policy's with compaction, with
``drop`` and without compaction, all at the same budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-compaction.toml"
DATA = ROOT / "recipes" / "data"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_one_thread")]


def success(run, checkpoint: Path, out: Path, mode: str) -> float:
    """Held-out success of ``checkpoint`` with ``--compaction mode`` at the recipe's budget."""
    done = run("rollout", DATA / "recall-heldout.jsonl", "--config", RECIPE, "--checkpoint", checkpoint, "--out", out,
               "--group-size", "2", "--seed", "1000", "--compaction", mode)
    assert done.exit_code == 0, done.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return float(sum(line["rollout/env_reward_mean"] * line["rollout/records"] for line in lines)
                 / sum(line["rollout/records"] for line in lines))


def test_summaries_trained_with_the_outcome_carry_the_fact_past_compaction(glmpost_cli, tmp_path):
    run = glmpost_cli
    model = tmp_path / "model"
    assert run("init-model", "--out", model, "--seed", "0", "--index-topk", "256").exit_code == 0
    untrained = success(run, model, tmp_path / "eval-untrained", "summary")
    assert run("shards", "import", DATA / "recall-demo.jsonl", "--checkpoint", model, "--out", tmp_path / "demo").exit_code == 0
    warmed = run("qat", tmp_path / "demo", "--config", RECIPE, "--checkpoint", model, "--out", tmp_path / "sft")
    assert warmed.exit_code == 0, warmed.stderr
    warm = success(run, tmp_path / "sft", tmp_path / "eval-warm", "summary")
    policy = tmp_path / "policy"
    rolled = run("rollout", DATA / "recall-train.jsonl", "--config", RECIPE, "--checkpoint", tmp_path / "sft",
                 "--out", tmp_path / "rollout", "--limit", "64", "--seed", "1")
    assert rolled.exit_code == 0, rolled.stderr
    judged = run("judge", tmp_path / "rollout", "--config", RECIPE, "--checkpoint", tmp_path / "sft", "--out", tmp_path / "judged")
    assert judged.exit_code == 0, judged.stderr
    trained = run("train-grpo", tmp_path / "judged", "--config", RECIPE, "--checkpoint", tmp_path / "sft", "--out", policy,
                  "--json")
    assert trained.exit_code == 0, trained.stderr
    assert json.loads(trained.stdout)["compactions"] >= 64  # every trajectory that reached the budget summarised
    after = {mode: success(run, policy, tmp_path / f"eval-{mode}", mode) for mode in ("summary", "drop", "off")}
    print(json.dumps({"untrained": untrained, "warm_start": warm, "after": after}))
    assert untrained == 0.0
    assert after["off"] == 0.0  # without compaction the budget ends every trajectory before the question
    assert after["drop"] <= 0.3  # rebuilt without a summary: the value is gone, answers are guesses (1 in 10)
    assert after["summary"] >= 0.6 and after["summary"] >= after["drop"] + 0.3, after
