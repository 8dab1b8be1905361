"""What the RL training stages (train-grpo, opd-merge, train-sao) do once their flags are parsed, the
same for the three: ``--follow SPOOL`` runs the stage's follow trainer and prints its summary;
otherwise one update from ``--checkpoint`` in a :class:`~glmpost.rl.run_once.RunOnce`, reported
(nothing on a rank other than 0, the skip when the version existed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import typer

from glmpost.commands.common import effective_options, print_summary, report_update
from glmpost.commands.options import LORA_OPTIONS, TRAINING_RUN_OPTIONS, config_from, follow_from
from glmpost.rl.follow import FollowConfig, follow_line
from glmpost.rl.run import RunOptions
from glmpost.rl.run_once import RunOnce

# The run settings every RL training stage takes (qat takes TRAINING_RUN_OPTIONS alone).
RL_RUN_OPTIONS = TRAINING_RUN_OPTIONS + ("reset_optimizer", "deterministic_topk") + LORA_OPTIONS  # LoRA: glmpost.rl.lora_training


def run_training_stage(ctx: typer.Context, stage: str, inputs: list[str] | None, *, checkpoint: Path, out: Path, what: str,
                       follow: Callable[..., dict[str, Any]], update: Callable[..., dict[str, Any] | None],
                       human: Callable[[dict[str, Any], str], str], as_json: bool) -> None:
    """``follow(spool, checkpoint=, out=, options=, stage_options=)`` and ``update(run, inputs,
    stage_options=)`` are the stage's library calls with its own settings bound (``functools.partial``);
    ``what`` names its inputs in the error when both or neither of INPUTS and --follow are given;
    ``human(summary, parent)`` is the update's line (``parent``: the version it trained from)."""
    spool = follow_from(ctx, FollowConfig, inputs, name="INPUTS", what=what)
    options, stage_options = config_from(ctx, RunOptions), effective_options(ctx)
    if spool is not None:
        summary = follow(spool, checkpoint=checkpoint, out=out, options=options, stage_options=stage_options)
        return print_summary(summary, as_json=as_json, human=follow_line(summary))
    with RunOnce(checkpoint, out, options, stage=stage) as run:
        summary = update(run, inputs, stage_options=stage_options)
    report_update(summary, as_json=as_json, human=lambda s: human(s, run.parent.name))
