"""Measure how far two numerical paths' log-probs are apart on the same action tokens.

Path A is always the trainer's forward of --checkpoint (in --dtype, on --device, with its DSA
top-k rule). Path B is, by what you pass:

\b
  (shards only)    the rollout_log_probs the engine recorded (the IcePop view);
  --against CKPT   another checkpoint, e.g. the FP8 / W4A16 rollout checkpoint
                   (dequantized);
  --against-dtype, --against-device, --against-topk, --against-batch-size
                   the same checkpoint in another dtype, device, DSA top-k
                   rule or batch size;
  --against-server URL
                   a `glmpost serve` / SGLang server (prefill log-probs).

delta = log p_A - log p_B per action token. Reports mean / p50 / p99 / max |delta|, k1 and k3
estimates of KL(p_B || p_A), the fraction IcePop keeps at --beta and DIS at --eps-low/--eps-high,
sampled-token agreement (both paths resample every action position with the record's own seeded
uniforms; the fraction where they pick the same token), a breakdown by response position and by
status, and the worst tokens with their decoded context. --indexer also compares the GLM-5 DSA
indexer's selected key sets between two local paths (mean Jaccard, identical sets and orders,
boundary ties). Writes DIR/report.json, plots (delta_hist.png, abs_delta_vs_position.png,
scatter.png), DIR/metrics.jsonl and DIR/stage.json; prints a table (or --json).

--fail-above METRIC=VALUE turns it into a CI gate: exit 1 when the metric exceeds the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm

from glmpost.checkpoints import CheckpointError, load_tokenizer, resolve_checkpoint
from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import ShardReader, require_fields, resolve_shard_paths
from glmpost.closure.mismatch import (
    DTYPES,
    compare_indexers,
    compare_paths,
    load_path_model,
    local_path,
    mismatch_report,
    parse_gates,
    rollout_path,
    server_path,
)
from glmpost.npu import resolve_device
from glmpost.stage import MetricsWriter, write_json_atomic, write_stage_json

STAGE = "diff-logprobs"
REPRODUCIBLE_ENGINES = ("glmpost-local",)  # engines whose per-sequence uniforms glmpost can redraw


def diff_logprobs(
    ctx: typer.Context,
    inputs: list[str] = typer.Argument(..., help="Trajectory shards (files, directories or globs); without --against* they need rollout_log_probs."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Path A: the trainer's weights, a root (its LATEST) or a version."),
    out: Path = typer.Option(..., "--out", help="Directory for report.json, plots, metrics.jsonl and stage.json (created; never silently replaced)."),
    against: Path | None = typer.Option(None, "--against", help="Path B: another checkpoint (root or version; quantized ones are dequantized)."),
    against_server: str | None = typer.Option(None, "--against-server", help="Path B: a glmpost serve / SGLang server URL."),
    dtype: str = typer.Option("auto", "--dtype", help="Path A dtype: auto (the checkpoint's), fp32, bf16 or fp16."),
    against_dtype: str | None = typer.Option(None, "--against-dtype", help="Path B dtype (default: path A's)."),
    device: str = typer.Option("auto", "--device", help="Path A device: auto, cpu, cuda[:N] or npu[:N]."),
    against_device: str | None = typer.Option(None, "--against-device", help="Path B device (default: path A's)."),
    deterministic_topk: bool = typer.Option(True, "--deterministic-topk/--torch-topk", help="Path A DSA indexer top-k rule (see `glmpost rollout --help`)."),
    against_topk: str | None = typer.Option(None, "--against-topk", help="Path B DSA indexer top-k rule: deterministic or torch (default: path A's)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Path A trajectories per forward pass."),
    against_batch_size: int | None = typer.Option(None, "--against-batch-size", min=1, help="Path B trajectories per forward pass (default: path A's)."),
    indexer: bool = typer.Option(False, "--indexer", help="Also compare the DSA indexer's selected top-k key sets (two local paths)."),
    beta: float = typer.Option(2.0, "--beta", help="IcePop beta: a token is kept when 1/beta <= p_A / p_B <= beta."),
    eps_low: float = typer.Option(0.2, "--eps-low", help="DIS lower epsilon: kept when 1 - eps_low < ratio."),
    eps_high: float = typer.Option(0.28, "--eps-high", help="DIS upper epsilon: kept when ratio < 1 + eps_high."),
    fail_above: list[str] = typer.Option([], "--fail-above", help="METRIC=VALUE (mean_abs, p50_abs, p99_abs, max_abs, k1, k3, sample_disagreement, indexer_differing_sets): exit 1 when exceeded; repeatable."),
    worst: int = typer.Option(10, "--worst", min=0, help="How many of the worst tokens to list."),
    context_tokens: int = typer.Option(12, "--context-tokens", min=0, help="Tokens of context decoded before each worst token."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write the PNG plots beside report.json."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    config: Path | None = config_option(),
) -> None:
    try:
        gates = parse_gates(fail_above)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for flag, value in (("--dtype", dtype), ("--against-dtype", against_dtype)):
        if value is not None and value not in DTYPES:
            raise UsageError(f"{flag} {value!r}: expected one of {', '.join(DTYPES)}")
    if against_topk not in (None, "deterministic", "torch"):
        raise UsageError(f"--against-topk {against_topk!r}: expected deterministic or torch")
    if against is not None and against_server is not None:
        raise UsageError("--against and --against-server both name path B; pass one")
    local_b = against is not None or any(v is not None for v in (against_dtype, against_device, against_topk, against_batch_size))
    if against_server is not None and local_b:
        raise UsageError("--against-server compares with the server as it runs; drop --against-dtype/--against-device/--against-topk/--against-batch-size")
    if indexer and not local_b:
        raise UsageError("--indexer compares two local paths: add --against, --against-dtype, --against-device, --against-topk or --against-batch-size")
    if "indexer_differing_sets" in gates and not indexer:
        raise UsageError("--fail-above indexer_differing_sets: not measured in this comparison (add --indexer)")
    mode = "checkpoint" if against is not None else "server" if against_server else "local" if local_b else "rollout"

    version_dir = _resolve("--checkpoint", checkpoint)
    tokenizer, revision = load_tokenizer(version_dir)
    against_dir = _resolve("--against", against) if against is not None else version_dir
    if against is not None:
        _, against_revision = load_tokenizer(against_dir)
        if against_revision != revision:
            raise GlmpostError(f"--against {against_dir}: tokenizer revision {against_revision} differs from --checkpoint's {revision}")

    records, temperatures, engines = _read_records(inputs, revision, need_rollout=mode == "rollout")
    if len(temperatures) > 1:
        raise GlmpostError(f"{STAGE}: records were sampled at different temperatures {sorted(temperatures)}; compare them separately")
    temperature = temperatures.pop() if temperatures else 1.0
    if temperature == 0:
        if mode == "rollout":
            raise GlmpostError(f"{STAGE}: greedy rollouts (temperature 0) record no sampling log-probs to compare")
        temperature = 1.0  # two model paths: compare the model's own distributions (samples stay greedy)

    device_a = resolve_device(device)
    path_b_desc: dict[str, Any]
    progress = tqdm(total=len(records) * 2, desc=STAGE, unit="traj", leave=False, disable=None)
    with progress:
        model_a = load_path_model(version_dir, dtype=dtype, device=device_a, deterministic_topk=deterministic_topk)
        path_a = local_path(model_a, records, temperature=temperature, label="A", batch_size=batch_size,
                            indexer=indexer, progress=progress.update)
        path_a_desc = {"kind": "checkpoint", "checkpoint": str(version_dir), "dtype": dtype, "device": str(device_a),
                       "topk": "deterministic" if deterministic_topk else "torch", "batch_size": batch_size}
        if mode == "rollout":
            resample = bool(engines) and engines <= set(REPRODUCIBLE_ENGINES)
            path_b = rollout_path(records, resample=resample)
            progress.update(len(records))
            path_b_desc = {"kind": "rollout", "engines": sorted(engines)}
        elif mode == "server":
            path_b, path_b_desc = _server_path(against_server, records, temperature=temperature, revision=revision,
                                               vocab_size=model_a.get_output_embeddings().weight.shape[0],
                                               progress=progress.update)
        else:
            device_b = resolve_device(against_device) if against_device is not None else device_a
            topk_b = deterministic_topk if against_topk is None else against_topk == "deterministic"
            same_model = against is None and (against_dtype or dtype) == dtype and str(device_b) == str(device_a)
            if same_model:
                from glmpost.npu.topk import set_indexer_topk

                set_indexer_topk(model_a, deterministic=topk_b)
                model_b = model_a
            else:
                del model_a
                model_b = load_path_model(against_dir, dtype=against_dtype or dtype, device=device_b, deterministic_topk=topk_b)
            path_b = local_path(model_b, records, temperature=temperature, label="B", batch_size=against_batch_size or batch_size,
                                indexer=indexer, progress=progress.update)
            path_b_desc = {"kind": "checkpoint", "checkpoint": str(against_dir), "dtype": against_dtype or dtype,
                           "device": str(device_b), "topk": "deterministic" if topk_b else "torch",
                           "batch_size": against_batch_size or batch_size}

    deltas = compare_paths(path_a, path_b, records)
    report = mismatch_report(deltas, worst=worst, beta=beta, eps_low=eps_low, eps_high=eps_high,
                             context=lambda i, position: _context(tokenizer, records[i], position, context_tokens))
    report.update({"mode": mode, "path_a": path_a_desc, "path_b": path_b_desc, "records": len(records),
                   "temperature": temperature, "resampled": deltas.agree is not None,
                   "checkpoint": str(version_dir), "deterministic_topk": deterministic_topk})
    if indexer:
        report["indexer"] = compare_indexers(path_a, path_b)
        report["overall"]["indexer_differing_sets"] = report["indexer"]["overall"].get("differing_sets", 0)
    failed = [f"{name} {report['overall'][name]:.6g} > {limit:g}" for name, limit in gates.items()
              if name in report["overall"] and report["overall"][name] > limit]
    unmeasured = [name for name in gates if name not in report["overall"] and report["overall"].get("tokens")]
    if unmeasured:
        raise UsageError(f"--fail-above {unmeasured[0]}: not measured in this comparison (path B cannot resample)")
    report["gates"] = {"fail_above": gates, "failed": failed}

    with staged_output_dir(out, overwrite=overwrite, complete_marker="stage.json", stage=STAGE,
                           options=effective_options(ctx), ctx=ctx) as staging:
        if staging is None:
            raise UsageError(f"--out {out} already holds a report; pass --overwrite to replace it")
        if plots:
            from glmpost.closure.plots import write_mismatch_plots

            report["plots"] = write_mismatch_plots(staging, deltas.delta, deltas.position, deltas.log_prob_a, deltas.log_prob_b,
                                                   label_a="A", label_b=f"B: {mode}")
        write_json_atomic(staging / "report.json", report)
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            row = {f"mismatch/{k}": v for k, v in report["overall"].items()}
            if indexer:
                row.update({f"indexer/{k}": v for k, v in report["indexer"]["overall"].items()})
            metrics.write(**row)
        write_stage_json(staging, STAGE, effective_options(ctx), checkpoint=str(version_dir), mode=mode)
    print_summary(report, as_json=as_json, human=_table(report, out))
    if failed:
        raise GlmpostError(f"{STAGE}: gate failed: {'; '.join(failed)} (report in {out / 'report.json'})")


def _resolve(flag: str, path: Path) -> Path:
    try:
        return resolve_checkpoint(path)
    except CheckpointError as exc:
        raise GlmpostError(f"{flag}: {exc}") from None


def _read_records(inputs: list[str], revision: str, *, need_rollout: bool):
    records, temperatures, engines = [], set(), set()
    for path in resolve_shard_paths(inputs):
        for index, record in enumerate(ShardReader(path)):
            where = f"{STAGE}: {path}: record {index}"
            require_fields(record, ["rollout_log_probs", "sampling"] if need_rollout else [], where=where)
            if record["tokenizer_revision"] != revision:
                raise GlmpostError(f"{where}: tokenizer revision {record['tokenizer_revision']} differs from the checkpoint's {revision}")
            sampling = record.get("sampling") or {}
            if "temperature" in sampling:
                temperatures.add(float(sampling["temperature"]))
            engines.add(str(sampling.get("engine", "unknown")))
            records.append(record)
    if not records:
        raise GlmpostError(f"{STAGE}: {', '.join(map(str, inputs))}: no records")
    return records, temperatures, engines


def _server_path(url: str, records, *, temperature: float, revision: str, vocab_size: int, progress):
    from glmpost.serving.sglang_client import ServerError, SGLangClient

    client = SGLangClient(url, timeout=120.0, retries=2, backoff=0.2)
    try:
        info = client.model_info()
    except ServerError as exc:
        raise GlmpostError(f"--against-server {client.url}: {exc}") from None
    theirs = info.get("tokenizer_revision") if isinstance(info, dict) else None
    if theirs is not None and theirs != revision:
        raise GlmpostError(f"--against-server {client.url}: tokenizer revision {theirs} differs from --checkpoint's {revision}")
    try:
        path = server_path(client, records, temperature=temperature, vocab_size=vocab_size, label="B", progress=progress)
    except (ValueError, ServerError) as exc:
        raise GlmpostError(f"--against-server {client.url}: {exc}") from None
    return path, {"kind": "server", "url": client.url, "weight_version": info.get("weight_version"),
                  "model_path": info.get("model_path")}


def _context(tokenizer, record, position: int, size: int) -> dict[str, Any]:
    """The worst token's id and text, and the ``size`` tokens before it, decoded."""
    ids = [int(x) for x in record["prompt_token_ids"]] + [int(x) for x in record["response_token_ids"]]
    at = len(record["prompt_token_ids"]) + position
    return {"token_id": ids[at], "token": tokenizer.decode([ids[at]]), "context": tokenizer.decode(ids[max(0, at - size) : at])}


def _table(report: dict[str, Any], out: Path) -> str:
    overall = report["overall"]
    a, b = report["path_a"], report["path_b"]
    b_name = {"rollout": "rollout log-probs", "server": f"server {b.get('url')}"}.get(report["mode"], f"{b.get('checkpoint')} {b.get('dtype')} {b.get('device')} {b.get('topk')}")
    lines = [f"{out}: {overall.get('tokens', 0)} action tokens of {report['records']} trajectories",
             f"  A: {a['checkpoint']} {a['dtype']} {a['device']} {a['topk']}-topk",
             f"  B: {b_name}"]
    agree = report["resampled"]
    lines.append(f"{'slice':12} {'tokens':>7} {'mean|d|':>9} {'p99|d|':>9} {'max|d|':>9} {'k3':>9} {'icepop':>7} {'dis':>7}"
                 + (f" {'agree':>7}" if agree else ""))
    for label, stats in [("all", overall), *report["by_position"].items(), *report["by_status"].items()]:
        if stats.get("tokens"):
            lines.append(f"{label:12} {stats['tokens']:>7} {stats['mean_abs']:9.2e} {stats['p99_abs']:9.2e} {stats['max_abs']:9.2e} "
                         f"{stats['k3']:9.2e} {stats['icepop_kept']:7.1%} {stats['dis_kept']:7.1%}"
                         + (f" {stats['sample_agreement']:7.1%}" if agree else ""))
    if "indexer" in report:
        ix = report["indexer"]["overall"]
        if ix.get("rows"):
            lines.append(f"indexer: {ix['rows']} rows x layers, mean Jaccard {ix['mean_jaccard']:.4f}, identical sets {ix['identical_sets']:.1%}, "
                         f"identical order {ix['identical_order']:.1%}, boundary ties A {ix['boundary_ties_a']:.1%} B {ix['boundary_ties_b']:.1%}")
    for row in report["worst"][:5]:
        lines.append(f"  worst {row['delta']:+.3g} {row['record']} @{row['position']}: ...{row.get('context', '')!r} -> {row.get('token', '')!r}")
    return "\n".join(lines)
