"""Checkpoint manifests, versioned roots with an atomic LATEST, tokenizer revisions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from glmpost.checkpoints import (
    CheckpointError,
    CheckpointManifest,
    CheckpointRoot,
    read_manifest,
    resolve_checkpoint,
    tokenizer_revision,
    write_manifest,
)
from glmpost.kernel.loading import load_model, load_tokenizer


def _version(tmp_path: Path, name: str, version: int, parent: str | None = None) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    write_manifest(directory, CheckpointManifest(policy_version=version, tokenizer_revision="sha256:x", stage="test", parent=parent))
    return directory


def test_manifest_round_trip(tmp_path):
    directory = tmp_path / "c"
    directory.mkdir()
    manifest = CheckpointManifest(policy_version=7, tokenizer_revision="sha256:ab", stage="train-grpo", step=3, parent="v000006")
    write_manifest(directory, manifest)
    assert read_manifest(directory) == manifest


def test_manifest_refusals_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"no glmpost.json"):
        read_manifest(tmp_path)
    (tmp_path / "glmpost.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match=r"glmpost.json: not a glmpost checkpoint manifest"):
        read_manifest(tmp_path)
    (tmp_path / "glmpost.json").write_text('{"format": "glmpost-checkpoint", "stage": "x"}')
    with pytest.raises(CheckpointError, match=r"missing policy_version, tokenizer_revision"):
        read_manifest(tmp_path)


def test_publish_moves_latest_and_resolve_follows_it(tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    assert root.versions() == [] and root.latest() is None and root.next_version() == 0
    for version in range(3):
        staged = _version(tmp_path, f"staged{version}", version)
        published = root.publish(staged, version)
        assert published == tmp_path / "root" / f"v{version:06d}"
        assert not staged.exists()
        assert root.latest() == version
        assert resolve_checkpoint(tmp_path / "root") == published
    assert root.versions() == [0, 1, 2] and root.next_version() == 3
    assert (tmp_path / "root" / "LATEST").read_text() == "v000002\n"
    # A version directory resolves to itself; LATEST can move back.
    assert resolve_checkpoint(root.version_dir(1)) == root.version_dir(1)
    root.set_latest(1)
    assert resolve_checkpoint(root.path) == root.version_dir(1)
    # No temporary files are left behind by the atomic pointer updates.
    assert sorted(p.name for p in root.path.iterdir()) == ["LATEST", "v000000", "v000001", "v000002"]


def test_publish_refuses_overwrite_and_mismatched_version(tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    root.publish(_version(tmp_path, "a", 0), 0)
    with pytest.raises(CheckpointError, match="already exists; policy versions are never overwritten"):
        root.publish(_version(tmp_path, "b", 0), 0)
    with pytest.raises(CheckpointError, match="manifest says policy version 5, publishing 1"):
        root.publish(_version(tmp_path, "c", 5), 1)
    with pytest.raises(CheckpointError, match="not a complete version"):
        root.set_latest(9)


def test_resolve_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="neither a version directory"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "LATEST").write_text("garbage\n")
    with pytest.raises(CheckpointError, match="LATEST: names 'garbage'"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "LATEST").write_text("v000004\n")
    with pytest.raises(CheckpointError, match="names v000004, which has no glmpost.json"):
        resolve_checkpoint(tmp_path)


def test_tokenizer_revision_tracks_tokenizer_files_and_chat_template(tiny_checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_checkpoint, copy)
    base = tokenizer_revision(copy)
    assert base == tokenizer_revision(tiny_checkpoint) and base.startswith("sha256:") and len(base) == 23
    (copy / "model.safetensors").write_bytes(b"not part of the tokenizer")
    assert tokenizer_revision(copy) == base
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|assistant|>", "<|assistant|> "))
    assert tokenizer_revision(copy) != base
    with pytest.raises(CheckpointError, match=r"tokenizer files have revision sha256:\w+ but glmpost.json records " + base):
        load_tokenizer(copy)
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        tokenizer_revision(tmp_path)


def test_load_from_root_uses_latest(tiny_checkpoint, tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    staged = tmp_path / "staged"
    shutil.copytree(tiny_checkpoint, staged)
    root.publish(staged, 0)
    tokenizer, revision = load_tokenizer(root.path)
    assert revision == read_manifest(tiny_checkpoint).tokenizer_revision
    model = load_model(root.path)
    assert type(model).__name__ == "GlmMoeDsaForCausalLM" and not model.training
    assert len(tokenizer) == model.config.vocab_size
