"""Which weights a server serves, told from its log-probs: the version confirmation of servers that
report no weight version (a vLLM without dev mode, an older one without ``/weight_info``, or one whose
label nobody set: ``"default"``), and of a reload that got no answer in time. A vLLM with a label
set by ``sync-weights`` is confirmed by the label instead (:mod:`glmpost.weight_sync.vllm_sync`).

A checkpoint's *fingerprint* is the model's own log-probs (temperature 1, no filter) of a fixed
token sequence, :data:`FINGERPRINT_TOKENS` ids spread over the vocabulary (:func:`fingerprint_ids`),
each under its prefix. It is computed once per checkpoint by glmpost's kernel scoring on CPU in
float32 (:class:`~glmpost.kernel.engine.LocalEngine` ``score``) and kept beside the weights in
``glmpost-fingerprint.json`` with the identity of the weight files it was computed from (written
atomically; a copy whose files were rewritten, e.g. by ``glmpost quantize``, recomputes it; a
read-only checkpoint is simply recomputed next time). A server's fingerprint is the same sequence scored through its prompt log-probs, which vLLM
computes as ``log_softmax(logits)`` under both log-prob modes (and as logits under the logits modes,
which :meth:`~glmpost.kernel.vllm_client.VLLMClient.score` refuses; vLLM 0.32
``gpu_model_runner._get_prompt_logprobs_dict``).

The server serves a checkpoint when the *mean* absolute difference of the two fingerprints is at
most ``tolerance`` (default :data:`DEFAULT_TOLERANCE` 0.05) and, when there is a previous version
(the newest older one in the same root: :func:`previous_version_dir`), smaller than its distance to
that one's fingerprint. Why: a bf16 or quantized server against the float32 reference differs by
rounding, which averages out over 31 positions, while other weights move every position
systematically; the tolerance only has to separate "these weights up to rounding" from "other
weights", and the nearer-than-the-previous-version rule separates consecutive versions, whose
distance can be below any tolerance that still admits rounding (one small step at a low learning
rate). A float32 ``glmpost serve`` matches to about 1e-6.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from glmpost.checkpoints import CheckpointRoot
from glmpost.kernel.lora_versions import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_lora_version, model_dir

FINGERPRINT_TOKENS = 32
DEFAULT_TOLERANCE = 0.05
SIDECAR = "glmpost-fingerprint.json"

__all__ = ["DEFAULT_TOLERANCE", "Fingerprint", "checkpoint_fingerprint", "confirm_server", "fingerprint_ids",
           "keep_fingerprint", "previous_version_dir", "server_fingerprint", "weights_identity"]


def previous_version_dir(version_dir: Path | str) -> Path | None:
    """The newest version of ``version_dir``'s root older than it (None outside a root, or for the first)."""
    directory = Path(version_dir).resolve()
    root = CheckpointRoot(directory.parent)
    match = [v for v in root.versions() if root.version_dir(v).resolve() == directory]
    older = [v for v in root.versions() if match and v < match[0]]
    return root.version_dir(older[-1]) if older else None


def fingerprint_ids(vocab_size: int) -> list[int]:
    """The fixed sequence scored: :data:`FINGERPRINT_TOKENS` ids spread over ``[0, vocab_size)``."""
    return [(17 + 7919 * i) % vocab_size for i in range(FINGERPRINT_TOKENS)]


@dataclass(frozen=True)
class Fingerprint:
    """Log-probs of ``token_ids[1:]``, each under its prefix."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]

    def distance(self, other: Sequence[float]) -> float:
        """Mean absolute difference to ``other`` (log-probs of the same positions); inf for another length."""
        if len(other) != len(self.log_probs):
            return float("inf")
        return sum(abs(a - float(b)) for a, b in zip(self.log_probs, other)) / max(1, len(other))


def weights_identity(directory: Path) -> list:
    """What a kept fingerprint is valid for: ``config.json``'s digest and each weight file's name, size
    and modification time (a copy that keeps them holds the same weights; a rewritten, quantized or
    edited file changes them, and the fingerprint is computed again). A LoRA version's: its base's,
    then its adapter files' (the base checked to be the one it was trained on: ``model_dir``)."""
    if is_lora_version(directory):
        adapter = [directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS]
        return [*weights_identity(model_dir(directory)), *([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in adapter)]
    files = sorted(p for pattern in ("*.safetensors", "*.bin", "*.pt") for p in directory.glob(pattern))
    config = hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()[:16]
    return [config, *([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files)]


def checkpoint_fingerprint(version_dir: Path | str) -> Fingerprint:
    """The fingerprint of a checkpoint's weights (a LoRA version's: its base with the adapter
    applied, as :func:`~glmpost.kernel.loading.load_model` loads it): its ``glmpost-fingerprint.json``
    when that was kept for these very weight files (:func:`weights_identity`), else computed on CPU in
    float32 (and kept there when the directory is writable)."""
    directory = Path(version_dir)
    vocab = int(json.loads((model_dir(directory) / "config.json").read_text())["vocab_size"])  # a LoRA version: its base's
    ids = fingerprint_ids(vocab)
    sidecar, weights = directory / SIDECAR, weights_identity(directory)
    try:
        kept = json.loads(sidecar.read_text())
        if kept.get("token_ids") == ids and kept.get("weights") == weights:
            return Fingerprint(tuple(ids), tuple(float(x) for x in kept["log_probs"]))
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    import torch  # only where no fingerprint was kept: loading the model is the slow path

    from glmpost.kernel.loading import load_model  # the model, only when computing one

    return keep_fingerprint(directory, load_model(directory, device="cpu", dtype=torch.float32))


def keep_fingerprint(directory: Path | str, model: Any) -> Fingerprint:
    """The fingerprint of ``directory``'s weights scored by ``model``, a float32 model holding them
    (the one :func:`checkpoint_fingerprint` loads, or a trainer's own model that has just written them:
    a LoRA version's adapter over its float32 base), kept beside them in ``glmpost-fingerprint.json``
    for these weight files (:func:`weights_identity`; not kept where the directory is read-only)."""
    import torch  # only when computing one

    from glmpost.kernel.engine import LocalEngine  # the kernel's scoring, only when computing one

    directory = Path(directory)
    ids = fingerprint_ids(int(json.loads((model_dir(directory) / "config.json").read_text())["vocab_size"]))
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            scores = LocalEngine(model, batch_size=1, pad_token_id=0).score([ids], [1])[0]
    finally:
        model.train(training)
    result = Fingerprint(tuple(ids), tuple(float(x) for x in scores.log_probs))
    try:
        sidecar = directory / SIDECAR
        tmp = sidecar.with_name(f".{SIDECAR}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"token_ids": ids, "log_probs": list(result.log_probs), "dtype": "float32",
                                   "weights": weights_identity(directory),
                                   "what": "log-probs of token_ids[1:] under their prefixes (glmpost.kernel.fingerprint)"}))
        os.replace(tmp, sidecar)
    except OSError:
        pass
    return result


def server_fingerprint(client: Any, token_ids: Sequence[int]) -> list[float]:
    """The server's log-probs of ``token_ids[1:]`` (its ``score``); raises ServerError."""
    return [float(x) for x in client.score(list(token_ids), 1)["token_log_probs"]]


def confirm_server(client: Any, expected: Fingerprint, *, tolerance: float = DEFAULT_TOLERANCE,
                   previous: Fingerprint | None = None) -> tuple[bool, str]:
    """Whether ``client``'s server serves the weights of ``expected`` (the rule in this module's
    docstring), and the distances as words; raises ServerError when it cannot score."""
    served = server_fingerprint(client, expected.token_ids)
    distance = expected.distance(served)
    words = f"fingerprint distance {distance:.3g} (tolerance {tolerance:g})"
    if previous is not None and previous.log_probs != expected.log_probs:
        old = previous.distance(served)
        words += f", {old:.3g} to the previous version"
        if not distance < old:
            return False, words
    return distance <= tolerance, words
