"""The stage protocol of the stages that make one output shard of each input shard (``judge``,
``score-teacher``), and the two drivers that run any of them.

A :class:`ShardStage` knows its own work and nothing of where shards come from::

    check(shard) -> records        read one input through before anything is written
    open()                          load what processing needs (models, servers), once
    process(shard, target, progress) -> metrics   write ``target`` atomically
    close()                         release it; summary() -> the run's totals

:func:`run_shards` runs it once over input shards (this task's share, ``--shard-index`` of
``--num-shards``): every pending input is checked before the stage opens; an output that is
already complete is kept (same options; other options: exit 2 naming the option; ``--overwrite``
redoes it); ``stage.json`` and one ``metrics.jsonl`` line per shard go to ``--out``.

:func:`follow_shards` runs it between two spools (``--follow IN --out OUT``, formats/SPEC.md §12):
each shard of ``IN`` as it lands, published into ``OUT`` under the same name, then committed in
``IN``. The output shard's name is the commit record: a restart that finds a claimed shard already
in ``OUT`` commits it without processing it again. It stops when ``IN`` has ended (every producer
closed its stream and nothing is left: it then closes its own stream in ``OUT``); SIGTERM / SIGINT
stop it after the shard in progress; ``--idle-timeout`` after that long without one (a safety net):
the claim loop every spool consumer shares, :class:`~glmpost.spool.claims.Claims`. Metrics and
stage.json go to ``OUT/producers/CONSUMER/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from glmpost.formats import ShardReader, resolve_shard_paths, select_shards
from glmpost.formats.shards import remove_partial_shards
from glmpost.locks import output_lock
from glmpost.spool.claims import Claims, Stop
from glmpost.spool.settings import FollowSettings, default_consumer
from glmpost.spool.spool import Spool
from glmpost.stage import MetricsWriter, check_same_options, complete_shard, log, shard_outputs, write_stage_json


class ShardStage(Protocol):
    """A stage whose unit of work is one input shard (module doc)."""

    name: str  # the stage, as stage.json and the shard headers say it (``judge``)
    options: dict[str, Any]  # its effective options (stage.json, shard headers)
    per_task_options: tuple[str, ...]  # options that may differ between the tasks writing one output
    outputs: str  # what its output shards are, for messages (``judged shards``)
    redo: str  # what redoing a shard is called (``judging again``)

    def check(self, shard: Path) -> int:
        """Read ``shard`` through (fields, tokenizer revision, routes); returns its record count."""

    def open(self) -> dict[str, Any]:
        """Load what processing needs; returns the facts stage.json records beside the options."""

    def process(self, shard: Path, target: Path, progress: tqdm) -> dict[str, Any]:
        """Write the output of ``shard`` to ``target`` atomically; returns its metrics line."""

    def close(self) -> None:
        """Release what :meth:`open` took (servers, pools)."""

    def summary(self) -> dict[str, Any]:
        """The totals of every shard processed so far."""

    def spool_revision(self, spool: Path) -> str:
        """The tokenizer revision of the records of the input spool ``spool``."""


def run_shards(stage: ShardStage, *, inputs: list[str], out: Path, shard_index: int, num_shards: int,
               overwrite: bool) -> dict[str, Any]:
    """Run ``stage`` once over this task's input shards (module doc); returns the run's summary."""
    out = Path(out)
    paths = select_shards(resolve_shard_paths(inputs), shard_index, num_shards)
    targets = shard_outputs(paths, out, what=stage.outputs)
    with output_lock(out, stage=stage.name, task=(shard_index, num_shards)):
        check_same_options(out, stage.name, stage.options, ignore=stage.per_task_options, overwrite=overwrite)
        remove_partial_shards(targets.values())
        pending = [p for p in paths if overwrite or not complete_shard(targets[p], stage.name, redo=stage.redo)]
        counts = [stage.check(path) for path in pending]
        if pending:
            _process_all(stage, pending, targets, out, counts)
    if len(paths) > len(pending):
        log(f"kept {len(paths) - len(pending)} complete output shard(s) in {out} (--overwrite redoes them)")
    if not paths:
        log(f"--shard-index {shard_index} of --num-shards {num_shards} selects no input shard; nothing to do")
    return {"out": str(out), "shards": len(pending), "skipped": len(paths) - len(pending), **stage.summary()}


def _process_all(stage: ShardStage, pending: list[Path], targets: dict[Path, Path], out: Path, counts: list[int]) -> None:
    """Open the stage, process every pending shard into its target, close it."""
    facts = stage.open()
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_stage_json(out, stage.name, stage.options, **facts)
        progress = tqdm(total=sum(counts), desc=stage.name, unit="rec", leave=False, disable=None)
        with MetricsWriter(out / "metrics.jsonl") as metrics, progress:
            for path in pending:
                metrics.write(shard=targets[path].name, input=str(path), **stage.process(path, targets[path], progress))
    finally:
        stage.close()


def follow_line(summary: dict[str, Any], verb: str) -> str:
    """The human line of a follow run (``verb``: what the stage did to each shard)."""
    return f"{summary['out']}: {summary['shards']} shard(s) {verb} from {summary['spool']}, stopped by {summary['stopped_by']}"


def follow_shards(stage: ShardStage, settings: FollowSettings, *, out: Path) -> dict[str, Any]:
    """Run ``stage`` between the spools ``settings.follow`` and ``out`` (module doc); returns the run's
    summary. The stage opens after the first shard is checked."""
    revision = stage.spool_revision(Path(settings.follow))
    source, target = Spool(settings.follow, tokenizer_revision=revision), Spool(out, tokenizer_revision=revision)
    consumer = settings.consumer or default_consumer(stage.name, target.path)
    home = target.producer_home(consumer)
    # One process per consumer name: its output home, and its claims in the input spool.
    with output_lock(home, stage=stage.name), Claims(source, consumer, settings, stage=stage.name) as claims:
        summary = _follow(stage, claims, target, target.open_producer(consumer), revision)
        if summary["stopped_by"] == Stop.END_OF_STREAM.value:  # its input ended: so does its output
            target.close_producer(consumer, reason="end_of_stream")
        return summary


def _follow(stage: ShardStage, claims: Claims, target: Spool, home: Path, revision: str) -> dict[str, Any]:
    """Each shard ``claims`` hands out, published into ``target`` and committed, until it stops."""
    source = claims.spool
    home.mkdir(parents=True, exist_ok=True)
    write_stage_json(home, stage.name, stage.options, tokenizer_revision=revision, spool=str(source.path))
    done, opened = 0, False
    progress = tqdm(desc=f"{stage.name} --follow", unit="rec", leave=False, disable=None)
    with MetricsWriter(home / "metrics.jsonl") as metrics, progress:
        try:
            while True:
                claimed = claims.claim()
                for shard in claimed.shards:
                    if shard.name not in target.names():  # else made before a crash: only the commit is left
                        progress.total = (progress.total or 0) + stage.check(shard)
                        if not opened:
                            stage.open()
                            opened = True
                        metrics.write(shard=shard.name, input=str(source.path),
                                      **stage.process(shard, target.publish_path(shard.name), progress))
                        done += 1
                    source.commit(claims.consumer, [shard], version=-1,
                                  ids={shard.name: [r["id"] for r in ShardReader(shard)]})
                if claimed.stop is not None:
                    break
        finally:
            if opened:
                stage.close()
    log(f"{target.path}: {done} shard(s) from {source.path}")
    return {"out": str(target.path), "spool": str(source.path), "consumer": claims.consumer, "shards": done,
            "stopped_by": claimed.stop.value, **stage.summary()}
