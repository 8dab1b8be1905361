"""Peer equality (issue 46): glmpost's GRPO variants equal TRL's ``GRPOTrainer`` loss on one batch.

One batch of judged records (12 sequences, 3 groups of 4, completions of 1 to 8 tokens, one group of
equal rewards) on the same tiny weights in fp32 (the wide tiny GLM-5: its DSA indexer selects every
key, so both sides attend alike). Each side computes the old log-probs on the weights W0 (glmpost
``PolicyTrainer.prepare``, TRL ``_generate_and_score_completions`` fed by a ``rollout_func`` that
returns these records and a reward function that returns their rewards), then both models take the
same perturbation to W1 (so ratios leave 1 and clipping happens) and compute the loss and its
gradient there (glmpost: one ``train`` step whose optimizer step only records the gradients; TRL:
``_compute_loss`` and ``backward``). The rollout log-probs are the model's own plus noise, so the
importance corrections weigh, truncate and reject.

How glmpost's settings map to TRL 1.16.0's (``trl.GRPOConfig``):

=====================================  =================================================================
glmpost                                TRL
=====================================  =================================================================
--eps-low / --eps-high                 epsilon / epsilon_high
--loss-normalization segment           loss_type="grpo" (each sequence's token mean, then the mean)
--loss-normalization dapo (= token)    loss_type="dapo"
--loss-normalization bnpo (= token)    loss_type="bnpo" (the same with one micro-batch, one process)
--loss-normalization dr_grpo           loss_type="dr_grpo", --dr-grpo-max-tokens = max_completion_length
--loss-denominator action              TRL's denominators count every completion token (no trust mask)
--no-icepop                            TRL has no IcePop mask
--policy-loss ppo / gspo               importance_sampling_level="token" / "sequence"
--policy-loss cispo                    loss_type="cispo", epsilon_high = 1 + --cispo-eps-high
                                       (--cispo-eps-low 1: no lower bound, as TRL's)
--advantage-scaling group/batch/none   scale_rewards="group"/"batch"/"none"; --advantage-eps 1e-4 (TRL's)
--importance-correction tis            vllm_importance_sampling_mode="token_truncate", clip_max = C
--importance-correction seq-tis        vllm_importance_sampling_mode="sequence_truncate", clip_max = C
--importance-correction mis            vllm_importance_sampling_mode="sequence_mask", clip_max = C
--importance-cap C                     vllm_importance_sampling_clip_max (clip_min unset)
--kl-coef / --ref-checkpoint           beta with use_bias_correction_kl=False (glmpost's k3 is not
                                       multiplied by the ratio), the same reference weights
--entropy-coef (token normalisations)  entropy_coef (TRL's bonus is a token mean whatever loss_type)
=====================================  =================================================================

TRL's old log-probs are computed (not taken as the current ones detached) when ``use_vllm`` with its
importance correction, or when ``num_iterations`` > 1: the tests set ``use_vllm`` on the built trainer
(no server is contacted: the ``rollout_func`` generates) and ``num_iterations=2``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from glmpost.kernel.engine import Completion, SamplingParams
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.rl.batches import prepare_batch
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.distributed import TorchBackend
from glmpost.rl.trainer import PolicyTrainer
from glmpost.rollout.records import RolloutPrompt, rollout_record

trl = pytest.importorskip("trl")  # the dev / bench extra pins it

B, G, MAX_TOKENS = 12, 4, 8
LENGTHS = [3, 5, 8, 2, 6, 8, 4, 7, 8, 1, 5, 6]
REWARDS = [0.1, 0.9, 0.4, 0.4, 0.5, 0.5, 0.5, 0.5, 1.0, 0.0, 0.0, 0.25]  # the second group: equal rewards

# (id, TRL's GRPOConfig arguments, glmpost's GRPOConfig settings); unless a case says, the clip is 0.2 / 0.2.
CASES = [
    ("grpo", dict(loss_type="grpo", epsilon_high=0.28), dict(loss_normalization="segment", eps_high=0.28)),
    ("dapo", dict(loss_type="dapo", epsilon_high=0.28), dict(loss_normalization="dapo", eps_high=0.28)),
    ("bnpo", dict(loss_type="bnpo"), dict(loss_normalization="bnpo")),
    ("dr_grpo-no-std", dict(loss_type="dr_grpo", scale_rewards="none"),
     dict(loss_normalization="dr_grpo", dr_grpo_max_tokens=MAX_TOKENS, advantage_scaling="none")),
    ("batch-std", dict(loss_type="dapo", scale_rewards="batch"), dict(loss_normalization="dapo", advantage_scaling="batch")),
    ("gspo", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
     dict(policy_loss="gspo", loss_normalization="segment", eps_low=3e-4, eps_high=4e-4)),
    ("gspo-dapo", dict(loss_type="dapo", importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.05),
     dict(policy_loss="gspo", loss_normalization="dapo", eps_low=0.05, eps_high=0.05)),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.1), dict(policy_loss="cispo", loss_normalization="dapo", cispo_eps_high=0.1)),
    ("tis", dict(loss_type="dapo", vllm_importance_sampling_mode="token_truncate"),
     dict(loss_normalization="dapo", importance_correction="tis")),
    ("seq-tis", dict(loss_type="dapo", vllm_importance_sampling_mode="sequence_truncate"),
     dict(loss_normalization="dapo", importance_correction="seq-tis")),
    ("mis", dict(loss_type="grpo", vllm_importance_sampling_mode="sequence_mask"),
     dict(loss_normalization="segment", importance_correction="mis")),
    ("gspo-tis", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.05, epsilon_high=0.05,
                      vllm_importance_sampling_mode="token_truncate"),
     dict(policy_loss="gspo", loss_normalization="segment", eps_low=0.05, eps_high=0.05, importance_correction="tis")),
    ("dapo-kl-entropy", dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False, entropy_coef=0.01),
     dict(loss_normalization="dapo", kl_coef=0.04, entropy_coef=0.01)),
]
CAP = 1.5


class GradientCapture(TorchBackend):
    """The optimizer step records the gradients and takes no step."""

    def step(self) -> float:
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return 0.0


def _perturb(model) -> None:
    """W0 -> W1, the same on both sides."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


@pytest.fixture(scope="module")
def batch(wide_checkpoint):
    """The prompt, completions and their rollout log-probs (the model's own at W0 plus noise)."""
    tokenizer, revision = load_tokenizer(wide_checkpoint)
    prompt = tokenizer.encode("count: 3")
    generator = torch.Generator().manual_seed(0)
    completions = [torch.randint(10, 500, (n,), generator=generator).tolist() for n in LENGTHS]
    model = load_model(wide_checkpoint)
    sampled = []
    with torch.no_grad():
        for completion in completions:
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
            own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            sampled.append((own + 0.3 * torch.randn(len(completion), generator=generator)).tolist())
    return dict(checkpoint=wide_checkpoint, tokenizer=tokenizer, revision=revision, prompt=prompt,
                completions=completions, sampled=sampled)


def _records(batch) -> list[dict]:
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_TOKENS, seed=0)
    records = []
    for i, (completion, log_probs) in enumerate(zip(batch["completions"], batch["sampled"])):
        prompt = RolloutPrompt(f"p{i // G}", batch["prompt"], "count", {"digit": "3"})
        record = rollout_record(prompt, Completion(completion, log_probs, "length"), sample_index=i % G, params=params,
                                policy_version=0, tokenizer_revision=batch["revision"], engine={})
        records.append({**record, "reward": REWARDS[i]})
    return records


def _glmpost(batch, settings: dict) -> tuple[float, dict, dict]:
    model = load_model(batch["checkpoint"])
    reference = load_model(batch["checkpoint"]) if settings.get("kl_coef") else None
    config = GRPOConfig(lr=1e-3, micro_batch_size=B, icepop=False, loss_denominator="action", advantage_eps=1e-4,
                        grad_clip=0.0, importance_cap=CAP, **{"eps_high": 0.2, **settings})
    backend = GradientCapture(model, config)
    trainer = PolicyTrainer(model, config, pad_token_id=batch["tokenizer"].pad_token_id, backend=backend, reference=reference)
    examples = prepare_batch(_records(batch), advantage_eps=1e-4, advantage_scaling=config.advantage_scaling).examples
    prepared = trainer.prepare(examples)
    _perturb(model)
    metrics = trainer.train(prepared)[0]
    return metrics["train/loss"], backend.grads, metrics


def _trl(batch, arguments: dict, tmp_path: Path) -> tuple[float, dict]:
    from datasets import Dataset
    from trl.trainer.utils import add_fused_lm_head

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL
    arguments = {"epsilon": 0.2, "epsilon_high": 0.2, "beta": 0.0, **arguments}
    correcting = "vllm_importance_sampling_mode" in arguments
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, num_generations=G,
                          max_completion_length=MAX_TOKENS, num_iterations=2, report_to=[], use_cpu=True, bf16=False,
                          gradient_checkpointing=False, vllm_importance_sampling_correction=correcting,
                          vllm_importance_sampling_clip_max=CAP, **arguments)
    dataset = Dataset.from_list([{"prompt": "count: 3", "reward": reward} for reward in REWARDS])

    def rollout(prompts, trainer):
        return {"prompt_ids": [batch["prompt"]] * B, "completion_ids": batch["completions"], "logprobs": batch["sampled"]}

    def judged(prompts, completions, reward, **kwargs):
        return reward

    model = load_model(batch["checkpoint"])
    model.train()
    trainer = trl.GRPOTrainer(model, reward_funcs=[judged], args=args, train_dataset=dataset,
                              processing_class=batch["tokenizer"], rollout_func=rollout)
    trainer.use_vllm = True  # the rollout log-probs are an engine's: TRL's importance correction reads them
    trainer._last_loaded_step = trainer.state.global_step  # nothing to sync: rollout_func generates
    trainer.current_gradient_accumulation_steps = 1
    if arguments["beta"]:
        trainer.ref_model = load_model(batch["checkpoint"])  # glmpost's loading on both sides
        add_fused_lm_head(trainer.ref_model)
    inputs = trainer._generate_and_score_completions([dict(row) for row in dataset])
    _perturb(trainer.model)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_the_pinned_trl_release():
    assert trl.__version__ == "1.16.0", "the mapping in this module's docstring was read from TRL 1.16.0: check it again"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradients_equal_trls(batch, case, tmp_path, torch_one_thread):
    name, trl_arguments, settings = case
    ours, our_grads, metrics = _glmpost(batch, settings)
    theirs, their_grads = _trl(batch, trl_arguments, tmp_path)
    assert abs(ours - theirs) <= 1e-6, (ours, theirs)
    assert set(our_grads) == set(their_grads)
    assert max(float((our_grads[n] - their_grads[n]).abs().max()) for n in their_grads) <= 1e-6
    assert max(float(g.abs().max()) for g in their_grads.values()) > 1e-2  # a real gradient, not two zeros
    # Each case exercises what it names.
    if name in ("grpo", "dapo", "gspo", "gspo-dapo"):
        assert 0 < metrics["train/clip_fraction"] < 1
    if name == "cispo":
        assert metrics["train/clip_fraction"] > 0
    if "tis" in name:
        assert metrics["train/is_weight_mean"] != 1.0 and metrics["train/is_rejected_fraction"] == 0
    if name == "mis":
        assert 0 < metrics["train/is_rejected_fraction"] < 1
