"""Make SAO's critic from a policy checkpoint: the policy architecture with a value head (brief,
"SAO：一条轨迹完成就训练": a value model V_phi restores the baseline a group of one lacks).

The critic is published as version 0 of the checkpoint root --out (v000000 and LATEST): the
policy's Hugging Face files (config, weights, tokenizer) plus value_head.safetensors and
glmpost.json naming the policy it came from. V(t) is the head on the backbone's last hidden state.
By default only the MLP / MoE projections and the value head train (the brief: the critic's
attention is frozen); stage.json lists the tensors frozen by default (attention, the DSA indexer,
embeddings, norms, the unused language-model head); metrics.jsonl counts the parameters. A root
that already holds a version is left as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, json_option, with_config
from glmpost.rl.critic import InitCriticConfig, init_critic_root


@with_config(InitCriticConfig)
def init_critic(
    ctx: typer.Context,
    source: Path = typer.Option(..., "--from", help="Policy checkpoint to build the critic from: a root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Checkpoint root that receives the critic as v000000 and LATEST (created)."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **settings: Any,
) -> None:
    summary = init_critic_root(source, out, config_from(ctx, InitCriticConfig), options=effective_options(ctx))
    print_summary(summary, as_json=as_json, human=(
        f"{out}: already holds a critic (v{summary['policy_version']}); nothing to do" if summary["skipped"] else
        f"{out}: critic v0 from {summary['from']}, {summary['trainable_parameters']:,} of {summary['parameters']:,} "
        f"parameters trained ({summary['frozen_tensors']} tensors frozen)"))
