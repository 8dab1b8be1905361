"""A LoRA version merged into the full checkpoint it stands for, for what reads weights rather than
applying an adapter: ``glmpost quantize`` (every scheme and format, msModelSlim included; ``--scheme
none`` writes the merged float checkpoint itself: the deployment merge on demand) and, through that
checkpoint, ``qat``.

The merge is PEFT's own (``merge_and_unload``: ``W + alpha / r · B @ A`` in every adapted layer, the
routed experts' fused weights included) computed in float32 on the base loaded in float32, then
stored in the base's dtype: the same weights a rollout engine that merges (vLLM's and SGLang's
``--lora`` paths do not; they apply the adapter unmerged, as glmpost does) would compute with.
Merged and unmerged agree to float32 rounding (about 1e-6 on the tiny GLM-5); stored in bfloat16, the
merged weight rounds a small update away, which is why rollout and training never merge.

The merged checkpoint keeps the LoRA version's policy version and tokenizer, and its manifest says
where it came from (``extra.merged_from``: the LoRA version and its base).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings
from pathlib import Path
from typing import Iterator

import torch

from glmpost.checkpoints import MANIFEST, CheckpointError, read_manifest, resolve_checkpoint, write_manifest
from glmpost.errors import first_line
from glmpost.kernel.loading import check_finite, load_weights, saved_dtype
from glmpost.kernel.lora import ADAPTER
from glmpost.kernel.lora_versions import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_lora_version, read_lora_base
from glmpost.stage import log

__all__ = ["full_weights", "merge_lora_version"]

_ADAPTER_FILES = {ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, "README.md", "stage.json", "metrics.jsonl"}


def merge_lora_version(version_dir: Path | str, out: Path | str) -> Path:
    """Write the full checkpoint the LoRA version ``version_dir`` stands for into ``out`` (created;
    it must not hold a checkpoint): its base's weights with the adapter merged (module doc), the
    base's ``config.json``, the version's tokenizer files, and a manifest with the version's policy
    version. Returns ``out``."""
    from peft import PeftModel  # optional heavy dependency (LoRA only)

    version_dir = resolve_checkpoint(version_dir)
    if not is_lora_version(version_dir):
        raise CheckpointError(f"{version_dir}: not a LoRA version (no {ADAPTER_CONFIG}); nothing to merge")
    base = read_lora_base(version_dir)
    dtype = saved_dtype(base)
    model = load_weights(base, torch.float32)
    try:
        with warnings.catch_warnings():  # PEFT asks transformers 5 a deprecated question (is_gradient_checkpointing)
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = PeftModel.from_pretrained(model, str(version_dir), adapter_name=ADAPTER, is_trainable=False)
            merged = wrapped.merge_and_unload()
    except Exception as exc:  # PEFT raises many types for an adapter that does not fit (ValueError, KeyError, ...)
        raise CheckpointError(f"{version_dir}: the adapter does not merge into its base {base} ({first_line(exc)})") from None
    check_finite(merged, version_dir)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    merged.to(getattr(torch, dtype)).save_pretrained(str(out))
    for item in sorted(version_dir.iterdir()):  # the tokenizer and generation config (the version's copy of the base's)
        if item.is_file() and item.name not in _ADAPTER_FILES and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)
    manifest = read_manifest(version_dir)
    write_manifest(out, dataclasses.replace(manifest, lora_base=None, parent=str(version_dir), extra={
        **manifest.extra, "merged_from": {"lora_version": str(version_dir), "base": str(base), "dtype": dtype}}))
    return out


@contextlib.contextmanager
def full_weights(checkpoint: Path | str, *, scratch_beside: Path, layout_only: bool = False) -> Iterator[Path]:
    """The version directory ``checkpoint`` names, when it is a full version; for a LoRA version, its
    merged checkpoint (:func:`merge_lora_version`) in a scratch directory beside ``scratch_beside``
    (on its file system), removed when the context ends, whatever happened. ``layout_only``: the
    base instead of merging (the same tensor names and shapes; for a run that only checks them)."""
    directory = resolve_checkpoint(checkpoint)
    if not is_lora_version(directory):
        yield directory
        return
    base = read_lora_base(directory)
    if layout_only:
        yield base
        return
    scratch_beside = Path(scratch_beside)
    scratch = scratch_beside.with_name(f".{scratch_beside.name}.merged-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    log(f"{directory}: a LoRA version; merging it into its base {base} first")
    try:
        yield merge_lora_version(directory, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
