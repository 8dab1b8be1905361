"""Bringing your own model (issue 31): ``import-model`` makes a checkpoint root of a Hugging Face
folder without copying its weights, training continues it version after version, and a model
folder given as ``--out`` is refused in one line instead of stalling learning silently."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from test_hardening_inputs import _llama as llama_folder
from test_train_grpo import _judged

from glmpost.checkpoints import CheckpointRoot, read_manifest


def _llama(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A plain ``save_pretrained`` Llama folder with the tiny model's tokenizer, its weights read-only."""
    folder = llama_folder(tiny_checkpoint, tmp_path)
    os.chmod(folder / "model.safetensors", 0o444)
    return folder


def _one_line(result, code: int) -> str:
    assert result.exit_code == code, (result.exit_code, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("glmpost: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_import_links_the_weights_and_training_continues_the_root(glmpost_cli, tiny_checkpoint, tmp_path):
    folder, root = _llama(tiny_checkpoint, tmp_path), tmp_path / "root"
    result = glmpost_cli("import-model", folder, "--out", root, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    weights = root / "v000000" / "model.safetensors"
    assert summary["placed"] == {"hard": summary["files"]} and os.path.samefile(weights, folder / "model.safetensors")
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o444  # the source's mode is its own
    manifest = read_manifest(root / "v000000")
    assert manifest.policy_version == 0 and manifest.stage == "import-model" and manifest.parent == str(folder.resolve())
    assert CheckpointRoot(root).latest() == 0 and json.loads((root / "v000000" / "metrics.jsonl").read_text())["import/files"] == summary["files"]

    judged = _judged(glmpost_cli, root, tmp_path)
    trained = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--lr", "1e-3", "--json")
    assert trained.exit_code == 0, trained.stderr
    assert CheckpointRoot(root).latest() == 1 and read_manifest(root / "v000001").parent == str(root / "v000000")
    assert (folder / "model.safetensors").read_bytes() == weights.read_bytes()  # publishing never wrote into the source

    again = glmpost_cli("import-model", folder, "--out", root)
    assert again.exit_code == 0 and "already imported" in again.stdout
    assert "--link 'hard', now 'copy'" in _one_line(glmpost_cli("import-model", folder, "--out", root, "--link", "copy"), 2)
    refused = _one_line(glmpost_cli("import-model", folder, "--out", root, "--overwrite"), 2)
    assert "holds trained versions (v000001 ... v000001)" in refused and CheckpointRoot(root).latest() == 1


def test_links_fall_back_to_copies_and_symbolic_links_on_request(glmpost_cli, tiny_checkpoint, tmp_path, monkeypatch):
    folder = _llama(tiny_checkpoint, tmp_path)
    symbolic = glmpost_cli("import-model", folder, "--out", tmp_path / "sym", "--link", "symbolic", "--json")
    assert symbolic.exit_code == 0, symbolic.stderr
    assert (tmp_path / "sym" / "v000000" / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert (tmp_path / "sym" / "v000000" / "model.safetensors").is_symlink()

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    copied = glmpost_cli("import-model", folder, "--out", tmp_path / "copied", "--json")
    assert copied.exit_code == 0, copied.stderr
    assert json.loads(copied.stdout)["placed"] == {"copy": json.loads(symbolic.stdout)["files"]}
    assert "copied: the file system does not allow hard links" in copied.stderr
    weights = tmp_path / "copied" / "v000000" / "model.safetensors"
    assert not os.path.samefile(weights, folder / "model.safetensors") and weights.read_bytes() == (folder / "model.safetensors").read_bytes()


def test_a_model_folder_as_out_is_refused_and_left_untouched(glmpost_cli, tiny_checkpoint, tmp_path):
    folder = _llama(tiny_checkpoint, tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    judged = _judged(glmpost_cli, folder, tmp_path)
    for args in (["train-grpo", judged, "--checkpoint", folder, "--out", folder],
                 ["sync-weights", "--checkpoint", tiny_checkpoint, "--out", folder],
                 ["init-critic", "--from", folder, "--out", folder],
                 ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tiny_checkpoint]):
        line = _one_line(glmpost_cli(*args), 2)
        assert f"--out {args[-1]} holds" in line and "it is a model folder, not a checkpoint root" in line
        assert f"`glmpost import-model {args[-1]} --out ROOT`" in line
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_that_is_not_a_model_is_refused_in_one_line(glmpost_cli, tiny_checkpoint, tmp_path):
    folder = _llama(tiny_checkpoint, tmp_path)
    (folder / "model.safetensors").unlink()
    assert "no weights (*.safetensors, *.bin) beside config.json" in _one_line(glmpost_cli("import-model", folder, "--out", tmp_path / "a"), 1)
    (folder / "config.json").write_text("{not json")
    assert "config.json: unreadable" in _one_line(glmpost_cli("import-model", folder, "--out", tmp_path / "b"), 1)
    assert "not a directory" in _one_line(glmpost_cli("import-model", tmp_path / "missing", "--out", tmp_path / "c"), 1)
    assert not any((tmp_path / name).exists() for name in "abc")
