"""GSPO and DAPO each learn the shipped count task on the tiny GLM-5 from scratch (issue 46).

The loop of tests/test_learning.py (the full fine-tuning GRPO learning test: the embedded engine
samples, the count verifier scores, the trainer updates with a persistent optimizer), 40 iterations
of 10 prompts x 8 samples, with the variant's settings: GSPO at the paper's clip range 3e-4 / 4e-4
with each sequence weighing the same (TRL's GSPO setup), DAPO with clip-higher 0.28 and its
token-level loss. Measured (one torch thread): GSPO's batch reward 0.002 over the first 5
iterations -> 0.065 over the last 5, greedy 0.0125 -> 0.10; DAPO's 0.002 -> 0.106, greedy 0.0125
-> 0.15. Chance is about 0.002.
"""

from __future__ import annotations

import json

import pytest
from test_learning import count_task_learning

from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.trainer import PolicyTrainer

VARIANTS = {
    "gspo": dict(policy_loss="gspo", eps_low=3e-4, eps_high=4e-4, loss_normalization="segment"),
    "dapo": dict(eps_low=0.2, eps_high=0.28, loss_normalization="dapo"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_variant_raises_the_count_reward(tiny_checkpoint, variant, torch_one_thread):
    tokenizer, revision = load_tokenizer(tiny_checkpoint)
    model = load_model(tiny_checkpoint)
    config = GRPOConfig(lr=3e-3, epochs=2, mini_batches=2, micro_batch_size=128, seed=1, **VARIANTS[variant])
    trainer = PolicyTrainer(model, config, pad_token_id=tokenizer.pad_token_id)
    run = count_task_learning(model, trainer, tokenizer, revision, iterations=40)
    curve, first, last, before, after = run["curve"], run["first5"], run["last5"], run["greedy_before"], run["greedy_after"]
    clipped = [step["train/clip_fraction"] for step in run["steps"]]
    print(json.dumps({"variant": variant, **{k: run[k] for k in ("greedy_before", "greedy_after", "first5", "last5")}}))
    assert first < 0.01  # chance is about 0.002
    assert last >= 0.04 and last >= 10 * max(first, 1e-3), curve
    assert after > before
    assert max(clipped) > 0  # the clip (GSPO's per sequence) was active
