"""``rollout --follow SPOOL``: keep sampling and publish each part into a spool as soon as it is
complete (asynchronous RL, formats/SPEC.md §12; brief: "一旦训练与推理解耦，吞吐变高，却又出现 policy
lag" — every record carries the version that produced each action token, the trainer decides).

Round after round the prompts of this task (``--shard-index`` of ``--num-shards``) are sampled
again, round ``r`` with seed ``--seed + r`` (so ids, ``PROMPT@vVERSIONsSEED/SAMPLE``, never repeat).
Each part of ``--prompts-per-shard`` prompts is published as ``PRODUCER-rROUND-pPART.msgpack.zst``
the moment its groups are complete: no barrier across parts, a group whole in one shard (group
size 1 for SAO / OPD: one trajectory per prompt). Before each part, and with the local engine
before each turn of a multi-turn part, the engine switches to the newest version of
``--reload-root`` (the trainer's ``--out``; by default ``--checkpoint`` when it is a root) if it
moved; each action token carries the version that sampled it, so a trajectory may span versions.
Trajectories in flight at a switch either drop their KV caches, the next turn prefilling the
history under the new weights (``--kv-on-switch recompute``), or keep them (``keep``: faster, and
the turns that attended to the old weights' keys and values are listed in the record's
``extra.kv_cache.stale_turns``; ``diff-logprobs`` reports their mismatch apart). The record's
``policy_version`` (and group id) is the version its part started with.

A restart skips every part the spool already holds (in any area), so a crash loses at most the part
being sampled (never visible: shards publish atomically). SIGTERM / SIGINT stop after the part in
progress; ``--max-rounds`` stops after that many rounds. Either way the rollout then closes its
stream in the spool (end of stream, formats/SPEC.md §12): the followers downstream stop once they
have taken everything; a restart opens it again. ``--max-queued N`` waits before a part
while N shards are published and not yet consumed (here and in the ``--queue`` spools
downstream): a producer-side bound on staleness (AReaL's ``max_head_offpolicyness`` plays this
role), the time waited is the rollout's idle fraction. With servers, ``--max-server-lag N`` waits
before a part while a server samples a version more than N behind ``--reload-root``'s LATEST (until
sync-weights moves it): the rollout then never samples records a trainer's ``--max-staleness``
would drop for the servers' lag (the metric ``rollout/server_lag``). Metrics and stage.json go to
``SPOOL/producers/PRODUCER/``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from itertools import count
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from glmpost.checkpoints import LATEST, CheckpointRoot
from glmpost.config import ConfigError, setting
from glmpost.formats.schema import UNKNOWN_VERSION
from glmpost.locks import output_lock
from glmpost.npu import resolve_device
from glmpost.rollout.parts import STAGE, shard_metrics, task_parts
from glmpost.rollout.policy import PolicyCheckpoint
from glmpost.rollout.refill import refill_metrics
from glmpost.rollout.runner import RolloutRunner
from glmpost.rollout.settings import RolloutConfig
from glmpost.spool.spool import Spool
from glmpost.stage import MetricsWriter, log, stop_on_signals, write_stage_json


@dataclass
class RolloutFollowConfig:
    """The options ``rollout --follow`` adds."""

    follow: Optional[Path] = setting(
        None, "Publish into this spool, round after round, each part the moment it is complete (asynchronous RL) "
        "instead of writing --out once (formats/SPEC.md §12).")
    producer: Optional[str] = setting(None, "This rollout's name in the spool's shard names (default: one derived "
                                      "from --checkpoint and --shard-index, stable across restarts).")
    reload_root: Optional[Path] = setting(
        None, "With --follow: the checkpoint root whose LATEST the engine switches to between parts (the trainer's "
        "--out); default: --checkpoint when it is a root.")
    max_rounds: Optional[int] = setting(None, "With --follow: stop after this many rounds over the prompts (default: until stopped).", min=1)
    max_queued: Optional[int] = setting(
        None, "With --follow: wait before a part while this many shards are published but not yet consumed (in the spool "
        "and the --queue spools): bounds how many versions old a trajectory is when it is trained (default: no bound).", min=1)
    max_server_lag: Optional[int] = setting(
        None, "With --follow and --server: before each part, wait while a server samples a version more than this many "
        "behind --reload-root's LATEST (or one it cannot tell), until sync-weights moves it: records are then never "
        "sampled further behind than this, so a trainer's --max-staleness drops none for server lag (default: no wait).",
        min=0)
    queue: list[Path] = setting([], "With --max-queued: further spools whose waiting shards count (downstream ones, e.g. the "
                                "judged spool the trainer consumes). Repeatable.")
    kv_on_switch: str = setting(
        "recompute", "With --follow, multi-turn, local engine: at a weight switch between turns, recompute the trajectories' "
        "KV caches under the new weights (recompute) or keep the old weights' caches and record the turns that used them "
        "(keep: extra.kv_cache.stale_turns).")

    def check(self) -> None:
        if self.kv_on_switch not in KV_ON_SWITCH:
            raise ConfigError("{kv_on_switch} must be one of {choices}, got {value!r}", choices=", ".join(KV_ON_SWITCH),
                              value=self.kv_on_switch)


KV_ON_SWITCH = ("recompute", "keep")


def default_producer(checkpoint: Path, shard_index: int) -> str:
    digest = hashlib.blake2b(str(Path(checkpoint).resolve()).encode(), digest_size=4).hexdigest()
    return f"rollout-{digest}-t{shard_index}"


def _queued(spools: list[Spool]) -> int:
    """Shards published and not yet consumed, over ``spools``."""
    total = 0
    for spool in spools:
        depth = spool.depth()
        total += depth.ready + depth.claimed
    return total


def _behind(servers: list[str], versions: list[int], newest: int, lag: int) -> list[tuple[str, int]]:
    """The servers (with their versions) that sample more than ``lag`` versions before ``newest``, or an unknown one."""
    return [(url, v) for url, v in zip(servers, versions) if v == UNKNOWN_VERSION or newest - v > lag]


class _Producer:
    """One ``rollout --follow`` run: the runner (its engine following the newest version), the spool
    it publishes into, and what it has done so far."""

    def __init__(self, config: RolloutConfig, follow: RolloutFollowConfig, *, options: dict[str, Any]):
        follow.check()
        self.config, self.follow = config, follow
        self.params = config.sampling_params()  # each round's: with its seed (prepared by the runner)
        device = resolve_device(config.device)
        checkpoint = PolicyCheckpoint.open(config.checkpoint)
        self.spool = Spool(follow.follow, tokenizer_revision=checkpoint.revision)
        self.name = follow.producer or default_producer(config.checkpoint, config.shard_index)
        reload_root = follow.reload_root or (config.checkpoint if (Path(config.checkpoint) / LATEST).is_file() else None)
        self.runner = RolloutRunner(config, options=options)
        prompts = self.runner.open(checkpoint)
        self.home = self.spool.open_producer(self.name)
        cut, mine = task_parts(prompts, config)
        self.parts = [(index, cut[index]) for index in mine]
        write_stage_json(self.home, STAGE, options, producer=self.name, spool=str(self.spool.path))
        self.watched = [self.spool] + [Spool(path, tokenizer_revision=checkpoint.revision) for path in follow.queue]
        self.runner.open_engine(checkpoint, device)
        self.runner.follow_weights(reload_root, keep_cache=follow.kv_on_switch == "keep", label=self.name)
        self.published, self.versions, self.rounds = 0, set(), 0
        self.waited, self.started = 0.0, time.monotonic()
        self.server_lag = 0  # versions the furthest server was behind LATEST before the last part (--max-server-lag)

    def idle_fraction(self) -> float:
        return round(self.waited / max(time.monotonic() - self.started, 1e-9), 4)

    def wait_for_room(self, stop: dict) -> None:
        """Backpressure: wait while ``--max-queued`` shards are published and not yet consumed."""
        while (self.follow.max_queued is not None and stop["signal"] is None
               and _queued(self.watched) >= self.follow.max_queued):
            time.sleep(0.1)
            self.waited += 0.1

    def switch_within_lag(self, stop: dict) -> None:
        """Switch to the newest version, then with ``--max-server-lag N`` wait (polling, counted as idle)
        while a server samples a version more than N behind it, or one it cannot tell: sync-weights
        moves the servers. The log says which servers it waits for, each time that changes."""
        self.runner.switch_to_newest()
        lag = self.follow.max_server_lag
        if lag is None or self.runner.following is None:
            return
        said = None
        while stop["signal"] is None:
            newest = CheckpointRoot(self.runner.following.root).latest()
            newest = self.runner.checkpoint.policy_version if newest is None else newest
            versions = self.runner.sampling_versions()
            behind = _behind(self.servers(), versions, newest, lag)
            self.server_lag = max((newest - v for v in versions if v != UNKNOWN_VERSION), default=0)
            if not behind:
                return
            if behind != said:
                shown = ", ".join(f"{url} at {'an unknown version' if v == UNKNOWN_VERSION else f'v{v}'}" for url, v in behind)
                log(f"{self.name}: waiting for the servers to sample v{newest - lag} or newer (--max-server-lag {lag}): "
                    f"{shown}; sync-weights moves them")
                said = behind
            time.sleep(0.5)
            self.waited += 0.5
            self.runner.switch_to_newest()

    def servers(self) -> list[str]:
        """The URL of each server sampling (one name for the local engine)."""
        pool = getattr(self.runner.backend, "pool", None)
        return [client.url for client in pool.clients] if pool is not None else ["the local engine"]

    def publish_part(self, name: str, part: list, progress: tqdm) -> dict[str, Any]:
        """Sample ``part`` and publish it as the shard ``name``; returns its metrics line."""
        checkpoint, started = self.runner.checkpoint, time.perf_counter()
        progress.total = (progress.total or 0) + len(part) * self.config.group_size
        samples = self.runner.generate(part, progress)
        self.runner.write_part(self.spool.publish_path(name), samples, checkpoint)
        completions = [s.outcome[0] for s in samples if s.outcome[0] is not None]
        aborted = sum(s.status() == "aborted" for s in samples)
        self.published += 1
        self.versions.update({checkpoint.policy_version, self.runner.checkpoint.policy_version})
        return {**shard_metrics(name, completions, aborted=aborted, seconds=time.perf_counter() - started,
                                policy_version=checkpoint.policy_version),
                **refill_metrics(samples), "rollout/queue_ready": self.spool.depth().ready,
                "rollout/switches_between_turns": self.runner.turn_switches, "rollout/queued": _queued(self.watched),
                "rollout/idle_fraction": self.idle_fraction(), "rollout/server_lag": self.server_lag}

    def run(self, stop: dict) -> None:
        """Round after round over this task's parts until stopped (module doc)."""
        held = self.spool.names()
        progress = tqdm(desc="rollout --follow", unit="seq", leave=False, disable=None)
        with MetricsWriter(self.home / "metrics.jsonl") as metrics, progress:
            for round_number in count():
                if stop["signal"] is not None or (self.follow.max_rounds is not None and round_number >= self.follow.max_rounds):
                    break
                self.runner.prepare(replace(self.params, seed=self.config.seed + round_number))
                for part_index, part in self.parts:
                    name = f"{self.name}-r{round_number:05d}-p{part_index:05d}.msgpack.zst"
                    if name in held:
                        continue
                    self.wait_for_room(stop)
                    if stop["signal"] is not None:
                        break
                    self.switch_within_lag(stop)
                    if stop["signal"] is not None:
                        break
                    metrics.write(**self.publish_part(name, part, progress))
                else:
                    self.rounds += 1

    def summary(self, stopped_by: str | None) -> dict[str, Any]:
        return {"spool": str(self.spool.path), "producer": self.name, "shards_published": self.published,
                "rounds": self.rounds, "policy_versions": sorted(self.versions),
                "policy_version": self.runner.checkpoint.policy_version, "switches_between_turns": self.runner.turn_switches,
                "idle_fraction": self.idle_fraction(), "stopped_by": stopped_by or "max_rounds"}


def follow_rollout(config: RolloutConfig, follow: RolloutFollowConfig, *, options: dict[str, Any]) -> dict[str, Any]:
    """Run the follow loop (module doc); returns the run's summary."""
    name = follow.producer or default_producer(config.checkpoint, config.shard_index)
    with output_lock(Path(follow.follow) / "producers" / name, stage=STAGE):
        producer = _Producer(config, follow, options=options)
        with stop_on_signals() as stop:
            try:
                producer.run(stop)
            finally:
                producer.runner.backend.close()
        producer.spool.close_producer(producer.name, reason=stop["signal"] or "max_rounds")  # after its last shard
    return producer.summary(stop["signal"])
