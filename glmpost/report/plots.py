"""The report's curves: which metrics keys each plot draws, and the PNGs (matplotlib's Agg backend).

Trainer curves (a checkpoint root's history; x: the optimizer step over all its versions): reward,
trusted fraction (the IcePop / DIS mask's kept share of action tokens), version lag (mean and max
over the batch's records, from ``train/version_lag/N``), train / rollout log-prob mismatch
(``diagnostics = ["mismatch"]``), learning rate, the policy loss and the SFT loss (qat). Output
curves (x: the policy version that sampled, judged or was evaluated; several shards of one version
are averaged, weighted by records): response length (mean, min, max), judged reward, eval's avg@n,
pass@k, maj@n and mean verifier score. Every stream of every run is one colour on every plot;
several keys on one plot differ in line style and marker."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmpost.report.sources import LAG_MAX, LAG_MEAN, Stream

STEP, VERSION = "step", "version"
AXIS_LABELS = {STEP: "optimizer step (all versions)", VERSION: "policy version"}
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x")


@dataclass(frozen=True)
class Curve:
    key: str  # a metrics key, or a pattern (``eval/pass@*``) standing for every key it matches
    label: str
    how: str = "mean"  # several lines at one x (output curves): mean (weighted by records), min or max


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's name, without .png
    title: str
    axis: str
    ylabel: str
    curves: tuple[Curve, ...]


PLOTS = (
    Plot("reward", "Reward", STEP, "mean reward of the trained batch", (Curve("train/reward_mean", "reward"),)),
    Plot("trusted_fraction", "Trusted fraction (IcePop / DIS mask kept)", STEP, "trusted / action tokens",
         (Curve("train/trusted_fraction", "trusted fraction"),)),
    Plot("version_lag", "Version lag", STEP, "policy versions behind the trainer",
         (Curve(LAG_MEAN, "mean lag"), Curve(LAG_MAX, "max lag"))),
    Plot("mismatch", "Train / rollout log-prob mismatch", STEP, "on the same weights",
         (Curve("train/mismatch_abs_logp_mean", "mean |log p train - log p rollout|"),
          Curve("train/mismatch_k3_kl", "k3 KL(rollout || train)"))),
    Plot("lr", "Learning rate", STEP, "lr", (Curve("train/lr", "lr"), Curve("sft/lr", "SFT lr"))),
    Plot("loss", "Policy loss", STEP, "loss (train/loss)", (Curve("train/loss", "loss"),)),
    Plot("sft_loss", "SFT loss (qat)", STEP, "loss (sft/loss)", (Curve("sft/loss", "SFT loss"),)),
    Plot("response_length", "Response length", VERSION, "tokens",
         (Curve("rollout/response_length_mean", "mean"), Curve("rollout/response_length_max", "max", "max"),
          Curve("rollout/response_length_min", "min", "min"))),
    Plot("judged_reward", "Sampled reward (judge)", VERSION, "mean reward", (Curve("judge/reward_mean", "mean reward"),)),
    Plot("eval", "Evaluation (glmpost eval)", VERSION, "score",
         (Curve("eval/avg@*", "avg@n"), Curve("eval/pass@*", "pass@k"), Curve("eval/maj@*", "maj@n"),
          Curve("eval/score_mean", "mean verifier score"))),
)


@dataclass
class Drawn:
    """A plot as the page shows it: its file, the keys drawn, and each (stream label, key)'s last value."""

    plot: Plot
    file: str
    keys: list[str]
    finals: dict[tuple[str, str], float] = field(default_factory=dict)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _lines(stream: Stream, axis: str) -> list[dict[str, Any]]:
    return stream.steps if axis == STEP else [line for lines in stream.by_version.values() for line in lines]


def concrete_keys(plot: Plot, streams: list[Stream]) -> list[tuple[str, Curve]]:
    """The keys some stream has a number for, with their curve (a pattern's keys sorted)."""
    present = {key for stream in streams for line in _lines(stream, plot.axis) for key, v in line.items() if _number(v)}
    return [(key, curve) for curve in plot.curves for key in sorted(fnmatch.filter(present, curve.key))]


def _weight(line: dict[str, Any]) -> float:
    for key in ("rollout/records", "judge/records"):
        if _number(line.get(key)) and line[key] > 0:
            return float(line[key])
    return 1.0


def points(stream: Stream, axis: str, key: str, how: str) -> list[tuple[float, float]]:
    """The (x, y) of one key of one stream (module doc)."""
    if axis == STEP:
        return [(float(i), float(line[key])) for i, line in enumerate(stream.steps) if _number(line.get(key))]
    found = []
    for version in sorted(stream.by_version):
        values = [(float(line[key]), _weight(line)) for line in stream.by_version[version] if _number(line.get(key))]
        if not values:
            continue
        if how == "mean":
            y = sum(v * w for v, w in values) / sum(w for _, w in values)
        else:
            y = (min if how == "min" else max)(v for v, _ in values)
        found.append((float(version), y))
    return found


def curve_label(stream: Stream, key: str, curve: Curve, several: bool) -> str:
    if not several:
        return stream.label
    tail = key.rsplit("/", 1)[-1] if "*" in curve.key else curve.label
    return f"{stream.label} ({tail})"


def draw(plot: Plot, streams: list[Stream], directory: Path, *, dpi: int) -> Drawn | None:
    """Write ``directory/NAME.png`` with a line per stream and key; None when no stream has any of its keys."""
    # A Figure without pyplot draws through the Agg canvas: no global state, no GUI backend.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = concrete_keys(plot, streams)
    if not keys:
        return None
    drawn = Drawn(plot, f"{plot.name}.png", [key for key, _ in keys])
    fig = Figure(figsize=(6.4, 3.8))
    ax = fig.add_subplot()
    for index, stream in enumerate(streams):
        for style, (key, curve) in enumerate(keys):
            found = points(stream, plot.axis, key, curve.how)
            if not found:
                continue
            xs, ys = zip(*found)
            ax.plot(xs, ys, color=f"C{index % 10}", linestyle=STYLES[style % len(STYLES)], linewidth=1.5,
                    marker=MARKERS[style % len(MARKERS)] if len(found) <= 30 else None, markersize=3,
                    label=curve_label(stream, key, curve, len(keys) > 1))
            drawn.finals[(stream.label, key)] = ys[-1]
    ax.set_title(plot.title)
    ax.set_xlabel(AXIS_LABELS[plot.axis])
    ax.set_ylabel(plot.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(directory / drawn.file, dpi=dpi)
    return drawn
