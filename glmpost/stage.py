"""What every stage's output shares, on the library side: ``stage.json`` (the effective options an
output was made with), crash-safe JSON files, ``metrics.jsonl``, and logs on stderr (stdout carries
results)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from glmpost import __version__
from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.formats import ShardError, ShardReader
from glmpost.fsutil import write_text_atomic
from glmpost.trackers import track


def recorded_options(values: dict[str, Any], *, leave_out: tuple[str, ...]) -> dict[str, Any]:
    """``values`` as options stage.json and shard headers record (JSON-safe: paths as strings), but
    those named in ``leave_out``."""
    options = {}
    for name, value in values.items():
        if name in leave_out:
            continue
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, (list, tuple)):
            value = [str(v) if isinstance(v, Path) else v for v in value]
        options[name] = value
    return options


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temporary name, fsync, rename: readers never see half a file."""
    write_text_atomic(Path(path), json.dumps(payload, indent=2, sort_keys=True) + "\n")


def write_stage_json(out_dir: Path, stage: str, options: dict[str, Any], **extra: Any) -> None:
    payload = {"stage": stage, "glmpost_version": __version__, "options": options, **extra}
    write_json_atomic(Path(out_dir) / "stage.json", payload)


def check_same_options(
    out_dir: Path,
    stage: str,
    options: dict[str, Any],
    *,
    ignore: tuple[str, ...],
    overwrite: bool,
    facts: dict[str, Any] | None = None,
) -> None:
    """Refuse to add shards to ``out_dir`` that an earlier run made with other options.

    Stages that several tasks write into one directory (``--shard-index``) resume by writing only
    missing shards; that is only sound when every shard comes from the same options. The refusal
    names the option's field (a command says its flag: :class:`~glmpost.config.ConfigError`).
    """
    path = Path(out_dir) / "stage.json"
    if overwrite or not path.is_file():
        return
    try:
        before = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ConfigError("{path}: invalid JSON; pass {overwrite} to start this output over", path=path, exit_code=1) from None
    if before.get("stage") != stage:
        raise ConfigError("{out} {out_dir} holds output of `glmpost {earlier}`, not {stage}",
                          out_dir=out_dir, earlier=before.get("stage"), stage=stage)
    for key, value in (facts or {}).items():  # e.g. the policy version a checkpoint root resolved to
        if key in before and before[key] != value:
            raise ConfigError("{out} {out_dir} was written with {key} {before!r}, now {now!r}; use another {out} or pass {overwrite}",
                              out_dir=out_dir, key=key, before=before[key], now=value)
    earlier = before.get("options", {})
    for key, value in options.items():
        if key in ignore or key not in earlier:
            continue
        if earlier[key] != value:
            raise ConfigError("{out} {out_dir} was written with {%s} {before!r}, now {now!r}; use another {out} or pass {overwrite}" % key,
                              out_dir=out_dir, before=earlier[key], now=value)


def shard_outputs(paths: list[Path], out: Path, *, what: str) -> dict[Path, Path]:
    """``out/NAME`` for each input shard of a stage that writes one output per input (judge,
    score-teacher); two inputs with one name, or an output that is an input, are refused.
    ``what`` names the outputs in the message (``judged shards``)."""
    targets: dict[Path, Path] = {}
    by_name: dict[str, Path] = {}
    for path in paths:
        if path.name in by_name:
            raise UsageError(f"input shards {by_name[path.name]} and {path} share the file name {path.name}; outputs keep input names")
        by_name[path.name] = path
        target = out / path.name
        if target.resolve() == path.resolve():
            raise ConfigError("{out} {out_dir} holds the input {path}; {what} must not replace their inputs",
                              out_dir=out, path=path, what=what)
        targets[path] = target
    if out.exists() and not out.is_dir():
        raise ConfigError("{out} {out_dir} exists and is not a directory", out_dir=out)
    return targets


def complete_shard(target: Path, stage: str, *, redo: str) -> bool:
    """Whether ``target`` is a complete shard written by ``stage`` (read through, checksums verified);
    when it is not, says why it will be redone (``redo``: ``judging again``)."""

    if not target.exists():
        return False
    try:
        reader = ShardReader(target)
        for _ in reader:
            pass
    except ShardError as exc:
        log(f"{redo}: {exc}")
        return False
    if reader.header["stage"] != stage:
        log(f"{redo}: {target} was written by {reader.header['stage']!r}, not {stage!r}")
        return False
    return True


class MetricsWriter:
    """Append one JSON object per line to ``DIR/metrics.jsonl`` (stable key names, flushed per line),
    then hand it to the stage's trackers (:mod:`glmpost.trackers`; the file is written first)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "a")

    def write(self, **metrics: Any) -> None:
        row = {"time": round(time.time(), 3), **metrics}
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        self._f.flush()
        track(row)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def log(message: str) -> None:
    """Progress and logs go to stderr; stdout is for results."""
    sys.stderr.write(f"glmpost: {message}\n")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[dict[str, Any]]:
    """For a long-running stage: SIGTERM and SIGINT set ``flags["signal"]`` (its name) instead of
    killing, so the stage stops where it is safe to; the handlers are restored after the block."""
    import signal

    flags: dict[str, Any] = {"signal": None}
    names = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
    previous = {sig: signal.signal(sig, lambda s, f: flags.update(signal=names[s])) for sig in names}
    try:
        yield flags
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
