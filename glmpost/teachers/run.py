"""Teacher scoring of student rollout shards (what ``glmpost score-teacher`` runs).

Every record is routed by its domain to exactly one teacher (:class:`Routing`); the teacher prefills
the student's exact token ids at temperature 1 and each action token gets its log-prob (payload
``sampled``), plus the teacher's top-k ids and log-probs (payload ``topk``). Teachers must share the
student's tokenizer revision and vocabulary size. Everything that can fail is checked before
anything is written; each output shard is written atomically (:class:`ScoreTeacherStage`, run once or
following a spool by :mod:`glmpost.drivers`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm import tqdm

from glmpost.config import ConfigError, domain_assignment, setting, shared
from glmpost.errors import GlmpostError
from glmpost.formats import ShardReader, ShardWriter, window_views
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.engine import SamplingParams
from glmpost.kernel.lora_versions import is_lora_version
from glmpost.kernel.scoring import TeacherPayload, joined_payload, payload_from_rows, score_records
from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.sglang_pool import SGLangPool
from glmpost.kernel.vllm_client import VLLMClient
from glmpost.spool.spool import spool_revision
from glmpost.teachers.routing import (
    STAGE,
    Routing,
    Teacher,
    check_input,
    check_token_range,
    check_vocabularies,
    load_teachers,
    unique_teachers,
)

PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "chunk_size", "device", "config", "zstd_level", "server")
PAYLOADS = ("sampled", "topk")
ENGINES = ("local", "sglang", "vllm")


def parse_route(value: Any) -> tuple[str, str]:
    """``--route DOMAIN=CHECKPOINT`` as ``(domain, checkpoint)``."""
    return domain_assignment(value, flag="--route", example="DOMAIN=CHECKPOINT")


def parse_routes(value: Any) -> dict[str, str]:
    """The recipe's [score-teacher.routes] table, or --routes 'DOMAIN=CKPT,DOMAIN=CKPT'."""
    if isinstance(value, str):
        value = dict(parse_route(part) for part in value.split(",") if part.strip())
    if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
        raise ConfigError("{routes} / [score-teacher.routes]: expected DOMAIN = \"CHECKPOINT\" entries, got {value!r}",
                          value=value)
    return {str(k): str(v) for k, v in value.items()}


@dataclass
class ScoreTeacherConfig:
    """What one ``score-teacher`` run does (the options of ``glmpost score-teacher``, under the same
    names). ``options`` are the effective options written to ``stage.json`` and the shard headers
    (the run spells their ``route`` as ``DOMAIN=CKPT`` strings)."""

    inputs: list[str]  # student rollout shards: files, directories or globs
    out: Path  # one scored shard per input shard, same file name
    teacher: Path | None = setting(None, "One teacher checkpoint (root or version) for every record.")
    routes: dict[str, str] | None = setting(None, "Domain-to-teacher table, as the recipe's [score-teacher.routes] "
                                            "(DOMAIN=CKPT,... on the command line).",
                                            cli={"annotation": Optional[str], "metavar": "TABLE", "parser": parse_routes})
    route: list[tuple[str, str]] = field(default_factory=list)  # --route DOMAIN=CKPT items; they win over routes
    default_teacher: Path | None = setting(
        None, "Teacher for records whose domain has no route; without it such a record is an error.")
    student: Path | None = setting(None, "Student checkpoint whose vocabulary teachers must share (default: the "
                                   "checkpoint the rollout shards recorded, if it exists).")
    payload: str = setting("sampled", "sampled (one log-prob per token) or topk (also the teacher's top-k ids and log-probs).")
    topk: int = setting(8, "k of the top-k payload.", min=1)
    engine: str = setting("local", "local (in-process prefill), sglang or vllm (--server; vllm: prompt_logprobs of vLLM's "
                          "/v1/completions).")
    server: str | None = setting(None, "URL[,URL...] of SGLang-compatible servers serving the one teacher (--engine sglang).")
    api_key: str | None = setting(None, "The servers' API key, sent as 'Authorization: Bearer KEY' (never recorded).", cli={"show_default": False})
    batch_size: int = setting(8, "Records per teacher forward (local engine) or requests in flight (sglang).", min=1)
    chunk_size: int = setting(512, "Positions per chunk of the teacher's LM head (bounds [chunk, V] memory).", min=1)
    device: str = shared("device")
    attention: str = shared("attention")
    shard_index: int = shared("shard_index")
    num_shards: int = shared("num_shards")
    zstd_level: int = shared("zstd_level")
    overwrite: bool = shared("overwrite")
    options: dict[str, Any] = field(default_factory=dict)


def check_config(config: ScoreTeacherConfig) -> Routing:
    """Refuse contradictory options (payload, engine, teachers, server); returns the routing."""
    if config.payload not in PAYLOADS:
        raise ConfigError("{payload} {value!r}: expected one of {known}", value=config.payload, known=", ".join(PAYLOADS))
    if config.engine not in ENGINES:
        raise ConfigError("{engine} {value!r}: expected one of {known}", value=config.engine, known=", ".join(ENGINES))
    table = {**(config.routes or {}), **dict(config.route)}
    teacher, default = config.teacher, config.default_teacher
    if teacher is not None and (table or default is not None):
        raise ConfigError("{teacher} scores every record with one teacher; do not combine it with routes or {default_teacher}")
    if teacher is None and not table and default is None:
        raise ConfigError("no teacher: pass {teacher}, a [score-teacher.routes] table / {route}, or {default_teacher}")
    routing = Routing(table, str(teacher) if teacher is not None else (str(default) if default else None))
    if config.engine != "local" and not config.server:
        raise ConfigError("{engine} {value} needs {server} URL", value=config.engine)
    return routing


class ScoreTeacherStage:
    """score-teacher as a :class:`~glmpost.drivers.ShardStage`: one scored shard per student rollout
    shard; the teachers load (or the server is connected) when it opens."""

    name = STAGE
    per_task_options = PER_TASK_OPTIONS
    outputs = "scored shards"
    redo = "scoring again"

    def __init__(self, config: ScoreTeacherConfig):
        self.config = config
        self.routing = check_config(config)
        self.options = {**config.options, "route": [f"{d}={c}" for d, c in config.route]}
        self.topk = config.topk if config.payload == "topk" else 0
        self.teachers: dict[str, Teacher] = {}  # route key (domain or '*') -> teacher
        self.opened: dict[str, Teacher] = {}  # checkpoint -> teacher, as checking opened them
        self.plan: dict[Path, list[str]] = {}  # input shard -> each record's route key
        self.totals = {"records": 0, "action_tokens": 0, "seconds": 0.0}
        self.kl_sums: dict[str, list[float]] = {}
        self.pool: Any = None

    def spool_revision(self, spool: Path) -> str:
        if self.config.engine != "local":
            raise ConfigError("{follow} scores with the local engine; drop {engine} sglang (or run score-teacher per shard set)")
        return spool_revision(spool)

    def check(self, shard: Path) -> int:
        """Everything that can fail before anything is written: teachers load, every record carries
        the rollout fields and routes to a teacher sharing its action space."""
        self.plan[shard] = check_input(shard, self.routing, self.teachers, self.opened)
        if self.config.engine != "local" and len(unique_teachers(self.teachers)) > 1:
            raise ConfigError("{engine} sglang or vllm scores with one teacher per run (its {server}); run score-teacher once per teacher")
        check_vocabularies(unique_teachers(self.teachers), self.config.student, [shard])
        check_token_range(shard, self.plan[shard], self.teachers)
        return len(self.plan[shard])

    def open(self) -> dict[str, Any]:
        """Load the teachers (or connect to the server)."""
        c = self.config
        if c.engine == "local":
            load_teachers(unique_teachers(self.teachers), c.device, c.attention)
        else:
            self.pool = _sglang_pool(c.server, unique_teachers(self.teachers)[0], c.batch_size, api_key=c.api_key,
                                     client_class=VLLMClient if c.engine == "vllm" else SGLangClient)
            if c.engine == "vllm":
                _refuse_logits(self.pool)
        return {"teachers": {d: t.id for d, t in self.teachers.items()}}

    def process(self, shard: Path, target: Path, progress: tqdm) -> dict[str, Any]:
        stats = self.score_shard(shard, target, self.pool, progress)
        for key in self.totals:
            self.totals[key] += stats[key]
        for domain, (s, n) in stats["kl"].items():
            acc = self.kl_sums.setdefault(domain, [0.0, 0.0])
            acc[0] += s
            acc[1] += n
        return stats["metrics"]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def score_shard(self, path: Path, target: Path, pool: Any, progress: tqdm) -> dict[str, Any]:
        """Score one shard into ``target`` (atomic: a failure leaves no output shard)."""
        records = list(ShardReader(path))
        header = ShardReader(path).header
        keys = self.plan[path]
        started = time.perf_counter()
        payloads = self._payloads(records, keys, pool, progress)
        seconds = time.perf_counter() - started
        c = self.config
        shard_options = {**self.options, "input_shard": str(path)}
        with ShardWriter(target, stage=STAGE, options=shard_options, tokenizer_revision=header["tokenizer_revision"],
                         level=c.zstd_level) as writer:
            action_tokens, kl = _write_scored(writer, records, keys, payloads, self.teachers,
                                              payload=c.payload, topk=self.topk, engine=c.engine)
        metrics = {
            "score/records": len(records),
            "score/action_tokens": action_tokens,
            "score/teacher_tokens_per_s": round(action_tokens / max(seconds, 1e-9), 2),
            **{f"score/rollout_teacher_kl/{d}": s / n for d, (s, n) in sorted(kl.items()) if n},
        }
        return {"records": len(records), "action_tokens": action_tokens, "seconds": seconds, "kl": kl, "metrics": metrics}

    def _payloads(self, records: list[dict], keys: list[str], pool: Any, progress: tqdm) -> list[TeacherPayload]:
        """Each record's teacher payload, scoring the records of one route at a time."""
        c = self.config
        payloads: list[Any] = [None] * len(records)
        for key in sorted(set(keys)):
            indices = [i for i, k in enumerate(keys) if k == key]
            # a compacted record is scored window by window, each on the context the student saw
            windows = [window_views(records[i]) for i in indices]
            routed = [view for views in windows for view in views]
            t = self.teachers[key]
            if c.engine == "local":
                scored = score_records(t.model, routed, topk=self.topk, batch_size=c.batch_size, chunk_size=c.chunk_size,
                                       pad_token_id=t.pad_token_id)
            else:
                scored = _score_remote(pool, routed, self.topk)
            parts = iter(scored)
            for i, views in zip(indices, windows):
                payloads[i] = joined_payload([next(parts) for _ in views])
            progress.update(len(indices))
        return payloads

    def summary(self) -> dict[str, Any]:
        """The totals of the shards scored so far."""
        totals = self.totals
        return {
            "records": totals["records"],
            "action_tokens": totals["action_tokens"],
            "teacher_tokens_per_s": round(totals["action_tokens"] / totals["seconds"], 1) if totals["seconds"] else 0.0,
            "payload": self.config.payload,
            "teachers": {d: t.id for d, t in sorted(self.teachers.items())},
            "rollout_teacher_kl": {d: s / n for d, (s, n) in sorted(self.kl_sums.items()) if n},
        }

    def human(self, summary: dict[str, Any]) -> str:
        """The summary as lines for a person: totals, then each domain's teacher and rollout KL."""
        skipped = summary["skipped"]
        text = (f"{summary['out']}: scored {summary['records']} records ({summary['action_tokens']} action tokens) in {summary['shards']} shard(s)"
                + (f", kept {skipped}" if skipped else "")
                + f" with {len(unique_teachers(self.teachers))} teacher(s), payload {summary['payload']}, {summary['teacher_tokens_per_s']} tokens/s")
        for domain, value in summary["rollout_teacher_kl"].items():
            routed = summary["teachers"].get(domain, summary["teachers"].get("*", "?"))
            text += f"\n  {domain}: teacher {routed}, sampled reverse KL at rollout {value:.4f}"
        return text


def _sglang_pool(server: str, teacher: Teacher, concurrency: int, *, api_key: str | None = None,
                 client_class: type = SGLangClient):
    """Connect to the servers; each must serve the teacher's tokenizer revision and vocabulary (when it
    reports them: vLLM does not), and a LoRA teacher's adapter under the name sync-weights gave it."""

    pool = SGLangPool(server, concurrency=concurrency, api_key=api_key, client_class=client_class)
    for client in pool.clients:
        info = client.model_info()
        theirs = info.get("tokenizer_revision")
        if theirs is not None and theirs != teacher.revision:
            pool.close()
            raise ConfigError("{server} {url} serves tokenizer revision {theirs} but teacher {path} has {revision}",
                              url=client.url, theirs=theirs, path=teacher.path, revision=teacher.revision, exit_code=1)
        vocab = info.get("vocab_size")
        if vocab is not None and int(vocab) != teacher.vocab_size:
            pool.close()
            raise ConfigError("{server} {url} serves a vocabulary of {vocab} tokens but teacher {path} has {size}",
                              url=client.url, vocab=vocab, path=teacher.path, size=teacher.vocab_size, exit_code=1)
        if is_lora_version(teacher.path):  # a LoRA teacher: every request names its adapter, which sync-weights loaded
            problem = client.name_adapter(teacher.path, teacher.policy_version or 0)
            if problem is not None:
                pool.close()
                raise ConfigError("{server} {url} {problem}; sync-weights of {path} to that server loads it", url=client.url,
                                  problem=problem, path=teacher.path, exit_code=1)
            teacher.adapter = client.adapter[0]
    return pool


def _score_remote(pool, records: list[dict], topk: int) -> list[TeacherPayload]:
    """Each record's payload from the server pool (records without response tokens are not sent)."""

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


def _write_scored(writer: ShardWriter, records: list[dict], keys: list[str], payloads: list[TeacherPayload],
                  teachers: dict[str, Teacher], *, payload: str, topk: int, engine: str) -> tuple[int, dict[str, list[float]]]:
    """Write each record with its teacher fields; returns the action-token count and, per domain,
    the sums (KL, tokens) of the sampled reverse KL at rollout."""
    kl: dict[str, list[float]] = {}
    action_tokens = 0
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
        # The rollout's own log-probs are the student's at sampling time: when they are of its own
        # distribution (temperature 1, untruncated, or kind raw) their gap to the teacher is the
        # sampled reverse KL the distillation starts from.
        if "rollout_log_probs" in record and _student_own_distribution(record):
            acc = kl.setdefault(record.get("domain") or "none", [0.0, 0.0])
            acc[0] += float((record["rollout_log_probs"][actions].astype(np.float64) - p.log_probs[actions]).sum())
            acc[1] += int(actions.sum())
    return action_tokens, kl


def _student_own_distribution(record: dict) -> bool:
    """Whether the record's ``rollout_log_probs`` are of the student's own distribution."""
    try:
        return SamplingParams.from_record(record.get("sampling")).scored() == ScoredDistribution()
    except ValueError:  # greedy before log_prob_kind (the point mass's 0), or an unknown kind
        return False


def _refuse_logits(pool: Any) -> None:
    """A vLLM server whose prompt log-probs are logits (``logprobs_mode`` raw_logits / processed_logits)
    is refused in one line before anything is scored."""
    for client in pool.clients:
        try:
            problem = client.scoring_problem()
        except ServerError:
            continue  # unreachable: the scoring says so itself
        if problem:
            raise ConfigError("{server} {problem}", problem=problem, exit_code=1)
