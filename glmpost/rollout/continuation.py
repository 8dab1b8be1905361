"""KV caches kept between the turns of multi-turn trajectories (the embedded engine's prefix cache).

Without them every turn re-prefills the whole history: prompt, every earlier action and every
observation. With them, each engine batch of trajectories keeps its cache after a turn; the next
turn selects the rows still running (``Cache.batch_select_indices``) and prefills only what each
row's prompt adds to the ids its cache covers (the rest of the last action, then the observation),
left padded so every row's next token is in the last column.

A row's cache also holds the tokens it was fed after it stopped while the batch decoded on (and
the padding of later turns): they stay in the cache but are masked out of ``attention``, so a row
attends exactly to its own ids, as in the trainer's forward over the whole trajectory. A session
whose cached ids are not a prefix of its new prompt (or the whole prompt) starts over in a fresh
batch; the cache is an optimisation, never a source of different ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
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

    batches: list[CachedBatch] = field(default_factory=list)
    reused_tokens: int = 0  # prompt tokens read from a cache instead of prefilled
    prefilled_tokens: int = 0  # prompt tokens run through the model

    def plan(self, prompts: Sequence[Sequence[int]], sessions: Sequence[str],
             batch_size: int) -> list[tuple[CachedBatch | None, list[int], list[int]]]:
        """Split one call into engine batches: ``(cached batch, prompt indices, its rows)`` for the
        prompts that continue a cached row, then ``(None, prompt indices, [])`` batches of at most
        ``batch_size`` for the rest. Cached batches are handed out (and forgotten here): the engine
        stores what each batch leaves with :meth:`keep`."""
        where = {session: (batch, row) for batch in self.batches for row, session in enumerate(batch.sessions)}
        continuing: dict[int, tuple[CachedBatch, list[int], list[int]]] = {}
        fresh: list[int] = []
        for index, (prompt, session) in enumerate(zip(prompts, sessions)):
            found = where.get(session)
            if found is not None and found[0].continues(found[1], prompt):
                batch, row = found
                entry = continuing.setdefault(id(batch), (batch, [], []))
                entry[1].append(index)
                entry[2].append(row)
            else:
                fresh.append(index)
        self.batches = []
        plan: list[tuple[CachedBatch | None, list[int], list[int]]] = list(continuing.values())
        plan += [(None, fresh[start : start + batch_size], []) for start in range(0, len(fresh), batch_size)]
        return plan

    def keep(self, batch: CachedBatch) -> None:
        """Hold ``batch`` for the sessions' next turn."""
        self.batches.append(batch)

    def clear(self) -> None:
        """Release every cache (the trajectories ended)."""
        self.batches = []
