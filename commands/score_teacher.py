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
sglang scores through an SGLang-compatible server (`glmpost serve`) with one teacher.

One output shard per input shard (same file name); complete outputs are kept on a rerun
(--overwrite redoes them); nothing is written before every teacher loads and every record is routed.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.closure.teachers import ScoreTeacherConfig, ScoreTeacherRun, parse_route, parse_routes
from glmpost.commands.common import config_option, effective_options, option_flag, print_summary
from glmpost.commands.options import json_option


def score_teacher(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., metavar="SHARDS", help="Student rollout shards: files, directories or globs."),
    out: Path = typer.Option(..., "--out", help="Output directory; one scored shard per input shard, same file name."),
    teacher: Optional[Path] = typer.Option(None, "--teacher", help="One teacher checkpoint (root or version) for every record."),
    routes: Optional[str] = typer.Option(
        None, "--routes", metavar="TABLE", parser=parse_routes,
        help="Domain-to-teacher table, as the recipe's [score-teacher.routes] (DOMAIN=CKPT,... on the command line).",
    ),
    route: List[str] = typer.Option(
        [], "--route", metavar="DOMAIN=CKPT", parser=parse_route,
        help="Route records of DOMAIN to the teacher checkpoint CKPT. Repeatable; wins over --routes.",
    ),
    default_teacher: Optional[Path] = typer.Option(
        None, "--default-teacher", help="Teacher for records whose domain has no route; without it such a record is an error."
    ),
    student: Optional[Path] = typer.Option(
        None, "--student",
        help="Student checkpoint whose vocabulary teachers must share (default: the checkpoint the rollout shards recorded, if it exists).",
    ),
    payload: str = typer.Option("sampled", "--payload", help="sampled (one log-prob per token) or topk (also the teacher's top-k ids and log-probs)."),
    topk: int = typer.Option(8, "--topk", min=1, help="k of the top-k payload."),
    engine: str = typer.Option("local", "--engine", help="local (in-process prefill) or sglang (--server)."),
    server: Optional[str] = typer.Option(None, "--server", help="URL[,URL...] of SGLang-compatible servers serving the one teacher (--engine sglang)."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Records per teacher forward (local engine) or requests in flight (sglang)."),
    chunk_size: int = typer.Option(512, "--chunk-size", min=1, help="Positions per chunk of the teacher's LM head (bounds [chunk, V] memory)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda[:N] or npu[:N] for the local engine."),
    shard_index: int = typer.Option(0, "--shard-index", min=0, help="This task's index among --num-shards (Slurm arrays)."),
    num_shards: int = typer.Option(1, "--num-shards", min=1, help="Split the input shards round-robin over this many tasks."),
    zstd_level: int = typer.Option(3, "--zstd-level", min=1, max=22, help="zstd level of the output shards."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Score again shards whose output already exists."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
) -> None:
    run = ScoreTeacherRun(ScoreTeacherConfig(
        inputs=inputs, out=out, teacher=teacher, routes=routes or {}, route=list(route or []),
        default_teacher=default_teacher, student=student, payload=payload, topk=topk, engine=engine, server=server,
        batch_size=batch_size, chunk_size=chunk_size, device=device, shard_index=shard_index, num_shards=num_shards,
        zstd_level=zstd_level, overwrite=overwrite, options=effective_options(ctx),
        flag_name=lambda name: option_flag(ctx, name),
    ))
    summary = run.run()
    print_summary(summary, as_json=as_json, human=run.human(summary))
