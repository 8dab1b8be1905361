"""OPD / MOPD formulas (glmpost/rl/advantages.py, losses.py) on hand-computed cases, and the OPD trainer's gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from glmpost.formats.prompts import encode_prompt
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.kernel.scoring import score_tokens
from glmpost.rl.advantages import opd_advantages
from glmpost.rl.batches import prepare_opd_batch
from glmpost.rl.configs import OPDConfig
from glmpost.rl.distributed import TorchBackend
from glmpost.rl.losses import opd_pg_loss, sampled_reverse_kl, topk_reverse_kl
from glmpost.rl.micro_batches import collate
from glmpost.rl.trainer import PolicyTrainer
from glmpost.rollout.records import RolloutPrompt, rollout_record

NAN = float("nan")


def test_opd_advantage_hand_computed_with_observations_and_task_term():
    teacher = torch.tensor([[-0.5, -2.0, NAN, -1.0]])
    student = torch.tensor([[-1.0, -1.0, -3.0, -1.0]])
    mask = torch.tensor([[True, True, False, True]])  # token 2 is an observation: no teacher signal
    assert opd_advantages(teacher, student, mask).tolist() == [[0.5, -1.0, 0.0, 0.0]]
    with_task = opd_advantages(teacher, student, mask, task_advantages=torch.tensor([[2.0]]), task_weight=0.5)
    assert with_task.tolist() == [[1.5, 0.0, 0.0, 1.0]]
    assert sampled_reverse_kl(student, teacher, mask).tolist() == [[-0.5, 1.0, 0.0, 0.0]]


def test_sign_teacher_preferred_token_rises_and_dispreferred_falls():
    logits = torch.zeros(1, 2, 4, requires_grad=True)
    tokens = torch.tensor([[1, 2]])
    student = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)  # log(1/4) each
    teacher = torch.tensor([[math.log(0.9), math.log(0.01)]])  # likes token 1 at t=0, dislikes token 2 at t=1
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = opd_advantages(teacher, student, mask)
    assert advantages[0, 0] > 0 > advantages[0, 1]
    opd_pg_loss(student, advantages, mask, 2.0).backward()
    with torch.no_grad():
        after = torch.log_softmax(logits - 0.5 * logits.grad, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert after[0, 0] > student[0, 0] and after[0, 1] < student[0, 1]


def test_no_gradient_flows_through_the_teacher_term():
    teacher = torch.tensor([[-0.2, -3.0]], requires_grad=True)
    student = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = opd_advantages(teacher, student, mask)
    assert not advantages.requires_grad
    loss = opd_pg_loss(student, advantages, mask, 2.0)
    loss.backward()
    assert teacher.grad is None
    # d/d logp_t of -A_t logp_t / 2 is exactly -A_t / 2: the student term inside A is stopped too.
    assert student.grad[0].tolist() == pytest.approx([-0.4, 1.0])


def test_topk_term_hand_computed():
    p = torch.log(torch.tensor([[[0.5, 0.25]]]))
    q = torch.log(torch.tensor([[[0.25, 0.25]]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    plain = 0.5 * math.log(2.0)
    assert topk_reverse_kl(p, q, mask, correction=False).item() == pytest.approx(plain, abs=1e-6)
    assert topk_reverse_kl(p, q, mask).item() == pytest.approx(plain - 0.25, abs=1e-6)
    # Off the mask a NaN teacher gives an exact 0 and a finite gradient.
    p = p.clone().requires_grad_(True)
    off = topk_reverse_kl(p, torch.full_like(q, NAN), torch.zeros(1, 1, dtype=torch.bool))
    off.sum().backward()
    assert off.item() == 0.0 and torch.isfinite(p.grad).all()


def _optimise_student(teacher_probs: torch.Tensor, top: torch.Tensor, *, correction: bool) -> torch.Tensor:
    """Free full-vocabulary student logits minimising the top-k loss; returns the student's probabilities."""
    logits = torch.zeros(teacher_probs.shape[0], dtype=torch.float64, requires_grad=True)
    teacher_topk = teacher_probs.log()[top][None, None]
    optimiser = torch.optim.LBFGS([logits], lr=1.0, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15,
                                  line_search_fn="strong_wolfe")
    mask = torch.ones(1, 1, dtype=torch.bool)

    def closure():
        optimiser.zero_grad()
        student_topk = torch.log_softmax(logits, -1)[top][None, None]
        loss = topk_reverse_kl(student_topk, teacher_topk, mask, correction=correction).sum()
        loss.backward()
        return loss

    optimiser.step(closure)
    return torch.softmax(logits.detach(), -1)


def test_topk_correction_puts_the_optimum_at_the_teacher_distribution_on_the_topk_set():
    teacher = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
    top = torch.tensor([0, 1, 2])  # the teacher's top-3 set
    corrected = _optimise_student(teacher, top, correction=True)
    # The optimum: the teacher's own probabilities on the set, so renormalised on it they agree too.
    assert corrected[top].tolist() == pytest.approx(teacher[top].tolist(), abs=1e-4)
    renormalised = corrected[top] / corrected[top].sum()
    assert renormalised.tolist() == pytest.approx((teacher[top] / teacher[top].sum()).tolist(), abs=1e-4)
    # Without the correction the truncated KL stops at p = q / e: mass leaks out of the top-k set.
    plain = _optimise_student(teacher, top, correction=False)
    assert plain[top].tolist() == pytest.approx((teacher[top] / math.e).tolist(), abs=1e-4)


# --------------------------------------------------------------------------------------------
# Chunked scoring and the trainer


@pytest.fixture(scope="module")
def scored(wide_checkpoint):
    tokenizer, revision = load_tokenizer(wide_checkpoint)
    model = load_model(wide_checkpoint)
    prompts = [RolloutPrompt(f"p{i}", encode_prompt(tokenizer, [{"role": "user", "content": f"count: {i}"}]), "count", {})
               for i in range(4)]
    engine = LocalEngine(model, batch_size=8, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    completions = engine.generate([p.token_ids for p in prompts], [p.prompt_id for p in prompts], params)
    records = [rollout_record(p, c, sample_index=0, params=params, policy_version=0, tokenizer_revision=revision, engine={})
               for p, c in zip(prompts, completions)]
    return model, tokenizer, records


def test_score_tokens_matches_the_full_logits_path(scored):
    model, tokenizer, records = scored
    from glmpost.rl.batches import TrainExample

    examples = [TrainExample(r["prompt_token_ids"].tolist() + r["response_token_ids"].tolist(), len(r["prompt_token_ids"]),
                             r["action_mask"], r["rollout_log_probs"], 0.0, r["id"]) for r in records]
    batch = collate(examples, pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        scores = score_tokens(model, batch.input_ids, batch.attention_mask, score_mask=batch.action_mask, topk=5, chunk_size=3)
        reference = sequence_log_probs(model, batch.input_ids, batch.attention_mask, score_mask=batch.action_mask)
        full = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float(), -1)[:, :-1]
    mask = batch.action_mask
    assert torch.equal(scores.mask, reference.mask)
    assert torch.allclose(scores.log_probs, reference.log_probs, atol=1e-6)
    top = full.topk(5, dim=-1)
    assert torch.equal(scores.topk_ids[mask], top.indices[mask])
    assert torch.allclose(scores.topk_log_probs[mask], top.values[mask], atol=1e-5)
    assert (scores.topk_ids[~mask] == 0).all()
    # With grad: gathered log-probs of given ids, and their gradient, match the full path.
    ids = scores.topk_ids.flip(-1)
    with_grad = score_tokens(model, batch.input_ids, batch.attention_mask, score_mask=mask, gather_ids=ids, chunk_size=4)
    assert torch.allclose(with_grad.gathered[mask], top.values.flip(-1)[mask], atol=1e-5)


class RecordingBackend(TorchBackend):
    """AdamW as usual, keeping a copy of the gradients of each step."""

    def step(self) -> float:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return super().step()


def _teacher_records(records, shift):
    out = []
    for r in records:
        r = dict(r)
        r["teacher_log_probs"] = np.where(r["action_mask"], np.minimum(r["rollout_log_probs"] + shift, 0.0), np.nan).astype(np.float32)
        r["teacher"] = {"id": "t"}
        out.append(r)
    return out


def test_opd_trainer_gradient_is_the_pure_pg_loss_gradient(scored, wide_checkpoint):
    _, tokenizer, records = scored
    rng = np.random.default_rng(0)
    scored_records = _teacher_records(records, rng.uniform(-1.0, 0.5, size=6).astype(np.float32))
    batch = prepare_opd_batch(scored_records)
    model = load_model(wide_checkpoint)
    config = OPDConfig(lr=1e-3, micro_batch_size=2, icepop=False)
    backend = RecordingBackend(model, config)
    trainer = PolicyTrainer(model, config, pad_token_id=tokenizer.pad_token_id, backend=backend)
    history = trainer.train(batch.examples)
    # The pure form on the same weights: -sum A_t log pi_theta / N with A_t = sg(logp_T - logp_theta).
    reference = load_model(wide_checkpoint)
    full = collate(batch.examples, pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    reference.train()
    student = sequence_log_probs(reference, full.input_ids, full.attention_mask, score_mask=full.action_mask).log_probs
    advantages = opd_advantages(full.token_fields["teacher_log_probs"], student, full.action_mask)
    opd_pg_loss(student, advantages, full.action_mask, float(full.action_mask.sum())).backward()
    for name, param in reference.named_parameters():
        if param.grad is not None:
            assert torch.allclose(backend.grads[name], param.grad, atol=1e-6), name
    kl = sampled_reverse_kl(student.detach(), full.token_fields["teacher_log_probs"], full.action_mask)
    assert history[0]["teacher_kl/count"] == pytest.approx(float(kl.sum() / full.action_mask.sum()), abs=1e-5)


def test_topk_loss_trains_and_reports(scored, wide_checkpoint):
    model, tokenizer, records = scored
    from glmpost.rl.batches import TrainExample

    full = collate([TrainExample(r["prompt_token_ids"].tolist() + r["response_token_ids"].tolist(), len(r["prompt_token_ids"]),
                                 r["action_mask"], r["rollout_log_probs"], 0.0, r["id"]) for r in records],
                   pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        teacher = score_tokens(model, full.input_ids, full.attention_mask, score_mask=full.action_mask, topk=4)
    scored_records = []
    for row, r in enumerate(records):
        p, n = len(r["prompt_token_ids"]), len(r["prompt_token_ids"]) + len(r["response_token_ids"])
        r = dict(r, teacher={"id": "self"})
        r["teacher_log_probs"] = teacher.log_probs[row, p - 1 : n - 1].numpy().astype(np.float32)
        r["teacher_topk_ids"] = teacher.topk_ids[row, p - 1 : n - 1].numpy().astype(np.int32)
        r["teacher_topk_log_probs"] = teacher.topk_log_probs[row, p - 1 : n - 1].numpy()
        scored_records.append(r)
    batch = prepare_opd_batch(scored_records, loss="topk")
    trainer = PolicyTrainer(load_model(wide_checkpoint), OPDConfig(lr=1e-3, loss="topk", icepop=False), pad_token_id=tokenizer.pad_token_id)
    history = trainer.train(batch.examples)
    # The teacher is the student itself: the corrected top-k KL is 0 and so is the sampled KL.
    assert history[0]["train/topk_kl"] == pytest.approx(0.0, abs=1e-5)
    assert history[0]["teacher_kl/count"] == pytest.approx(0.0, abs=1e-5)
