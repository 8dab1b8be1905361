"""MOPD learns: two tiny teachers fine-tuned to different behaviours on two domains; the base model
(the student) runs rollout -> score-teacher (routed by domain) -> opd-merge a few times, and its
reverse KL to the routed teacher drops on held-out prompts of BOTH domains.

Teachers and student fork from one checkpoint (the brief's "同源教师" condition, "MOPD：能力整合发生在
策略空间"). The teachers come from plain SFT (glmpost.sft) on recipes/data/opd-teachers.jsonl, one
domain each: `echo: d` -> the digit six times, `flip: d` -> "ababab". The KL is the exact one,
sum_v p log(p/q) over the vocabulary, averaged over the action tokens of student samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glmpost.checkpoints import CheckpointManifest, NextVersion, load_model, load_tokenizer
from glmpost.engine import LocalEngine, SamplingParams
from glmpost.prompts import conversation_record, encode_prompt, read_prompts
from glmpost.sft import SFTConfig, SFTTrainer, sft_examples
from glmpost.trainer import collate, TrainExample

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
ITERATIONS = 6


def _make_teacher(base: Path, domain: str, root: Path) -> Path:
    tokenizer, revision = load_tokenizer(base)
    items = [i for i in read_prompts(DATA / "opd-teachers.jsonl") if i.domain == domain]
    examples = sft_examples([conversation_record(i, tokenizer, revision) for i in items])
    model = load_model(base)
    trainer = SFTTrainer(model, SFTConfig(lr=3e-3, epochs=40, batch_size=len(examples), micro_batch_size=len(examples)),
                         pad_token_id=tokenizer.pad_token_id)
    trainer.train(examples)
    plan = NextVersion.plan(base, root)
    plan.staging.mkdir(parents=True)
    model.save_pretrained(plan.staging)
    return plan.publish(CheckpointManifest(policy_version=plan.version, tokenizer_revision=revision, stage="sft"))


@torch.no_grad()
def _reverse_kl(student_dir: Path, teachers: dict[str, Path], seed: int = 123) -> dict[str, float]:
    """Exact per-token KL(student || routed teacher) on student samples of the held-out prompts."""
    tokenizer, _ = load_tokenizer(student_dir)
    student = load_model(student_dir)
    prompts = read_prompts(DATA / "opd-heldout.jsonl")
    engine = LocalEngine(student, batch_size=64, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed, stop_token_ids=[])
    group = 8
    token_ids = [encode_prompt(tokenizer, p.messages) for p in prompts]
    completions = engine.generate([t for t in token_ids for _ in range(group)],
                                  [f"{p.id}/{i}" for p in prompts for i in range(group)], params)
    result = {}
    for domain, teacher_dir in teachers.items():
        teacher = load_model(teacher_dir)
        examples = []
        for index, completion in enumerate(completions):
            prompt = prompts[index // group]
            if prompt.domain != domain:
                continue
            ids = token_ids[index // group]
            examples.append(TrainExample(ids + list(completion.token_ids), len(ids), np.ones(len(completion.token_ids), bool),
                                         np.zeros(len(completion.token_ids), np.float32), 0.0, prompt.id))
        batch = collate(examples, pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"))
        p = torch.log_softmax(student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float(), -1)
        q = torch.log_softmax(teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float(), -1)
        kl = (p.exp() * (p - q)).sum(-1)
        result[domain] = float(kl[batch.action_mask].mean())
    return result


@pytest.mark.xfail(strict=False, reason="not yet tuned: with peaked SFT teachers (KL 4.5-6 nats) the sampled-token "
                   "loss moves the near-uniform tiny student too slowly within the time budget; see the issue-6 report")
def test_student_moves_toward_each_routed_teacher_on_held_out_prompts(glmpost_cli, wide_checkpoint, tmp_path):
    teachers = {d: _make_teacher(wide_checkpoint, d, tmp_path / f"teacher-{d}") for d in ("echo", "flip")}
    student_root = tmp_path / "student"
    before = _reverse_kl(wide_checkpoint, teachers)
    checkpoint = wide_checkpoint
    curve = []
    for iteration in range(ITERATIONS):
        rollouts, scored = tmp_path / f"rollout-{iteration}", tmp_path / f"scored-{iteration}"
        result = glmpost_cli("rollout", DATA / "opd-prompts.jsonl", "--checkpoint", checkpoint, "--out", rollouts,
                             "--group-size", "4", "--max-new-tokens", "8", "--stop-token-ids", "none",
                             "--seed", iteration, "--batch-size", "64")
        assert result.exit_code == 0, result.stderr
        result = glmpost_cli("score-teacher", rollouts, "--out", scored, "--config", DATA.parent / "tiny-opd.toml",
                             "--route", f"echo={teachers['echo']}", "--route", f"flip={teachers['flip']}", "--json")
        assert result.exit_code == 0, result.stderr
        assert set(json.loads(result.stdout)["teachers"]) == {"echo", "flip"}
        result = glmpost_cli("opd-merge", scored, "--checkpoint", checkpoint, "--out", student_root,
                             "--config", DATA.parent / "tiny-opd.toml", "--json")
        assert result.exit_code == 0, result.stderr
        summary = json.loads(result.stdout)
        curve.append(summary["teacher_kl"])
        checkpoint = student_root
    after = _reverse_kl(student_root, teachers)
    print(json.dumps({"before": before, "after": after, "sampled_kl_curve": curve}))
    for domain in ("echo", "flip"):
        assert after[domain] < 0.5 * before[domain], (domain, before, after)
