"""``glmpost eval --follow ROOT``: evaluate every version of a checkpoint root as it is published
(asynchronous RL's trainers publish while the rollouts go on; a held-out curve over versions).

    ROOT/vNNNNNN published (its manifest in place: publishing is an atomic move)
    -> OUT/vNNNNNN/ (rollout, judged, report.json, stage.json: one eval run, :func:`run_eval`)
    -> one OUT/metrics.jsonl line per version (``policy_version``, ``eval/...``; the trackers' x-axis)

Only versions whose number is a multiple of ``every`` are evaluated, oldest first. A version whose
OUT/vNNNNNN/stage.json exists was evaluated (a restart goes on after it). The root is looked at
every ``poll_s`` seconds; ``idle_timeout`` seconds without a version to evaluate end the run (0:
as soon as every published version is evaluated; None: never, until SIGTERM or SIGINT, which end
it between two versions).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from glmpost.checkpoints import CheckpointRoot, version_dir_name
from glmpost.config import ConfigError, setting
from glmpost.evaluation.run import PER_RUN_OPTIONS, STAGE, EvalConfig, describe_scores, run_eval
from glmpost.locks import output_lock
from glmpost.rollout.settings import RolloutConfig
from glmpost.stage import MetricsWriter, check_same_options, log, stop_on_signals, write_stage_json


@dataclass
class EvalFollowConfig:
    """Which versions of a root ``eval --follow`` evaluates, and how long it waits for them (module doc)."""

    follow: Optional[Path] = setting(
        None, "Evaluate every version of this checkpoint root as it is published (asynchronous RL), each into "
        "OUT/vNNNNNN/, one OUT/metrics.jsonl line per version; instead of --checkpoint.", cli={"metavar": "ROOT"})
    every: int = setting(1, "With --follow: evaluate only the versions whose number is a multiple of this.", min=1)
    poll_s: float = setting(5.0, "With --follow: seconds between looks at the root for a new version.", min=0.01)
    idle_timeout: Optional[float] = setting(
        None, "With --follow: stop after this many seconds without a version to evaluate (0: once every published "
        "version is evaluated; default: wait for ever, until SIGTERM or Ctrl-C).", min=0.0)


def pending_versions(root: CheckpointRoot, out: Path, every: int) -> list[int]:
    """The published versions of ``root`` to evaluate (multiples of ``every``) that OUT has no finished run of."""
    return [v for v in root.versions() if v % every == 0 and not (out / version_dir_name(v) / "stage.json").is_file()]


def follow_eval(config: EvalConfig, follow: EvalFollowConfig, sampling: RolloutConfig, *,
                options: dict[str, Any]) -> dict[str, Any]:
    """Evaluate the versions of ``follow.follow`` as they come (module doc); returns the summary:
    ``evaluated`` (this run's versions, in order) and ``reports`` (each version's overall metrics)."""
    root, out = CheckpointRoot(follow.follow), Path(config.out)
    if not root.path.is_dir():
        raise ConfigError("{follow} {path} is not a checkpoint root (no such directory)", path=root.path, exit_code=1)
    evaluated: list[int] = []
    reports: dict[str, Any] = {}
    out.mkdir(parents=True, exist_ok=True)
    with output_lock(out, stage=f"{STAGE} --follow"), stop_on_signals() as flags, \
            MetricsWriter(out / "metrics.jsonl") as metrics:
        check_same_options(out, STAGE, options, ignore=(*PER_RUN_OPTIONS, "every", "poll_s", "idle_timeout"),
                           overwrite=False)
        write_stage_json(out, STAGE, options, follow=str(root.path))
        idle_since = time.monotonic()
        while flags["signal"] is None:
            pending = pending_versions(root, out, follow.every)
            if not pending:
                if follow.idle_timeout is not None and time.monotonic() - idle_since >= follow.idle_timeout:
                    break
                time.sleep(follow.poll_s)
                continue
            version = pending[0]
            target = dataclasses.replace(config, checkpoint=root.version_dir(version), out=out / version_dir_name(version))
            summary = run_eval(target, sampling, options={**options, "checkpoint": str(target.checkpoint)},
                               metrics=metrics)
            evaluated.append(version)
            reports[version_dir_name(version)] = summary["report"]["overall"]
            log(f"evaluated {version_dir_name(version)}: "
                + describe_scores(summary["report"]["overall"], threshold=config.threshold))
            idle_since = time.monotonic()
    if flags["signal"] is not None:
        log(f"{flags['signal']}: stopped after {len(evaluated)} versions")
    return {"out": str(out), "root": str(root.path), "evaluated": evaluated, "reports": reports}
