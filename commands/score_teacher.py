"""Score student rollout shards with teachers: add each sampled token's teacher log-prob (OPD / MOPD).

Every record is routed by its domain to exactly one teacher: --teacher scores every record with one
checkpoint; otherwise the recipe table [score-teacher.routes] (domain = "CHECKPOINT") or --route
DOMAIN=CHECKPOINT picks the teacher, and --default-teacher takes domains without a route (without
it an unrouted domain is an error naming the domain). The teacher prefills exactly the student's
token ids (prompt + response, never re-tokenized) at temperature 1 and records, on action tokens
only, `teacher_log_probs` = log pi_T(y_t | s_t) (payload `sampled`), plus the teacher's top-k ids and
log-probs with --payload topk; observation tokens get no teacher signal (NaN). The `teacher` map
names the teacher (id, checkpoint, policy version, tokenizer revision, payload, temperature).

Teachers must share the student's action space: a teacher whose tokenizer revision differs from the
shards', or whose vocabulary size differs from the student's (--student, by default the checkpoint
the rollout recorded) or another teacher's, is refused with both values. The local engine scores
--batch-size records at a time in --chunk-size position chunks, so memory stays bounded; --engine
sglang scores through an SGLang-compatible server (`glmpost serve`) with one teacher (--api-key KEY
if the server wants one; the key is never recorded); --engine vllm through a vLLM server's
prompt_logprobs (or `glmpost serve --api vllm`).

One output shard per input shard (same file name); complete outputs are kept on a rerun
(--overwrite redoes them); nothing is written before every teacher loads and every record is routed.

--follow IN makes it a stage of asynchronous OPD: it claims student rollout shards from spool IN as
they land, scores each into spool --out under the same name and commits it in IN (a restart
commits what it had scored and scores the rest); --engine local only. It stops on SIGTERM /
SIGINT after the shard in progress, or after --idle-timeout seconds without a shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, drive_shard_stage, json_option, with_config
from glmpost.drivers import follow_line
from glmpost.kernel.sglang_client import check_api_key, without_api_key
from glmpost.spool.settings import FollowSettings
from glmpost.teachers.run import ScoreTeacherConfig, ScoreTeacherStage, parse_route


@with_config(FollowSettings)
@with_config(ScoreTeacherConfig)
def score_teacher(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(None, metavar="SHARDS", help="Student rollout shards: files, directories or globs; none with --follow."),
    out: Path = typer.Option(..., "--out", help="Output directory; one scored shard per input shard, same file name (with "
                             "--follow: the spool the scored shards are published into)."),
    route: List[str] = typer.Option(
        [], "--route", metavar="DOMAIN=CKPT", parser=parse_route,
        help="Route records of DOMAIN to the teacher checkpoint CKPT. Repeatable; wins over --routes.",
    ),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **follow_options: Any,
) -> None:
    api_key = ctx.params["api_key"]
    check_api_key(api_key)  # before any teacher loads
    stage = ScoreTeacherStage(config_from(ctx, ScoreTeacherConfig, options=without_api_key(effective_options(ctx))))
    summary, followed = drive_shard_stage(ctx, stage, inputs, what="student rollout shards to score")
    print_summary(summary, as_json=as_json, human=follow_line(summary, "scored") if followed else stage.human(summary))
