"""Hardening, storage (issue 30): an output that is a file, a read-only file system and a full one are
refused in one line naming the path, and nothing already written is lost. Real file systems: a
tmpfs mounted read-only or with a small size (skipped where this user may not mount)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from glmpost.checkpoints import CheckpointRoot
from test_train_grpo import _judged


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _one_line(result, exit_code: int) -> str:
    assert result.exit_code == exit_code, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_an_output_that_is_a_file_is_refused_and_left_as_it_was(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "count: 1"}\n')
    target = tmp_path / "a-file"
    target.write_text("mine\n")
    for args in (["rollout", prompts, "--checkpoint", tiny_checkpoint], ["train-grpo", judged, "--checkpoint", tiny_checkpoint],
                 ["judge", judged, "--checkpoint", tiny_checkpoint, "--verifier", "count=count"]):
        result = glmpost_cli(*args, "--out", target)
        assert f"{target} exists and is not a directory" in _one_line(result, 2)
        assert target.read_text() == "mine\n"


def test_a_read_only_file_system_is_one_line_naming_the_output(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        result = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", ro / "policy")
        assert f"{ro / 'policy'}: cannot write beside it" in _one_line(result, 1) and "Read-only file system" in result.stderr
        rollout = glmpost_cli("rollout", judged, "--checkpoint", tiny_checkpoint, "--out", ro / "rolled")
        assert "Read-only file system" in _one_line(rollout, 1)


def test_a_full_disk_while_publishing_keeps_the_published_versions(glmpost_cli, tiny_checkpoint, tmp_path):
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    with _tmpfs(tmp_path / "small", "size=3m") as small:  # one tiny version (weights + AdamW state: ~2.1 MB) fits
        root = small / "policy"
        assert glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root).exit_code == 0
        weights = (root / "v000001" / "model.safetensors").read_bytes()
        full = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--max-version-lag", "1")
        message = _one_line(full, 1)
        assert f"{root / '.staging-v000002'}: cannot write the new version" in message and "No space left on device" in message
        assert CheckpointRoot(root).versions() == [1] and CheckpointRoot(root).latest() == 1
        assert (root / "v000001" / "model.safetensors").read_bytes() == weights
