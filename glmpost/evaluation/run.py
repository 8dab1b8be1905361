"""One eval run (what ``glmpost eval`` runs): sample n responses per prompt, judge them, report
avg@n, pass@k and maj@n per domain and overall.

    rollout (the rollout library, group size n) -> OUT/rollout
    -> judge (the judge library, the domain verifier as the one component ``correct``) -> OUT/judged
    -> per prompt: c correct of n -> per domain and overall: the means over prompts
    -> OUT/report.json, one OUT/metrics.jsonl line, OUT/stage.json

A sample is *correct* when its verifier score (the judged record's ``rewards["correct"]``) is at
least ``threshold`` (default 1: the verifier's full score; ``math`` scores 0 or 1, ``count`` the
fraction of matching tokens). A sample whose judgement failed (NaN, the reason in its
``reward_info``) is incorrect and counted in ``failures``. Its *answer*, for maj@n, is its
verifier's canonical answer (``reward_info.components.correct.answer``: ``math``'s final answer as
one string, equal for equal answers, by the ``math_checker``: :mod:`glmpost.rewards.math_answers`),
else what its verifier extracted (``...correct.extracted``, normalised by
:func:`~glmpost.rewards.math_answers.normalize_math_answer`), else its whole response text (special
tokens removed, whitespace stripped); a sample without one does not vote.
A rerun keeps the rollout parts and judged shards already complete (``overwrite`` redoes them) and
is refused when an option that changes the samples differs from OUT/stage.json's (``k`` and
``threshold`` may change: the report is written again).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional

from glmpost.config import ConfigError, section, setting
from glmpost.drivers import run_shards
from glmpost.evaluation.metrics import avg_at_k, maj_at_k, pass_at_k
from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.kernel.loading import load_tokenizer
from glmpost.locks import output_lock
from glmpost.rewards.judging import JudgeConfig, JudgeStage, VerifierRouting
from glmpost.rewards.math_answers import check_math_checker, normalize_math_answer
from glmpost.rollout.runner import RolloutRunner
from glmpost.rollout.settings import RolloutConfig
from glmpost.stage import MetricsWriter, check_same_options, write_json_atomic, write_stage_json

STAGE = "eval"
CORRECT = "correct"  # the judge's default component: the domain verifier, weight 1
# Options a rerun may change: how to run, and what only the report reads (the samples stay the same).
PER_RUN_OPTIONS = ("as_json", "overwrite", "config", "batch_size", "device", "concurrency", "timeout", "retries",
                   "zstd_level", "k", "threshold")


@dataclass
class EvalConfig:
    """What one ``eval`` run reports (its sampling settings are a :class:`RolloutConfig`)."""

    inputs: list[str] = field(default_factory=list)  # prompt JSONL files (or shards to resample)
    checkpoint: Optional[Path] = None  # the policy: a root (its LATEST) or a version directory
    out: Optional[Path] = None  # OUT/rollout, OUT/judged, OUT/report.json, OUT/metrics.jsonl
    n: int = setting(4, "Responses sampled per prompt: the n of avg@n, pass@k and maj@n.", min=1)
    k: list[int] = setting(
        [], "A k of pass@k (1 <= k <= --n); repeatable. Default: 1 and --n.", min=1,
        cli={"annotation": List[int], "metavar": "K"})
    threshold: float = setting(
        1.0, "A sample is correct when its verifier score is at least this (math scores 0 or 1; count the fraction "
        "of matching tokens); a failed judgement is incorrect.", above=0.0, max=1.0)
    routing: VerifierRouting = section(VerifierRouting, help={
        "domains": 'Domain-to-verifier table, as the recipe\'s [eval.domains] (e.g. \'{gsm8k = "math"}\'). '
                   "Domains named like a built-in verifier (math, count, env) need no entry.",
        "default_verifier": "Verifier for prompts whose domain has none (or no domain); without it such a prompt is an error."})

    def ks(self) -> list[int]:
        """The k of pass@k, sorted, each checked against n (default: 1 and n)."""
        ks = sorted(set(self.k or [1, self.n]))
        for k in ks:
            if not 1 <= k <= self.n:
                raise ConfigError("{k} {value} must be between 1 and {n} ({count})", value=k, count=self.n)
        return ks


def run_eval(config: EvalConfig, sampling: RolloutConfig, *, options: dict[str, Any],
             metrics: MetricsWriter | None = None) -> dict[str, Any]:
    """Roll out, judge, report (module doc); returns the summary (``report`` is report.json). The
    metrics line goes to ``metrics`` when given (``eval --follow``: one file for every version)."""
    ks = config.ks()
    check_math_checker(config.routing.math_checker)  # before the rollout: judging it would refuse the checker
    out = Path(config.out)
    rollout = dataclasses.replace(sampling, inputs=list(config.inputs), checkpoint=config.checkpoint,
                                  out=out / "rollout", group_size=config.n, shard_index=0, num_shards=1)
    with output_lock(out, stage=STAGE):
        check_same_options(out, STAGE, options, ignore=PER_RUN_OPTIONS, overwrite=sampling.overwrite)
        rolled = RolloutRunner(rollout).run()
        judge = JudgeStage(JudgeConfig(inputs=[str(rollout.out)], out=out / "judged", checkpoint=config.checkpoint,
                                       routing=config.routing, device=sampling.device,
                                       zstd_level=sampling.zstd_level,
                                       options=config.routing.as_options()))
        run_shards(judge, inputs=[str(rollout.out)], out=out / "judged", shard_index=0,
                   num_shards=1, overwrite=sampling.overwrite)
        tokenizer, _ = load_tokenizer(config.checkpoint)
        samples = list(judged_samples(out / "judged", tokenizer, config.threshold))
        report = build_report(samples, n=config.n, ks=ks)
        report["policy_version"] = rolled.get("policy_version")
        write_json_atomic(out / "report.json", report)
        if metrics is not None:
            metrics.write(**report_metrics(report))
        else:
            with MetricsWriter(out / "metrics.jsonl") as own:
                own.write(**report_metrics(report))
        write_stage_json(out, STAGE, options, policy_version=rolled.get("policy_version"))
    return {"out": str(out), "records": len(samples), "report": report}


@dataclass(frozen=True)
class Sample:
    """One judged response as the metrics see it."""

    prompt_id: str
    domain: str
    score: float  # the verifier's score; NaN when the judgement failed
    correct: bool
    answer: Optional[str]  # what votes for maj@n; None does not vote


def judged_samples(judged: Path, tokenizer: Any, threshold: float) -> Iterator[Sample]:
    """Every judged record of ``judged`` (shard order: a prompt's samples in sample order) as a :class:`Sample`."""
    for path in resolve_shard_paths([str(judged)]):
        for record in ShardReader(path):
            score = float((record.get("rewards") or {}).get(CORRECT, math.nan))
            yield Sample(str(record["prompt_id"]), str(record.get("domain") or ""), score,
                         not math.isnan(score) and score >= threshold, answer_of(record, tokenizer))


def answer_of(record: dict[str, Any], tokenizer: Any) -> Optional[str]:
    """The answer a sample votes for (module doc)."""
    details = ((record.get("reward_info") or {}).get("components") or {}).get(CORRECT) or {}
    if "answer" in details:
        return None if details["answer"] is None else str(details["answer"])
    if "extracted" in details:
        return None if details["extracted"] is None else str(normalize_math_answer(details["extracted"]))
    text = tokenizer.decode([int(t) for t in record["response_token_ids"]], skip_special_tokens=True).strip()
    return text or None


def prompt_metrics(samples: list[Sample], ks: list[int]) -> dict[str, float]:
    """avg@n, pass@k for each k, maj@n and the mean score of one prompt's samples."""
    n, correct = len(samples), [s.correct for s in samples]
    if n < max(ks):
        raise ConfigError("prompt {prompt!r} has {count} judged samples, fewer than {k} {value}",
                          prompt=samples[0].prompt_id, count=n, value=max(ks))
    scores = [s.score for s in samples if not math.isnan(s.score)]
    return {"avg": avg_at_k(correct), **{f"pass@{k}": pass_at_k(n, sum(correct), k) for k in ks},
            "maj": maj_at_k([s.answer for s in samples], correct),
            "score_mean": sum(scores) / len(scores) if scores else math.nan,
            "failures": float(n - len(scores)), "samples": float(n)}


def build_report(samples: list[Sample], *, n: int, ks: list[int]) -> dict[str, Any]:
    """report.json: ``overall`` and ``domains[DOMAIN]``, each with prompts, samples, n, ``avg@n``,
    ``pass@k`` per k, ``maj@n``, ``score_mean`` (the mean verifier score) and ``failures``; every
    metric the mean over prompts of the per-prompt value (:func:`prompt_metrics`)."""
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.prompt_id, []).append(sample)
    per_prompt = {pid: (group[0].domain, prompt_metrics(group, ks)) for pid, group in groups.items()}
    domains = sorted({domain for domain, _ in per_prompt.values()})
    return {"n": n, "k": ks,
            "overall": _aggregate([m for _, m in per_prompt.values()], n),
            "domains": {d: _aggregate([m for dom, m in per_prompt.values() if dom == d], n) for d in domains}}


def _aggregate(prompts: list[dict[str, float]], n: int) -> dict[str, Any]:
    if not prompts:
        return {"prompts": 0, "samples": 0, "n": n}
    mean = {key: sum(p[key] for p in prompts) / len(prompts) for key in prompts[0] if key not in ("failures", "samples")}
    scored = [p["score_mean"] for p in prompts if not math.isnan(p["score_mean"])]
    return {"prompts": len(prompts), "samples": int(sum(p["samples"] for p in prompts)), "n": n,
            f"avg@{n}": mean["avg"], **{key: value for key, value in mean.items() if key.startswith("pass@")},
            f"maj@{n}": mean["maj"], "score_mean": sum(scored) / len(scored) if scored else None,
            "failures": int(sum(p["failures"] for p in prompts))}


def describe_scores(overall: dict[str, Any], *, threshold: float) -> str:
    """The ``overall`` metrics of a report as one line saying what each is: avg@n, pass@k and maj@n
    count a response correct only at a verifier score of at least ``threshold``, while score_mean
    is the mean verifier score itself (partial credit: ``count`` scores the fraction of matching
    tokens), so it can be above 0 while avg@n is 0."""
    kinds = ("avg@", "pass@", "maj@")
    counted = ", ".join(f"{key} {overall[key]:.4f}" for kind in kinds for key in overall
                        if key.startswith(kind) and isinstance(overall[key], float))
    text = f"{counted} (a response counts as correct at a verifier score >= {threshold:g})"
    if isinstance(overall.get("score_mean"), float):
        avg = next((key for key in overall if key.startswith("avg@")), "avg@n")
        text += (f", score_mean {overall['score_mean']:.4f} (the mean verifier score: partial credit counts, so it can "
                 f"be above 0 when {avg} is 0)")
    return text


def report_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """The report's scalars as one metrics line: ``eval/METRIC`` overall, ``eval/DOMAIN/METRIC`` per domain."""
    line = {f"eval/{key}": value for key, value in report["overall"].items()}
    for domain, values in report["domains"].items():
        line.update({f"eval/{domain or '(none)'}/{key}": value for key, value in values.items()})
    return {"policy_version": report.get("policy_version"), **line}
