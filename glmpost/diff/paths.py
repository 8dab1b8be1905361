"""The two scoring paths of ``glmpost diff-logprobs`` besides the recorded rollout: a checkpoint's model
scored locally (:class:`LocalSide`: path A, and path B in ``checkpoint`` and ``local`` mode) and a
server's prefill log-probs (:func:`server_path_b`: path B in ``server`` mode);
:mod:`glmpost.diff.run` runs the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from glmpost.checkpoints import read_manifest
from glmpost.config import ConfigError
from glmpost.diff.mismatch import PathScores, load_path_model, local_path, server_path
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.loading import attention_ran
from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.vllm_client import VLLMClient
from glmpost.models.native_attention import set_attention
from glmpost.npu.topk import set_indexer_topk


@dataclass
class LocalSide:
    """One local path: a checkpoint's model in ``dtype`` on ``device`` with a DSA top-k rule and a
    GLM-5 attention implementation, scoring ``batch_size`` trajectories per forward pass."""

    checkpoint: Path
    dtype: str
    device: Any
    deterministic_topk: bool
    batch_size: int
    attention: str = "native"

    def load(self):
        """The model of this path (:func:`~glmpost.diff.mismatch.load_path_model`)."""
        return load_path_model(self.checkpoint, dtype=self.dtype, device=self.device, deterministic_topk=self.deterministic_topk,
                               attention=self.attention)

    def adopt(self, model):
        """Another path's model (same weights, dtype and device), switched to this path's top-k rule and attention."""

        set_indexer_topk(model, deterministic=self.deterministic_topk)
        set_attention(model, self.attention)
        return model

    def score(self, model, records, *, distribution: ScoredDistribution, label: str, indexer: bool, progress: Callable) -> PathScores:
        """``records`` scored through the trainer's forward (:func:`~glmpost.diff.mismatch.local_path`)."""
        return local_path(model, records, distribution=distribution, label=label, batch_size=self.batch_size,
                          indexer=indexer, progress=progress)

    def describe(self) -> dict[str, Any]:
        """The path as the report names it."""
        return {"kind": "checkpoint", "checkpoint": str(self.checkpoint), "dtype": self.dtype, "device": str(self.device),
                "topk": "deterministic" if self.deterministic_topk else "torch",
                "attention": attention_ran(self.checkpoint, self.attention),
                "batch_size": self.batch_size}



def server_path_b(url: str, records, *, distribution: ScoredDistribution, revision: str, vocab_size: int,
                  progress: Callable, api_key: Optional[str] = None, engine: str = "sglang",
                  adapter_of: Optional[Path] = None) -> tuple[PathScores, dict[str, Any]]:
    """Path B on a server: its scores and its description; the server must be reachable and serve
    tokenizer ``revision``; ``adapter_of`` (a LoRA version): every request names its adapter."""

    client = (VLLMClient if engine == "vllm" else SGLangClient)(url, timeout=120.0, retries=2, backoff=0.2, api_key=api_key)
    try:
        info = client.model_info()
    except ServerError as exc:
        raise ConfigError("{against_server} {url}: {reason}", url=client.url, reason=exc, exit_code=1) from None
    problem = client.scoring_problem() if isinstance(client, VLLMClient) else None
    if problem:
        raise ConfigError("{against_server} {problem}", problem=problem, exit_code=1)
    theirs = info.get("tokenizer_revision") if isinstance(info, dict) else None
    if theirs is not None and theirs != revision:
        raise ConfigError("{against_server} {url}: tokenizer revision {theirs} differs from {checkpoint}'s {revision}",
                          url=client.url, theirs=theirs, revision=revision, exit_code=1)
    if adapter_of is not None:  # path A a LoRA version: the server's base and that adapter, which sync-weights loaded
        problem = client.name_adapter(adapter_of, read_manifest(adapter_of).policy_version)
        if problem is not None:
            raise ConfigError("{against_server} {url} {problem}; sync-weights of {path} to that server loads it",
                              url=client.url, problem=problem, path=adapter_of, exit_code=1)
    try:
        path = server_path(client, records, distribution=distribution, vocab_size=vocab_size, label="B", progress=progress)
    except (ValueError, ServerError) as exc:
        raise ConfigError("{against_server} {url}: {reason}", url=client.url, reason=exc, exit_code=1) from None
    described = {"kind": "server", "engine": engine, "url": client.url, "weight_version": info.get("weight_version"),
                 "model_path": info.get("model_path")}
    if client.adapter is not None:
        described["adapter"], described["weight_version"] = client.adapter[0], str(client.adapter[1])
    return path, described
