"""PNG plots of a log-prob mismatch (``glmpost diff-logprobs``), drawn with matplotlib's Agg backend.

* ``delta_hist.png``: histogram of ``delta = log p_A - log p_B`` over action tokens (log-scaled counts);
* ``abs_delta_vs_position.png``: ``|delta|`` against the token's position in the response;
* ``scatter.png``: ``log p_B`` (x) against ``log p_A`` (y) with the diagonal ``y = x``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PLOTS = ("delta_hist.png", "abs_delta_vs_position.png", "scatter.png")


def write_mismatch_plots(directory: Path, delta: np.ndarray, position: np.ndarray, log_prob_a: np.ndarray,
                         log_prob_b: np.ndarray, *, label_a: str, label_b: str) -> list[str]:
    """Write the three plots into ``directory``; returns their file names."""
    # A Figure without pyplot draws through the Agg canvas: no global state, no GUI backend.
    from matplotlib.figure import Figure

    directory = Path(directory)
    written = []

    def save(fig: Figure, name: str) -> None:
        fig.tight_layout()
        fig.savefig(directory / name, dpi=100)
        written.append(name)

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    if delta.size:
        ax.hist(delta, bins=60, log=True, color="tab:blue")
    ax.set_xlabel(f"delta log p = log p[{label_a}] - log p[{label_b}]")
    ax.set_ylabel("action tokens")
    ax.set_title(f"{delta.size} tokens, max |delta| {np.abs(delta).max() if delta.size else 0:.3g}")
    save(fig, PLOTS[0])

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    ax.scatter(position, np.abs(delta), s=6, alpha=0.6)
    if delta.size and np.abs(delta).max() > 0:
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_xlabel("position in the response")
    ax.set_ylabel("|delta log p|")
    save(fig, PLOTS[1])

    fig = Figure(figsize=(5, 5))
    ax = fig.add_subplot()
    ax.scatter(log_prob_b, log_prob_a, s=6, alpha=0.6)
    if delta.size:
        low = float(min(log_prob_a.min(), log_prob_b.min()))
        high = float(max(log_prob_a.max(), log_prob_b.max()))
        ax.plot([low, high], [low, high], color="grey", linewidth=1)
    ax.set_xlabel(f"log p [{label_b}]")
    ax.set_ylabel(f"log p [{label_a}]")
    save(fig, PLOTS[2])
    return written
