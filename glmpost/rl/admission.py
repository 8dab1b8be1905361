"""Which records a policy-gradient update trains (train-grpo, opd-merge, train-sao; run once or
following a spool): one :func:`admit` for the three.

Read and checked (complete shards, the stage's fields, the checkpoint's tokenizer revision), the
records pass four gates in order:

1. **unseen**: a record a spool's ledger says was trained before is left out and counted;
2. **fresh**: ``max_staleness`` drops whole trajectories sampled too many versions before the
   parent (:func:`~glmpost.rl.batches.drop_stale`; their lengths and rewards are measured);
3. **version lags**: a record newer than the parent, or older than the accepted lag, is refused;
4. **sampled distribution**: the records agree on the distribution their ``rollout_log_probs`` are
   of (:func:`sampled_distribution`), which the trainer's log-probs are then taken under too.

Then the stage's settings are validated. What passes is an :class:`Admission`: the records, what
the gates measured, and the distribution, which the run hands to the trainer with the update (the
stage's config is never changed). None left after a gate is :class:`NothingToTrain`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from glmpost.errors import GlmpostError
from glmpost.formats import read_checked_records
from glmpost.kernel.distribution import ScoredDistribution, scored_distribution
from glmpost.kernel.engine import SamplingParams
from glmpost.rl.batches import check_version_lags, drop_stale
from glmpost.stage import log


class NothingToTrain(GlmpostError):
    """An update whose records were all excluded (stale, already trained, failed): nothing to publish.
    ``metrics``: what the exclusion measured (the stale-dropped records' lengths and rewards)."""

    def __init__(self, message: str, metrics: dict[str, float] | None = None):
        super().__init__(message)
        self.metrics = dict(metrics or {})


@dataclass(frozen=True)
class Admission:
    """The records an update trains, what admitting them measured, and the distribution their
    ``rollout_log_probs`` are of (the trainer's log-probs are taken under it)."""

    records: list[dict]
    distribution: ScoredDistribution
    already: int  # records trained before (a spool's ledger), left out
    stale: dict[str, float]  # what max_staleness dropped (drop_stale's metrics; empty when unset)
    lags: dict[str, int]  # records per policy-version lag ("unknown": records without versions)

    @property
    def metrics(self) -> dict[str, Any]:
        """What every optimizer step's metrics line records of the admission."""
        return {"train/already_trained": self.already, **lag_metrics(self.lags), **self.stale}

    @property
    def stale_dropped(self) -> int:
        return int(self.stale.get("train/stale_dropped", 0))

    @property
    def scored(self) -> dict[str, Any]:
        """The distribution as stage.json records it (``log_prob_distribution``)."""
        d = self.distribution
        return {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p}


def admit(inputs: Sequence[str], config, *, stage: str, parent_version: int, revision: str, require: Sequence[str],
          check: Callable[[dict, str], None] | None = None, skip_ids: frozenset[str] = frozenset(),
          temperature: float | None = None, dis: bool = False) -> Admission:
    """The records of ``inputs`` an update from a parent at ``parent_version`` trains (module doc).
    ``require`` / ``check``: the stage's fields and rule (:func:`~glmpost.formats.read_checked_records`);
    ``skip_ids``: records trained before; ``temperature``: score at it instead of the records' own
    (train-grpo --temperature); ``dis``: the update masks lagged records with DIS already (the lag
    refusal says so). ``config``: ``max_staleness``, ``accepted_lag()`` and ``validate()``."""
    records = read_checked_records(inputs, revision=revision, stage=stage, require=list(require), check=check)
    records, already = _unseen(records, skip_ids, stage)
    records, stale = _fresh(records, parent_version, config, stage)
    lags = check_version_lags(records, parent_version, max_lag=config.accepted_lag(), stage=stage, dis=dis)
    recorded = sampled_distribution(records, stage)
    distribution = recorded if temperature is None else sampled_distribution(records, stage, temperature=temperature)
    config.validate()  # a refused setting names its field (a command turns it into its flag)
    if temperature is not None and not math.isclose(temperature, recorded.temperature):
        log(f"warning: --temperature {temperature} differs from the sampling temperature {recorded.temperature}; "
            "IcePop will compare different distributions")
    return Admission(records, distribution, already, stale, lags)


def sampled_distribution(records: Sequence[dict], stage: str, *, temperature: float | None = None) -> ScoredDistribution:
    """The one distribution the records' ``rollout_log_probs`` are of (their ``sampling``:
    ``log_prob_kind`` at their temperature, top-k and top-p; formats/SPEC.md), which the trainer's
    old and new log-probs then are of too, so IcePop's ratio compares like with like (brief, "IcePop
    为什么有两层 ratio"; TRL#6789). ``temperature`` overrides the records' (train-grpo --temperature).

    Greedy records (temperature 0) are refused: the policy they were decoded with is a point mass,
    so there is no probability ratio to optimise (their ``raw`` log-probs remain comparable with
    ``diff-logprobs``). So are records that differ in these settings, or name an unknown kind."""
    settings: dict[tuple, str] = {}
    for record in records:
        try:
            params = SamplingParams.from_record(record["sampling"])
        except ValueError as exc:
            raise GlmpostError(f"{stage}: record {record['id']!r}: {exc}") from None
        if params.temperature == 0:
            raise GlmpostError(f"{stage}: record {record['id']!r} was decoded greedily (sampling.temperature 0): a point "
                               "mass has no probability ratio to optimise; roll out with --temperature > 0")
        settings.setdefault((params.log_prob_kind, params.temperature, params.top_k, params.top_p), record["id"])
    if len(settings) > 1:
        raise GlmpostError(f"{stage}: records differ in sampling (log_prob_kind, temperature, top_k, top_p): "
                           f"{sorted(settings, key=str)}; train them separately")
    kind, sampled_at, top_k, top_p = next(iter(settings))
    return scored_distribution(kind, temperature=sampled_at if temperature is None else temperature, top_k=top_k, top_p=top_p)


def lag_metrics(lags: dict[str, int]) -> dict[str, int]:
    """Records per policy-version lag (``train/version_lag/0``, ..., ``/unknown``)."""
    return {f"train/version_lag/{lag}": n for lag, n in sorted(lags.items())}


def _unseen(records: list[dict], skip_ids: frozenset[str], stage: str) -> tuple[list[dict], int]:
    """The records whose id is not in ``skip_ids`` (trained before, by a spool's ledger) and how
    many were; none left is :class:`NothingToTrain`."""
    kept = [r for r in records if r["id"] not in skip_ids]
    if records and not kept:
        raise NothingToTrain(f"{stage}: no usable records: every record was trained before ({len(records)})")
    return kept, len(records) - len(kept)


def _fresh(records: list[dict], parent_version: int, config, stage: str) -> tuple[list[dict], dict[str, float]]:
    """The records ``max_staleness`` keeps (:func:`~glmpost.rl.batches.drop_stale`) and its metrics;
    none left is :class:`NothingToTrain` (carrying the metrics)."""
    kept, metrics = drop_stale(records, parent_version, config.max_staleness)
    if records and not kept:
        raise NothingToTrain(f"{stage}: no usable records: all {len(records)} were sampled more than --max-staleness "
                             f"{config.max_staleness} policy versions before --checkpoint's {parent_version}", metrics)
    return kept, metrics
