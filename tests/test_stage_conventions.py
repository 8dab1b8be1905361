"""Stage conventions every stage keeps (DESIGN.md §7): a rerun with other options than the finished
output's stage.json is refused naming the option and --overwrite; checkpoints are readable by other
users (an inference server often runs as one)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest


def _modes(directory: Path) -> set[tuple[str, int]]:
    kinds = {("dir", stat.S_IMODE(os.stat(directory).st_mode))}
    for path in directory.rglob("*"):
        kinds.add(("dir" if path.is_dir() else "file", stat.S_IMODE(path.stat().st_mode)))
    return kinds


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_checkpoints_are_readable_by_other_users(glmpost_cli, tiny_checkpoint, tmp_path, umask_022):
    model = tmp_path / "model"
    assert glmpost_cli("init-model", "--out", model, "--seed", "5").exit_code == 0
    prompts = tmp_path / "sft.jsonl"
    prompts.write_text(json.dumps({"prompt": "count: 3", "response": "3333"}) + "\n")
    qat = glmpost_cli("qat", prompts, "--checkpoint", model, "--out", tmp_path / "qat", "--scheme", "w4a16",
                      "--group-size", "16", "--batch-size", "1")
    assert qat.exit_code == 0, qat.stderr
    quantized = glmpost_cli("quantize", model, "--out", tmp_path / "w4", "--scheme", "w4a16", "--group-size", "16")
    assert quantized.exit_code == 0, quantized.stderr
    for directory in (model, tmp_path / "qat" / "v000001", tmp_path / "w4"):
        assert (directory / "model.safetensors").is_file()
        assert _modes(directory) == {("dir", 0o755), ("file", 0o644)}, directory


def test_a_rerun_with_other_options_is_refused_naming_the_option(glmpost_cli, tiny_checkpoint, tmp_path):
    model = tmp_path / "model"
    assert glmpost_cli("init-model", "--out", model, "--seed", "1").exit_code == 0
    weights = (model / "model.safetensors").read_bytes()
    again = glmpost_cli("init-model", "--out", model, "--seed", "1")
    assert again.exit_code == 0 and "already complete (skipped)" in again.stdout
    other = glmpost_cli("init-model", "--out", model, "--seed", "2")
    assert other.exit_code == 2 and "was written with --seed 1, now 2" in other.stderr and "--overwrite" in other.stderr
    assert (model / "model.safetensors").read_bytes() == weights  # nothing written over

    fp8 = tmp_path / "fp8"
    assert glmpost_cli("quantize", tiny_checkpoint, "--out", fp8, "--scheme", "fp8-block").exit_code == 0
    w8 = glmpost_cli("quantize", tiny_checkpoint, "--out", fp8, "--scheme", "w8a16")
    assert w8.exit_code == 2 and "was written with --scheme 'fp8-block', now 'w8a16'" in w8.stderr
    assert json.loads((fp8 / "glmpost.json").read_text())["extra"]["scheme"] == "fp8-block"
    replaced = glmpost_cli("quantize", tiny_checkpoint, "--out", fp8, "--scheme", "w8a16", "--overwrite")
    assert replaced.exit_code == 0 and json.loads((fp8 / "glmpost.json").read_text())["extra"]["scheme"] == "w8a16"

    demo = Path(__file__).resolve().parents[1] / "recipes" / "data" / "count-demo.jsonl"
    imported = tmp_path / "imported"
    assert glmpost_cli("shards", "import", demo, "--checkpoint", tiny_checkpoint, "--out", imported).exit_code == 0
    level = glmpost_cli("shards", "import", demo, "--checkpoint", tiny_checkpoint, "--out", imported, "--zstd-level", "9")
    assert level.exit_code == 2 and "--zstd-level" in level.stderr
