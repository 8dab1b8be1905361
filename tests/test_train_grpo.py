"""``glmpost train-grpo``: refusals, version publishing, exclusions, resume, DeepSpeed ranks = one process."""

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
from safetensors.numpy import load_file

from glmpost.checkpoints import CheckpointRoot, read_manifest
from glmpost.formats import ShardReader, ShardWriter, resolve_shard_paths
from glmpost.rl.schedules import scheduled_lr

GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]


def _judged(glmpost_cli, checkpoint, tmp_path, *, name="judged", nan_first=False, seed=0, rollout_args=()) -> Path:
    """Rollout shards of the count task with a reward = fraction of tokens equal to the digit."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "domain": "count", "task": {"digit": str(d)}}) + "\n" for d in range(4)))
    rollout = tmp_path / f"{name}-rollout"
    result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", rollout, "--group-size", "4",
                         "--max-new-tokens", "6", "--stop-token-ids", "none", "--seed", seed, *rollout_args)
    assert result.exit_code == 0, result.stderr
    out = tmp_path / name
    out.mkdir()
    for path in resolve_shard_paths([rollout]):
        reader = ShardReader(path)
        records = list(reader)
        with ShardWriter(out / path.name, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as writer:
            for index, record in enumerate(records):
                reward = float(index % 4) / 4 + float(np.mean(record["response_token_ids"] % 2))
                if nan_first and index == 0:
                    reward = float("nan")
                writer.write({**record, "reward": reward, "rewards": {"correct": reward},
                              "reward_info": {"failure": "judge timed out"} if nan_first and index == 0 else {}})
    return out


def test_refuses_unjudged_shards_and_foreign_tokenizers(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    assert glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", "--max-new-tokens", "3").exit_code == 0
    result = glmpost_cli("train-grpo", tmp_path / "r", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root")
    assert result.exit_code == 1 and "has no reward: run `glmpost judge` first" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "root").exists()

    other = tmp_path / "other"
    assert glmpost_cli("init-model", "--out", other, "--set", "vocab_size=600").exit_code == 0
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    foreign = glmpost_cli("train-grpo", judged, "--checkpoint", other, "--out", tmp_path / "root")
    assert foreign.exit_code == 1 and "differs from the checkpoint's" in foreign.stderr


def test_publishes_the_next_version_and_counts_exclusions(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path, nan_first=True)
    root = tmp_path / "root"
    args = ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root, "--lr", "1e-3", "--mini-batches", "2", "--json"]
    result = glmpost_cli(*args)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["policy_version"] == 1 and summary["excluded"]["nan_reward"] == 1
    assert summary["records"] == 16 and summary["trained_records"] == 15 and summary["steps"] == 2
    assert CheckpointRoot(root).latest() == 1
    version = root / "v000001"
    manifest = read_manifest(version)
    assert manifest.stage == "train-grpo" and manifest.parent == str(tiny_checkpoint) and manifest.step == 2
    assert manifest.tokenizer_revision == read_manifest(tiny_checkpoint).tokenizer_revision
    before, after = load_file(tiny_checkpoint / "model.safetensors"), load_file(version / "model.safetensors")
    assert any(not np.array_equal(before[k], after[k]) for k in before)
    # The DSA indexer gets no gradient (transformers runs it under no_grad): it stays frozen.
    assert all(np.array_equal(before[k], after[k]) for k in before if ".indexer." in k)
    lines = [json.loads(line) for line in (version / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for key in ("train/loss", "train/clip_fraction", "train/trusted_fraction", "train/mismatch_abs_logp_mean",
                "train/mismatch_k3_kl", "train/reward_mean", "train/reward_std", "train/zero_advantage_groups",
                "train/entropy", "train/grad_norm", "train/action_tokens_per_s", "train/excluded_nan_reward"):
        assert key in lines[0], key
    assert lines[0]["train/excluded_nan_reward"] == 1

    again = glmpost_cli(*args)
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] is True
    # From the root, the next update trains v1 into v2 (on the v0 records again: a lag it must accept).
    second = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--lr", "1e-3", "--max-version-lag", "1", "--json")
    assert second.exit_code == 0, second.stderr
    assert json.loads(second.stdout)["policy_version"] == 2 and CheckpointRoot(root).latest() == 2
    assert read_manifest(root / "v000002").parent == str(version)
    assert (root / "v000002" / "trainer_state" / "optimizer.pt").is_file()


def test_resume_after_a_kill_repeats_no_step_and_matches_an_uninterrupted_run(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    # In the middle of a schedule: the resumed steps take the rates the uninterrupted run took.
    common = [str(judged), "--checkpoint", str(tiny_checkpoint), "--lr", "1e-3", "--epochs", "40", "--mini-batches", "2",
              "--micro-batch-size", "4", "--lr-schedule", "cosine", "--lr-warmup-steps", "10", "--lr-decay-steps", "70",
              "--min-lr-ratio", "0.1"]
    assert glmpost_cli("train-grpo", *common, "--out", tmp_path / "straight").exit_code == 0

    root = tmp_path / "resumed"
    state = root / ".staging-v000001" / "trainer_state" / "resume.pt"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    process = subprocess.Popen(GLMPOST + ["train-grpo", *common, "--out", str(root), "--save-every", "3"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.02)
    time.sleep(0.3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert state.exists() and not (root / "v000001").exists(), "the run finished before it could be interrupted"

    refused = glmpost_cli("train-grpo", *common, "--out", root)
    assert refused.exit_code == 2 and "pass --resume to continue it" in refused.stderr
    resumed = glmpost_cli("train-grpo", *common, "--out", root, "--resume", "--json")
    assert resumed.exit_code == 0, resumed.stderr
    lines = [json.loads(line) for line in (root / "v000001" / "metrics.jsonl").read_text().splitlines()]
    assert [line["train/step"] for line in lines] == list(range(80))
    assert [line["train/lr"] for line in lines] == pytest.approx(
        [scheduled_lr(s, lr=1e-3, schedule="cosine", warmup_steps=10, decay_steps=70, min_lr_ratio=0.1) for s in range(80)])
    straight, again = load_file(tmp_path / "straight" / "v000001" / "model.safetensors"), load_file(root / "v000001" / "model.safetensors")
    for key in straight:
        np.testing.assert_array_equal(again[key], straight[key], err_msg=key)


def test_two_deepspeed_ranks_match_one_process(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    common = [str(judged), "--checkpoint", str(tiny_checkpoint), "--lr", "1e-3", "--mini-batches", "2",
              "--micro-batch-size", "3", "--lr-warmup-steps", "2", "--json"]  # DeepSpeed steps with the scheduled rate too
    single = glmpost_cli("train-grpo", *common, "--out", tmp_path / "single")
    assert single.exit_code == 0, single.stderr
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    for stage in ("1", "2", "3"):
        result = subprocess.run(torchrun + ["-m", "glmpost.commands.app", "train-grpo", *common, "--out", str(tmp_path / f"zero{stage}"),
                                            "--zero-stage", stage], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        ranks = json.loads(result.stdout.strip().splitlines()[-1])
        assert ranks["world_size"] == 2
        # ZeRO-3 creates the parameters partitioned (no rank loads the whole model); 1 and 2 do not.
        assert ("ZeRO-3: the model was created partitioned over 2 ranks" in result.stderr) == (stage == "3")
        assert ranks["loss"] == pytest.approx(json.loads(single.stdout)["loss"], rel=1e-5, abs=1e-7)
        one = load_file(tmp_path / "single" / "v000001" / "model.safetensors")
        two = load_file(tmp_path / f"zero{stage}" / "v000001" / "model.safetensors")
        for key in one:
            np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_zero3_ranks_killed_mid_run_resume_to_the_uninterrupted_weights(glmpost_cli, tiny_checkpoint, tmp_path):
    """Two ZeRO-3 ranks (weights, gradients and optimizer states partitioned) killed after a resume
    point continue from DeepSpeed's partitioned checkpoint to exactly the uninterrupted run's weights."""
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    common = [str(judged), "--checkpoint", str(tiny_checkpoint), "--lr", "1e-3", "--epochs", "12", "--mini-batches", "2",
              "--micro-batch-size", "3", "--zero-stage", "3"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}

    def torchrun(*args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
                "-m", "glmpost.commands.app", "train-grpo", *common, *args]

    straight = subprocess.run(torchrun("--out", str(tmp_path / "straight")), capture_output=True, text=True, env=env, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    root = tmp_path / "resumed"
    state = root / ".staging-v000001" / "trainer_state" / "resume.pt"
    process = subprocess.Popen(torchrun("--out", str(root), "--save-every", "3"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while not state.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    ranks = _descendants(process.pid)
    assert len(ranks) >= 2, ranks
    for pid in [*ranks, process.pid]:  # the ranks (torchrun starts each in its own session), the launcher
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    time.sleep(1.0)  # nothing left running could still publish
    assert state.exists() and not (root / "v000001").exists(), "the run finished before it could be interrupted"
    assert json.loads(state.read_text())["step"] > 0
    resumed = subprocess.run(torchrun("--out", str(root), "--resume"), capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["train/step"] for line in (root / "v000001" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(24))
    one, two = load_file(tmp_path / "straight" / "v000001" / "model.safetensors"), load_file(root / "v000001" / "model.safetensors")
    for key in one:
        np.testing.assert_array_equal(two[key], one[key], err_msg=key)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_records_of_an_older_policy_are_refused_unless_a_lag_is_accepted(glmpost_cli, tiny_checkpoint, tmp_path):
    """IcePop compares two engines on the same weights: records sampled by v0 cannot be trained from v1
    unless --max-version-lag accepts the lag (and the trust mask becomes DIS)."""
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)  # sampled by policy version 0
    first = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "policy", "--json")
    assert first.exit_code == 0, first.stderr
    v1 = tmp_path / "policy" / "v000001"
    stale = glmpost_cli("train-grpo", judged, "--checkpoint", v1, "--out", tmp_path / "policy")
    assert stale.exit_code == 2 and stale.stderr.count("\n") == 1
    assert "was sampled by policy version 0, 1 behind --checkpoint's 1" in stale.stderr and "--max-version-lag 1" in stale.stderr
    assert not (tmp_path / "policy" / "v000002").exists()
    lagged = glmpost_cli("train-grpo", judged, "--checkpoint", v1, "--out", tmp_path / "policy", "--max-version-lag", "1", "--json")
    assert lagged.exit_code == 0, lagged.stderr
    stage = json.loads((tmp_path / "policy" / "v000002" / "stage.json").read_text())
    assert stage["version_lags"] == {"1": 16}
    assert json.loads((tmp_path / "policy" / "v000001" / "stage.json").read_text())["version_lags"] == {"0": 16}
    step = json.loads((tmp_path / "policy" / "v000002" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["train/version_lag/1"] == 16


TRUNCATED = ("--temperature", "0.7", "--top-k", "20", "--top-p", "0.9")  # the round-trip settings


def _rewrite_sampling(src: Path, dst: Path, **changes) -> Path:
    """A copy of ``src``'s shards with ``changes`` applied to every record's ``sampling`` map."""
    dst.mkdir()
    for path in resolve_shard_paths([src]):
        reader = ShardReader(path)
        with ShardWriter(dst / path.name, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as writer:
            for record in reader:
                writer.write({**record, "sampling": {**record["sampling"], **changes}})
    return dst


def _trusted_and_closed(glmpost_cli, judged, checkpoint, tmp_path, distribution) -> dict:
    """train-grpo on ``judged`` trusts >= 99% of the action tokens under ``distribution`` (as its
    stage.json records it), and diff-logprobs agrees with the rollout to 1e-5; returns its report."""
    result = glmpost_cli("train-grpo", judged, "--checkpoint", checkpoint, "--out", tmp_path / "policy", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["trusted_fraction"] >= 0.99
    stage = json.loads((tmp_path / "policy" / "v000001" / "stage.json").read_text())
    assert stage["log_prob_distribution"] == distribution
    assert stage["attention_ran"] == "native"  # the tiny GLM-5 model, on the default --attention
    diff = glmpost_cli("diff-logprobs", judged, "--checkpoint", checkpoint, "--out", tmp_path / "diff", "--json", "--no-plots")
    assert diff.exit_code == 0, diff.stderr
    report = json.loads(diff.stdout)
    assert report["overall"]["max_abs"] <= 1e-5
    return report


def test_truncated_sampling_round_trip_trusts_every_token_it_should(glmpost_cli, tiny_checkpoint, tmp_path):
    """Top-k 20 / top-p 0.9 / T 0.7: the trainer recomputes the truncated, renormalised distribution
    the engine sampled from, so IcePop trusts (nearly) every token and diff-logprobs agrees to 1e-5;
    a train side that ignores the truncation (records claiming no filter) trusts few (TRL#6789)."""
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path, rollout_args=TRUNCATED)
    record = next(iter(ShardReader(resolve_shard_paths([judged])[0])))
    assert record["sampling"]["log_prob_kind"] == "sampled" and record["sampling"]["top_k"] == 20
    report = _trusted_and_closed(glmpost_cli, judged, tiny_checkpoint, tmp_path, {"temperature": 0.7, "top_k": 20, "top_p": 0.9})
    assert report["overall"]["sample_agreement"] == 1.0
    assert (report["top_k"], report["top_p"], report["log_prob_kind"]) == (20, 0.9, "sampled")

    ignored = _rewrite_sampling(judged, tmp_path / "ignored", top_k=0, top_p=1.0)
    wrong = glmpost_cli("train-grpo", ignored, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "wrong", "--json")
    assert wrong.exit_code == 0, wrong.stderr
    assert json.loads(wrong.stdout)["trusted_fraction"] < 0.5


def test_greedy_records_are_refused_by_the_trainer(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path, rollout_args=("--temperature", "0"))
    record = next(iter(ShardReader(resolve_shard_paths([judged])[0])))
    assert record["sampling"]["log_prob_kind"] == "raw" and float(record["rollout_log_probs"].max()) < 0
    result = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "policy")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "was decoded greedily (sampling.temperature 0)" in result.stderr and "--temperature > 0" in result.stderr
    assert not (tmp_path / "policy").exists()
    # Their raw log-probs (the model's own distribution) still check against the trainer's forward.
    diff = glmpost_cli("diff-logprobs", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "diff", "--json", "--no-plots")
    assert diff.exit_code == 0, diff.stderr
    assert json.loads(diff.stdout)["overall"]["max_abs"] <= 1e-5


def test_an_unknown_log_prob_kind_is_one_error_naming_the_field(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    bad = _rewrite_sampling(judged, tmp_path / "bad", log_prob_kind="filtered")
    result = glmpost_cli("train-grpo", bad, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "policy")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "sampling.log_prob_kind: unknown log-prob kind 'filtered'" in result.stderr


def test_loss_denominator_is_a_recipe_choice(glmpost_cli, tiny_checkpoint, tmp_path):
    """The denominator is set from a recipe section, recorded in stage.json, and checked
    (tests/test_trainer.py checks what it does to the gradient)."""
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[train-grpo]\nloss_denominator = "action"\n')
    action = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "a", "--config", recipe, "--json")
    assert action.exit_code == 0, action.stderr
    stage = json.loads((tmp_path / "a" / "v000001" / "stage.json").read_text())
    assert stage["options"]["loss_denominator"] == "action"
    bad = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "b", "--loss-denominator", "tokens")
    assert bad.exit_code == 2 and "--loss-denominator 'tokens' is not one of trusted, action" in bad.stderr


def test_sglang_pre_filter_log_probs_train_under_the_tempered_distribution(glmpost_cli, tiny_checkpoint, tmp_path):
    """SGLang's semantics (log_softmax(z / T) before top-k / top-p, `serve --log-prob-kind tempered`)
    through rollout --engine sglang: the records say so, and train-grpo and diff-logprobs score the
    tempered distribution. The same values taken for the truncated one would be distrusted."""
    from serve_process import start_server, stop_server

    proc, url = start_server(tiny_checkpoint, "--log-prob-kind", "tempered")
    try:
        judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path, rollout_args=("--engine", "sglang", "--server", url, *TRUNCATED))
    finally:
        stop_server(proc)
    record = next(iter(ShardReader(resolve_shard_paths([judged])[0])))
    assert record["sampling"]["log_prob_kind"] == "tempered" and record["sampling"]["top_k"] == 20
    _trusted_and_closed(glmpost_cli, judged, tiny_checkpoint, tmp_path, {"temperature": 0.7, "top_k": 0, "top_p": 1.0})

    misread = _rewrite_sampling(judged, tmp_path / "misread", log_prob_kind="sampled")
    wrong = glmpost_cli("train-grpo", misread, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "wrong", "--json")
    assert wrong.exit_code == 0, wrong.stderr
    assert json.loads(wrong.stdout)["trusted_fraction"] < 0.5
