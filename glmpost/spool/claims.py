"""The claim loop of every stage that consumes a spool (formats/SPEC.md §12): ``judge`` and
``score-teacher`` (:func:`glmpost.drivers.follow_shards`) and the trainers
(:func:`glmpost.rl.follow.follow_spool`).

``with Claims(spool, consumer, settings, stage=...) as claims`` holds what consuming takes: the
consumer's lock in the spool (one process per consumer name), its lease renewed in the background
(a killed process stops renewing, so its claims go back), SIGTERM / SIGINT caught so the stage
stops where it is safe to; on the way out the claims not committed go back to ``ready/``.

:meth:`Claims.claim` hands out shards until they hold what the consumer wants: the consumer's own
claims first (held from before a restart), then new ones, one at a time, oldest first. It stops
short, and says why (a :class:`Stop`), on a signal, at the end of the stream (every producer closed
its stream and no shard is left) or after ``idle_timeout`` seconds without a shard (a safety net,
not the way a run ends); between empty tries it sleeps ``poll_s``.
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

from glmpost.locks import output_lock
from glmpost.spool.settings import FollowSettings
from glmpost.spool.spool import Spool, lease_kept
from glmpost.stage import log, stop_on_signals


class Stop(enum.Enum):
    """Why a consumer stopped (its summary's ``stopped_by`` is the value)."""

    END_OF_STREAM = "end_of_stream"  # every producer closed its stream and no shard is left
    IDLE = "idle"  # idle_timeout seconds without a shard
    SIGTERM = "SIGTERM"
    SIGINT = "SIGINT"
    MAX_STEPS = "max_steps"  # a trainer's --max-steps updates
    MAX_VERSIONS = "max_versions"  # a trainer's --max-versions versions


@dataclass(frozen=True)
class Claimed:
    """What one :meth:`Claims.claim` handed out, and why it stopped short of what was wanted (None:
    it did not)."""

    shards: list[Path]
    stop: Stop | None = None


class Claims:
    """A consumer's claims in a spool while the block runs (module doc). ``waited``: the seconds it
    has slept on an empty spool."""

    def __init__(self, spool: Spool, consumer: str, settings: FollowSettings, *, stage: str):
        self.spool, self.consumer, self.settings, self.stage = spool, consumer, settings, stage
        self.waited = 0.0
        self.last_shard = time.monotonic()
        self._signals: dict[str, Any] = {"signal": None}
        self._held = contextlib.ExitStack()

    def __enter__(self) -> "Claims":
        with contextlib.ExitStack() as held:
            held.enter_context(output_lock(self.spool.claimed_dir / self.consumer, stage=self.stage))
            self._signals = held.enter_context(stop_on_signals())
            held.enter_context(lease_kept(self.spool, self.consumer, self.settings.lease_s))
            self._held = held.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            released = self.spool.release(self.consumer)  # not committed: back to ready/ for anyone
            if released:
                log(f"{self.spool.path}: returned {released} unpublished claim(s) to ready/")
        finally:
            self._held.close()

    @property
    def signalled(self) -> Stop | None:
        """SIGTERM or SIGINT, once one was received."""
        name = self._signals["signal"]
        return None if name is None else Stop(name)

    def claim(self, want: int = 1, *, size: Callable[[Path], int] = lambda shard: 1, skip: Collection[str] = (),
              keep: Callable[[list[Path]], list[Path]] | None = None) -> Claimed:
        """Shards until their ``size`` adds up to ``want`` (default: one shard): this consumer's own
        claims first, but those ``skip`` names (claims it is still working on), then new ones;
        ``keep(new)`` leaves out new claims the consumer has done already (a commit a crash
        interrupted). Short of ``want`` on a signal, the end of the stream or idleness (module doc)."""
        shards, have = [], 0
        if self.signalled is not None:
            return Claimed(shards, self.signalled)
        for shard in self.spool.claimed(self.consumer):
            if shard.name not in skip and have < want:
                shards.append(shard)
                have += size(shard)
                self.last_shard = time.monotonic()
        while have < want:
            if self.signalled is not None:
                return Claimed(shards, self.signalled)
            new = self.spool.claim(self.consumer, limit=1, lease_s=self.settings.lease_s)
            new = keep(new) if new and keep is not None else new
            if new:
                shards += new
                have += sum(map(size, new))
                self.last_shard = time.monotonic()
                continue
            stop = self._idle_stop()
            if stop is not None:
                return Claimed(shards, stop)
            time.sleep(self.settings.poll_s)
            self.waited += self.settings.poll_s
        return Claimed(shards)

    def _idle_stop(self) -> Stop | None:
        """Why to stop when no shard is ready: the end of the stream, or idleness."""
        if self.spool.ended(self.consumer):
            return Stop.END_OF_STREAM
        timeout = self.settings.idle_timeout
        if timeout is not None and time.monotonic() - self.last_shard > timeout:
            return Stop.IDLE
        return None
