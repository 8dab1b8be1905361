"""One ``glmpost diff-logprobs`` run: how far two numerical paths' log-probs are apart on the same
action tokens (:mod:`glmpost.diff.mismatch` measures; this module runs the comparison).

    check the settings -> resolve the checkpoints -> read the records -> score path A, then path B
    -> compare (and the DSA indexers) -> check the gates -> write the caller's staging directory

* **path A**: the trainer's forward of ``checkpoint`` (``dtype``, ``device``, top-k rule, ``batch_size``).
* **path B** (``mode``): ``rollout`` (the recorded ``rollout_log_probs``), ``checkpoint`` (``against``,
  dequantized), ``local`` (another dtype, device, top-k rule or batch size) or ``server``
  (``against_server``, prefill log-probs); :mod:`glmpost.diff.paths` scores the local and server paths.
* **output**: :meth:`LogprobDiff.write` writes ``report.json``, the plots, ``metrics.jsonl`` and
  ``stage.json`` into the caller's staging directory; :meth:`LogprobDiff.check_gates` raises on a failed gate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from glmpost.checkpoints import CheckpointError, read_manifest, resolve_checkpoint
from glmpost.config import ConfigError, setting, shared
from glmpost.diff.by_version import version_split
from glmpost.diff.kv_cache import any_stale, kv_cache_labels
from glmpost.diff.mismatch import (
    DTYPES,
    PathScores,
    compare_indexers,
    compare_paths,
    mismatch_report,
    rollout_path,
    summarize,
)
from glmpost.diff.paths import LocalSide, server_path_b
from glmpost.diff.plots import write_mismatch_plots
from glmpost.diff.report import GATE_METRICS, apply_gates, metrics_row, parse_gates
from glmpost.diff.routing_probe import path_routing, routing_report
from glmpost.errors import GlmpostError
from glmpost.formats import iter_checked_records
from glmpost.formats.windows import window_views
from glmpost.kernel.distribution import ScoredDistribution, scored_distribution
from glmpost.kernel.engine import SamplingParams
from glmpost.kernel.loading import attention_ran, load_tokenizer
from glmpost.kernel.lora_versions import is_lora_version
from glmpost.npu import resolve_device
from glmpost.npu.topk import indexers
from glmpost.stage import MetricsWriter, write_json_atomic, write_stage_json

STAGE = "diff-logprobs"
REPRODUCIBLE_ENGINES = ("glmpost-local",)  # engines whose per-sequence uniforms glmpost can redraw


@dataclass
class DiffConfig:
    """The settings of one comparison: the options of ``glmpost diff-logprobs``; refusals name these fields."""

    inputs: list[str] = field(default_factory=list)  # trajectory shards (files, directories or globs)
    checkpoint: Optional[Path] = None  # path A: a checkpoint root (its LATEST) or a version
    out: Optional[Path] = None  # the report directory, as messages name it (the caller stages it)
    against: Optional[Path] = setting(None, "Path B: another checkpoint (root or version; quantized ones are dequantized).")
    against_server: Optional[str] = setting(None, "Path B: a glmpost serve / SGLang server URL.")
    against_engine: str = setting("sglang", "--against-server's API: sglang (SGLang, glmpost serve) or vllm (vLLM's "
                                  "/v1/completions prompt_logprobs; against vLLM-Ascend this measures its NPU top-k/top-p).")
    api_key: Optional[str] = setting(None, "--against-server's API key, sent as 'Authorization: Bearer KEY' (never recorded).", cli={"show_default": False})
    dtype: str = setting("auto", "Path A dtype: auto (the checkpoint's), fp32, bf16 or fp16.")
    against_dtype: Optional[str] = setting(None, "Path B dtype (default: path A's).")
    device: str = setting("auto", "Path A device: auto, cpu, cuda[:N] or npu[:N].")
    against_device: Optional[str] = setting(None, "Path B device (default: path A's).")
    deterministic_topk: bool = setting(True, "Path A DSA indexer top-k rule (see `glmpost rollout --help`).",
                                       flag="--deterministic-topk/--torch-topk")
    against_topk: Optional[str] = setting(None, "Path B DSA indexer top-k rule: deterministic or torch (default: path A's).")
    attention: str = setting("native", "Path A GLM-5 attention: native or reference (see `glmpost rollout --help`).")
    against_attention: Optional[str] = setting(None, "Path B GLM-5 attention: native or reference (default: path A's).")
    batch_size: int = setting(8, "Path A trajectories per forward pass.", min=1)
    against_batch_size: Optional[int] = setting(None, "Path B trajectories per forward pass (default: path A's).", min=1)
    indexer: bool = setting(False, "Also compare the DSA indexer's selected top-k key sets (two local paths).")
    routing: bool = setting(False, "Also compare each action token's MoE experts per layer, record (rollout --record-routing) vs path A: differing fractions, A's router-score margin at the k-th expert, the log-prob delta of differing tokens vs the rest.")
    routing_replay: bool = setting(False, "Path A routes each recorded token to the record's experts (R3, as train-grpo --routing-replay does), gate weights from its own router.")
    by_version: Optional[Path] = setting(
        None, "Against the rollout log-probs: also re-score each action token with the checkpoint of the version that "
        "sampled it (this root's versions, or the first one's parent) and report per version lag the engine mismatch "
        "(log pi_v - log pi_rollout) apart from the lag effect (log pi_A - log pi_v), and DIS's kept fraction.")
    icepop_beta: float = setting(2.0, "IcePop beta: a token is kept when 1/beta <= p_A / p_B <= beta (--beta: its "
                                 "deprecated spelling, kept for one release).")
    dis_low: float = setting(0.2, "DIS trust band below 1: kept when 1 - dis-low < ratio (--eps-low: its deprecated "
                             "spelling, kept for one release).")
    dis_high: float = setting(0.28, "DIS trust band above 1: kept when ratio < 1 + dis-high (--eps-high: its "
                              "deprecated spelling, kept for one release).")
    fail_above: list[str] = setting([], f"METRIC=VALUE ({', '.join(GATE_METRICS)}): exit 1 when exceeded; repeatable.")
    worst: int = setting(10, "How many of the worst tokens to list.", min=0)
    context_tokens: int = setting(12, "Tokens of context decoded before each worst token.", min=0)
    plots: bool = setting(True, "Write the PNG plots beside report.json.", flag="--plots/--no-plots")
    overwrite: bool = shared("overwrite")

    @property
    def local_b(self) -> bool:
        """Whether path B is a local model (another checkpoint, or path A's with other settings)."""
        return self.against is not None or any(
            v is not None for v in (self.against_dtype, self.against_device, self.against_topk, self.against_batch_size,
                                    self.against_attention))

    @property
    def mode(self) -> str:
        """What path B is: ``checkpoint``, ``server``, ``local`` or ``rollout``."""
        return "checkpoint" if self.against is not None else "server" if self.against_server else "local" if self.local_b else "rollout"

    def check(self) -> dict[str, float]:
        """Refuse contradictory or unknown settings (exit 2); returns the parsed ``fail_above`` gates."""
        try:
            gates = parse_gates(self.fail_above)
        except ValueError as exc:
            raise ConfigError("{fail_above} {problem}", problem=exc) from None
        for name in ("dtype", "against_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ConfigError("{%s} {value!r}: expected one of {known}" % name, value=value, known=", ".join(DTYPES))
        for name in ("attention", "against_attention"):
            value = getattr(self, name)
            if value is not None and value not in ("native", "reference"):
                raise ConfigError("{%s} {value!r}: expected native or reference" % name, value=value)
        if self.against_topk not in (None, "deterministic", "torch"):
            raise ConfigError("{against_topk} {value!r}: expected deterministic or torch", value=self.against_topk)
        if self.against_engine not in ("sglang", "vllm"):
            raise ConfigError("{against_engine} {value!r}: expected sglang or vllm", value=self.against_engine)
        if self.against is not None and self.against_server is not None:
            raise ConfigError("{against} and {against_server} both name path B; pass one")
        if self.against_server is not None and self.local_b:
            raise ConfigError("{against_server} compares with the server as it runs; drop "
                              "{against_dtype}/{against_device}/{against_topk}/{against_batch_size}/{against_attention}")
        if self.indexer and not self.local_b:
            raise ConfigError("{indexer} compares two local paths: add {against}, {against_dtype}, {against_device}, "
                              "{against_topk}, {against_attention} or {against_batch_size}")
        if self.by_version is not None and self.mode != "rollout":
            raise ConfigError("{by_version} splits the mismatch against the rollout log-probs: drop {against}, "
                              "{against_server}, {against_dtype}, {against_device}, {against_topk}, {against_attention} "
                              "and {against_batch_size}")
        if "routing_differing_tokens" in gates and not self.routing:
            raise ConfigError("{fail_above} routing_differing_tokens: not measured in this comparison (add {routing})")
        if "indexer_differing_sets" in gates and not self.indexer:
            raise ConfigError("{fail_above} indexer_differing_sets: not measured in this comparison (add {indexer})")
        return gates


def resolve_field_checkpoint(name: str, path: Path) -> Path:
    """The version directory ``path`` names; an error names the config field ``name``."""
    try:
        return resolve_checkpoint(path)
    except CheckpointError as exc:
        raise ConfigError("{%s}: {reason}" % name, reason=exc, exit_code=1) from None


def open_checkpoints(config: DiffConfig) -> tuple[Path, Path, Any, str]:
    """``(version_dir, against_dir, tokenizer, revision)``: path A's checkpoint and path B's (A's
    without ``against``), which must share A's tokenizer revision."""
    version_dir = resolve_field_checkpoint("checkpoint", config.checkpoint)
    tokenizer, revision = load_tokenizer(version_dir)
    against_dir = resolve_field_checkpoint("against", config.against) if config.against is not None else version_dir
    if config.against is not None:
        _, against_revision = load_tokenizer(against_dir)
        if against_revision != revision:
            raise ConfigError("{against} {path}: tokenizer revision {theirs} differs from {checkpoint}'s {revision}",
                              path=against_dir, theirs=against_revision, revision=revision, exit_code=1)
    return version_dir, against_dir, tokenizer, revision


def read_diff_records(inputs: list[str], revision: str, *, need_rollout: bool) -> tuple[list[dict[str, Any]], set[tuple], set[str]]:
    """Every record of ``inputs`` (checked: fields, tokenizer ``revision``, ``sampling``), a record that
    compaction split into context windows as one record per window (:func:`~glmpost.formats.windows.window_views`:
    each scored on the context the engine saw), and the distinct log-prob settings (kind, temperature,
    filter) and engines they name."""
    records, settings, engines = [], set(), set()
    require = ["rollout_log_probs", "sampling"] if need_rollout else []
    for record, where in iter_checked_records(inputs, revision=revision, stage=STAGE, require=require):
        sampling = record.get("sampling") or {}
        try:
            params = SamplingParams.from_record(sampling)
        except ValueError as exc:
            raise GlmpostError(f"{where}: record {record['id']!r}: {exc}") from None
        settings.add((params.log_prob_kind, params.temperature, params.top_k, params.top_p))
        engines.add(str(sampling.get("engine", "unknown")))
        records.extend(window_views(record))  # a compacted record: each window on its own context
    if not records:
        raise GlmpostError(f"{STAGE}: {', '.join(map(str, inputs))}: no records")
    return records, settings, engines


def comparison_distribution(settings: set[tuple], mode: str) -> ScoredDistribution:
    """The one distribution the records' log-probs are of (formats/SPEC.md ``sampling``: their
    ``log_prob_kind`` at their temperature, top-k and top-p), which both paths compute. Greedy
    records from before ``log_prob_kind`` carry the point mass's 0, which nothing can check against
    a rollout; two model paths then compare the model's own (raw) distributions."""
    if len(settings) > 1:
        raise GlmpostError(f"{STAGE}: records differ in (log_prob_kind, temperature, top_k, top_p): "
                           f"{sorted(settings, key=str)}; compare them separately")
    kind, temperature, top_k, top_p = next(iter(settings))
    if temperature == 0 and kind != "raw":
        if mode == "rollout":
            raise GlmpostError(f"{STAGE}: greedy rollouts recorded as sampling.log_prob_kind {kind!r} carry the point mass's "
                               "log-prob 0: nothing to compare (glmpost now records greedy log-probs as 'raw')")
        return ScoredDistribution()
    return scored_distribution(kind, temperature=temperature, top_k=top_k, top_p=top_p)


def worst_context(tokenizer, record: dict[str, Any], position: int, size: int) -> dict[str, Any]:
    """The worst token's id and text, and the ``size`` tokens before it, decoded."""
    ids = [int(x) for x in record["prompt_token_ids"]] + [int(x) for x in record["response_token_ids"]]
    at = len(record["prompt_token_ids"]) + position
    return {"token_id": ids[at], "token": tokenizer.decode([ids[at]]), "context": tokenizer.decode(ids[max(0, at - size) : at])}


class LogprobDiff:
    """Runs one comparison: :meth:`measure` returns the report, :meth:`write` writes it into a
    staging directory, :meth:`check_gates` raises when a gate failed."""

    def __init__(self, config: DiffConfig):
        self.config = config
        self.report: dict[str, Any] = {}
        self.failed: list[str] = []
        self.deltas = None
        self.version_dir: Optional[Path] = None

    def measure(self) -> dict[str, Any]:
        """Check the settings, score both paths, compare them and check the gates; returns the report."""
        c = self.config
        gates = c.check()
        self.version_dir, against_dir, tokenizer, revision = open_checkpoints(c)
        records, settings, engines = read_diff_records(c.inputs, revision, need_rollout=c.mode == "rollout")
        distribution = comparison_distribution(settings, c.mode)
        path_a, path_b, desc_a, desc_b = self._score(records, distribution=distribution, revision=revision,
                                                     engines=engines, against_dir=against_dir)
        self.deltas = deltas = compare_paths(path_a, path_b, records)
        report = mismatch_report(deltas, worst=c.worst, beta=c.icepop_beta, eps_low=c.dis_low, eps_high=c.dis_high,
                                 context=lambda i, position: worst_context(tokenizer, records[i], position, c.context_tokens))
        report.update({"mode": c.mode, "path_a": desc_a, "path_b": desc_b,
                       "records": sum(not r.get("window") for r in records), "windows": len(records),
                       "temperature": distribution.temperature, "top_k": distribution.top_k, "top_p": distribution.top_p,
                       "log_prob_kind": next(iter(settings))[0], "resampled": deltas.agree is not None,
                       "checkpoint": str(self.version_dir), "deterministic_topk": c.deterministic_topk})
        if any_stale(records):  # the KV owner contract: turns sampled on an older version's cache
            labels = kv_cache_labels(records, deltas.record_index, deltas.position)
            report["by_kv_cache"] = {
                label: summarize(deltas.delta[labels == label], agree=None if deltas.agree is None else deltas.agree[labels == label],
                                 beta=c.icepop_beta, eps_low=c.dis_low, eps_high=c.dis_high)
                for label in ("fresh", "stale") if (labels == label).any()}
        if c.by_version is not None:
            report["by_version"] = self._by_version(records, path_a, distribution)
        if c.routing:
            report["routing"] = routing_report(self.routing, records, c.batch_size, deltas, replayed=c.routing_replay)
            report["overall"]["routing_differing_tokens"] = report["routing"]["overall"]["differing_tokens"]
        if c.indexer:
            report["indexer"] = compare_indexers(path_a, path_b)
            report["overall"]["indexer_differing_sets"] = report["indexer"]["overall"].get("differing_sets", 0)
        self.failed = apply_gates(report, gates)
        self.report = report
        return report

    def _score(self, records, *, distribution: ScoredDistribution, revision: str, engines: set[str], against_dir: Path):
        """``(path_a, path_b, description_a, description_b)``, with a progress bar over both."""
        c = self.config
        side_a = LocalSide(self.version_dir, c.dtype, resolve_device(c.device), c.deterministic_topk, c.batch_size, c.attention)
        progress = tqdm(total=len(records) * 2, desc=STAGE, unit="traj", leave=False, disable=None)
        with progress:
            model_a = side_a.load()
            if c.indexer and not any(True for _ in indexers(model_a)):
                raise ConfigError("{indexer} compares DSA indexer selections, but {checkpoint} ({architecture}) has no DSA "
                                  "indexer", checkpoint=self.version_dir, architecture=type(model_a).__name__)
            with self._routing(model_a, records):
                path_a = side_a.score(model_a, records, distribution=distribution, label="A", indexer=c.indexer, progress=progress.update)
            if c.mode == "rollout":
                path_b = rollout_path(records, resample=bool(engines) and engines <= set(REPRODUCIBLE_ENGINES))
                progress.update(len(records))
                return path_a, path_b, side_a.describe(), {"kind": "rollout", "engines": sorted(engines)}
            if c.mode == "server":
                path_b, desc_b = server_path_b(c.against_server, records, distribution=distribution, revision=revision,
                                               vocab_size=model_a.get_output_embeddings().weight.shape[0], progress=progress.update,
                                               api_key=c.api_key, engine=c.against_engine,
                                               adapter_of=self.version_dir if is_lora_version(self.version_dir) else None)
                return path_a, path_b, side_a.describe(), desc_b
            side_b = self._side_b(side_a, against_dir)
            if c.against is None and side_b.dtype == side_a.dtype and str(side_b.device) == str(side_a.device):
                model_b = side_b.adopt(model_a)
            else:
                del model_a  # free path A's weights before loading path B's
                model_b = side_b.load()
            path_b = side_b.score(model_b, records, distribution=distribution, label="B", indexer=c.indexer, progress=progress.update)
            return path_a, path_b, side_a.describe(), side_b.describe()

    def _routing(self, model, records):
        """Path A's routing session (``routing`` / ``routing_replay``: :mod:`glmpost.diff.routing_probe`), or none."""
        if not (self.config.routing or self.config.routing_replay):
            return contextlib.nullcontext()
        self.routing, session = path_routing(model, records, batch_size=self.config.batch_size, replay=self.config.routing_replay, where=STAGE)
        return session

    def _by_version(self, records, path_a: PathScores, distribution: ScoredDistribution) -> dict[str, Any]:
        """:func:`glmpost.diff.by_version.version_split` with path A's settings."""

        c = self.config

        def score_with(directory: Path, subset: list) -> PathScores:
            side = LocalSide(directory, c.dtype, resolve_device(c.device), c.deterministic_topk, c.batch_size, c.attention)
            return side.score(side.load(), subset, distribution=distribution, label="v", indexer=False, progress=lambda n: None)

        try:
            return version_split(records, path_a, current_version=read_manifest(self.version_dir).policy_version,
                                 root=c.by_version, score_with=score_with, beta=c.icepop_beta, eps_low=c.dis_low, eps_high=c.dis_high)
        except CheckpointError as exc:
            raise ConfigError("{by_version}: {reason}", reason=exc, exit_code=1) from None

    def _side_b(self, side_a: LocalSide, against_dir: Path) -> LocalSide:
        """Path B as a local path: each ``against_*`` setting, else path A's."""
        c = self.config
        return LocalSide(against_dir, c.against_dtype or c.dtype,
                         resolve_device(c.against_device) if c.against_device is not None else side_a.device,
                         side_a.deterministic_topk if c.against_topk is None else c.against_topk == "deterministic",
                         c.against_batch_size or c.batch_size, c.against_attention or c.attention)

    def write(self, staging: Path, options: dict[str, Any]) -> None:
        """Write the plots (with ``plots``), ``report.json``, ``metrics.jsonl`` and ``stage.json``
        (recording ``options``) into ``staging``."""
        report, deltas = self.report, self.deltas
        if self.config.plots:

            report["plots"] = write_mismatch_plots(staging, deltas.delta, deltas.position, deltas.log_prob_a, deltas.log_prob_b,
                                                   label_a="A", label_b=f"B: {report['mode']}")
        write_json_atomic(staging / "report.json", report)
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            metrics.write(**metrics_row(report))
        write_stage_json(staging, STAGE, options, checkpoint=str(self.version_dir), mode=report["mode"],
                         attention_ran=attention_ran(self.version_dir, self.config.attention))

    def check_gates(self) -> None:
        """Raise (exit 1) when a ``fail_above`` gate failed, naming the gates and the report."""
        if self.failed:
            raise GlmpostError(f"{STAGE}: gate failed: {'; '.join(self.failed)} (report in {self.config.out / 'report.json'})")
