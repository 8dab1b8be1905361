"""The teachers of a score-teacher run: each record routed by its domain to exactly one teacher
checkpoint (:class:`Routing`), each teacher opened once (:class:`Teacher`), and every check made
before anything is written: rollout fields, the shards' tokenizer revision, one vocabulary, token
ids inside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmpost.checkpoints import CheckpointError, read_manifest, resolve_checkpoint
from glmpost.config import ConfigError
from glmpost.errors import GlmpostError
from glmpost.formats import ShardReader, require_fields
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.kernel.lora_versions import model_dir
from glmpost.npu import resolve_device

STAGE = "score-teacher"
ROLLOUT_FIELDS = ("prompt_token_ids", "response_token_ids", "action_mask", "observation_mask", "status", "tokenizer_revision")
TEACHER_FIELDS = ("teacher_log_probs", "teacher_topk_ids", "teacher_topk_log_probs", "teacher")
SCORING_TEMPERATURE = 1.0  # the teacher's own distribution (brief: log pi_T(y_t|s_t))


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
    adapter: str | None = None  # a LoRA teacher scored by servers: the adapter name its requests give

    def info(self, *, payload: str, topk: int, engine: str) -> dict[str, Any]:
        """The ``teacher`` map of a scored record (without its ``route``)."""
        info = {"id": self.id, "checkpoint": str(self.path), "tokenizer_revision": self.revision, "payload": payload,
                "temperature": SCORING_TEMPERATURE, "engine": engine, "vocab_size": self.vocab_size}
        if self.policy_version is not None:
            info["policy_version"] = self.policy_version
        if self.adapter is not None:
            info["adapter"] = self.adapter
        if payload == "topk":
            info["topk"] = topk
        return info


class Routing:
    """domain -> teacher; every record goes to exactly one teacher."""

    def __init__(self, routes: dict[str, str], default: str | None):
        self.routes, self.default = routes, default

    def checkpoint_for(self, domain: str | None, *, where: str) -> str:
        """The checkpoint scoring records of ``domain``; an unrouted domain without a default is refused."""
        if domain is not None and domain in self.routes:
            return self.routes[domain]
        if self.default is not None:
            return self.default
        known = ", ".join(sorted(self.routes)) or "none"
        raise ConfigError("{where}: domain {domain!r} has no teacher route (routes: {known}); "
                          "add it to [score-teacher.routes] or pass {default_teacher}", where=where, domain=domain, known=known)


def unique_teachers(teachers: dict[str, Teacher]) -> list[Teacher]:
    """The distinct teachers (by resolved path), in routing order."""
    seen: dict[Path, Teacher] = {}
    for t in teachers.values():
        seen.setdefault(t.path, t)
    return list(seen.values())


def open_teacher(checkpoint: str) -> Teacher:
    """Resolve a teacher checkpoint and read its tokenizer revision, vocabulary and policy version."""
    try:
        path = resolve_checkpoint(checkpoint)
        _, revision = load_tokenizer(path)
        from transformers import AutoConfig

        vocab = int(AutoConfig.from_pretrained(str(model_dir(path))).vocab_size)  # a LoRA teacher: its base's
    except (CheckpointError, OSError, ValueError) as exc:
        raise GlmpostError(f"teacher checkpoint {checkpoint} does not load: {str(exc).splitlines()[0] if str(exc) else exc}") from None
    try:
        version = read_manifest(path).policy_version
    except CheckpointError:
        version = None
    name = f"{path.parent.name}/{path.name}" if path.name.startswith("v") and path.name[1:].isdigit() else path.name
    return Teacher(path, name, revision, vocab, version)


def load_teachers(teachers: list[Teacher], device: str, attention: str = "native") -> None:
    """Load each teacher's model onto ``device`` for the local engine, its GLM-5 attention ``attention``."""

    torch_device = resolve_device(device)
    for t in teachers:
        try:
            t.model = load_model(t.path, device=torch_device, attention=attention)
        except GlmpostError:
            raise
        except Exception as exc:  # e.g. a corrupt safetensors file: one line naming the teacher
            raise GlmpostError(f"teacher checkpoint {t.path} does not load: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        tokenizer, _ = load_tokenizer(t.path)
        t.pad_token_id = tokenizer.pad_token_id or 0


def check_input(path: Path, routing: Routing, teachers: dict[str, Teacher], opened: dict[str, Teacher]) -> list[str]:
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
                opened[checkpoint] = open_teacher(checkpoint)
            teachers[key] = opened[checkpoint]
        t = teachers[key]
        if t.revision != revision:
            raise GlmpostError(
                f"{path}: teacher {t.path} has tokenizer revision {t.revision} but the student's shards have {revision}; "
                "teachers must share the student's tokenizer"
            )
        keys.append(key)
    return keys


def check_vocabularies(teachers: list[Teacher], student: Path | None, pending: list[Path]) -> None:
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

            reference = int(AutoConfig.from_pretrained(str(model_dir(resolve_checkpoint(student)))).vocab_size)
            name = f"student {student}"
        except (CheckpointError, OSError, ValueError) as exc:
            raise ConfigError("{student} {path}: cannot read its config ({reason})", path=student,
                              reason=str(exc).splitlines()[0]) from None
    for t in teachers:
        if reference is None:
            reference, name = t.vocab_size, f"teacher {t.path}"
        elif t.vocab_size != reference:
            raise GlmpostError(f"teacher {t.path} has a vocabulary of {t.vocab_size} tokens but {name} has {reference}; "
                               "teachers must share the student's vocabulary")


def check_token_range(path: Path, keys: list[str], teachers: dict[str, Teacher]) -> None:
    """Every token id of the shard lies inside its record's teacher's vocabulary."""
    for record, key in zip(ShardReader(path), keys):
        high = max(int(record["prompt_token_ids"].max(initial=0)), int(record["response_token_ids"].max(initial=0)))
        if high >= teachers[key].vocab_size:
            raise GlmpostError(f"{path}: record {record['id']!r} has token id {high}, outside teacher "
                               f"{teachers[key].path}'s vocabulary of {teachers[key].vocab_size}")
