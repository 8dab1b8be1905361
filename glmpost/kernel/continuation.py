"""KV caches kept between the turns of multi-turn trajectories (the embedded engine's prefix cache).

Without them every turn re-prefills the whole history: prompt, every earlier action and every
observation. With them, each engine batch of trajectories keeps its cache after a turn; the next
turn selects the rows still running (``Cache.batch_select_indices``) and prefills only what each
row's prompt adds to the ids its cache covers (the rest of the last action, then the observation),
left padded so every row's next token is in the last column.

A row's cache also holds the tokens it was fed after it stopped while the batch decoded on (and
the padding of later turns): they stay in the cache but are masked out of ``attention``, so a row
attends exactly to its own ids, as in the trainer's forward over the whole trajectory. A prompt
whose cached ids are not a prefix of it (or the whole of it) starts over in a fresh batch; the
cache is an optimisation, never a source of different ids.

Two ways to find a prompt's row: by *session* (the rollout runner names each trajectory; rows no
prompt names are finished and dropped), or by *prefix* (``glmpost serve``, whose requests carry only
``input_ids``, as SGLang's radix cache finds them): the row with the longest cached ids that the
prompt extends; the rows of a batch no prompt continued are kept apart, and the ``retain`` most
recently used batches are held.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass(eq=False)  # compared by identity (it holds tensors)
class CachedBatch:
    """One engine batch's state after a turn: row ``r`` is session ``sessions[r]``, its cache covers
    the real tokens ``ids[r]`` under the row's 2D ``attention`` (1 on them, 0 on padding and on
    tokens fed after the row stopped)."""

    sessions: list[str]
    ids: list[list[int]]
    cache: Any
    attention: torch.Tensor

    def continues(self, row: int, prompt: Sequence[int]) -> bool:
        """True when ``prompt`` extends row ``row``'s cached ids by at least one token."""
        cached = self.ids[row]
        return len(prompt) > len(cached) and list(prompt[: len(cached)]) == cached


@dataclass
class TurnCaches:
    """The cached batches of the trajectories in flight, and how many prompt tokens they spared."""

    retain: int = 0  # prefix lookups: batches held for later calls (session lookups hold what the call continues)
    batches: list[CachedBatch] = field(default_factory=list)
    reused_tokens: int = 0  # prompt tokens read from a cache instead of prefilled
    prefilled_tokens: int = 0  # prompt tokens run through the model
    last_reused: list[int] = field(default_factory=list)  # per prompt of the last call: ids read from a cache
    # Session lookups: the policy version of the weights sampling now, the oldest version whose keys
    # and values each session's cache holds (a rollout that kept caches across a weight switch),
    # and, per prompt of the last call, that version for a prompt read from a cache (else None).
    version: int | None = None
    built_by: dict[str, int | None] = field(default_factory=dict)
    last_cache_versions: list[int | None] = field(default_factory=list)

    def plan(self, prompts: Sequence[Sequence[int]], sessions: Sequence[str] | None,
             batch_size: int) -> list[tuple[CachedBatch | None, list[int], list[int]]]:
        """Split one call into engine batches: ``(cached batch, prompt indices, its rows)`` for the
        prompts that continue a cached row (found by session, or with ``sessions`` None by prefix),
        then ``(None, prompt indices, [])`` batches of at most ``batch_size`` for the rest. Cached
        batches are handed out (and forgotten here): the engine stores what each batch leaves with
        :meth:`keep`."""
        found = self._by_session(prompts, sessions) if sessions is not None else self._by_prefix(prompts)
        continuing: dict[int, tuple[CachedBatch, list[int], list[int]]] = {}
        fresh: list[int] = []
        self.last_reused = [0] * len(prompts)
        for index, hit in enumerate(found):
            if hit is None:
                fresh.append(index)
                continue
            batch, row = hit
            entry = continuing.setdefault(id(batch), (batch, [], []))
            entry[1].append(index)
            entry[2].append(row)
            self.last_reused[index] = len(batch.ids[row])
        self.reused_tokens += sum(self.last_reused)
        self.prefilled_tokens += sum(len(p) for p in prompts) - sum(self.last_reused)
        if sessions is not None:
            self.batches = []
            self._track_versions(sessions, found)
        else:
            self._set_apart([(batch, rows) for batch, _, rows in continuing.values()])
        plan: list[tuple[CachedBatch | None, list[int], list[int]]] = list(continuing.values())
        plan += [(None, fresh[start : start + batch_size], []) for start in range(0, len(fresh), batch_size)]
        return plan

    def _track_versions(self, sessions: Sequence[str], found: list) -> None:
        self.last_cache_versions = [self.built_by.get(session) if hit is not None else None for session, hit in zip(sessions, found)]
        self.built_by = {session: (self.built_by.get(session) if hit is not None else self.version)
                         for session, hit in zip(sessions, found)}

    def _by_session(self, prompts, sessions) -> list[tuple[CachedBatch, int] | None]:
        where = {session: (batch, row) for batch in self.batches for row, session in enumerate(batch.sessions)}
        hits = [where.get(session) for session in sessions]
        return [hit if hit is not None and hit[0].continues(hit[1], prompt) else None for hit, prompt in zip(hits, prompts)]

    def _by_prefix(self, prompts) -> list[tuple[CachedBatch, int] | None]:
        """Per prompt, the unclaimed row with the longest cached ids it extends (None: no row)."""
        claimed: set[tuple[int, int]] = set()
        hits: list[tuple[CachedBatch, int] | None] = []
        for prompt in prompts:
            best = None
            for batch in self.batches:
                for row in range(len(batch.ids)):
                    if (id(batch), row) not in claimed and batch.continues(row, prompt) and (
                            best is None or len(batch.ids[row]) > len(best[0].ids[best[1]])):
                        best = (batch, row)
            if best is not None:
                claimed.add((id(best[0]), best[1]))
            hits.append(best)
        return hits

    def _set_apart(self, continued: list[tuple[CachedBatch, list[int]]]) -> None:
        """Prefix lookups: hand the continued batches out, keeping a copy of the rows no prompt
        continued (they may be extended by a later request)."""
        for batch, rows in continued:
            self.batches = [b for b in self.batches if b is not batch]
            rest = [row for row in range(len(batch.ids)) if row not in set(rows)]
            if rest:
                cache = copy.deepcopy(batch.cache)
                index = torch.tensor(rest, dtype=torch.long, device=batch.attention.device)
                cache.batch_select_indices(index)
                self.batches.append(CachedBatch([batch.sessions[r] for r in rest], [batch.ids[r] for r in rest], cache,
                                                batch.attention[index]))

    def keep(self, batch: CachedBatch) -> None:
        """Hold ``batch`` for the sessions' next turn (prefix lookups: the ``retain`` most recent)."""
        self.batches.append(batch)
        if self.retain and len(self.batches) > self.retain:
            del self.batches[: len(self.batches) - self.retain]

    def clear(self) -> None:
        """Release every cache (the trajectories ended, or the weights changed and they are recomputed)."""
        self.batches = []
        self.built_by = {}
