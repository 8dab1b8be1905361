"""What every training run does around its :class:`~glmpost.rl.run.TrainingCore`: refuse options that
cannot work before touching the output, hold the output root while it runs (rank 0: the root's lock for
all ranks, and a ``LATEST`` a crash left behind moved to the newest version), and close the core
before letting the root go. :class:`HeldRun` is that frame; :class:`~glmpost.rl.run_once.RunOnce` and
:class:`~glmpost.rl.follow_session.FollowSession` each say only which core they open.
"""

from __future__ import annotations

import abc
import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from glmpost.checkpoints import LATEST, CheckpointRoot, NextVersion, model_folder_problem, version_dir_name
from glmpost.config import ConfigError
from glmpost.locks import output_lock
from glmpost.rl.distributed import TrainingSession
from glmpost.rl.run import RunOptions, TrainingCore
from glmpost.stage import log


def check_run_options(out: Path, options: RunOptions) -> None:
    """What a run refuses before it touches ``out``: both ``resume`` and ``overwrite``, and an output
    that cannot be a checkpoint root."""
    if options.resume and options.overwrite:
        raise ConfigError("{resume} continues an interrupted run and {overwrite} starts it over: give one of them")
    problem = model_folder_problem(out)
    if problem:
        raise ConfigError("{out} {path} {problem}", path=out, problem=problem)


@contextlib.contextmanager
def hold_root(out: Path, stage: str) -> Iterator[None]:
    """The output root held for a run: rank 0 holds its lock for all ranks (one writer per root) and
    first moves a ``LATEST`` a crash left behind to the newest published version."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    with output_lock(out, stage=stage):
        repaired = CheckpointRoot(out).repair_latest()
        if repaired is not None:
            log(f"{out}: {LATEST} named {repaired[0] or 'nothing'}, but {version_dir_name(repaired[1])} was published; moved it")
        yield


class HeldRun(abc.ABC):
    """``with`` a run: the root held (:func:`hold_root`) and the core :meth:`open_core` plans, closed
    on the way out whatever happened."""

    def __init__(self, checkpoint: Path | str, out: Path | str, options: RunOptions, *, stage: str):
        self.checkpoint, self.out, self.options, self.stage = checkpoint, Path(out), options, stage
        check_run_options(self.out, options)
        self.core: TrainingCore | None = None
        self._held = contextlib.ExitStack()

    @abc.abstractmethod
    def open_core(self) -> TrainingCore:
        """The core this run trains on, planned once the root is held (each kind of run says which)."""

    def __enter__(self):
        with contextlib.ExitStack() as held:
            held.enter_context(hold_root(self.out, self.stage))
            self.core = self.open_core()
            self._held = held.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.core is not None:
                self.core.close()
        finally:
            self._held.__exit__(*exc)  # the root's lock sees what ended the run (a full disk: named)

    @property
    def plan(self) -> NextVersion:
        return self.core.plan

    @property
    def parent(self) -> Path:
        return self.core.parent

    def load(self, checkpoint: Path, session: TrainingSession, *, trained: bool = True):
        return self.core.load(checkpoint, session, trained=trained)
