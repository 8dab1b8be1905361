"""``--tracker``: every metrics.jsonl line also reaches TensorBoard, W&B, MLflow and trackio, read back
with the libraries' own readers; metrics.jsonl stays complete whatever a tracker does."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from glmpost import trackers
from glmpost.formats import ShardReader, ShardWriter, resolve_shard_paths

GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]
ALL = ("tensorboard", "wandb", "mlflow", "trackio")


def _judged(glmpost_cli, checkpoint: Path, tmp_path: Path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "domain": "count",
                                           "task": {"digit": str(d)}}) + "\n" for d in range(4)))
    rollout = tmp_path / "rollout"
    result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", rollout, "--group-size", "4",
                         "--max-new-tokens", "6", "--stop-token-ids", "none")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "judged"
    out.mkdir()
    for path in resolve_shard_paths([rollout]):
        reader = ShardReader(path)
        with ShardWriter(out / path.name, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as w:
            for index, record in enumerate(reader):
                reward = float(index % 4) / 4
                w.write({**record, "reward": reward, "rewards": {"correct": reward}, "reward_info": {}})
    return out


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file (LevelDB log framing: 32 KiB blocks of checksummed chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_history(run_dir: Path) -> dict[int, dict]:
    rows = {}
    for record in _wandb_records(next(run_dir.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows[int(items["_step"])] = items
    return rows


def test_two_train_grpo_updates_reach_every_tracker_as_one_run(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    home, root = tmp_path / "trackers", tmp_path / "policy"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    tracked = [a for name in ALL for a in ("--tracker", name)] + ["--tracker-dir", str(home), "--tracker-project", "t"]
    for checkpoint in (tiny_checkpoint, root):
        proc = subprocess.run([*GLMPOST, "train-grpo", str(judged), "--checkpoint", str(checkpoint), "--out", str(root),
                               "--mini-batches", "2", "--max-version-lag", "1", "--json", *tracked],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["steps"] == 2  # stdout is the result alone, whatever the trackers print
    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [line["train/global_step"] for line in lines] == [0, 1, 2, 3]
    losses = {line["train/global_step"]: line["train/loss"] for line in lines}
    run = "train-grpo " + "/".join(root.parts[-2:])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(home / "tensorboard" / trackers.safe_name(run)))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses, rel=1e-6)

    # W&B offline: one run directory per invocation, all of the one run id (`wandb sync` resumes it).
    run_dirs = sorted((home / "wandb").glob(f"offline-run-*-{trackers.run_id('t', run)}"))
    assert len(run_dirs) == 2
    history = {step: row for run_dir in run_dirs for step, row in _wandb_history(run_dir).items()}
    assert {step: row["train/loss"] for step, row in history.items()} == pytest.approx(losses, rel=1e-12)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the store the stage wrote (its offline default)
    from mlflow.tracking import MlflowClient

    client = MlflowClient((home / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert found.info.run_name == run and found.info.status == "FINISHED"
    assert found.data.params["out"] == str(root) and "lr" in found.data.params and "tracker" not in found.data.params
    assert {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")} == pytest.approx(losses)

    check = subprocess.run([sys.executable, "-c", (
        "import json; from trackio.sqlite_storage import SQLiteStorage as S;"
        f"print(json.dumps([S.get_logs('t', {run!r}), S.get_run_config('t', {run!r})]))")],
        capture_output=True, text=True, env={**env, "TRACKIO_DIR": str((home / "trackio").resolve())})
    assert check.returncode == 0, check.stderr
    logs, config = json.loads(check.stdout.strip().splitlines()[-1])
    assert {row["step"]: row["train/loss"] for row in logs} == pytest.approx(losses)
    assert config["out"] == str(root) and "tracker" not in config


def test_a_tracker_that_fails_is_one_line_and_metrics_jsonl_is_complete(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    out = tmp_path / "model"
    result = glmpost_cli("init-model", "--out", out, "--seed", "1", "--tracker", "mlflow", "--tracker-dir", tmp_path / "t")
    assert result.exit_code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "tracker mlflow" in line]
    assert len(said) == 1 and "failed to start" in said[0] and "Traceback" not in result.stderr
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["init/parameters"] > 0


def test_an_unknown_or_missing_tracker_is_refused_before_any_work(glmpost_cli, tmp_path, monkeypatch):
    bad = glmpost_cli("init-model", "--out", tmp_path / "a", "--tracker", "neptune")
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "--tracker 'neptune' is not a tracker" in bad.stderr
    monkeypatch.setitem(trackers.PACKAGES, "wandb", "glmpost_no_such_package")
    missing = glmpost_cli("init-model", "--out", tmp_path / "b", "--tracker", "wandb")
    assert missing.exit_code == 2 and "needs the glmpost_no_such_package package" in missing.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_tracker_options_are_recipe_keys_and_not_part_of_the_output(glmpost_cli, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[init-model]\ntracker = ["tensorboard"]\ntracker-dir = "{tmp_path / "t"}"\n')
    out = tmp_path / "m"
    assert glmpost_cli("init-model", "--out", out, "--config", recipe).exit_code == 0
    assert list((tmp_path / "t" / "tensorboard").iterdir())
    assert "tracker" not in json.loads((out / "stage.json").read_text())["options"]


class _Broken(trackers.Tracker):
    name = "broken"

    def __init__(self):
        self.calls = 0

    def log(self, values, step):
        self.calls += 1
        raise OSError("disk full")

    def close(self, failed):
        raise AssertionError("a dropped tracker is not closed")


class _Kept(trackers.Tracker):
    name = "kept"

    def __init__(self):
        self.rows, self.closed = [], None

    def log(self, values, step):
        self.rows.append((step, values))

    def close(self, failed):
        self.closed = failed


def test_a_tracker_failing_mid_run_is_dropped_once_and_the_others_keep_every_line(capsys):
    broken, kept = _Broken(), _Kept()
    tracked = trackers.TrackerSet([broken, kept])
    tracked.log({"time": 1.0, "train/global_step": 7, "train/loss": 0.5, "shard": "a.zst", "ok": True})
    tracked.log({"train/update_seconds": 3})  # a closing line: at the last step
    tracked.close(failed=True)
    assert broken.calls == 1 and kept.closed is True
    assert kept.rows == [(7, {"train/global_step": 7.0, "train/loss": 0.5, "ok": 1.0}), (7, {"train/update_seconds": 3.0})]
    lines = trackers.TrackerSet([kept := _Kept()])
    for row in ({"a": 1, "rollout/policy_version": 4}, {"a": 2, "rollout/policy_version": 4}):  # the line's index
        lines.log(row)
    assert [step for step, _ in kept.rows] == [0, 1]
    follow = trackers.TrackerSet([kept := _Kept()], by_version=True)  # a follow mode: the policy version
    for row in ({"rollout/policy_version": 2}, {"policy_version": 3}, {"judge/records": 1}):
        follow.log(row)
    assert [step for step, _ in kept.rows] == [2, 3, 2]
    assert capsys.readouterr().err.count("tracker broken failed (disk full)") == 1


def test_run_names_steps_and_ids():
    assert trackers.default_run_name("train-grpo", Path("/x/runs/quickstart/policy")) == "train-grpo quickstart/policy"
    assert trackers.number_at({"follow/policy_version": 3, "policy_version": 9}, trackers.VERSION_KEYS) == 3
    assert trackers.number_at({"policy_version": float("nan")}, trackers.VERSION_KEYS) is None
    assert trackers.run_id("p", "a") == trackers.run_id("p", "a") != trackers.run_id("p", "b")
    assert trackers.safe_name("train-grpo quickstart/policy") == "train-grpo_quickstart_policy"
