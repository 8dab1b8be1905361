"""The two rollout engines a run samples with, behind one interface (``prepare``, ``generate``,
``close``): ``local`` (:class:`~glmpost.rollout.engine.LocalEngine` in this process) and ``sglang``
(SGLang servers or ``glmpost serve`` over HTTP, each sequence's seed sent as ``sampling_seed``; every
server checked first: reachable, and serving the checkpoint's tokenizer revision). A request that
finally fails comes back as an aborted outcome with its reason, never a lost prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from tqdm import tqdm

from glmpost import __version__
from glmpost.checkpoints import CheckpointError, load_model, load_tokenizer, read_manifest, resolve_checkpoint
from glmpost.config import ConfigError
from glmpost.rollout.engine import Completion, LocalEngine, SamplingParams, sequence_seed
from glmpost.rollout.records import completion_from_sglang, sglang_sampling_params
from glmpost.stage import log

if TYPE_CHECKING:
    from glmpost.rollout.runner import RolloutConfig

# What an engine returns per sequence: (completion | None, weight_version, abort_reason).
Outcome = tuple[Optional[Completion], Any, Optional[str]]


def eos_id_list(default_stops: int | list[int] | None) -> list[int]:
    """A model's ``eos_token_id`` (one id, a list, or none) as a list."""
    if isinstance(default_stops, list):
        return default_stops
    return [default_stops] if default_stops is not None else []


def engine_version() -> str:
    """The version stamped in each record's engine map (this glmpost's)."""
    return __version__


def as_version(value: Any) -> int | None:
    """A server's weight_version as a policy version when it is an integer, else None."""
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


@dataclass
class PolicyCheckpoint:
    """The checkpoint sampled from: its version directory, policy version and tokenizer."""

    version_dir: Path
    policy_version: int
    tokenizer: Any
    revision: str

    @classmethod
    def open(cls, checkpoint: Path) -> "PolicyCheckpoint":
        """Resolve a root or version directory; one without a manifest is stamped policy version 0."""
        version_dir = resolve_checkpoint(checkpoint)
        try:
            policy_version = read_manifest(version_dir).policy_version
        except CheckpointError:
            log(f"{version_dir} has no glmpost.json; stamping policy version 0")
            policy_version = 0
        tokenizer, revision = load_tokenizer(version_dir)
        return cls(version_dir, policy_version, tokenizer, revision)


class LocalBackend:
    """``--engine local``: the checkpoint's model in this process, ``batch_size`` sequences per call."""

    def __init__(self, model: Any, *, batch_size: int, pad_token_id: int):
        self.model = model
        self.model_config = model.config
        self.default_stops = model.generation_config.eos_token_id
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.engine: LocalEngine | None = None
        self.params: SamplingParams | None = None

    @classmethod
    def open(cls, checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any) -> "LocalBackend":
        """Load the model on ``device`` (``config.device`` resolved)."""
        model = load_model(checkpoint.version_dir, device=device, deterministic_topk=config.deterministic_topk)
        return cls(model, batch_size=config.batch_size, pad_token_id=checkpoint.tokenizer.pad_token_id)

    def prepare(self, params: SamplingParams, eos_ids: list[int]) -> None:
        """Sample with ``params`` from now on."""
        self.engine = LocalEngine(self.model, batch_size=self.batch_size, pad_token_id=self.pad_token_id)
        self.params = params

    def engine_name(self) -> str:
        """The name stamped in each record's engine map."""
        return LocalEngine.name

    def generate(self, sequences: list[list[int]], keys: list[str], progress: tqdm) -> list[Outcome]:
        """Sample every sequence, ``batch_size`` at a time; none is ever aborted."""
        completions: list[Completion] = []
        for start in range(0, len(sequences), self.batch_size):
            batch = sequences[start : start + self.batch_size]
            completions += self.engine.generate(batch, keys[start : start + self.batch_size], self.params)
            progress.update(len(batch))
        return [(c, None, None) for c in completions]

    def close(self) -> None:
        """Nothing to release."""


class SGLangBackend:
    """``--engine sglang``: the same batches sent to SGLang servers, ``concurrency`` requests at a time."""

    def __init__(self, pool: Any, *, model_config: Any, default_stops: Any, batch_size: int):
        self.pool = pool
        self.model_config = model_config
        self.default_stops = default_stops
        self.batch_size = batch_size
        self.params: SamplingParams | None = None
        self.sglang_params: dict[str, Any] = {}

    @classmethod
    def open(cls, checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any = None) -> "SGLangBackend":
        """Read the checkpoint's config (no weights) and connect to the servers, each checked
        (``device`` is unused: the servers hold the model)."""
        from transformers import AutoConfig, GenerationConfig

        version_dir = str(checkpoint.version_dir)
        model_config = AutoConfig.from_pretrained(version_dir)
        try:
            default_stops = GenerationConfig.from_pretrained(version_dir).eos_token_id
        except OSError:
            default_stops = model_config.eos_token_id
        pool = connect_servers(config, revision=checkpoint.revision, version_dir=checkpoint.version_dir)
        return cls(pool, model_config=model_config, default_stops=default_stops, batch_size=config.batch_size)

    def prepare(self, params: SamplingParams, eos_ids: list[int]) -> None:
        """Translate ``params`` to SGLang's sampling params (refused when SGLang cannot express them)."""
        try:
            self.sglang_params = sglang_sampling_params(params, eos_ids)
        except ValueError as exc:
            raise ConfigError("{engine_name} sglang {stop_token_ids}: {reason}", reason=exc) from None
        self.params = params

    def engine_name(self) -> str:
        """The name stamped in each record's engine map."""
        return "sglang"

    def generate(self, sequences: list[list[int]], keys: list[str], progress: tqdm) -> list[Outcome]:
        """One /generate batch request per ``batch_size`` chunk (the local engine's batches), in
        parallel; a chunk whose request finally failed comes back aborted with the reason."""
        from glmpost.serving.sglang_client import ServerError

        futures = [(chunk, self._submit(number, chunk, sequences, keys))
                   for number, chunk in enumerate(_chunks(len(sequences), self.batch_size))]
        outcomes: list[Outcome] = []
        for chunk, future in futures:
            try:
                outcomes += self._answers(future.result(), len(chunk))
            except ServerError as exc:
                outcomes += [(None, None, str(exc))] * len(chunk)
            progress.update(len(chunk))
        return outcomes

    def _submit(self, number: int, chunk: list[int], sequences: list[list[int]], keys: list[str]) -> Any:
        """Queue the request of one chunk, each sequence with its own ``sampling_seed``."""
        per_seq = [{**self.sglang_params, "sampling_seed": sequence_seed(self.params.seed, keys[i])} for i in chunk]
        ids = [sequences[i] for i in chunk]
        return self.pool.submit(number, lambda c, ids=ids, sp=per_seq: c.generate(ids, sp, return_logprob=True))

    def _answers(self, answers: Any, expected: int) -> list[Outcome]:
        """A chunk's answers as outcomes; the wrong number of answers is a failed request."""
        from glmpost.serving.sglang_client import ServerError

        if not isinstance(answers, list) or len(answers) != expected:
            raise ServerError(f"{len(answers) if isinstance(answers, list) else 'no'} answers for {expected} sequences",
                              url="?")
        return [completion_from_sglang(a, self.params.stop_token_ids) for a in answers]

    def close(self) -> None:
        """Stop the pool's request threads."""
        self.pool.close()


def _chunks(count: int, size: int) -> Iterator[list[int]]:
    """The indices ``0 .. count-1`` in consecutive chunks of ``size``."""
    for start in range(0, count, size):
        yield list(range(start, min(start + size, count)))


def connect_servers(config: RolloutConfig, *, revision: str, version_dir: Path) -> Any:
    """A pool over the ``server`` URLs, each checked: reachable, and serving our tokenizer revision."""
    from glmpost.serving.sglang_client import SGLangPool

    try:
        pool = SGLangPool(config.server, concurrency=config.concurrency, timeout=config.timeout, retries=config.retries)
    except ValueError as exc:
        raise ConfigError("{server} {value!r}: {reason}", value=config.server, reason=exc) from None
    for client in pool.clients:
        check_server(client, config, revision=revision, version_dir=version_dir)
    return pool


def check_server(client: Any, config: RolloutConfig, *, revision: str, version_dir: Path) -> None:
    """Ask one server for its model info (quickly): an unreachable server or another tokenizer
    revision is an error; a server that batches fewer sequences than ``batch_size`` is warned about."""
    from glmpost.serving.sglang_client import ServerError

    quick = type(client)(client.url, timeout=min(config.timeout, 30.0), retries=min(config.retries, 1), backoff=0.2)
    try:
        info = quick.model_info()
    except ServerError as exc:
        raise ConfigError("{server} {url}: unreachable ({reason})", url=client.url, reason=exc, exit_code=1) from None
    served = info.get("tokenizer_revision") if isinstance(info, dict) else None
    if served is None:
        log(f"--server {client.url} does not report a tokenizer revision (not `glmpost serve`); "
            f"make sure it serves the tokenizer of {version_dir}")
    elif served != revision:
        raise ConfigError("{server} {url} serves tokenizer revision {served}; {checkpoint} {version_dir} has {revision}",
                          url=client.url, served=served, version_dir=version_dir, revision=revision, exit_code=1)
    if isinstance(info, dict) and isinstance(info.get("batch_size"), int) and info["batch_size"] < config.batch_size:
        log(f"--server {client.url} batches {info['batch_size']} sequences, fewer than --batch-size {config.batch_size}: "
            "log-probs may differ from --engine local in the last bits")


def open_backend(checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any) -> LocalBackend | SGLangBackend:
    """The engine ``config.engine_name`` names, opened on the checkpoint (a local one on ``device``)."""
    backend = SGLangBackend if config.engine_name == "sglang" else LocalBackend
    return backend.open(checkpoint, config, device)
