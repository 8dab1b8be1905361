"""The report of a diff-logprobs run as gates and readers see it: ``--fail-above`` gates, the
``metrics.jsonl`` line, and the table a person reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from glmpost.config import ConfigError

GATE_METRICS = ("mean_abs", "p50_abs", "p99_abs", "max_abs", "k1", "k3", "sample_disagreement",
                "indexer_differing_sets", "routing_differing_tokens")


def parse_gates(items: Iterable[str]) -> dict[str, float]:
    """``METRIC=VALUE`` pairs of ``--fail-above`` (metrics of the overall summary, see GATE_METRICS); a
    ValueError names the item, not the setting (the caller does: ``{fail_above} <problem>``)."""
    gates = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in GATE_METRICS:
            raise ValueError(f"{item!r}: expected METRIC=VALUE with METRIC one of {', '.join(GATE_METRICS)}")
        try:
            gates[name] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
    return gates


def apply_gates(report: dict[str, Any], gates: dict[str, float]) -> list[str]:
    """Record the gates in ``report``; returns the failed ones (``"NAME VALUE > LIMIT"``). A gate on
    a metric this comparison did not measure is refused (exit 2)."""
    overall = report["overall"]
    failed = [f"{name} {overall[name]:.6g} > {limit:g}" for name, limit in gates.items() if name in overall and overall[name] > limit]
    unmeasured = [name for name in gates if name not in overall and overall.get("tokens")]
    if unmeasured:
        raise ConfigError("{fail_above} {name}: not measured in this comparison (path B cannot resample)", name=unmeasured[0])
    report["gates"] = {"fail_above": gates, "failed": failed}
    return failed


def metrics_row(report: dict[str, Any]) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of a report: ``mismatch/*`` and (with the indexer) ``indexer/*``."""
    row = {f"mismatch/{k}": v for k, v in report["overall"].items()}
    if "indexer" in report:
        row.update({f"indexer/{k}": v for k, v in report["indexer"]["overall"].items()})
    return row


def diff_table(report: dict[str, Any], out: Path) -> str:
    """The terminal table of a report: both paths, the statistics per slice, the indexer and the worst tokens."""
    overall = report["overall"]
    a, b = report["path_a"], report["path_b"]
    b_name = {"rollout": "rollout log-probs", "server": f"server {b.get('url')}"}.get(report["mode"], f"{b.get('checkpoint')} {b.get('dtype')} {b.get('device')} {b.get('topk')}")
    windows = report.get("windows", report["records"])
    lines = [f"{out}: {overall.get('tokens', 0)} action tokens of {report['records']} trajectories"
             + (f" ({windows} context windows)" if windows != report["records"] else ""),
             f"  A: {a['checkpoint']} {a['dtype']} {a['device']} {a['topk']}-topk",
             f"  B: {b_name}"]
    agree = report["resampled"]
    lines.append(f"{'slice':12} {'tokens':>7} {'mean|d|':>9} {'p99|d|':>9} {'max|d|':>9} {'k3':>9} {'icepop':>7} {'dis':>7}"
                 + (f" {'agree':>7}" if agree else ""))
    kv_rows = [(f"kv-{label}", stats) for label, stats in report.get("by_kv_cache", {}).items()]
    for label, stats in [("all", overall), *report["by_position"].items(), *report["by_status"].items(), *kv_rows]:
        if stats.get("tokens"):
            lines.append(f"{label:12} {stats['tokens']:>7} {stats['mean_abs']:9.2e} {stats['p99_abs']:9.2e} {stats['max_abs']:9.2e} "
                         f"{stats['k3']:9.2e} {stats['icepop_kept']:7.1%} {stats['dis_kept']:7.1%}"
                         + (f" {stats['sample_agreement']:7.1%}" if agree else ""))
    lines += _indexer_lines(report) + _routing_lines(report)
    for lag, row in report.get("by_version", {}).get("by_lag", {}).items():
        lines.append(f"lag {lag}: {row['tokens']} tokens, engine mean|d| {row['engine_mean_abs']:.2e} max {row['engine_max_abs']:.2e}, "
                     f"lag mean|d| {row['lag_mean_abs']:.2e} max {row['lag_max_abs']:.2e}, DIS keeps {row['dis_kept']:.1%}, "
                     f"IcePop {row['icepop_kept']:.1%}")
    by_cache = report.get("by_version", {}).get("engine_by_kv_cache", {})
    for label, row in by_cache.items() if "stale" in by_cache else ():
        lines.append(f"engine on a {label} KV cache: {row['tokens']} tokens, mean|d| {row['engine_mean_abs']:.2e} "
                     f"max {row['engine_max_abs']:.2e}")
    for row in report["worst"][:5]:
        lines.append(f"  worst {row['delta']:+.3g} {row['record']} @{row['position']}: ...{row.get('context', '')!r} -> {row.get('token', '')!r}")
    return "\n".join(lines)


def _indexer_lines(report: dict[str, Any]) -> list[str]:
    """The table's indexer line (none without indexer rows)."""
    ix = report.get("indexer", {}).get("overall", {})
    if not ix.get("rows"):
        return []
    return [f"indexer: {ix['rows']} rows x layers, mean Jaccard {ix['mean_jaccard']:.4f}, identical sets {ix['identical_sets']:.1%}, "
            f"identical order {ix['identical_order']:.1%}, boundary ties A {ix['boundary_ties_a']:.1%} B {ix['boundary_ties_b']:.1%}"]


def _routing_lines(report: dict[str, Any]) -> list[str]:
    """The table's MoE routing line (none without ``--routing``): record vs path A."""
    routing = report.get("routing", {}).get("overall", {})
    if not routing.get("tokens"):
        return []
    margin = routing.get("margin_where_differing") or {}
    differing, same = routing["delta_differing"], routing["delta_same"]
    line = (f"routing: {routing['tokens']} tokens x {routing['layers']} MoE layers, experts differ on {routing['differing_tokens']:.1%} "
            f"of tokens ({routing['differing_token_layers']:.1%} of token-layers)")
    if margin:
        line += f", A's k-th margin there median {margin['median']:.3g}"
    if differing.get("tokens") and same.get("tokens"):
        line += f"; mean|d| {differing['mean_abs']:.3g} where they differ vs {same['mean_abs']:.3g}"
    return [line + (" (path A replayed the record's experts)" if routing.get("replayed") else "")]
