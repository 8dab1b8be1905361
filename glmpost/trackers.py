"""Experiment trackers: every ``metrics.jsonl`` line a stage writes also goes to TensorBoard, W&B,
MLflow or trackio (``--tracker``, repeatable), through the libraries themselves.

``metrics.jsonl`` stays the record: a line is written there first, then handed to the trackers, and
a tracker that fails (to start, or later) is said in one line on stderr and left out; the stage
goes on. A line's numbers (ints, floats, bools) are its scalars; strings and the wall-clock
``time`` are left out. The x-axis is a trainer's ``train/global_step`` (its optimizer steps across
the root's versions; a line without one after one, such as a closing or a follow summary line, goes
at the last step), else, in a follow mode (``--follow``), the line's policy version
(:data:`VERSION_KEYS`), else the line's index in this run. The stage's options are the run's config.

Everything is local unless the library's own environment says otherwise: TensorBoard event files
under ``DIR/tensorboard/RUN``, W&B in offline mode under ``DIR/wandb`` (``WANDB_MODE=online`` to
upload), MLflow's file store ``DIR/mlruns`` (``MLFLOW_TRACKING_URI`` to use a server), trackio's
SQLite store ``DIR/trackio`` (``TRACKIO_DIR`` wins). A run keeps its name across invocations (by
default the stage and the last two parts of its output path, so each ``train-grpo`` of one root
continues one run): W&B and trackio resume it, MLflow appends to the run of that name, TensorBoard
adds an event file to its directory.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

from glmpost.config import ConfigError, setting
from glmpost.errors import first_line

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
STEP_KEY = "train/global_step"  # a trainer's x-axis
VERSION_KEYS = ("follow/policy_version", "rollout/policy_version", "policy_version")  # a follow mode's
LEFT_OUT = ("time",)  # wall-clock seconds: every tracker stamps its own


@dataclass
class TrackerSettings:
    """Where a stage's metrics go besides ``metrics.jsonl`` (module doc)."""

    tracker: list[str] = setting(
        [], "Also send every metrics.jsonl line to this experiment tracker: tensorboard, wandb, mlflow or trackio "
        "(repeatable; pip install 'glmpost[trackers]'). Local by default: see --tracker-dir.",
        cli={"annotation": List[str], "metavar": "NAME"})
    tracker_dir: Path = setting(
        Path("glmpost-trackers"), "Local home of the trackers' files: DIR/tensorboard/RUN (event files), DIR/wandb "
        "(W&B offline runs; WANDB_MODE=online uploads), DIR/mlruns (MLflow's file store; MLFLOW_TRACKING_URI wins), "
        "DIR/trackio (TRACKIO_DIR wins).")
    tracker_project: str = setting("glmpost", "Project (W&B, trackio) or experiment (MLflow) the run belongs to.")
    tracker_run: Optional[str] = setting(
        None, "Run name in the trackers (default: the stage and the last two parts of its output path, so every "
        "train-grpo into one root continues one run).", cli={"metavar": "NAME"})

    def names(self) -> list[str]:
        """The trackers asked for, each once, in order; an unknown name is refused."""
        names: list[str] = []
        for name in self.tracker:
            if name not in TRACKERS:
                raise ConfigError("{tracker} {name!r} is not a tracker (known: {known})", name=name,
                                  known=", ".join(TRACKERS))
            if name not in names:
                names.append(name)
        return names


TRACKER_SETTINGS = tuple(f.name for f in dataclasses.fields(TrackerSettings))  # the options every tracked stage takes


def default_run_name(stage: str, out: Path | None) -> str:
    """``train-grpo quickstart/policy``: the stage and the last two parts of its output path."""
    if out is None:
        return stage
    parts = Path(os.path.abspath(out)).parts[-2:]
    return f"{stage} {'/'.join(parts)}"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line (bools as 0/1), without :data:`LEFT_OUT`."""
    return {key: float(value) for key, value in row.items()
            if key not in LEFT_OUT and isinstance(value, (int, float)) and not isinstance(value, complex)}


def number_at(row: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` the line holds as a finite number, as an int; else None."""
    for key in keys:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return int(value)
    return None


def flat_config(options: dict[str, Any], *, limit: int = 500) -> dict[str, str]:
    """Options as flat strings (MLflow params, TensorBoard text): lists and tables as their repr, cut at ``limit``."""
    return {key: str(value)[:limit] for key, value in options.items()}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """stdout carries results: what a tracker library prints goes to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


class Tracker(abc.ABC):
    """One tracker's run: ``log`` a line's scalars at a step, ``close`` (``failed``: the stage failed)."""

    name = ""

    @abc.abstractmethod
    def log(self, values: dict[str, float], step: int) -> None:
        """Record ``values`` at x-axis ``step``."""

    @abc.abstractmethod
    def close(self, failed: bool) -> None:
        """End the run (marked failed where the library has such a state)."""


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, settings: TrackerSettings, run: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # torch's writer; needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(Path(settings.tracker_dir) / "tensorboard" / safe_name(run)))
        self.writer.add_text("options", "\n".join(f"    {k} = {v}" for k, v in sorted(flat_config(config).items())))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, settings: TrackerSettings, run: str, config: dict[str, Any]):
        import wandb  # optional: glmpost[trackers]

        home = Path(settings.tracker_dir)
        home.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=settings.tracker_project, name=run, id=run_id(settings.tracker_project, run),
                              dir=str(home), mode=os.environ.get("WANDB_MODE", "offline"), config=config,
                              resume="allow", settings=wandb.Settings(quiet=True, console="off", x_disable_stats=True))

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, settings: TrackerSettings, run: str, config: dict[str, Any]):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local file store is the offline default
        from mlflow.tracking import MlflowClient  # optional: glmpost[trackers]

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(settings.tracker_dir) / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.tracker_project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(settings.tracker_project))
        earlier = self.client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{run}'",
                                          max_results=1)
        if earlier:
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run).info.run_id
            for key, value in flat_config(config).items():  # params are set once per run
                self.client.log_param(self.run_id, key, value)

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # optional: glmpost[trackers]; imported with the client

        stamp = _milliseconds()
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, stamp, step) for key, value in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class TrackioTracker(Tracker):
    name = "trackio"

    def __init__(self, settings: TrackerSettings, run: str, config: dict[str, Any]):
        os.environ.setdefault("TRACKIO_DIR", str((Path(settings.tracker_dir) / "trackio").resolve()))
        import trackio  # optional: glmpost[trackers]; reads TRACKIO_DIR when first imported

        self.trackio = trackio
        self.run = trackio.init(project=settings.tracker_project, name=run, config=config, resume="allow",
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.trackio.finish()  # the module's finish: its exit hook then has no run to finish again


BACKENDS: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                               "mlflow": MLflowTracker, "trackio": TrackioTracker}


def _milliseconds() -> int:
    return int(time.time() * 1000)


def safe_name(run: str) -> str:
    """A run name as one path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", run).strip("_") or "run"


def run_id(project: str, run: str) -> str:
    """A stable W&B run id for ``project``/``run``: the same name resumes the same run."""
    return hashlib.sha1(f"{project}\0{run}".encode()).hexdigest()[:16]


def missing_package(name: str) -> str | None:
    """The package tracker ``name`` needs when it is not installed, else None."""
    return None if importlib.util.find_spec(PACKAGES[name]) is not None else PACKAGES[name]


class TrackerSet:
    """The trackers of one stage run: each line's scalars to every tracker still working."""

    def __init__(self, trackers: list[Tracker], *, by_version: bool = False):
        self.trackers = trackers
        self.by_version = by_version  # a follow mode: lines without a step go at their policy version
        self.index = 0  # lines seen
        self.last_step: int | None = None  # the last train/global_step seen

    def step(self, row: dict[str, Any]) -> int:
        """The line's x-axis value (module doc)."""
        step = number_at(row, (STEP_KEY,))
        if step is not None:
            self.last_step = step
            return step
        if self.last_step is not None:
            return self.last_step
        version = number_at(row, VERSION_KEYS) if self.by_version else None
        return version if version is not None else self.index

    def log(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        step = self.step(row)
        self.index += 1
        if not values:
            return
        for tracker in list(self.trackers):
            try:
                with _quiet():
                    tracker.log(values, step)
            except Exception as exc:  # a failing tracker never stops the stage nor metrics.jsonl
                self._drop(tracker, f"failed ({first_line(exc)})")

    def close(self, failed: bool = False) -> None:
        for tracker in list(self.trackers):
            try:
                with _quiet():
                    tracker.close(failed)
            except Exception as exc:
                self._drop(tracker, f"failed to close ({first_line(exc)})")
        self.trackers = []

    def _drop(self, tracker: Tracker, why: str) -> None:
        _say(f"tracker {tracker.name} {why}; left out, metrics.jsonl is complete")
        self.trackers.remove(tracker)


_active: TrackerSet | None = None


def _say(message: str) -> None:
    """A log line on stderr, as :func:`glmpost.stage.log` writes it (that module hands lines to this one)."""
    sys.stderr.write(f"glmpost: {message}\n")


def track(row: dict[str, Any]) -> None:
    """Hand one metrics line to the active trackers (none: nothing happens)."""
    if _active is not None:
        _active.log(row)


def start(settings: TrackerSettings, *, run: str, config: dict[str, Any], by_version: bool = False) -> TrackerSet:
    """Start the trackers ``settings`` names (a missing package is refused before any work; one that
    fails to start is said in one line and left out) and make them the active set."""
    global _active
    names = settings.names()
    for name in names:
        package = missing_package(name)
        if package is not None:
            raise ConfigError("{tracker} %s needs the %s package: pip install 'glmpost[trackers]'" % (name, package))
    trackers: list[Tracker] = []
    for name in names:
        try:
            with _quiet():
                trackers.append(BACKENDS[name](settings, run, config))
        except Exception as exc:
            _say(f"tracker {name} failed to start ({first_line(exc)}); left out, metrics.jsonl is complete")
    _active = TrackerSet(trackers, by_version=by_version)
    return _active


def stop(failed: bool = False) -> None:
    """Close the active trackers (W&B and MLflow mark the run failed when ``failed``)."""
    global _active
    if _active is not None:
        _active.close(failed)
    _active = None


@contextlib.contextmanager
def tracking(settings: TrackerSettings, *, stage: str, out: Path | None, config: dict[str, Any],
             follow: bool = False) -> Iterator[None]:
    """The trackers of one stage run, on the process that writes metrics (rank 0 under a launcher);
    ``follow``: a follow mode (the policy version is the x-axis of lines without a step)."""
    if not settings.tracker or int(os.environ.get("RANK", "0")) != 0:
        settings.names()
        yield
        return
    start(settings, run=settings.tracker_run or default_run_name(stage, out), config=config, by_version=follow)
    failed = True
    try:
        yield
        failed = False
    finally:
        stop(failed)
