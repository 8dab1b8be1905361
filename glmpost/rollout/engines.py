"""The three rollout engines a run samples with, behind one interface (``prepare``, ``generate``,
``close``), and :func:`open_backend`, which opens the one a run names: ``local``
(:mod:`glmpost.rollout.local_backend`: :class:`~glmpost.kernel.engine.LocalEngine` in this process),
``sglang`` (:mod:`glmpost.rollout.sglang_backend`: SGLang servers or ``glmpost serve`` over HTTP) and
``vllm`` (:mod:`glmpost.rollout.vllm_engine`: vLLM servers, their weights confirmed by label or
fingerprint). Each opens on a :class:`~glmpost.rollout.policy.PolicyCheckpoint`.
"""

from __future__ import annotations

from typing import Any

from glmpost import __version__
from glmpost.rollout.local_backend import LocalBackend
from glmpost.rollout.policy import PolicyCheckpoint
from glmpost.rollout.settings import RolloutConfig
from glmpost.rollout.sglang_backend import SGLangBackend
from glmpost.rollout.vllm_engine import VLLMBackend

__all__ = ["engine_version", "eos_id_list", "open_backend"]


def eos_id_list(default_stops: int | list[int] | None) -> list[int]:
    """A model's ``eos_token_id`` (one id, a list, or none) as a list."""
    if isinstance(default_stops, list):
        return default_stops
    return [default_stops] if default_stops is not None else []


def engine_version() -> str:
    """The version stamped in each record's engine map (this glmpost's)."""
    return __version__


def open_backend(checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any) -> LocalBackend | SGLangBackend:
    """The engine ``config.engine.engine_name`` names, opened on the checkpoint (a local one on ``device``)."""
    if config.engine.engine_name == "vllm":
        return VLLMBackend.open(checkpoint, config, device)
    backend = SGLangBackend if config.engine.engine_name == "sglang" else LocalBackend
    return backend.open(checkpoint, config, device)
