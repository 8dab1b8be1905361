"""GRPO trainer: IcePop masking, split-invariant token-mean loss, exclusions, first-step ratio 1."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from glmpost.formats.prompts import encode_prompt
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.rl.batches import prepare_batch
from glmpost.rl.distributed import TorchBackend
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.trainer import PolicyTrainer
from glmpost.rollout.records import RolloutPrompt, rollout_record


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    tokenizer, revision = load_tokenizer(tiny_checkpoint)
    return tiny_checkpoint, tokenizer, revision


def _records(policy, *, groups=2, group_size=4, new_tokens=6, seed=0):
    checkpoint, tokenizer, revision = policy
    model = load_model(checkpoint)
    engine = LocalEngine(model, batch_size=16, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed)
    prompts = [RolloutPrompt(f"p{d}", encode_prompt(tokenizer, [{"role": "user", "content": f"count: {d}"}]), "count", {"digit": str(d)})
               for d in range(groups)]
    sequences = [p.token_ids for p in prompts for _ in range(group_size)]
    keys = [f"{p.prompt_id}/{i}" for p in prompts for i in range(group_size)]
    records = []
    for index, completion in enumerate(engine.generate(sequences, keys, params)):
        record = rollout_record(prompts[index // group_size], completion, sample_index=index % group_size, params=params,
                                policy_version=0, tokenizer_revision=revision, engine={})
        record["reward"] = float(index % group_size) / group_size
        records.append(record)
    return records


def _trainer(policy, **overrides):
    checkpoint, tokenizer, _ = policy
    config = GRPOConfig(**{"lr": 1e-2, "micro_batch_size": 8, **overrides})
    return PolicyTrainer(load_model(checkpoint), config, pad_token_id=tokenizer.pad_token_id)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_first_step_ratio_is_one_and_icepop_counts_trusted_tokens(policy):
    records = _records(policy)
    batch = prepare_batch(records)
    # Make the rollout engine disagree with the trainer on two tokens of one trajectory:
    # rho = pi_train_old / pi_infer = exp(-3) < 1/2 -> both leave the gradient.
    example = batch.examples[0]
    example.rollout_log_probs = example.rollout_log_probs.copy()
    example.rollout_log_probs[[1, 3]] += 3.0
    example.rollout_log_probs = np.minimum(example.rollout_log_probs, 0.0)
    metrics = _trainer(policy).train(batch.examples)[0]
    actions = sum(int(e.action_mask.sum()) for e in batch.examples)
    assert metrics["train/action_tokens"] == actions
    assert metrics["train/trusted_tokens"] <= actions - 2
    assert metrics["train/trusted_fraction"] == metrics["train/trusted_tokens"] / actions
    # Old log-probs are recomputed on the same weights, so the PPO ratio starts at 1.
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/clip_fraction"] == 0.0
    assert metrics["train/mismatch_abs_logp_mean"] > 0.0


def test_masked_tokens_carry_no_gradient_whatever_their_advantage(policy):
    examples = prepare_batch(_records(policy)).examples
    outlier = examples[0]
    # Every token of the outlier is distrusted: rho = exp(-4) for all of them.
    outlier.rollout_log_probs = np.minimum(outlier.rollout_log_probs + 4.0, 0.0)
    outlier.rollout_log_probs[outlier.rollout_log_probs == 0.0] = -1e-3
    updates = []
    for advantage in (5.0, -5.0):
        variant = [copy.copy(e) for e in examples]
        variant[0].advantage = advantage
        trainer = _trainer(policy)
        trainer.train(variant)
        updates.append(_params(trainer))
    for name in updates[0]:
        assert torch.equal(updates[0][name], updates[1][name]), name
    # Without IcePop the same outlier does move the weights.
    moved = []
    for advantage in (5.0, -5.0):
        variant = [copy.copy(e) for e in examples]
        variant[0].advantage = advantage
        trainer = _trainer(policy, icepop=False)
        trainer.train(variant)
        moved.append(_params(trainer))
    assert any(not torch.equal(moved[0][n], moved[1][n]) for n in moved[0])


class GradientRecorder(TorchBackend):
    """The local backend, keeping a copy of the accumulated gradient of each optimizer step."""

    def step(self) -> float:
        self.gradients = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return super().step()


def test_action_denominator_scales_the_trusted_gradient_by_the_trusted_fraction(policy):
    """The same sum over trusted tokens, divided by the trusted count (default: the survivors of a
    heavy mask are up-weighted) or by every action token."""
    checkpoint, tokenizer, _ = policy
    examples = prepare_batch(_records(policy)).examples
    for example in examples[:5]:  # five of eight trajectories wholly distrusted: rho = exp(-4)
        example.rollout_log_probs = np.minimum(example.rollout_log_probs + 4.0, -1e-3)
    runs = {}
    for denominator in ("trusted", "action"):
        config = GRPOConfig(lr=1e-2, micro_batch_size=8, loss_denominator=denominator)
        backend = GradientRecorder(load_model(checkpoint), config)
        metrics = PolicyTrainer(backend.model, config, pad_token_id=tokenizer.pad_token_id, backend=backend).train(examples)[0]
        runs[denominator] = (metrics, backend.gradients)
    (trusted, g_trusted), (action, g_action) = runs["trusted"], runs["action"]
    fraction = trusted["train/trusted_fraction"]
    assert 0.2 < fraction < 0.6 and action["train/trusted_fraction"] == fraction
    assert action["train/loss"] == pytest.approx(trusted["train/loss"] * fraction, rel=1e-5, abs=1e-9)
    for name, grad in g_trusted.items():
        torch.testing.assert_close(g_action[name], grad * fraction, atol=1e-7, rtol=1e-4, msg=name)
    assert any(float(g.abs().max()) > 0 for g in g_trusted.values())


def test_gradient_does_not_depend_on_micro_batch_split(policy):
    checkpoint, tokenizer, _ = policy
    examples = prepare_batch(_records(policy)).examples
    results = []
    for micro_batch_size in (1, 3, 8):
        config = GRPOConfig(lr=1e-2, micro_batch_size=micro_batch_size)
        model = load_model(checkpoint)
        backend = GradientRecorder(model, config)
        metrics = PolicyTrainer(model, config, pad_token_id=tokenizer.pad_token_id, backend=backend).train(examples)[0]
        results.append((metrics["train/loss"], backend.gradients))
    assert results[0][1], "no gradient was recorded"
    for loss, gradients in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5, abs=1e-7)
        assert gradients.keys() == results[0][1].keys()
        for name, value in gradients.items():
            torch.testing.assert_close(value, results[0][1][name], rtol=1e-4, atol=1e-7)


def test_epochs_and_mini_batches_give_that_many_optimizer_steps(policy):
    history = _trainer(policy, epochs=2, mini_batches=3).train(prepare_batch(_records(policy)).examples)
    assert [m["train/step"] for m in history] == list(range(6))
    assert [m["train/epoch"] for m in history] == [0, 0, 0, 1, 1, 1]
    assert all(math.isfinite(m["train/grad_norm"]) for m in history)
    # Later steps move away from the old policy: the ratio is no longer exactly 1.
    assert history[-1]["train/ratio_mean"] != pytest.approx(1.0, abs=1e-7)


def test_prepare_batch_excludes_and_counts(policy):
    records = _records(policy, groups=3, group_size=4)
    records[0]["reward"] = float("nan")
    records[1]["status"] = "aborted"
    for record in records[4:8]:
        record["reward"] = 1.0  # an all-equal group: no relative signal
    batch = prepare_batch(records)
    # Group 0 keeps 2 valid samples of 4, not more than half: GLM-5 drops it whole.
    assert batch.excluded == {"nan_reward": 1, "status": 1, "no_actions": 0, "small_group": 2}
    assert len(batch.examples) == 8 and batch.groups == 2 and batch.zero_advantage_groups == 1
    assert [e.advantage for e in batch.examples[:4]] == [0.0] * 4
    assert sum(e.advantage for e in batch.examples[4:]) == pytest.approx(0.0, abs=1e-6)
    assert batch.failed == {"aborted": 1, "nan_reward": 1} and batch.group_sizes == {4: 2}
    records[2]["status"] = "completed"
    records[1]["status"] = "completed"  # 3 of 4 valid: kept, its baseline over those three
    kept = prepare_batch(records)
    assert kept.excluded["small_group"] == 0 and kept.group_sizes == {3: 1, 4: 2}
    assert sum(e.advantage for e in kept.examples[:3]) == pytest.approx(0.0, abs=1e-6)


def test_kl_to_reference_is_zero_at_the_start_and_entropy_is_reported(policy):
    checkpoint, tokenizer, _ = policy
    config = GRPOConfig(lr=1e-2, kl_coef=0.1, entropy_coef=0.01)
    trainer = PolicyTrainer(load_model(checkpoint), config, pad_token_id=tokenizer.pad_token_id, reference=load_model(checkpoint))
    history = trainer.train(prepare_batch(_records(policy)).examples)
    assert history[0]["train/kl_ref_k3"] == pytest.approx(0.0, abs=1e-6)
    assert history[0]["train/entropy"] > 0.0
