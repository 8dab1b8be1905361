"""Batch arithmetic of a recipe: the rules its batch sizes must satisfy across stages.

``glmpost recipe check`` runs :func:`batch_arithmetic` on every stage's effective options (recipe
values over the commands' defaults) before anything runs.
"""

from __future__ import annotations

import math
from typing import Any

Problems = list[tuple[str, str]]  # (recipe section, message)


def batch_arithmetic(values: dict[str, dict[str, Any]], *, ranks: int) -> tuple[Problems, Problems]:
    """The rules a recipe's batch sizes must satisfy; returns ``(errors, warnings)`` as (section, message).

    ``values`` maps a stage to all its options (recipe values and the commands' defaults). For a
    GRPO update (``train-grpo``; ``opd-merge`` likewise) fed by ``[rollout]``, one update trains
    ``R = prompts-per-shard * group-size`` trajectories (one rollout shard per update, as the
    brief's batch of 32 prompts x 32 samples). glmpost's trainer (glmpost/rl/trainer.py) splits the
    shuffled R into ``mini-batches`` optimizer steps and each step's trajectories round-robin over
    the ``ranks`` data-parallel ranks, which run ``micro-batch-size`` trajectories per
    forward/backward. Errors:

    - ``group-size >= 2`` for train-grpo: a group of one has advantage (R - mean) / (std + eps) = 0;
    - ``mini-batches <= R``: else a mini-batch is empty;
    - ``R % mini-batches == 0``: every optimizer step sees the same number of trajectories;
    - ``(R / mini-batches) % ranks == 0``: every rank gets the same share (else ranks run
      zero-weighted filler passes to keep their collectives in step).

    Warnings: a rank's share not a multiple of ``micro-batch-size`` (the last micro-batch is
    partly filled) or smaller than it; train-grpo ``temperature`` differing from the rollout's.
    ``qat``: ``batch-size % ranks == 0`` (error) and ``(batch-size / ranks) % micro-batch-size``
    (warning).
    """
    errors: Problems = []
    warnings: Problems = []
    rollout = values.get("rollout")
    for stage in ("train-grpo", "opd-merge"):
        if values.get(stage) is not None and rollout is not None:
            _update_rules(stage, values[stage], rollout, ranks, errors, warnings)
    qat = values.get("qat")
    if qat is not None and isinstance(qat.get("batch_size"), int) and isinstance(qat.get("micro_batch_size"), int):
        batch, micro = qat["batch_size"], qat["micro_batch_size"]
        if batch % ranks:
            errors.append(("qat", f"batch-size {batch} does not split evenly over {ranks} ranks"))
        elif (batch // ranks) % micro:
            warnings.append(("qat", (f"micro-batch-size {micro} does not divide a rank's {batch // ranks} "
                                    "trajectories per step; the last micro-batch is partly filled")))
    return errors, warnings


def _update_rules(stage: str, train: dict[str, Any], rollout: dict[str, Any], ranks: int,
                  errors: Problems, warnings: Problems) -> None:
    """The rules of one policy update (``train-grpo`` or ``opd-merge``) fed by ``[rollout]``."""
    group, prompts = rollout.get("group_size"), rollout.get("prompts_per_shard")
    mini, micro = train.get("mini_batches"), train.get("micro_batch_size")
    if not all(isinstance(v, int) for v in (group, prompts, mini, micro)):
        return
    records = prompts * group
    if stage == "train-grpo" and group < 2:
        errors.append(("rollout", (f"group-size {group} with [train-grpo]: GRPO needs at least 2 samples per "
                                  "prompt (a group of one has advantage (R - mean) / (std + eps) = 0)")))
    how = f"prompts-per-shard {prompts} x group-size {group} = {records} trajectories per update"
    if mini > records:
        errors.append((stage, f"mini-batches {mini} exceeds the {how}: some optimizer steps would be empty"))
        return
    if records % mini:
        errors.append((stage, (f"mini-batches {mini} does not divide the {how} "
                              f"(steps of {records // mini} and {records // mini + 1})")))
        return
    per_step = records // mini
    if per_step % ranks:
        errors.append((stage, (f"{per_step} trajectories per optimizer step ({how} / mini-batches {mini}) "
                              f"do not split evenly over {ranks} ranks")))
        return
    share = per_step // ranks
    if micro > share:
        warnings.append((stage, (f"micro-batch-size {micro} exceeds a rank's {share} trajectories per step; "
                                f"micro-batches hold {share}")))
    elif share % micro:
        warnings.append((stage, (f"micro-batch-size {micro} does not divide a rank's {share} trajectories per "
                                f"step; the last micro-batch holds {share % micro}")))
    temp_train, temp_roll = train.get("temperature"), rollout.get("temperature")
    if isinstance(temp_train, float) and isinstance(temp_roll, float) and not math.isclose(temp_train, temp_roll):
        warnings.append((stage, (f"temperature {temp_train} differs from [rollout] temperature {temp_roll}; "
                                "IcePop would compare different distributions")))
