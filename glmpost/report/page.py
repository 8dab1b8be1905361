"""``report.html``: one static page (no script, no network) with the plots beside it as PNG files,
a table of each stream's last values, the plots left out, and each run's files and options."""

from __future__ import annotations

import json
import time
from html import escape
from pathlib import Path

from glmpost import __version__
from glmpost.report.plots import AXIS_LABELS, Drawn, Plot
from glmpost.report.sources import Run, stage_of

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1400px;
       padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1em; }
figure { margin: 0; border: 1px solid #ddd; border-radius: 6px; padding: 0.5em; background: #fff; }
figure h3 { margin: 0.2em 0 0.4em; font-size: 1.05em; } figure img { width: 100%; height: auto; }
figcaption { color: #555; font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.9em; } th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } th { background: #f4f4f4; }
pre { background: #f8f8f8; padding: 0.6em; overflow-x: auto; font-size: 0.8em; }
code { font-size: 0.9em; }
"""


def number(value: float) -> str:
    """A value as the table shows it."""
    return f"{value:.6g}"


def _figure(drawn: Drawn) -> str:
    plot = drawn.plot
    keys = ", ".join(f"<code>{escape(k)}</code>" for k in drawn.keys)
    return (f'<figure id="{escape(plot.name)}"><h3>{escape(plot.title)}</h3>'
            f'<img src="{escape(drawn.file)}" alt="{escape(plot.title)}">'
            f"<figcaption>{keys}; x: {escape(AXIS_LABELS[plot.axis])}</figcaption></figure>")


def _table(drawn: list[Drawn], labels: list[str]) -> str:
    labels = [label for label in labels if any(label == series for d in drawn for series, _ in d.finals)]
    head = "".join(f"<th>{escape(label)}</th>" for label in labels)
    rows = []
    for d in drawn:
        for index, key in enumerate(d.keys):
            cells = []
            for label in labels:
                value = d.finals.get((label, key))
                text = "" if value is None else number(value)
                cells.append(f'<td class="num" data-series="{escape(label)}" data-key="{escape(key)}">{text}</td>')
            title = f'<th rowspan="{len(d.keys)}">{escape(d.plot.title)}</th>' if index == 0 else ""
            rows.append(f"<tr>{title}<td><code>{escape(key)}</code></td>{''.join(cells)}</tr>")
    return (f'<table id="final-values"><thead><tr><th>plot</th><th>key</th>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def _left_out(plots: list[Plot]) -> str:
    if not plots:
        return ""
    items = "".join(f"<li>{escape(p.title)}: no run has "
                    + " or ".join(f"<code>{escape(c.key)}</code>" for c in p.curves) + "</li>" for p in plots)
    return f'<h2>Not plotted</h2><ul id="not-plotted">{items}</ul>'


def _relative(path: Path, run: Run) -> str:
    try:
        return str(path.relative_to(run.path.resolve()))
    except ValueError:
        return str(path)


def _run_details(run: Run) -> str:
    files = "".join(f"<li><code>{escape(_relative(f, run))}</code></li>" for f in run.metrics_files)
    stages = []
    for path in run.stage_files:
        payload = stage_of(path.parent)
        options = json.dumps(payload.get("options", {}), indent=1, sort_keys=True)
        stages.append(f"<details><summary><code>{escape(_relative(path, run))}</code> "
                      f"({escape(str(payload.get('stage', '?')))})</summary><pre>{escape(options)}</pre></details>")
    streams = ", ".join(escape(s.label) for s in run.streams)
    return (f'<details class="run"><summary><b>{escape(run.name)}</b>: <code>{escape(str(run.path))}</code> '
            f"({len(run.metrics_files)} metrics files, {len(run.stage_files)} stage.json)</summary>"
            f"<p>Lines: {streams}</p><p>metrics.jsonl read:</p><ul>{files}</ul>"
            f"<p>stage.json options:</p>{''.join(stages)}</details>")


def write_page(path: Path, *, title: str, runs: list[Run], drawn: list[Drawn], left_out: list[Plot]) -> None:
    """Write the page (module doc) to ``path``."""
    labels = [s.label for run in runs for s in run.streams]
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    body = [f"<h1>{escape(title)}</h1>",
            f'<p class="meta">{len(runs)} run(s): {", ".join(escape(r.name) for r in runs)}. '
            f"Written by glmpost {escape(__version__)} at {generated}.</p>",
            "<h2>Final values</h2>", _table(drawn, labels) if drawn else "<p>Nothing to show.</p>",
            "<h2>Curves</h2>", f'<div class="plots">{"".join(_figure(d) for d in drawn)}</div>',
            _left_out(left_out), "<h2>Runs</h2>", *(_run_details(run) for run in runs)]
    path.write_text("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                    f"<title>{escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
                    + "\n".join(body) + "\n</body></html>\n")
