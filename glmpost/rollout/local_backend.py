"""``--engine local``'s rollout backend: :class:`LocalBackend`, the checkpoint's model in this
process behind the interface of :mod:`glmpost.rollout.engines` (``prepare``, ``generate``, ``close``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from tqdm import tqdm

from glmpost.kernel.continuation import TurnCaches
from glmpost.kernel.engine import Completion, LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model
from glmpost.rollout.servers import Outcome
from glmpost.rollout.policy import PolicyCheckpoint
from glmpost.rollout.settings import RolloutConfig

__all__ = ["LocalBackend"]


class LocalBackend:
    """``--engine local``: the checkpoint's model in this process, ``batch_size`` sequences per call;
    a sequence's samples are a function of its seed (``seed_reproducible``)."""

    seed_reproducible = True

    def __init__(self, model: Any, *, batch_size: int, pad_token_id: int, version: int | None = None,
                 record_routing: bool = False):
        self.model = model
        self.record_routing = record_routing  # each sampled token's MoE experts (glmpost.kernel.routing)
        self.model_config = model.config
        self.default_stops = model.generation_config.eos_token_id
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.engine: LocalEngine | None = None
        self.params: SamplingParams | None = None
        self.version = version  # the policy version of the weights sampling now
        self.turn_caches = TurnCaches(version=version)

    @classmethod
    def open(cls, checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any) -> "LocalBackend":
        """Load the model on ``device`` (``config.device`` resolved)."""
        model = load_model(checkpoint.version_dir, device=device, deterministic_topk=config.deterministic_topk,
                           attention=config.attention)
        return cls(model, batch_size=config.batch_size, pad_token_id=checkpoint.tokenizer.pad_token_id,
                   version=checkpoint.policy_version, record_routing=config.record_routing)

    def switch(self, checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any, *, keep_cache: bool) -> None:
        """Sample with ``checkpoint``'s weights from now on, trajectories in flight included (the KV
        owner contract; brief: "多轮会话的 ... KV Cache owner 同步迁移或显式失效"): their caches are
        dropped, so the next turn prefills the whole history under the new weights, or with
        ``keep_cache`` kept: the next turns attend to keys and values the old weights computed, and
        each such completion's ``cache_version`` names the version that built them. The model's config,
        eos ids and pad id are the new checkpoint's too, as if the backend were opened on it."""
        self.model = load_model(checkpoint.version_dir, device=device, deterministic_topk=config.deterministic_topk,
                                attention=config.attention)
        self.model_config, self.default_stops = self.model.config, self.model.generation_config.eos_token_id
        self.pad_token_id = checkpoint.tokenizer.pad_token_id
        if self.engine is not None:
            self.engine = self._engine()
        self.version = self.turn_caches.version = checkpoint.policy_version
        if not keep_cache:
            self.turn_caches.clear()

    def prepare(self, params: SamplingParams, eos_ids: list[int]) -> SamplingParams:
        """Sample with ``params`` from now on; returns them unchanged (this engine computes the log-prob kind they name)."""
        self.engine = self._engine()
        self.params = params
        return params

    def _engine(self) -> LocalEngine:
        return LocalEngine(self.model, batch_size=self.batch_size, pad_token_id=self.pad_token_id,
                           record_routing=self.record_routing)

    def engine_name(self) -> str:
        """The name stamped in each record's engine map."""
        return LocalEngine.name

    def generate(self, sequences: list[list[int]], keys: list[str], progress: tqdm, *,
                 homes: Optional[list[int]] = None, sessions: Optional[list[str]] = None,
                 max_new_tokens: Optional[int] = None) -> list[Outcome]:
        """Sample every sequence, ``batch_size`` at a time; none is ever aborted (``homes``: no servers
        here, ignored). With ``sessions`` (one trajectory key per sequence), every batch keeps its KV
        cache for the trajectories' next turn, which then prefills only its new tokens.
        ``max_new_tokens`` overrides the run's for this call (a compaction's summaries)."""
        if sessions is not None:
            params = self.params if max_new_tokens is None else replace(self.params, max_new_tokens=max_new_tokens)
            completions = self.engine.generate(sequences, keys, params, sessions=sessions, caches=self.turn_caches)
            for completion, built_by in zip(completions, self.turn_caches.last_cache_versions):
                completion.cache_version = built_by
            progress.update(len(sequences))
            return [(c, self.version, None) for c in completions]
        completions: list[Completion] = []
        for start in range(0, len(sequences), self.batch_size):
            batch = sequences[start : start + self.batch_size]
            completions += self.engine.generate(batch, keys[start : start + self.batch_size], self.params)
            progress.update(len(batch))
        return [(c, self.version, None) for c in completions]

    def sampling_versions(self, checkpoint: PolicyCheckpoint) -> list[int]:
        """The one version sampling here (this process loads each version itself: never behind)."""
        return [self.version]

    def served(self, key: str) -> Optional[str]:
        """No server answers a local sequence."""
        return None

    def close(self) -> None:
        """Release the trajectories' KV caches."""
        self.turn_caches.clear()
