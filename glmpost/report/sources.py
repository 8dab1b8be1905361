"""What a report reads from a run directory: every ``metrics.jsonl`` under it, grouped into streams.

A *stream* is one line on each plot. A checkpoint root (a directory with ``LATEST``) is one: its
``metrics.jsonl`` holds the trainer's per-step history across versions (x: the optimizer step,
counted over the whole history), and with it go the rollout, judge and other output directories its
versions trained on (followed from each version's ``stage.json`` ``inputs``, then theirs: judged ->
rollout), whose lines are placed by policy version (rollout: ``rollout/policy_version``; judge: the
version of the rollout shard it judged; eval: ``policy_version``). An output no root trained on
goes with the root its stage.json ``checkpoint`` names (an eval of the policy); the rest form one
more stream (``other``). Left out: a root's version directories (their lines
are the root's), an eval's own rollout/ and judged/ (its metrics line says the result), an earlier
report, and hidden directories. A RUN_DIR that is a version directory is read as the steps of that version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from glmpost.errors import GlmpostError, UsageError, first_line

METRICS = "metrics.jsonl"
REPORT_STAGE = "report"
OTHER = "other"
LAG_PREFIX = "train/version_lag/"
# Derived per step from the train/version_lag/N record counts.
LAG_MEAN, LAG_MAX = "derived/version_lag_mean", "derived/version_lag_max"


@dataclass
class Stream:
    """One line on each plot (module doc)."""

    label: str
    steps: list[dict[str, Any]] = field(default_factory=list)  # a root's history, in order
    by_version: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # output lines by policy version


@dataclass
class Run:
    """One RUN_DIR: its name, streams, and what was read."""

    name: str
    path: Path
    streams: list[Stream]
    metrics_files: list[Path]
    stage_files: list[Path]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every line of a ``metrics.jsonl`` (blank lines skipped); a line that is not a JSON object is an
    error naming the file and line."""
    lines = []
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise GlmpostError(f"{path}:{number}: malformed metrics line: {first_line(exc)}") from None
            if not isinstance(line, dict):
                raise GlmpostError(f"{path}:{number}: malformed metrics line: a JSON {type(line).__name__}, not an object")
            lines.append(line)
    return lines


def stage_of(directory: Path) -> dict[str, Any]:
    """``directory/stage.json`` as a dict ({} when there is none or it is not JSON)."""
    try:
        payload = json.loads((directory / "stage.json").read_text())
    except (OSError, ValueError):
        return {}
    return payload if isinstance(payload, dict) else {}


def _is_root(directory: Path) -> bool:
    return (directory / "LATEST").is_file()


def _skipped(directory: Path, top: Path, out: Path | None, versions: bool) -> bool:
    """Whether files in ``directory`` are left out (module doc; ``versions``: a root's version directories are not)."""
    relative = directory.relative_to(top)
    if any(part.startswith(".") for part in relative.parts):
        return True
    if out is not None and (directory == out or out in directory.parents):
        return True
    for ancestor in [directory, *directory.parents]:
        stage = stage_of(ancestor).get("stage")
        if stage == REPORT_STAGE:
            return True
        if ancestor != directory and (stage == "eval" or (not versions and ancestor == directory.parent and _is_root(ancestor))):
            return True
        if ancestor == top:
            break
    return False


def found_files(top: Path, name: str, out: Path | None, *, versions: bool = False) -> list[Path]:
    """Every ``name`` under ``top`` that is not left out, sorted."""
    return sorted(p for p in top.rglob(name) if p.is_file() and not _skipped(p.parent, top, out, versions))


def _input_dirs(directory: Path) -> Iterator[Path]:
    """The directories a stage output was made from (its stage.json ``inputs``: directories or shards)."""
    for item in stage_of(directory).get("options", {}).get("inputs") or []:
        path = Path(str(item))
        if path.is_file():
            path = path.parent
        if path.is_dir():
            yield path.resolve()


def trained_on(roots: list[Path]) -> dict[Path, Path]:
    """Output directory -> the root whose versions trained on it (directly or through a judge)."""
    owner: dict[Path, Path] = {}
    for root in roots:
        frontier = [d for version in sorted(root.glob("v[0-9]*")) for d in _input_dirs(version)]
        for _ in range(4):  # train <- judged <- (scored) <- rollout
            frontier = [d for d in frontier if d not in owner]
            for directory in frontier:
                owner[directory] = root
            frontier = [d for directory in frontier for d in _input_dirs(directory)]
    return owner


def checkpoint_root(directory: Path, roots: list[Path]) -> Path | None:
    """The root (of ``roots``) whose policy made the output ``directory`` (its stage.json ``checkpoint``:
    the root or one of its versions; ``eval --follow``'s ``follow``: the root), if any."""
    options = stage_of(directory).get("options", {})
    checkpoint = options.get("checkpoint") or options.get("follow")
    if not checkpoint:
        return None
    path = Path(str(checkpoint)).resolve()
    return next((root for root in roots if root in (path, path.parent)), None)


def with_lag(line: dict[str, Any]) -> dict[str, Any]:
    """A trainer line with the mean and max version lag of its records (from ``train/version_lag/N``)."""
    lags = {int(key[len(LAG_PREFIX):]): n for key, n in line.items()
            if key.startswith(LAG_PREFIX) and key[len(LAG_PREFIX):].isdigit() and isinstance(n, (int, float))}
    if lags and sum(lags.values()) > 0:
        line = {**line, LAG_MEAN: sum(lag * n for lag, n in lags.items()) / sum(lags.values()),
                LAG_MAX: max(lag for lag, n in lags.items() if n > 0)}
    return line


class VersionOf:
    """The policy version of an output line (module doc); judge lines through the rollout shard they judged."""

    def __init__(self) -> None:
        self.rollouts: dict[Path, dict[str, Any]] = {}

    def __call__(self, line: dict[str, Any]) -> int | None:
        for key in ("rollout/policy_version", "policy_version"):
            if isinstance(line.get(key), int):
                return line[key]
        if "input" not in line:
            return None
        shard = Path(str(line["input"]))
        lines = self.rollouts.get(shard.parent)
        if lines is None:
            metrics = shard.parent / METRICS
            lines = {str(x.get("shard")): x for x in read_metrics(metrics)} if metrics.is_file() else {}
            self.rollouts[shard.parent] = lines
        version = lines.get(shard.name, {}).get("rollout/policy_version")
        return version if isinstance(version, int) else None


def load_run(path: Path, name: str, out: Path | None) -> Run:
    """Read the run directory ``path`` (module doc); a missing directory or one without metrics is an error."""
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise UsageError(f"run directory {path} {problem}")
    top = path.resolve()
    files = found_files(top, METRICS, out)
    if not files:
        raise UsageError(f"run directory {path} holds no {METRICS} (not a glmpost output directory)")
    roots = [f.parent for f in files if _is_root(f.parent)]
    owner = trained_on(roots)
    streams = {root: Stream(str(root.relative_to(top)) if root != top else root.name) for root in roots}
    other = Stream(OTHER)
    version_of = VersionOf()
    for metrics in files:
        lines = read_metrics(metrics)
        if metrics.parent in streams or _is_root(metrics.parent.parent):  # a version directory read alone: its steps
            streams.setdefault(metrics.parent, Stream(metrics.parent.name)).steps.extend(with_lag(line) for line in lines)
            continue
        stream = streams.get(owner.get(metrics.parent) or checkpoint_root(metrics.parent, roots), other)
        for line in lines:
            version = version_of(line)
            if version is not None:
                stream.by_version.setdefault(version, []).append(line)
    kept = [s for s in [*streams.values(), other] if s.steps or s.by_version]
    for stream in kept:
        stream.label = name if len(kept) == 1 else f"{name}: {stream.label}"
    return Run(name, path, kept, files, found_files(top, "stage.json", out, versions=True))


def run_names(paths: list[Path], names: list[str]) -> list[str]:
    """Each run's name: the one given, else its directory's name (made unique with its parent's)."""
    chosen = list(names) + [p.resolve().name or str(p) for p in paths[len(names):]]
    for index, path in enumerate(paths):
        if index >= len(names) and chosen.count(chosen[index]) > 1:
            chosen[index] = "/".join(path.resolve().parts[-2:])
    seen: dict[str, int] = {}
    for index, name in enumerate(chosen):
        seen[name] = seen.get(name, 0) + 1
        if chosen.count(name) > 1:
            chosen[index] = f"{name} #{seen[name]}"
    return chosen
