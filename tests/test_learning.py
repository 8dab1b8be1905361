"""GRPO learns the shipped count task on the tiny GLM-5 from scratch (shared/notes/tiny-glm5-rl-facts.md).

The loop is the rollout -> judge -> train-grpo chain run in one process with the same library
calls the three stages make (the stages themselves are tested end to end elsewhere): the embedded
engine samples, the `count` verifier scores, the GRPO trainer updates with a persistent optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from glmpost.formats.prompts import encode_prompt, read_prompts
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.rewards.verifiers import VerifyContext, count_verifier
from glmpost.rl.batches import prepare_batch
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.trainer import PolicyTrainer
from glmpost.rollout.records import RolloutPrompt, rollout_record

TASK = Path(__file__).resolve().parents[1] / "recipes" / "data" / "count-train.jsonl"
NEW_TOKENS = 8


def _reward(tokenizer, record) -> float:
    context = VerifyContext(
        text="", response_token_ids=record["response_token_ids"], action_mask=record["action_mask"],
        task=record["task"], status=record["status"], tokenizer=tokenizer, sampling=record["sampling"],
    )
    return count_verifier(context).score


def count_task_learning(model, trainer, tokenizer, revision: str, *, iterations: int) -> dict:
    """The loop (module doc) on ``model`` trained by ``trainer``: the greedy reward before and after
    ``iterations`` updates of 8 samples per prompt at temperature 1, each update's sampled reward
    (``curve``) and its trainer steps' metrics (``steps``)."""
    prompts = [RolloutPrompt(p.id, encode_prompt(tokenizer, p.messages), p.domain, p.task) for p in read_prompts(TASK)]
    engine = LocalEngine(model, batch_size=128, pad_token_id=tokenizer.pad_token_id)

    def run(iteration: int, *, temperature: float, group_size: int):
        params = SamplingParams(temperature=temperature, max_new_tokens=NEW_TOKENS, seed=iteration)
        keys = [f"{p.prompt_id}/{i}" for p in prompts for i in range(group_size)]
        completions = engine.generate([p.token_ids for p in prompts for _ in range(group_size)], keys, params)
        records = []
        for index, completion in enumerate(completions):
            record = rollout_record(prompts[index // group_size], completion, sample_index=index % group_size,
                                    params=params, policy_version=iteration, tokenizer_revision=revision, engine={})
            records.append({**record, "reward": _reward(tokenizer, record)})
        return records

    def greedy_reward() -> float:
        return float(np.mean([r["reward"] for r in run(-1, temperature=0.0, group_size=1)]))

    before = greedy_reward()
    curve, steps = [], []
    for iteration in range(iterations):
        batch = prepare_batch(run(iteration, temperature=1.0, group_size=8))
        curve.append(float(batch.rewards.mean()))
        steps += trainer.train(batch.examples)
    return {"greedy_before": before, "greedy_after": greedy_reward(), "first5": float(np.mean(curve[:5])),
            "last5": float(np.mean(curve[-5:])), "curve": curve, "steps": steps}


def test_grpo_raises_the_count_reward_by_a_clear_margin(tiny_checkpoint):
    tokenizer, revision = load_tokenizer(tiny_checkpoint)
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, GRPOConfig(lr=3e-3, epochs=2, mini_batches=2, micro_batch_size=128, seed=1),
                          pad_token_id=tokenizer.pad_token_id)
    run = count_task_learning(model, trainer, tokenizer, revision, iterations=60)
    curve, first, last, before, after = run["curve"], run["first5"], run["last5"], run["greedy_before"], run["greedy_after"]
    print(json.dumps({k: run[k] for k in ("greedy_before", "greedy_after", "first5", "last5")}))
    assert first < 0.01  # chance is about 0.002
    assert last >= 0.05 and last >= 10 * max(first, 1e-3), curve
    assert after >= 0.1 > before
