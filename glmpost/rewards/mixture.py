"""The reward mixture: named components, each a reward or a penalty, scalarised into one reward.

General RL mixes rule rewards, an ORM and a generative judge (the brief, "General RL"). Each
component is a :class:`~glmpost.rewards.components.ComponentSpec` (``name``, ``source``, ``weight``,
source options; parsed and checked in :mod:`glmpost.rewards.components`) in one of
two lists, rewards ``R_k`` with weights ``w_k`` and penalties ``P_j`` with weights ``lambda_j``;
:func:`scalarize` is the formula and :class:`RewardMixture` evaluates the components on records.

Sources (and their options):

- ``verifier`` — the record's domain verifier (:class:`~glmpost.rewards.verifiers.VerifierTable`);
  ``verifier = "math"`` or ``"pkg.mod:fn"`` pins one regardless of domain.
- ``format`` — 1 when ``pattern`` (a regex, ``re.search``) is found in the response text, else 0.
- ``length`` — ``clip((A - max_tokens) / ramp_tokens, 0, 1)`` over the A action tokens
  (``ramp_tokens`` defaults to ``max_tokens``).
- ``overlong`` — DAPO's soft overlong punishment as a penalty (:func:`~glmpost.rewards.verifiers.overlong_penalty`):
  ``clip((A - (L_max - cache_tokens)) / cache_tokens, 0, 1)`` over the A action tokens, ``L_max`` =
  ``max_tokens``, default the record's ``sampling.max_new_tokens`` (the rollout's limit; a multi-turn
  record needs ``max_tokens``: its limit is per turn).
- ``truncated`` — 1 when the rollout's ``status`` is ``truncated``.
- ``orm`` — an Outcome Reward Model (``checkpoint``, ``activation``, ``batch_size``, ``attention``).
- ``judge`` — a generative judge (``checkpoint``, ``template``, ``max_new_tokens``,
  ``score_pattern``, ``max_score``, ``batch_size``, ``attention``: ``native`` or ``reference`` GLM-5 attention).

A component that fails on a record stores NaN in ``rewards[name]``, and the record's ``reward`` is
NaN with ``reward_info["failure"]`` naming the component and the reason; nothing is silently 0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from glmpost.errors import GlmpostError
from glmpost.formats import REWARD_FAILURE_KEY
from glmpost.rewards.components import ComponentSpec, check_components, default_components
from glmpost.rewards.verifiers import (
    VerifierTable,
    VerifyContext,
    format_score,
    length_penalty,
    overlong_penalty,
    resolve_verifier,
    run_verifier,
    truncated_penalty,
)


def scalarize(values: Mapping[str, float], specs: Sequence[ComponentSpec]) -> float:
    """``R(tau) = sum_k w_k R_k(tau) - sum_j lambda_j P_j(tau)``.

    ``values`` maps each component name to its value on one trajectory; rewards (``kind ==
    "reward"``) enter with ``+weight``, penalties with ``-weight`` (``lambda_j``). If any component
    is NaN (it failed), the result is NaN: a failed judgement never becomes a number.
    """
    total = 0.0
    for spec in specs:
        value = values[spec.name]
        if math.isnan(value):
            return math.nan
        total += spec.weight * value if spec.kind == "reward" else -spec.weight * value
    return total


@dataclass(frozen=True)
class ComponentResult:
    """One component on one record: ``value`` (NaN when it failed), the ``failure`` reason, details."""

    value: float
    failure: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)


def combine(specs: Sequence[ComponentSpec], results: Mapping[str, ComponentResult]) -> tuple[dict[str, float], float, dict[str, Any]]:
    """``(rewards, reward, reward_info)`` for one record from its component results.

    ``rewards`` holds every component value (NaN for failures); ``reward`` is :func:`scalarize`;
    ``reward_info["components"][name]`` holds source, kind, weight and details, plus
    ``failure`` for a failed one; when any failed, ``reward_info["failure"]`` is one line naming
    each failed component and why, and ``reward_info["failed_components"]`` lists them.
    """
    rewards = {spec.name: float(results[spec.name].value) for spec in specs}
    reward = scalarize(rewards, specs)
    components: dict[str, Any] = {}
    failures: list[str] = []
    for spec in specs:
        result = results[spec.name]
        entry = {"source": spec.source, "kind": spec.kind, "weight": spec.weight, **result.details}
        if result.failure is not None or math.isnan(result.value):
            reason = " ".join((result.failure or "no value").split())
            entry["failure"] = reason
            failures.append(f"{spec.name} ({spec.source}): {reason}")
        components[spec.name] = entry
    info: dict[str, Any] = {"components": components}
    if failures:
        info[REWARD_FAILURE_KEY] = "; ".join(failures)
        info["failed_components"] = [spec.name for spec in specs if "failure" in components[spec.name]]
    return rewards, reward, info


# --------------------------------------------------------------------------------------------
# Evaluating components on records


class RecordView:
    """A record plus its texts decoded by the policy tokenizer (special tokens removed), each
    decoded at most once and only when a component asks for it."""

    def __init__(self, record: Mapping[str, Any], tokenizer: Any):
        self.record = record
        self.tokenizer = tokenizer

    @property
    def id(self) -> str:
        return str(self.record.get("id", ""))

    @cached_property
    def text(self) -> str:
        """The whole response (actions and observations) after the reasoning block a single-turn
        rollout split off (``extra.reasoning_tokens``, ``rollout --reasoning-parser``): an answer
        inside the reasoning is never scored."""
        skip = (self.record.get("extra") or {}).get("reasoning_tokens", 0)
        skip = skip if isinstance(skip, int) and not isinstance(skip, bool) else 0
        return self.tokenizer.decode([int(t) for t in self.record["response_token_ids"][skip:]], skip_special_tokens=True)

    @cached_property
    def prompt_text(self) -> str:
        return self.tokenizer.decode([int(t) for t in self.record["prompt_token_ids"]], skip_special_tokens=True).strip()

    def context(self, options: Mapping[str, Any] | None = None) -> VerifyContext:
        """The record as a verifier sees it; ``options``: the run's verifier settings."""
        r = self.record
        return VerifyContext(
            text=self.text,
            response_token_ids=r["response_token_ids"],
            action_mask=r["action_mask"],
            task=r.get("task") or {},
            status=r.get("status", ""),
            tokenizer=self.tokenizer,
            domain=r.get("domain", ""),
            sampling=r.get("sampling") or {},
            record_id=self.id,
            extra=r.get("extra") or {},
            options=options or {},
        )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _per_record(fn: Callable[[RecordView], ComponentResult]) -> Callable[[list[RecordView]], list[ComponentResult]]:
    """Lift a per-record scorer to a batch one; an exception fails that record only."""

    def run(views: list[RecordView]) -> list[ComponentResult]:
        out = []
        for view in views:
            try:
                out.append(fn(view))
            except Exception as exc:  # a verifier's (possibly user code's) error is recorded, not raised
                out.append(ComponentResult(math.nan, _one_line(exc)))
        return out

    return run


class RewardMixture:
    """Evaluates components on batches of records and adds ``rewards``, ``reward``, ``reward_info``.

    ``tokenizer`` (the policy's, revision ``tokenizer_revision``) decodes responses; ``verifiers``
    routes domains; ORM and judge components load their checkpoints here, on ``device``, so a
    checkpoint that does not load fails before any record is judged.
    """

    def __init__(
        self,
        specs: Sequence[ComponentSpec],
        *,
        tokenizer: Any,
        tokenizer_revision: str,
        verifiers: VerifierTable,
        device: Any = "cpu",
    ):
        self.specs = check_components(specs or default_components())
        self.tokenizer = tokenizer
        self.tokenizer_revision = tokenizer_revision
        self.verifiers = verifiers
        self._scorers = {spec.name: self._build_named(spec, device) for spec in self.specs}

    # -- building ------------------------------------------------------------------------

    def _build_named(self, spec: ComponentSpec, device: Any) -> Callable[[list[RecordView]], list[ComponentResult]]:
        try:
            return self._build(spec, device)
        except GlmpostError as exc:  # e.g. a checkpoint that does not load: say which component wanted it
            error = GlmpostError(f"component {spec.name!r} ({spec.source}): {exc}")
            error.exit_code = exc.exit_code
            raise error from None

    def _build(self, spec: ComponentSpec, device: Any) -> Callable[[list[RecordView]], list[ComponentResult]]:
        o = spec.options
        if spec.source == "verifier":
            pinned = o.get("verifier")
            fixed = resolve_verifier(pinned, where=f"component {spec.name!r}") if pinned else None

            def verify(view: RecordView) -> ComponentResult:
                name, fn = (pinned, fixed) if fixed is not None else self.verifiers.lookup(view.record.get("domain"))
                verdict = run_verifier(fn, view.context(self.verifiers.options))
                return ComponentResult(verdict.score, details={"verifier": name, **verdict.details})

            return _per_record(verify)
        if spec.source == "format":
            pattern = re.compile(o["pattern"])
            return _per_record(lambda v: ComponentResult(format_score(v.text, pattern)))
        if spec.source == "length":
            max_tokens, ramp = o["max_tokens"], o.get("ramp_tokens", max(o["max_tokens"], 1))

            def length(view: RecordView) -> ComponentResult:
                n = int(np.count_nonzero(view.record["action_mask"]))
                return ComponentResult(length_penalty(n, max_tokens, ramp), details={"action_tokens": n})

            return _per_record(length)
        if spec.source == "overlong":
            return _per_record(lambda v: self._overlong(v, o))
        if spec.source == "truncated":
            return _per_record(lambda v: ComponentResult(truncated_penalty(v.record.get("status", ""))))
        if spec.source == "orm":
            from glmpost.rewards.models import OrmConfig, OutcomeRewardModel  # lazily: the model rewards import torch

            orm = OutcomeRewardModel(OrmConfig(**o), tokenizer_revision=self.tokenizer_revision, device=device)

            def score_orm(views: list[RecordView]) -> list[ComponentResult]:
                sequences = [np.concatenate([v.record["prompt_token_ids"], v.record["response_token_ids"]]) for v in views]
                return [ComponentResult(s.value, s.failure, s.details) for s in orm.score(sequences)]

            return score_orm
        if spec.source == "judge":
            from glmpost.rewards.models import (  # lazily: the model rewards import torch
                GenerativeJudge,
                GenerativeJudgeConfig,
            )

            judge = GenerativeJudge(GenerativeJudgeConfig(**o), device=device)

            def score_judge(views: list[RecordView]) -> list[ComponentResult]:
                scores = judge.score([v.prompt_text for v in views], [v.text for v in views], [v.id for v in views])
                return [ComponentResult(s.value, s.failure, s.details) for s in scores]

            return score_judge
        raise ValueError(f"unknown source {spec.source!r}")  # parse_component prevents this

    @staticmethod
    def _overlong(view: RecordView, options: Mapping[str, Any]) -> ComponentResult:
        n = int(np.count_nonzero(view.record["action_mask"]))
        limit = options.get("max_tokens")
        if limit is None:
            if (view.record.get("extra") or {}).get("env"):
                return ComponentResult(math.nan, "overlong: a multi-turn record's max_new_tokens is per turn; give max_tokens")
            limit = (view.record.get("sampling") or {}).get("max_new_tokens")
            if limit is None:
                return ComponentResult(math.nan, "overlong: the record's sampling has no max_new_tokens; give max_tokens")
        return ComponentResult(overlong_penalty(n, int(limit), options["cache_tokens"]),
                               details={"action_tokens": n, "max_tokens": int(limit)})

    # -- judging -------------------------------------------------------------------------

    def _run(self, spec: ComponentSpec, views: list[RecordView]) -> list[ComponentResult]:
        """One component on a batch; a batch-wide error (e.g. a model forward) fails each record of it."""
        try:
            return self._scorers[spec.name](views)
        except Exception as exc:
            failure = ComponentResult(math.nan, f"{spec.source} failed on a batch of {len(views)}: {_one_line(exc)}")
            return [failure] * len(views)

    def judge(self, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """New records: every input field kept, ``rewards``/``reward``/``reward_info`` set (replaced)."""
        views = [RecordView(r, self.tokenizer) for r in records]
        per_component = {spec.name: self._run(spec, views) for spec in self.specs}
        judged = []
        for i, record in enumerate(records):
            rewards, reward, info = combine(self.specs, {name: results[i] for name, results in per_component.items()})
            judged.append({**record, "rewards": rewards, "reward": reward, "reward_info": info})
        return judged


# --------------------------------------------------------------------------------------------
# Reporting


class RewardStats:
    """Running summary of judged records: reward mean/std/min/max over the records that did not
    fail, the failure count, and each component's mean and failure count."""

    def __init__(self, specs: Sequence[ComponentSpec]):
        self.names = [spec.name for spec in specs]
        self.rewards: list[float] = []
        self.records = 0
        self.failures = 0
        self.component_values: dict[str, list[float]] = {name: [] for name in self.names}
        self.component_failures: dict[str, int] = {name: 0 for name in self.names}

    def add(self, record: Mapping[str, Any]) -> None:
        self.records += 1
        reward = record["reward"]
        if math.isnan(reward):
            self.failures += 1
        else:
            self.rewards.append(reward)
        for name in self.names:
            value = record["rewards"][name]
            if math.isnan(value):
                self.component_failures[name] += 1
            else:
                self.component_values[name].append(value)

    def merge(self, other: "RewardStats") -> None:
        self.records += other.records
        self.failures += other.failures
        self.rewards.extend(other.rewards)
        for name in self.names:
            self.component_values[name].extend(other.component_values[name])
            self.component_failures[name] += other.component_failures[name]

    def metrics(self, prefix: str = "judge/") -> dict[str, Any]:
        """Stable keys: ``records``, ``failures``, ``reward_{mean,std,min,max}`` (None when every
        record failed), ``components/<name>/mean`` and ``components/<name>/failures``."""
        values = np.asarray(self.rewards, dtype=np.float64)
        stats: dict[str, Any] = {f"{prefix}records": self.records, f"{prefix}failures": self.failures}
        for key, fn in (("mean", np.mean), ("std", np.std), ("min", np.min), ("max", np.max)):
            stats[f"{prefix}reward_{key}"] = float(fn(values)) if values.size else None
        for name in self.names:
            component = self.component_values[name]
            stats[f"{prefix}components/{name}/mean"] = float(np.mean(component)) if component else None
            stats[f"{prefix}components/{name}/failures"] = self.component_failures[name]
        return stats
