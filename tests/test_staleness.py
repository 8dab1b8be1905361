"""Trust and staleness in the trainers: DIS as a loss (brief, "Direct Double-Sided Importance
Sampling"), trust masks chosen by name, the version filter tau, and GLM-5's rule for groups with
failed samples, on hand-computed cases and through the real trainer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.kernel.trust_masks import dis_mask
from glmpost.rl.batches import drop_stale, failure_counts, prepare_batch, whole_groups
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.losses import dis_policy_loss
from glmpost.rl.trainer import PolicyTrainer
from glmpost.rollout.refill import refill_slots


def test_dis_policy_loss_is_minus_r_a_and_its_gradient_r_a():
    log_probs = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5])).requires_grad_()
    rollout = torch.log(torch.tensor([0.5 / 1.1, 0.5 / 1.8, 0.5 / 0.3, float("nan")]))  # r = 1.1, 1.8, 0.3, (off)
    advantages = torch.tensor([2.0, 2.0, -1.0, 5.0])
    terms = dis_policy_loss(log_probs, rollout, advantages)
    assert terms.ratio[:3].tolist() == pytest.approx([1.1, 1.8, 0.3], rel=1e-6) and terms.ratio[3] == 1.0
    # The brief's example: 1.1 kept, 1.8 and 0.3 masked at eps 0.2 / 0.28.
    keep = dis_mask(log_probs, rollout, eps_low=0.2, eps_high=0.28)
    assert keep.tolist() == [True, False, False, False]
    (torch.where(keep, terms.losses, torch.zeros(4)).sum()).backward()
    # d(-r A)/d logp = -r A on the kept token, 0 elsewhere (no NaN from the off-action entry).
    assert log_probs.grad.tolist() == pytest.approx([-2.2, 0.0, 0.0, 0.0], rel=1e-6)


def test_trust_masks_by_name():
    assert GRPOConfig().trust_masks() == ("icepop",) and GRPOConfig().loss_terms()[0] == "policy"
    assert GRPOConfig(trust_mask=["dis"]).trust_masks() == ("dis",) and GRPOConfig(trust_mask=["dis"]).loss_terms()[0] == "dis_policy"
    assert GRPOConfig(trust_mask=["icepop", "dis"]).trust_masks() == ("icepop", "dis")
    assert GRPOConfig(icepop=False).trust_masks() == ()
    assert GRPOConfig(max_staleness=2).trust_masks() == ("dis",)  # lagged records: DIS, not IcePop
    with pytest.raises(Exception, match="is not one of icepop, dis|is not one of dis, icepop"):
        GRPOConfig(trust_mask=["icepop", "clamp"]).validate()


def rec(rid, group, *, versions=(3, 3), status="completed", reward=1.0, length=2, size=None):
    sampling = {"group_size": size} if size else {}
    return {"id": rid, "group_id": group, "status": status, "reward": reward, "sampling": sampling,
            "response_token_ids": np.zeros(length, dtype=np.int32), "policy_versions": np.array(versions[:length]),
            "action_mask": np.ones(length, dtype=bool), "observation_mask": np.zeros(length, dtype=bool)}


def test_stale_trajectories_are_dropped_whole_and_their_bias_is_shown():
    records = [rec("fresh", "g", versions=(5, 5), reward=1.0, length=2), rec("one", "g", versions=(4, 5), reward=0.5, length=2),
               rec("old", "g", versions=(2, 5, 5, 5), reward=0.0, length=4), rec("older", "g", versions=(1, 1, 1, 1, 1, 1),
                                                                                    reward=0.0, length=6)]
    kept, metrics = drop_stale(records, 5, 1)  # tau = 1: lags 0, 1 kept; 3, 4 dropped
    assert [r["id"] for r in kept] == ["fresh", "one"]
    assert metrics == {"train/stale_dropped": 2, "train/stale_dropped_response_length_mean": 5.0,
                       "train/stale_dropped_reward_mean": 0.0, "train/kept_response_length_mean": 2.0,
                       "train/kept_reward_mean": 0.75}
    assert drop_stale(records, 5, None) == (records, {})


def test_groups_keep_their_valid_samples_only_when_more_than_half_are_valid():
    records = [rec("a0", "a"), rec("a1", "a"), rec("a2", "a", status="env_error"),  # 2 of 3 valid: kept
               rec("b0", "b"), rec("b1", "b", status="aborted"),  # 1 of 2: dropped
               rec("c0", "c", size=4), rec("c1", "c", size=4),  # 2 of a declared 4 (two lost): dropped
               rec("d0", "d", reward=float("nan")), rec("d1", "d"), rec("d2", "d")]  # 2 of 3
    usable = [r for r in records if r["status"] == "completed" and math.isfinite(r["reward"])]
    kept, dropped, sizes = whole_groups(records, usable)
    assert [r["id"] for r in kept] == ["a0", "a1", "d1", "d2"] and dropped == 3 and sizes == {2: 2}
    assert failure_counts(records) == {"aborted": 1, "env_error": 1, "nan_reward": 1}


def test_only_groups_more_than_half_valid_are_refilled():
    # failed flags per slot: 3 of 4 valid -> its failed slot; 2 of 4, 1 of 3, all valid, none valid -> nothing
    groups = [[False, True, False, False], [True, False, True, False], [True, True, False], [False, False], [True]]
    assert refill_slots(groups) == [(0, 1)]
    assert refill_slots([[False, True, False], [True, False, False, True, False]]) == [(0, 1), (1, 0), (1, 3)]


def test_a_refill_takes_the_slot_of_the_sample_it_replaces():
    """Group of 4: one sample failed, its refill failed, the second refill failed too. Three valid of
    four slots (the refills are not slots): kept. Counted as six slots it would be dropped."""
    records = [rec("g/0", "g", size=4), rec("g/1", "g", size=4), rec("g/2", "g", size=4),
               rec("g/3", "g", size=4, status="env_error"), rec("g/4", "g", size=4, status="env_error"),
               rec("g/5", "g", size=4, status="aborted")]
    records[4]["extra"] = {"refill": {"replaces": "g/3", "round": 1}}
    records[5]["extra"] = {"refill": {"replaces": "g/4", "round": 2}}
    usable = records[:3]
    kept, dropped, sizes = whole_groups(records, usable)
    assert [r["id"] for r in kept] == ["g/0", "g/1", "g/2"] and dropped == 0 and sizes == {3: 1}
    for record in records[4:]:
        del record["extra"]
    assert whole_groups(records, usable)[0] == []


def test_the_baseline_of_a_refilled_group_is_its_valid_samples(tiny_checkpoint):
    from tests.test_trainer import _records

    policy = (tiny_checkpoint, *load_tokenizer(tiny_checkpoint))
    records = _records(policy, groups=2, group_size=4)
    records[0]["status"] = "env_error"  # group 0: 3 of 4 valid, rewards 0.25, 0.5, 0.75
    batch = prepare_batch(records)
    group0 = [e.advantage for e in batch.examples if e.group_id == records[0]["group_id"]]
    rewards = np.array([0.25, 0.5, 0.75])
    # (R - mean) / (std + eps) over the three valid samples (unbiased std 0.25): -1, 0, 1.
    assert group0 == pytest.approx(((rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)).tolist(), rel=1e-5)
    assert group0 == pytest.approx([-1.0, 0.0, 1.0], abs=1e-4)
    assert batch.group_sizes == {3: 1, 4: 1} and batch.failed == {"env_error": 1} and batch.excluded["small_group"] == 0


def test_dis_is_taken_again_on_the_weights_of_each_later_step(tiny_checkpoint):
    from tests.test_trainer import _records

    tokenizer, revision = load_tokenizer(tiny_checkpoint)
    examples = prepare_batch(_records((tiny_checkpoint, tokenizer, revision))).examples
    model = load_model(tiny_checkpoint)
    trainer = PolicyTrainer(model, GRPOConfig(trust_mask=["dis"], micro_batch_size=8), pad_token_id=tokenizer.pad_token_id)
    indices = list(range(len(examples)))
    old = trainer.old_policy(examples, indices, ScoredDistribution())
    assert all(torch.equal(old.trust[i], old.base_trust[i] & old.trust[i]) for i in indices)
    with torch.no_grad():  # another policy: some ratios to the rollout leave the band
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    stepped = trainer.step_trust(examples, indices, old, ScoredDistribution())
    for chunk, batch in trainer._micro_batches(examples, indices):
        with torch.no_grad():
            current = trainer._log_probs(model, batch, ScoredDistribution()).log_probs
        expected = batch.action_mask & dis_mask(current, batch.rollout_log_probs, eps_low=0.2, eps_high=0.28)
        for row, index in enumerate(chunk):
            assert torch.equal(stepped[index][: expected.shape[1]], expected[row].cpu())
    assert sum(int(stepped[i].sum()) for i in indices) < sum(int(old.trust[i].sum()) for i in indices)


def test_train_grpo_drops_stale_records_and_trains_the_rest_with_dis(glmpost_cli, tiny_checkpoint, tmp_path):
    from tests.test_train_grpo import _judged

    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)  # sampled by policy version 0
    first = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "policy")
    assert first.exit_code == 0, first.stderr
    v1 = tmp_path / "policy" / "v000001"
    dropped = glmpost_cli("train-grpo", judged, "--checkpoint", v1, "--out", tmp_path / "policy", "--max-staleness", "0")
    assert dropped.exit_code == 1 and "no usable records" in dropped.stderr
    lagged = glmpost_cli("train-grpo", judged, "--checkpoint", v1, "--out", tmp_path / "policy", "--max-staleness", "1",
                         "--mini-batches", "2", "--json")
    assert lagged.exit_code == 0, lagged.stderr
    lines = [json.loads(line) for line in (tmp_path / "policy" / "v000002" / "metrics.jsonl").read_text().splitlines()]
    assert [line["train/stale_dropped"] for line in lines] == [0, 0] and "train/clip_fraction" not in lines[0]
    assert lines[0]["train/effective_group_size/4"] == 4
    stage = json.loads((tmp_path / "policy" / "v000002" / "stage.json").read_text())
    assert stage["options"]["max_staleness"] == 1 and stage["group_sizes"] == {"4": 4}


def test_dis_on_two_zero3_ranks_with_uneven_shares_matches_one_process(glmpost_cli, tiny_checkpoint, tmp_path):
    """DIS re-scores each later mini-batch on its ranks; with mini-batches whose shares differ in
    size (6, 5, 5 records over 2 ranks) every rank still runs the same number of forwards (ZeRO-3
    gathers in each), and the result equals one process."""
    import os
    import subprocess
    import sys

    from safetensors.numpy import load_file

    from tests.test_train_grpo import _free_port, _judged

    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    common = [str(judged), "--checkpoint", str(tiny_checkpoint), "--lr", "1e-2", "--mini-batches", "3",
              "--micro-batch-size", "2", "--trust-mask", "dis", "--json"]
    single = glmpost_cli("train-grpo", *common, "--out", tmp_path / "single")
    assert single.exit_code == 0, single.stderr
    # One thread per rank: gloo ranks starved of CPU have aborted (SIGABRT) on this 2-core machine.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    result = subprocess.run(torchrun + ["-m", "glmpost.commands.app", "train-grpo", *common, "--out", str(tmp_path / "zero3"),
                                        "--zero-stage", "3"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout.strip().splitlines()[-1])
    assert ranks["world_size"] == 2
    assert ranks["loss"] == pytest.approx(json.loads(single.stdout)["loss"], rel=1e-4, abs=1e-6)
    one = load_file(tmp_path / "single" / "v000001" / "model.safetensors")
    two = load_file(tmp_path / "zero3" / "v000001" / "model.safetensors")
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
