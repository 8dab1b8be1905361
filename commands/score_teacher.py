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

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import typer
from tqdm import tqdm

from glmpost.checkpoints import (
    CheckpointError,
    load_model,
    load_tokenizer,
    read_manifest,
    resolve_checkpoint,
)
from glmpost.commands.common import (
    complete_shard,
    config_option,
    effective_options,
    option_flag,
    print_summary,
    shard_outputs,
)
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import (
    ShardReader,
    ShardWriter,
    require_fields,
    resolve_shard_paths,
    select_shards,
)
from glmpost.closure.scoring import TeacherPayload, payload_from_rows, score_records
from glmpost.stage import MetricsWriter, check_same_options, log, write_stage_json

STAGE = "score-teacher"
ROLLOUT_FIELDS = ("prompt_token_ids", "response_token_ids", "action_mask", "observation_mask", "status", "tokenizer_revision")
TEACHER_FIELDS = ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs", "teacher")
PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "chunk_size", "device", "config", "zstd_level", "server")
PAYLOADS = ("sampled", "topk")
ENGINES = ("local", "sglang")
SCORING_TEMPERATURE = 1.0  # the teacher's own distribution (brief: log pi_T(y_t|s_t))


def parse_route(value: Any) -> tuple[str, str]:
    """``DOMAIN=CHECKPOINT``."""
    if isinstance(value, tuple):
        return value
    domain, sep, path = str(value).partition("=")
    if not sep or not domain.strip() or not path.strip():
        raise UsageError(f"--route {value!r}: expected DOMAIN=CHECKPOINT")
    return domain.strip(), path.strip()


def parse_routes(value: Any) -> dict[str, str]:
    """The recipe's [score-teacher.routes] table, or --routes 'DOMAIN=CKPT,DOMAIN=CKPT'."""
    if isinstance(value, str):
        value = dict(parse_route(part) for part in value.split(",") if part.strip())
    if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
        raise UsageError(f"--routes / [score-teacher.routes]: expected DOMAIN = \"CHECKPOINT\" entries, got {value!r}")
    return {str(k): str(v) for k, v in value.items()}


@dataclass
class Teacher:
    """One teacher checkpoint, loaded once whatever the number of domains routed to it."""

    path: Path  # the resolved version directory
    id: str
    revision: str
    vocab_size: int
    policy_version: int | None
    model: Any = None
    pad_token_id: int = 0

    def info(self, *, payload: str, topk: int, engine: str) -> dict[str, Any]:
        info = {"id": self.id, "checkpoint": str(self.path), "tokenizer_revision": self.revision, "payload": payload,
                "temperature": SCORING_TEMPERATURE, "engine": engine, "vocab_size": self.vocab_size}
        if self.policy_version is not None:
            info["policy_version"] = self.policy_version
        if payload == "topk":
            info["topk"] = topk
        return info


def _open_teacher(checkpoint: str) -> Teacher:
    try:
        path = resolve_checkpoint(checkpoint)
        _, revision = load_tokenizer(path)
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(str(path)).vocab_size)
    except (CheckpointError, OSError, ValueError) as exc:
        raise GlmpostError(f"teacher checkpoint {checkpoint} does not load: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    try:
        version = read_manifest(path).policy_version
    except CheckpointError:
        version = None
    name = f"{path.parent.name}/{path.name}" if path.name.startswith("v") and path.name[1:].isdigit() else path.name
    return Teacher(path, name, revision, vocab, version)


class Routing:
    """domain -> teacher; every record goes to exactly one teacher."""

    def __init__(self, routes: dict[str, str], default: str | None):
        self.routes, self.default = routes, default

    def checkpoint_for(self, domain: str | None, *, where: str) -> str:
        if domain is not None and domain in self.routes:
            return self.routes[domain]
        if self.default is not None:
            return self.default
        known = ", ".join(sorted(self.routes)) or "none"
        raise UsageError(f"{where}: domain {domain!r} has no teacher route (routes: {known}); "
                         "add it to [score-teacher.routes] or pass --default-teacher")


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
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Optional[Path] = config_option(),
) -> None:
    if payload not in PAYLOADS:
        raise UsageError(f"--payload {payload!r}: expected one of {', '.join(PAYLOADS)}")
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    table = {**(routes or {}), **dict(route)}
    if teacher is not None and (table or default_teacher is not None):
        raise UsageError("--teacher scores every record with one teacher; do not combine it with routes or --default-teacher")
    if teacher is None and not table and default_teacher is None:
        raise UsageError("no teacher: pass --teacher, a [score-teacher.routes] table / --route, or --default-teacher")
    routing = Routing(table, str(teacher) if teacher is not None else (str(default_teacher) if default_teacher else None))
    if engine == "sglang" and not server:
        raise UsageError("--engine sglang needs --server URL")
    options = effective_options(ctx)
    options["route"] = [f"{d}={c}" for d, c in ctx.params.get("route") or []]
    k = topk if payload == "topk" else 0

    paths = select_shards(resolve_shard_paths(inputs), shard_index, num_shards)
    targets = shard_outputs(paths, out, what="scored shards")
    check_same_options(out, STAGE, options, ignore=PER_TASK_OPTIONS, overwrite=overwrite,
                       flag_name=lambda name: option_flag(ctx, name))
    pending = [p for p in paths if overwrite or not complete_shard(targets[p], STAGE, redo="scoring again")]
    skipped = len(paths) - len(pending)

    # Everything that can fail is checked before anything is written: teachers load, every record
    # carries the rollout fields and routes to a teacher sharing its action space.
    teachers: dict[str, Teacher] = {}
    plan: dict[Path, list[str]] = {}
    opened: dict[str, Teacher] = {}
    for path in pending:
        plan[path] = _check_input(path, routing, teachers, opened)
    if engine == "sglang" and len(_unique(teachers)) > 1:
        raise UsageError("--engine sglang scores with one teacher per run (its --server); run score-teacher once per teacher")
    _check_vocabularies(_unique(teachers), student, pending)
    for path in pending:
        _check_token_range(path, plan[path], teachers)

    totals = {"records": 0, "action_tokens": 0, "seconds": 0.0}
    kl_sums: dict[str, list[float]] = {}
    if pending:
        pool = None
        if engine == "local":
            from glmpost.npu import resolve_device

            torch_device = resolve_device(device)
            for t in _unique(teachers):
                try:
                    t.model = load_model(t.path, device=torch_device)
                except GlmpostError:
                    raise
                except Exception as exc:  # e.g. a corrupt safetensors file: one line naming the teacher
                    raise GlmpostError(f"teacher checkpoint {t.path} does not load: {type(exc).__name__}: "
                                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
                tokenizer, _ = load_tokenizer(t.path)
                t.pad_token_id = tokenizer.pad_token_id or 0
        else:
            pool = _sglang_pool(server, _unique(teachers)[0], batch_size)
        out.mkdir(parents=True, exist_ok=True)
        write_stage_json(out, STAGE, options, teachers={d: t.id for d, t in teachers.items()})
        progress = tqdm(total=sum(len(v) for v in plan.values()), desc=STAGE, unit="rec", leave=False, disable=None)
        try:
            with MetricsWriter(out / "metrics.jsonl") as metrics, progress:
                for path in pending:
                    stats = _score_shard(path, targets[path], plan[path], teachers, options, payload=payload, topk=k,
                                         engine=engine, pool=pool, batch_size=batch_size, chunk_size=chunk_size,
                                         level=zstd_level, progress=progress)
                    metrics.write(shard=targets[path].name, input=str(path), **stats["metrics"])
                    for key in totals:
                        totals[key] += stats[key]
                    for domain, (s, n) in stats["kl"].items():
                        acc = kl_sums.setdefault(domain, [0.0, 0.0])
                        acc[0] += s
                        acc[1] += n
        finally:
            if pool is not None:
                pool.close()
    if skipped:
        log(f"kept {skipped} complete output shard(s) in {out} (--overwrite scores them again)")
    summary = {
        "out": str(out),
        "shards": len(pending),
        "skipped": skipped,
        "records": totals["records"],
        "action_tokens": totals["action_tokens"],
        "teacher_tokens_per_s": round(totals["action_tokens"] / totals["seconds"], 1) if totals["seconds"] else 0.0,
        "payload": payload,
        "teachers": {d: t.id for d, t in sorted(teachers.items())},
        "rollout_teacher_kl": {d: s / n for d, (s, n) in sorted(kl_sums.items()) if n},
    }
    human = (f"{out}: scored {summary['records']} records ({summary['action_tokens']} action tokens) in {len(pending)} shard(s)"
             + (f", kept {skipped}" if skipped else "")
             + f" with {len(_unique(teachers))} teacher(s), payload {payload}, {summary['teacher_tokens_per_s']} tokens/s")
    for domain, value in summary["rollout_teacher_kl"].items():
        routed = summary["teachers"].get(domain, summary["teachers"].get("*", "?"))
        human += f"\n  {domain}: teacher {routed}, sampled reverse KL at rollout {value:.4f}"
    print_summary(summary, as_json=as_json, human=human)


# --------------------------------------------------------------------------------------------
# Steps


def _unique(teachers: dict[str, Teacher]) -> list[Teacher]:
    seen: dict[Path, Teacher] = {}
    for t in teachers.values():
        seen.setdefault(t.path, t)
    return list(seen.values())


def _check_input(path: Path, routing: Routing, teachers: dict[str, Teacher], opened: dict[str, Teacher]) -> list[str]:
    """Read one shard through: rollout fields, no earlier teacher fields, a teacher for each record
    with the shards' tokenizer revision. Returns each record's route key (its domain or '*')."""
    reader = ShardReader(path)
    revision = reader.header["tokenizer_revision"]
    keys = []
    for index, record in enumerate(reader):
        where = f"{STAGE}: {path}: record {index}"
        require_fields(record, ROLLOUT_FIELDS, where=where)
        for name in TEACHER_FIELDS:
            if name in record:
                raise GlmpostError(f"{where}: already has {name} (scored by {record.get('teacher', {}).get('id')!r}); score the rollout shards")
        domain = record.get("domain")
        checkpoint = routing.checkpoint_for(domain, where=f"{path}: record {record['id']!r}")
        key = domain if domain in routing.routes else "*"
        if key not in teachers:
            if checkpoint not in opened:
                opened[checkpoint] = _open_teacher(checkpoint)
            teachers[key] = opened[checkpoint]
        t = teachers[key]
        if t.revision != revision:
            raise GlmpostError(
                f"{path}: teacher {t.path} has tokenizer revision {t.revision} but the student's shards have {revision}; "
                "teachers must share the student's tokenizer"
            )
        keys.append(key)
    return keys


def _check_vocabularies(teachers: list[Teacher], student: Path | None, pending: list[Path]) -> None:
    """Every teacher's vocabulary size equals the student's and the other teachers'."""
    reference, name = None, None
    if student is None:
        for path in pending[:1]:
            recorded = ShardReader(path).header.get("options", {}).get("checkpoint")
            if isinstance(recorded, str) and Path(recorded).exists():
                student = Path(recorded)
    if student is not None:
        try:
            from transformers import AutoConfig

            reference = int(AutoConfig.from_pretrained(str(resolve_checkpoint(student))).vocab_size)
            name = f"student {student}"
        except (CheckpointError, OSError, ValueError) as exc:
            raise UsageError(f"--student {student}: cannot read its config ({str(exc).splitlines()[0]})") from None
    for t in teachers:
        if reference is None:
            reference, name = t.vocab_size, f"teacher {t.path}"
        elif t.vocab_size != reference:
            raise GlmpostError(f"teacher {t.path} has a vocabulary of {t.vocab_size} tokens but {name} has {reference}; "
                               "teachers must share the student's vocabulary")


def _check_token_range(path: Path, keys: list[str], teachers: dict[str, Teacher]) -> None:
    for record, key in zip(ShardReader(path), keys):
        high = max(int(record["prompt_token_ids"].max(initial=0)), int(record["response_token_ids"].max(initial=0)))
        if high >= teachers[key].vocab_size:
            raise GlmpostError(f"{path}: record {record['id']!r} has token id {high}, outside teacher "
                               f"{teachers[key].path}'s vocabulary of {teachers[key].vocab_size}")


def _sglang_pool(server: str, teacher: Teacher, concurrency: int):
    from glmpost.serving.sglang_client import SGLangPool

    pool = SGLangPool(server, concurrency=concurrency)
    for client in pool.clients:
        info = client.model_info()
        theirs = info.get("tokenizer_revision")
        if theirs is not None and theirs != teacher.revision:
            pool.close()
            raise GlmpostError(f"--server {client.url} serves tokenizer revision {theirs} but teacher {teacher.path} has {teacher.revision}")
        vocab = info.get("vocab_size")
        if vocab is not None and int(vocab) != teacher.vocab_size:
            pool.close()
            raise GlmpostError(f"--server {client.url} serves a vocabulary of {vocab} tokens but teacher {teacher.path} has {teacher.vocab_size}")
    return pool


def _score_remote(pool, records: list[dict], topk: int) -> list[TeacherPayload]:
    from glmpost.serving.sglang_client import ServerError

    def one(client, record):
        ids = np.concatenate([record["prompt_token_ids"], record["response_token_ids"]]).astype(np.int64).tolist()
        return client.score(ids, len(record["prompt_token_ids"]), top_logprobs_num=topk)

    payloads = []
    answers = iter(pool.map(one, [r for r in records if len(r["response_token_ids"])]))
    for record in records:
        actions = record["action_mask"] & ~record["observation_mask"]
        if not len(actions):
            payloads.append(payload_from_rows(np.zeros(0, np.float32), actions,
                                              *((np.zeros((0, topk), np.int32), np.zeros((0, topk), np.float32)) if topk else ())))
            continue
        answer = next(answers)
        if isinstance(answer, ServerError):
            raise GlmpostError(f"{STAGE}: record {record['id']!r}: {answer}")
        if topk:
            payloads.append(payload_from_rows(answer["token_log_probs"], actions, answer["top_ids"], answer["top_log_probs"]))
        else:
            payloads.append(payload_from_rows(answer["token_log_probs"], actions))
    return payloads


def _score_shard(path, target, keys, teachers, options, *, payload, topk, engine, pool, batch_size, chunk_size, level, progress):
    """Score one shard into ``target`` (atomic: a failure leaves no output shard)."""
    records = list(ShardReader(path))
    header = ShardReader(path).header
    started = time.perf_counter()
    payloads: list[TeacherPayload | None] = [None] * len(records)
    for key in sorted(set(keys)):
        indices = [i for i, k in enumerate(keys) if k == key]
        routed = [records[i] for i in indices]
        t = teachers[key]
        if engine == "local":
            scored = score_records(t.model, routed, topk=topk, batch_size=batch_size, chunk_size=chunk_size, pad_token_id=t.pad_token_id)
        else:
            scored = _score_remote(pool, routed, topk)
        for i, p in zip(indices, scored):
            payloads[i] = p
        progress.update(len(indices))
    seconds = time.perf_counter() - started
    kl: dict[str, list[float]] = {}
    action_tokens = 0
    shard_options = {**options, "input_shard": str(path)}
    with ShardWriter(target, stage=STAGE, options=shard_options, tokenizer_revision=header["tokenizer_revision"], level=level) as writer:
        for record, key, p in zip(records, keys, payloads):
            t = teachers[key]
            out = dict(record)
            out["teacher_log_probs"] = p.log_probs
            if p.topk_ids is not None:
                out["teacher_topk_ids"], out["teacher_topk_log_probs"] = p.topk_ids, p.topk_log_probs
            out["teacher"] = {**t.info(payload=payload, topk=topk, engine=engine), "route": key}
            writer.write(out)
            actions = record["action_mask"] & ~record["observation_mask"]
            action_tokens += int(actions.sum())
            # The rollout's own log-probs are the student's at sampling time: at temperature 1 their
            # gap to the teacher is the sampled reverse KL the distillation starts from.
            if "rollout_log_probs" in record and float(record.get("sampling", {}).get("temperature", 1.0)) == 1.0:
                acc = kl.setdefault(record.get("domain") or "none", [0.0, 0.0])
                acc[0] += float((record["rollout_log_probs"][actions].astype(np.float64) - p.log_probs[actions]).sum())
                acc[1] += int(actions.sum())
    metrics = {
        "score/records": len(records),
        "score/action_tokens": action_tokens,
        "score/teacher_tokens_per_s": round(action_tokens / max(seconds, 1e-9), 2),
        **{f"score/rollout_teacher_kl/{d}": s / n for d, (s, n) in sorted(kl.items()) if n},
    }
    return {"records": len(records), "action_tokens": action_tokens, "seconds": seconds, "kl": kl, "metrics": metrics}
