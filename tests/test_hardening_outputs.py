"""Hardening, outputs (issue 30): one writer per output, reruns that compare what they would redo,
LATEST repaired after a crash, damaged parts redone. Real processes and real files, as a user
would meet them."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_grpo import _judged

from glmpost.checkpoints import LATEST, CheckpointRoot, read_manifest
from glmpost.formats import ShardReader
from glmpost.locks import OutputLocked, lock_path, output_lock

HOLD = """
import sys, time
from pathlib import Path
from glmpost.locks import output_lock
with output_lock(Path(sys.argv[1]), stage="holder", task=None if len(sys.argv) < 3 else (int(sys.argv[2]), int(sys.argv[3]))):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(out: Path, *task: int) -> subprocess.Popen:
    """Another process holding ``out``'s lock (until killed)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(out), *map(str, task)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def _prompts(tmp_path: Path, n: int = 4) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"count: {i}"}) + "\n" for i in range(n)))
    return prompts


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(glmpost_cli, tiny_checkpoint,
                                                                                              tmp_path):
    prompts, out = _prompts(tmp_path), tmp_path / "rolled"
    holder = _holder(out)
    try:
        busy = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", out, "--max-new-tokens", "3")
        assert busy.exit_code == 1 and "Traceback" not in busy.stderr
        line = busy.stderr.strip()
        assert "\n" not in line and f"{out} is being written by pid {holder.pid} on {socket.gethostname()} since " in line
        assert "(holder)" in line and not out.exists()  # nothing written by the refused writer
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock_path(out).exists()  # a kill -9 leaves the file; the kernel let go of the lock
    taken = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", out, "--max-new-tokens", "3")
    assert taken.exit_code == 0, taken.stderr
    assert f"took over the lock of pid {holder.pid}" in taken.stderr and not lock_path(out).exists()


def test_tasks_of_one_split_stage_write_side_by_side_but_not_twice(tmp_path):
    out = tmp_path / "judged"
    other_task = _holder(out, 1, 2)
    try:
        with output_lock(out, stage="judge", task=(0, 2)):  # task 0 beside task 1: fine
            pass
        with pytest.raises(OutputLocked, match=f"pid {other_task.pid}"):
            with output_lock(out, stage="judge", task=(1, 2)):
                pass
    finally:
        other_task.kill()
        other_task.wait()


def test_two_trainers_into_one_root_one_is_refused_before_it_writes(glmpost_cli, tiny_checkpoint, tmp_path):
    judged, root = _judged(glmpost_cli, tiny_checkpoint, tmp_path), tmp_path / "root"
    holder = _holder(root)
    try:
        busy = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root)
        assert busy.exit_code == 1 and f"pid {holder.pid}" in busy.stderr and "Traceback" not in busy.stderr
        assert not root.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_training_rerun_skips_the_same_refuses_other_options_and_overwrite_redoes(glmpost_cli, tiny_checkpoint, tmp_path):
    judged, root = _judged(glmpost_cli, tiny_checkpoint, tmp_path), tmp_path / "root"
    args = ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root, "--lr", "1e-3", "--json"]
    assert glmpost_cli(*args).exit_code == 0
    first = (root / "v000001" / "model.safetensors").read_bytes()

    same = glmpost_cli(*args)
    assert same.exit_code == 0 and json.loads(same.stdout)["skipped"] is True

    other = glmpost_cli(*args[:-2], "2e-3")
    assert other.exit_code == 2 and other.stderr.count("\n") == 1
    assert f"--out {root / 'v000001'} was written with --lr 0.001, now 0.002" in other.stderr

    fewer = _judged(glmpost_cli, tiny_checkpoint, tmp_path, name="other-judged", seed=1)
    inputs = glmpost_cli("train-grpo", fewer, *args[2:])
    assert inputs.exit_code == 2 and "was written with INPUTS" in inputs.stderr

    redo = glmpost_cli(*args[:-2], "2e-3", "--overwrite", "--json")
    assert redo.exit_code == 0, redo.stderr
    assert json.loads(redo.stdout)["policy_version"] == 1 and CheckpointRoot(root).latest() == 1
    assert json.loads((root / "v000001" / "stage.json").read_text())["options"]["lr"] == 2e-3
    assert (root / "v000001" / "model.safetensors").read_bytes() != first
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no staging, no replaced version left

    assert glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--max-version-lag", "1").exit_code == 0
    later = glmpost_cli(*args[:-2], "2e-3", "--overwrite")
    assert later.exit_code == 2 and "v000002 came after it" in later.stderr


def test_latest_left_behind_by_a_crash_is_moved_by_the_next_writer(glmpost_cli, tiny_checkpoint, tmp_path):
    judged, root = _judged(glmpost_cli, tiny_checkpoint, tmp_path), tmp_path / "root"
    assert glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root).exit_code == 0
    (root / LATEST).write_text("v000000\n")  # as if killed between moving v000001 in and moving LATEST
    # LATEST names a version this root does not hold: the next writer points it at the newest one.
    result = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--max-version-lag", "1", "--json")
    assert result.exit_code == 0, result.stderr
    assert f"{root}: LATEST named v000000, but v000001 was published; moved it" in result.stderr
    assert json.loads(result.stdout)["policy_version"] == 2
    assert read_manifest(root / "v000002").parent == str(root / "v000001") and CheckpointRoot(root).latest() == 2


def test_a_damaged_part_is_redone_and_a_dead_writers_partial_file_removed(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts, out = _prompts(tmp_path), tmp_path / "rolled"
    args = ["rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", out, "--max-new-tokens", "3",
            "--prompts-per-shard", "2", "--group-size", "2"]
    assert glmpost_cli(*args).exit_code == 0
    parts = sorted(out.glob("rollout-*.msgpack.zst"))
    good = parts[0].read_bytes()
    parts[1].write_bytes(parts[1].read_bytes()[:40])  # cut short: no footer
    partial = out / f".{parts[0].name}.tmp-999999"
    partial.write_bytes(b"half a shard")
    again = glmpost_cli(*args)
    assert again.exit_code == 0, again.stderr
    assert "sampling this part again: " in again.stderr and "removed 1 partial shard(s)" in again.stderr
    assert not partial.exists() and parts[0].read_bytes() == good  # the complete part is kept as it was
    assert len(list(ShardReader(parts[1]))) == 4
    assert glmpost_cli("shards", "verify", out).exit_code == 0


def test_two_followers_under_one_consumer_name_one_is_refused(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.checkpoints import tokenizer_revision
    from glmpost.spool.spool import Spool

    rolled = Spool(tmp_path / "rolled", tokenizer_revision=tokenizer_revision(tiny_checkpoint))
    holder = _holder(rolled.claimed_dir / "judge-a")  # another judge following as judge-a
    try:
        busy = glmpost_cli("judge", "--follow", rolled.path, "--out", tmp_path / "judged", "--consumer", "judge-a",
                           "--checkpoint", tiny_checkpoint, "--idle-timeout", "0")
        assert busy.exit_code == 1 and f"is being written by pid {holder.pid}" in busy.stderr
        assert "Traceback" not in busy.stderr
    finally:
        holder.kill()
        holder.wait()
