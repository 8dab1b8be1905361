"""Score rollout shards: add reward components, the scalar reward and failure reasons to every record.

Each record's response is decoded with --checkpoint's tokenizer (the one the rollout used) and
scored by the reward mixture R = sum_k w_k R_k - sum_j lambda_j P_j: rewards (--reward) and
penalties (--penalty) drawn from the record's domain verifier (math, count, env, or any
package.module:function), format / length / truncation rules, an Outcome Reward Model and a
generative judge. With no component given, the reward is the domain verifier alone ("correct",
weight 1). Every component value is kept in `rewards`; a component that fails makes `reward` NaN
with the reason in `reward_info["failure"]`, never a silent 0. The math verifier reads a response's
last \\boxed{...} (else its last expression) and compares it with the task's `answer` by Math-Verify
(--math-checker math-verify, the default: 1/2 = 0.5, \\sqrt{4} = 2, sets in any order, units
dropped) or by glmpost's exact normaliser (--math-checker normalise).

One output shard per input shard (same file name) holds every input field plus `rewards`,
`reward` and `reward_info`; inputs are never modified. A rerun keeps output shards that are already
complete (crash-resume); --overwrite redoes them. DIR/metrics.jsonl has one line per shard
(reward mean/std/min/max, failures, per-component means). Slurm array tasks given --shard-index
and --num-shards share DIR; every task (and every rerun without --overwrite) must use the options
recorded in DIR/stage.json, and each output shard's header holds them too.

--follow IN makes it a stage of asynchronous RL: it claims rollout shards from spool IN as they
land, judges each into spool --out under the same name (the judged shard appears whole or not at
all) and commits it in IN; a restart commits what it had judged and judges the rest. It stops on
SIGTERM / SIGINT after the shard in progress, or after --idle-timeout seconds without a shard
(formats/SPEC.md §12).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, drive_shard_stage, json_option, with_config
from glmpost.config import domain_assignment
from glmpost.drivers import follow_line
from glmpost.errors import UsageError
from glmpost.rewards.components import ComponentSpec, parse_component
from glmpost.rewards.judging import JudgeConfig, JudgeStage
from glmpost.spool.settings import FollowSettings

SPEC_HELP = (
    "name=NAME,source=SOURCE,weight=W[,OPTION=VALUE...] or a TOML inline table; sources: verifier "
    "[verifier=math|pkg.mod:fn], format pattern=REGEX, length max_tokens=N [ramp_tokens=N], overlong cache_tokens=N [max_tokens=N] "
    "(DAPO's soft overlong penalty; max_tokens default: the rollout's max_new_tokens), truncated, "
    "orm checkpoint=DIR [activation=sigmoid|none, batch_size=N, attention=native|reference], judge checkpoint=DIR "
    "[template=TEXT, max_new_tokens=N, score_pattern=REGEX, max_score=X, batch_size=N, attention=native|reference]. "
    "Repeatable; recipe: [[judge.{table}]]."
)


# --------------------------------------------------------------------------------------------
# Option parsers: a recipe gives TOML tables, the command line strings; both end up the same.


class ComponentOption:
    """Parses one --reward / --penalty value (a recipe table or a flag string) into a ComponentSpec."""

    def __init__(self, kind: str):
        self.kind = kind

    def __call__(self, value: Any) -> ComponentSpec:
        if isinstance(value, ComponentSpec):
            return value
        if not isinstance(value, (str, dict)):
            raise UsageError(f"--{self.kind} {value!r}: expected a table or KEY=VALUE,... string")
        try:
            return parse_component(value, kind=self.kind)
        except ValueError as exc:
            raise UsageError(f"--{self.kind} {_show(value)}: {exc}") from None


def parse_verifier_route(value: Any) -> tuple[str, str]:
    """``DOMAIN=VERIFIER`` (VERIFIER a built-in name or package.module:function)."""
    return domain_assignment(value, flag="--verifier",
                             example="DOMAIN=VERIFIER, e.g. --verifier gsm8k=math or mydomain=pkg.mod:fn")


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


@with_config(FollowSettings)
@with_config(JudgeConfig)
def judge(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(
        None, metavar="SHARDS", help="Rollout shards: files, directories of *.msgpack.zst shards, or globs; none with --follow."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output directory; gets one judged shard per input shard, with the same file name (with --follow: "
        "the spool the judged shards are published into)."
    ),
    checkpoint: Path = typer.Option(
        ...,
        "--checkpoint",
        help="Checkpoint (root or version) whose tokenizer decodes the responses; records with another "
        "tokenizer revision are refused.",
    ),
    rewards: List[str] = typer.Option(
        [], "--reward", metavar="SPEC", parser=ComponentOption("reward"),
        help="A reward term w_k R_k: " + SPEC_HELP.format(table="rewards") + " Default: name=correct,source=verifier,weight=1.",
    ),
    penalties: List[str] = typer.Option(
        [], "--penalty", metavar="SPEC", parser=ComponentOption("penalty"),
        help="A penalty term lambda_j P_j, subtracted (weight = lambda_j): same SPEC as --reward. "
        "Recipe: [[judge.penalties]].",
    ),
    verifiers: List[str] = typer.Option(
        [], "--verifier", metavar="DOMAIN=VERIFIER", parser=parse_verifier_route,
        help="Route records of DOMAIN to a verifier: a built-in (math, count, env: a multi-turn rollout's own reward) "
        "or package.module:function taking a VerifyContext and returning a score in [0, 1]. Repeatable; wins over --domains.",
    ),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **follow_options: Any,
) -> None:
    stage = JudgeStage(config_from(ctx, JudgeConfig, options=effective_options(ctx)))
    summary, followed = drive_shard_stage(ctx, stage, inputs, what="rollout shards to judge")
    print_summary(summary, as_json=as_json, human=follow_line(summary, "judged") if followed else _human(summary, stage.specs))


def _human(summary: dict[str, Any], specs: list[ComponentSpec]) -> str:
    lines = [f"{summary['out']}: judged {summary['records']} records in {summary['shards']} shard(s)"
             + (f", kept {summary['skipped']} complete shard(s)" if summary["skipped"] else "")]
    if summary["records"]:
        mean = summary["reward_mean"]
        lines.append(
            f"reward mean {mean:.4f} (std {summary['reward_std']:.4f}, min {summary['reward_min']:.4f}, max {summary['reward_max']:.4f})"
            if mean is not None else "reward: every record failed"
        )
        lines.append(f"failed records: {summary['failures']}")
        for spec in specs:
            value = summary[f"components/{spec.name}/mean"]
            sign = "+" if spec.kind == "reward" else "-"
            shown = f"{value:.4f}" if value is not None else "n/a"
            lines.append(
                f"  {sign}{spec.weight:g} x {spec.name} ({spec.source}): mean {shown}, "
                f"{summary[f'components/{spec.name}/failures']} failed"
            )
    if "dynamic_sampling/groups_dropped" in summary:
        lines.append(f"dynamic sampling: kept {summary['dynamic_sampling/groups_kept']} group(s), left out "
                     f"{summary['dynamic_sampling/groups_dropped']} whose rewards are all equal "
                     f"({summary['dynamic_sampling/records_dropped']} records)")
    return "\n".join(lines)
