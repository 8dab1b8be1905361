"""``glmpost train-sao``: the policy's and the critic's versions, K critic steps per policy step counted by
the optimizers, the frozen critic tensors, the GAE targets, refusals, resume, follow mode and ZeRO ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_follow import _judged_batch, _publish
from test_train_grpo import GLMPOST, _free_port, _judged

from glmpost.checkpoints import CheckpointRoot, read_manifest, tokenizer_revision
from glmpost.rl.batches import TrainExample
from glmpost.rl.critic import init_critic, load_critic
from glmpost.rl.distributed import TorchBackend
from glmpost.rl.sao import CriticTrainer, SAOConfig, explained_variance
from glmpost.spool.spool import Spool


def _sao(glmpost_cli, judged, checkpoint, critic, out, *args):
    return glmpost_cli("train-sao", judged, "--checkpoint", checkpoint, "--critic", critic, "--out", out, "--lr", "1e-3",
                       "--critic-lr", "1e-3", *args)


def sao_variants(glmpost_cli, checkpoint, tmp_path, variants: dict[str, list]) -> dict[str, dict[str, dict]]:
    """train-sao once per variant (name -> extra options), each with a fresh critic from
    ``checkpoint``; the published weights by variant, then by part (policy, critic)."""
    judged = _judged(glmpost_cli, checkpoint, tmp_path)
    weights = {}
    for name, extra in variants.items():
        critic = tmp_path / name / "critic"
        assert glmpost_cli("init-critic", "--from", checkpoint, "--out", critic).exit_code == 0
        result = _sao(glmpost_cli, judged, checkpoint, critic, tmp_path / name / "policy", *extra)
        assert result.exit_code == 0, result.stderr
        weights[name] = {part: load_file(tmp_path / name / part / "v000001" / "model.safetensors") for part in ("policy", "critic")}
    return weights


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_publishes_both_versions_with_k_critic_steps_and_the_attention_frozen(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    critic, policy = tmp_path / "critic", tmp_path / "policy"
    assert glmpost_cli("init-critic", "--from", tiny_checkpoint, "--out", critic).exit_code == 0
    result = _sao(glmpost_cli, judged, tiny_checkpoint, critic, policy, "--epochs", "2", "--mini-batches", "2",
                  "--critic-steps", "3", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["policy_version"] == 1 and summary["steps"] == 4 and summary["trained_records"] == 16
    assert CheckpointRoot(policy).latest() == 1 and CheckpointRoot(critic).latest() == 1
    critic_manifest = read_manifest(critic / "v000001")
    assert critic_manifest.stage == "train-sao" and critic_manifest.policy_version == 1
    assert critic_manifest.parent == str(critic / "v000000")
    assert read_manifest(policy / "v000001").extra["critic"] == str(critic / "v000001")
    assert not (policy / "v000001" / "trainer_state" / "critic").exists()  # no resume state in a published version

    # K = 3 critic steps before each of the 4 policy steps, as the two optimizers count them.
    lines = _lines(policy / "v000001" / "metrics.jsonl")
    assert [line["sao/actor_optimizer_steps"] for line in lines] == [1, 2, 3, 4]
    assert [line["sao/critic_optimizer_steps"] for line in lines] == [3, 6, 9, 12]
    assert all(line["sao/value_loss"] < line["sao/value_loss_first"] for line in lines)  # the critic fits its targets
    assert lines[0]["train/trusted_fraction"] == 1.0  # DIS on the sampling weights keeps every token
    assert _lines(critic / "v000001" / "metrics.jsonl") == [
        {k: v for k, v in line.items() if k.startswith("sao/") or k == "train/step"} for line in lines]

    # Freezing: every tensor stage.json lists is bitwise the parent's; the value head and MLPs moved.
    frozen = set(json.loads((critic / "v000001" / "stage.json").read_text())["frozen"])
    assert frozen == set(json.loads((critic / "v000000" / "stage.json").read_text())["frozen_by_default"])
    before, after = load_file(critic / "v000000" / "model.safetensors"), load_file(critic / "v000001" / "model.safetensors")
    assert any(".self_attn.indexer." in name for name in frozen)
    for key in before:
        name = "language_model." + key
        if name in frozen:
            np.testing.assert_array_equal(after[key], before[key], err_msg=key)
        elif ".mlp." in key and key.endswith(".weight"):  # (the router's correction bias is a buffer)
            assert not np.array_equal(after[key], before[key]), key
    heads = [load_file(critic / v / "value_head.safetensors")["weight"] for v in ("v000000", "v000001")]
    assert not np.array_equal(*heads)

    # The next update continues both optimizers from the published state.
    again = _sao(glmpost_cli, judged, policy, critic, policy, "--max-version-lag", "1", "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["critic_optimizer_steps"] == 14 and CheckpointRoot(critic).latest() == 2
    assert read_manifest(critic / "v000002").parent == str(critic / "v000001")


def test_refusals_are_one_line_and_write_nothing(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    policy = tmp_path / "policy"

    def refused(critic, *args, code=2, inputs=judged):
        result = _sao(glmpost_cli, inputs, tiny_checkpoint, critic, policy, *args)
        assert result.exit_code == code and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr and not policy.exists()
        return result.stderr

    assert "no critic version there; pass --init-critic" in refused(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()
    other = tmp_path / "other"
    assert glmpost_cli("init-model", "--out", other, "--set", "num_hidden_layers=1").exit_code == 0
    assert glmpost_cli("init-critic", "--from", other, "--out", tmp_path / "shallow").exit_code == 0
    assert "critic of another architecture" in refused(tmp_path / "shallow", code=1)
    assert glmpost_cli("init-model", "--out", tmp_path / "words", "--set", "vocab_size=600").exit_code == 0
    assert glmpost_cli("init-critic", "--from", tmp_path / "words", "--out", tmp_path / "foreign").exit_code == 0
    assert "critic of tokenizer revision" in refused(tmp_path / "foreign", code=1)
    assert "a critic version directory" in refused(tmp_path / "shallow" / "v000000")
    assert "--critic-train 'mlp' is not one of attention" in refused(tmp_path / "shallow", "--critic-train", "mlp")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    assert glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r",
                       "--max-new-tokens", "3").exit_code == 0
    assert "has no reward: run `glmpost judge` first" in refused(tmp_path / "nowhere", "--init-critic", code=1,
                                                                 inputs=tmp_path / "r")

    made = _sao(glmpost_cli, judged, tiny_checkpoint, tmp_path / "made", policy, "--init-critic", "--json")
    assert made.exit_code == 0, made.stderr
    assert CheckpointRoot(tmp_path / "made").versions() == [0, 1]


def test_the_critics_targets_are_skip_observation_gae_of_its_values(tiny_checkpoint, tmp_path):
    """gamma = lambda = 1 with the reward at the last action token: A_t = R - V_t at every action token
    (the deltas telescope; an observation in between changes nothing), 0 elsewhere; returns = R."""
    init_critic(tiny_checkpoint, tmp_path / "critic")
    critic = load_critic(tmp_path / "critic", dtype="float32")
    config = SAOConfig(micro_batch_size=2)
    trainer = CriticTrainer(critic, TorchBackend(critic, config.critic_optimizer()), config, pad_token_id=0)
    actions = np.array([1, 1, 0, 0, 1, 1], dtype=bool)  # two turns around a two-token observation
    examples = [TrainExample([5, 6, 7, 8, 9, 10, 11, 12], 2, actions, np.zeros(6, np.float32), 0.0, "g", reward=0.75),
                TrainExample([5, 6, 7, 8, 9], 2, np.ones(3, bool), np.zeros(3, np.float32), 0.0, "h", reward=-1.0)]
    targets = trainer.prepare(examples, [0, 1])
    with torch.no_grad():
        values = [critic(torch.tensor([e.input_ids]))[0, :-1] for e in examples]
    for index, example in enumerate(examples):
        response = values[index][example.prompt_length - 1 :].double()
        expected = torch.where(torch.from_numpy(example.action_mask), example.reward - response, 0.0)
        torch.testing.assert_close(torch.from_numpy(example.token_fields["gae_advantages"]).double(), expected,
                                   rtol=0, atol=1e-6)
        on = torch.zeros(len(example.input_ids) - 1, dtype=torch.bool)
        on[example.prompt_length - 1 :] = torch.from_numpy(example.action_mask)
        torch.testing.assert_close(targets.returns[index][on], torch.full((int(on.sum()),), example.reward), rtol=0, atol=1e-6)
        torch.testing.assert_close(targets.old_values[index], values[index], rtol=0, atol=1e-6)
    # Returns 0.75 (4 tokens) and -1 (3 tokens): the statistics are over action tokens.
    assert targets.metrics["sao/return_mean"] == pytest.approx((4 * 0.75 - 3) / 7)
    assert explained_variance(4, 4.0, 4.0, 0.0, 0.0) is None  # returns that do not vary
    # R = (1, 3), V = (1, 2): Var(R) = 1, R - V = (0, 1) has variance 1/4, so 1 - 1/4.
    assert explained_variance(2, 4.0, 10.0, 1.0, 1.0) == pytest.approx(0.75)


def test_resume_after_a_kill_matches_the_uninterrupted_policy_and_critic(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    assert glmpost_cli("init-critic", "--from", tiny_checkpoint, "--out", tmp_path / "critic0").exit_code == 0
    common = [str(judged), "--checkpoint", str(tiny_checkpoint), "--lr", "1e-3", "--critic-lr", "1e-3", "--epochs", "16",
              "--mini-batches", "2", "--micro-batch-size", "4"]
    for name in ("straight-critic", "resumed-critic"):
        subprocess.run(["cp", "-r", str(tmp_path / "critic0"), str(tmp_path / name)], check=True)
    assert glmpost_cli("train-sao", *common, "--critic", tmp_path / "straight-critic", "--out", tmp_path / "straight").exit_code == 0

    root = tmp_path / "resumed"
    state = root / ".staging-v000001" / "trainer_state" / "resume.pt"
    process = subprocess.Popen(GLMPOST + ["train-sao", *common, "--critic", str(tmp_path / "resumed-critic"), "--out", str(root),
                                          "--save-every", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "TQDM_DISABLE": "1"})
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.02)
    time.sleep(0.4)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert state.exists() and not (root / "v000001").exists(), "the run finished before it could be interrupted"
    saved = sorted(p.name for p in (state.parent / "critic").glob("resume-*.pt"))
    assert 1 <= len(saved) <= 2  # the critic's newest states: the one the policy's names among them
    resumed = glmpost_cli("train-sao", *common, "--critic", tmp_path / "resumed-critic", "--out", root, "--resume", "--json")
    assert resumed.exit_code == 0, resumed.stderr
    lines = _lines(root / "v000001" / "metrics.jsonl")
    assert [line["train/step"] for line in lines] == list(range(32))
    assert [line["sao/critic_optimizer_steps"] for line in lines] == [2 * (s + 1) for s in range(32)]
    for straight, again in ((tmp_path / "straight" / "v000001", root / "v000001"),
                            (tmp_path / "straight-critic" / "v000001", tmp_path / "resumed-critic" / "v000001")):
        for name in ("model.safetensors", *(["value_head.safetensors"] if "critic" in str(again) else [])):
            one, two = load_file(straight / name), load_file(again / name)
            for key in one:
                np.testing.assert_array_equal(two[key], one[key], err_msg=f"{again}/{name}:{key}")


def test_a_crash_between_the_two_publishes_is_finished_by_the_next_run(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    from glmpost.rl import critic as critic_module

    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    critic, policy = tmp_path / "critic", tmp_path / "policy"

    def crash(self):
        raise SystemExit("killed after the policy's publish")

    monkeypatch.setattr(critic_module.CriticVersions, "publish", crash)
    crashed = _sao(glmpost_cli, judged, tiny_checkpoint, critic, policy, "--init-critic")
    assert crashed.exit_code != 0 and CheckpointRoot(policy).latest() == 1 and CheckpointRoot(critic).latest() == 0
    monkeypatch.undo()
    again = _sao(glmpost_cli, judged, tiny_checkpoint, critic, policy, "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["skipped"] and CheckpointRoot(critic).latest() == 1
    assert read_manifest(critic / "v000001").policy_version == 1
    assert not list(critic.glob(".staging-*"))


def test_follow_publishes_a_critic_with_every_policy_version(glmpost_cli, tiny_checkpoint, tmp_path):
    spool = Spool(tmp_path / "spool", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    for shard in _judged_batch(glmpost_cli, tiny_checkpoint, tmp_path, "a"):
        _publish(spool, shard)
    critic, policy = tmp_path / "critic", tmp_path / "policy"
    result = glmpost_cli("train-sao", "--follow", spool.path, "--checkpoint", tiny_checkpoint, "--critic", critic,
                         "--init-critic", "--out", policy, "--follow-records", "8", "--max-versions", "2",
                         "--max-version-lag", "2", "--poll-s", "0.05", "--idle-timeout", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["versions"] == [1, 2]
    assert CheckpointRoot(critic).versions() == [0, 1, 2] and CheckpointRoot(critic).latest() == 2
    assert read_manifest(critic / "v000002").parent == str(critic / "v000001")
    steps = [line["sao/critic_optimizer_steps"] for line in _lines(policy / "metrics.jsonl") if "sao/critic_optimizer_steps" in line]
    assert steps == [2, 4]  # one policy step per update, K = 2 before it, one optimizer across versions


def test_two_zero3_ranks_match_one_process_for_both_models(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    assert glmpost_cli("init-critic", "--from", tiny_checkpoint, "--out", tmp_path / "critic0").exit_code == 0
    for name in ("single-critic", "zero-critic"):
        subprocess.run(["cp", "-r", str(tmp_path / "critic0"), str(tmp_path / name)], check=True)
    common = [str(judged), "--checkpoint", str(tiny_checkpoint), "--lr", "1e-3", "--critic-lr", "1e-3", "--mini-batches", "2",
              "--micro-batch-size", "3", "--json"]
    single = glmpost_cli("train-sao", *common, "--critic", tmp_path / "single-critic", "--out", tmp_path / "single")
    assert single.exit_code == 0, single.stderr
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    result = subprocess.run(torchrun + ["-m", "glmpost.commands.app", "train-sao", *common, "--critic", str(tmp_path / "zero-critic"),
                                        "--out", str(tmp_path / "zero"), "--zero-stage", "3"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks, one = json.loads(result.stdout.strip().splitlines()[-1]), json.loads(single.stdout)
    assert ranks["world_size"] == 2 and ranks["critic_optimizer_steps"] == one["critic_optimizer_steps"] == 4
    # Two ranks reduce in another order than one process: float-rounding close, not bitwise.
    assert ranks["value_loss"] == pytest.approx(one["value_loss"], rel=1e-4, abs=1e-7)
    for single_dir, zero_dir, names in ((tmp_path / "single" / "v000001", tmp_path / "zero" / "v000001", ["model.safetensors"]),
                                        (tmp_path / "single-critic" / "v000001", tmp_path / "zero-critic" / "v000001",
                                         ["model.safetensors", "value_head.safetensors"])):
        for name in names:
            a, b = load_file(single_dir / name), load_file(zero_dir / name)
            assert a.keys() == b.keys(), name
            for key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5, err_msg=f"{zero_dir}/{name}:{key}")
