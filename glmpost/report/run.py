"""One report (what ``glmpost report`` runs): read the runs' metrics, draw the curves, write the page.

    RUN_DIR... -> every metrics.jsonl under each (:mod:`glmpost.report.sources`: streams)
    -> one PNG per plot some stream has keys for (:mod:`glmpost.report.plots`)
    -> OUT/report.html (:mod:`glmpost.report.page`), one OUT/metrics.jsonl line, OUT/stage.json

A report is a view of its runs: a rerun into the same OUT writes it again (PNGs of plots no longer
drawn are removed); an OUT holding another stage's output is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from glmpost.config import ConfigError, setting
from glmpost.locks import output_lock
from glmpost.report.page import write_page
from glmpost.report.plots import PLOTS, draw
from glmpost.report.sources import REPORT_STAGE, load_run, run_names, stage_of
from glmpost.stage import MetricsWriter, write_stage_json

STAGE = REPORT_STAGE
PAGE = "report.html"


@dataclass
class ReportConfig:
    """What one ``report`` shows."""

    runs: list[str] = field(default_factory=list)  # the run directories, one line each per plot
    out: Optional[Path] = None  # OUT/report.html, OUT/*.png, OUT/metrics.jsonl, OUT/stage.json
    names: list[str] = setting(
        [], "A run's name in the legends and the table, in the order of the RUN_DIRs; repeatable (default: each "
        "directory's name).", flag="--name", cli={"annotation": List[str], "metavar": "NAME"})
    title: str = setting("glmpost run report", "The page's title.")
    dpi: int = setting(100, "Resolution of the PNGs in dots per inch (each plot is 6.4 x 3.8 inches).", min=50, max=400)


def _check_out(out: Path) -> None:
    earlier = stage_of(out).get("stage") if out.is_dir() else None
    if earlier not in (None, STAGE):
        raise ConfigError("{out} {path} holds output of `glmpost {earlier}`, not a report; use another {out}",
                          path=out, earlier=earlier)


def run_report(config: ReportConfig, *, options: dict[str, Any]) -> dict[str, Any]:
    """Read, draw, write (module doc); returns the summary."""
    paths = [Path(p) for p in config.runs]
    if config.names and len(config.names) != len(paths):
        raise ConfigError("{names} is given {count} time(s) for {dirs} run directories: one per run directory, or none",
                          count=len(config.names), dirs=len(paths))
    out = Path(config.out)
    _check_out(out)
    runs = [load_run(path, name, out.resolve()) for path, name in zip(paths, run_names(paths, config.names))]
    streams = [stream for run in runs for stream in run.streams]
    with output_lock(out, stage=STAGE):
        out.mkdir(parents=True, exist_ok=True)
        drawn, left_out = [], []
        for plot in PLOTS:
            result = draw(plot, streams, out, dpi=config.dpi)
            if result is None:
                left_out.append(plot)
                (out / f"{plot.name}.png").unlink(missing_ok=True)
            else:
                drawn.append(result)
        write_page(out / PAGE, title=config.title, runs=runs, drawn=drawn, left_out=left_out)
        (out / "metrics.jsonl").unlink(missing_ok=True)
        with MetricsWriter(out / "metrics.jsonl") as metrics:
            metrics.write(**{"report/runs": [r.name for r in runs], "report/lines": [s.label for s in streams],
                             "report/plots": [d.plot.name for d in drawn], "report/keys": [k for d in drawn for k in d.keys],
                             "report/not_plotted": [p.name for p in left_out],
                             "report/metrics_files": sum(len(r.metrics_files) for r in runs)})
        write_stage_json(out, STAGE, options, runs={r.name: str(r.path) for r in runs})
    return {"out": str(out), "page": str(out / PAGE), "runs": [r.name for r in runs], "lines": [s.label for s in streams],
            "plots": [d.file for d in drawn], "not_plotted": [p.name for p in left_out]}
