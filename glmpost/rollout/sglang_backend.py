"""``--engine sglang``: a rollout's batches sent to SGLang servers or ``glmpost serve`` over HTTP, each
sequence's seed sent as ``sampling_seed``; every server checked first (reachable, taking the API key,
serving the checkpoint's tokenizer revision, taking the run's sampling fields), its settings read
once for ``seed_reproducible`` and the log-prob kind records carry. A request that finally fails
comes back as an aborted outcome with its reason, never a lost prompt, unless every request would
fail alike (a refused key or field: one error). ``--engine vllm`` subclasses it
(:mod:`glmpost.rollout.vllm_engine`).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any, Iterator, Optional, Sequence

from tqdm import tqdm

from glmpost.config import ConfigError
from glmpost.formats.schema import UNKNOWN_VERSION
from glmpost.kernel.engine import SamplingParams, sequence_seed
from glmpost.kernel.lora_versions import is_lora_version, model_dir
from glmpost.kernel.routing import config_routing_layout, routed_from_sglang
from glmpost.kernel.server_settings import probe_log_prob_kind, probe_prompts, rejected_field
from glmpost.kernel.sglang_client import ServerError
from glmpost.kernel.sglang_sampling import FIELD_SINCE, refused_message
from glmpost.rollout.lora_servers import ServedLora
from glmpost.rollout.policy import PolicyCheckpoint
from glmpost.rollout.records import as_version, completion_from_sglang, sglang_sampling_params
from glmpost.rollout.servers import (
    Outcome,
    api_key_error,
    check_routing_returned,
    checked_sampling,
    connect_servers,
    continued,
    one_by_one,
    version_stamp,
)
from glmpost.rollout.settings import RolloutConfig
from glmpost.stage import log

__all__ = ["SGLangBackend"]


class SGLangBackend:
    """``--engine sglang``: the same batches sent to SGLang servers, ``concurrency`` requests at a time.

    Each server's settings are read once (``settings``, in pool order): records say
    ``seed_reproducible`` only when every server does, and carry the servers' log-prob kind
    (``kind_setting``, or with ``auto`` the one they report, else the one
    :func:`~glmpost.kernel.server_settings.probe_log_prob_kind` finds on ``probe_prompts``), and each
    token the version of the weights that sampled it (``stamp``: :func:`~glmpost.rollout.servers.version_stamp`).
    Every sequence is sent with its own ``rid``, so a request that timed out is aborted on the
    server before it is sent again; a sequence the server aborted (a weight switch, ``/abort_request``)
    is continued from its partial output with the rest of its budget, ``max_continuations`` times.
    """

    reports_weight_version = True  # SGLang does; vLLM does not (its backend confirms weights by fingerprint)

    def __init__(self, pool: Any, *, model_config: Any, default_stops: Any, batch_size: int,
                 settings: Sequence[Any] = (), kind_setting: str = "auto", probe_prompts: Sequence[list[int]] = (),
                 stamp: Any = None, max_continuations: int = 3, routing: Any = None, lora: ServedLora | None = None):
        self.pool = pool
        self.lora = lora  # a LoRA version: the adapter every request names (glmpost.rollout.lora_servers)
        self.model_config = model_config
        self.default_stops = default_stops
        self.batch_size = batch_size
        self.settings = list(settings)
        self.kind_setting = kind_setting
        self.probe_prompts = list(probe_prompts)
        self.seed_reproducible = bool(self.settings) and all(s.seed_reproducible for s in self.settings)
        self.stamp = stamp or (lambda version: as_version(version))
        self.max_continuations = max_continuations
        self.routing = routing  # a RoutingLayout: record each token's experts (return_routed_experts)
        self.params: SamplingParams | None = None
        self.sglang_params: dict[str, Any] = {}
        self._served: dict[str, str] = {}
        self._run_id = uuid.uuid4().hex[:12]

    @classmethod
    def open(cls, checkpoint: PolicyCheckpoint, config: RolloutConfig, device: Any = None) -> "SGLangBackend":
        """Read the checkpoint's config (no weights) and connect to the servers, each checked
        (``device`` is unused: the servers hold the model)."""
        from transformers import AutoConfig, GenerationConfig

        version_dir = str(checkpoint.version_dir)
        model_config = AutoConfig.from_pretrained(str(model_dir(checkpoint.version_dir)))  # a LoRA version: its base's
        try:
            default_stops = GenerationConfig.from_pretrained(version_dir).eos_token_id
        except OSError:
            default_stops = model_config.eos_token_id
        pool, settings = connect_servers(config, revision=checkpoint.revision, version_dir=checkpoint.version_dir)
        lora = ServedLora.open(pool.clients, checkpoint) if is_lora_version(checkpoint.version_dir) else None
        stamps = ([version_stamp(s, config.engine.unversioned_server, checkpoint.policy_version) for s in settings]
                  if cls.reports_weight_version and lora is None else [None])  # an adapter's answers carry its version
        return cls(pool, model_config=model_config, default_stops=default_stops, batch_size=config.batch_size,
                   settings=settings, kind_setting=config.engine.server_log_prob_kind,
                   probe_prompts=probe_prompts(checkpoint.tokenizer), stamp=stamps[0],
                   max_continuations=config.engine.max_continuations,
                   routing=_routing_layout(model_config) if config.record_routing else None, lora=lora)

    def switch_adapter(self, newer: PolicyCheckpoint) -> Optional[bool]:
        """Name ``newer``'s adapter from now on (:meth:`~glmpost.rollout.lora_servers.ServedLora.switch`):
        True when switched, False when a server does not hold it yet, None when this is no switch
        between adapters (not a LoRA rollout, or ``newer`` no LoRA version of its root and base)."""
        return None if self.lora is None else self.lora.switch(self.pool.clients, newer)

    def sampling_versions(self, checkpoint: PolicyCheckpoint) -> list[int]:
        """The version each server samples now (``rollout --max-server-lag``): the weight version it
        reports, as its records would be stamped; ``checkpoint``'s for an adapter (each request names
        its version's adapter); :data:`~glmpost.formats.schema.UNKNOWN_VERSION` when it does not answer."""
        if self.lora is not None:
            return [checkpoint.policy_version] * len(self.pool.clients)
        versions = []
        for client in self.pool.clients:
            try:
                versions.append(self.stamp(client.get_weight_version()))
            except ServerError:
                versions.append(UNKNOWN_VERSION)
        return versions

    def server_facts(self) -> list[dict]:
        """Each server's URL, engine and release, as stage.json records them."""
        return [s.facts() for s in self.settings]

    def prepare(self, params: SamplingParams, eos_ids: list[int]) -> SamplingParams:
        """Translate ``params`` to SGLang's sampling params (refused when SGLang cannot express them),
        check that every server takes them as they are (:func:`~glmpost.rollout.servers.checked_sampling`);
        returns ``params`` with the kind the servers' log-probs are of (``log_prob_kind``), which records carry."""
        try:
            self.sglang_params = sglang_sampling_params(params, eos_ids)
        except ValueError as exc:
            raise ConfigError("{engine_name} sglang {stop_token_ids}: {reason}", reason=exc) from None
        self.params = params
        probe = self.probe_prompts[0] if self.probe_prompts else [0]
        for client, settings in zip(self.pool.clients, self.settings):
            self.sglang_params = checked_sampling(client, settings, self.sglang_params, probe, self._run_error)
            if self.routing is not None:
                check_routing_returned(client, probe, self.routing)
        kinds = {client.url: self._server_kind(client, settings) for client, settings in zip(self.pool.clients, self.settings)}
        if len(set(kinds.values())) > 1:
            shown = ", ".join(f"{url} {kind}" for url, kind in kinds.items())
            raise ConfigError("{server}: the servers return different log-prob kinds ({shown}); serve them alike",
                              shown=shown, exit_code=1)
        if kinds:
            self.params = params = replace(params, log_prob_kind=next(iter(kinds.values())))
        return params

    def _server_kind(self, client: Any, settings: Any) -> str:
        """The log-prob kind of one server: the setting (which must not contradict what the server
        reports), else the reported one, else the probed one."""

        reported = settings.log_prob_kind
        if self.kind_setting != "auto":
            if reported is not None and reported != self.kind_setting:
                raise ConfigError("{server_log_prob_kind} {value} contradicts {server} {url}, which reports log_prob_kind "
                                  "{reported}", value=self.kind_setting, url=client.url, reported=reported)
            return self.kind_setting
        if reported is not None:
            return reported
        try:
            kind = probe_log_prob_kind(client, self.probe_prompts)
        except ValueError as exc:
            raise ConfigError("{server} {url} does not report what its log-probs are of and the probe cannot tell "
                              "({reason}); pass {server_log_prob_kind} KIND", url=client.url, reason=exc) from None
        except ServerError as exc:
            raise (self._run_error(exc) or ConfigError("{server} {url}: the log-prob probe failed ({reason})",
                                                       url=client.url, reason=exc, exit_code=1)) from None
        log(f"--server {client.url} does not report what its log-probs are of; the probe says {kind}")
        return kind

    def _run_error(self, exc: Any) -> ConfigError | None:
        """The one error for the whole run that a failed request is when every request would fail
        alike (the API key refused, a sampling field rejected), else None (the request is aborted)."""

        if exc.status in (401, 403):
            return api_key_error(exc)
        field_name = rejected_field(exc, [*self.sglang_params, "sampling_seed"])
        if field_name is None:
            return None
        return ConfigError("{server} {url} rejects sampling_params.{field} ({reason}){hint}", url=exc.url,
                           field=field_name, reason=exc, hint=f"; {refused_message(field_name)}"
                           if field_name in FIELD_SINCE else "", exit_code=1)

    def engine_name(self) -> str:
        """The name stamped in each record's engine map."""
        return "sglang"

    def generate(self, sequences: list[list[int]], keys: list[str], progress: tqdm, *,
                 homes: Optional[list[int]] = None, sessions: Optional[list[str]] = None,
                 max_new_tokens: Optional[int] = None) -> list[Outcome]:
        """Every sequence sampled (``max_new_tokens``: this call's budget, overriding the run's); an
        aborted one continued from its partial output (:meth:`_requests`), at most
        ``max_continuations`` times, its tokens then stamped each with its weights' version.

        ``homes`` (a server index per sequence) keeps every turn of a multi-turn trajectory on its
        server, whose prefix cache holds its history (the brief's DP-aware routing). ``sessions``:
        the server's prefix cache finds each trajectory's history by its ids, nothing to name."""

        budget = self.params.max_new_tokens if max_new_tokens is None else max_new_tokens
        outcomes = self._requests(sequences, keys, [budget] * len(sequences), homes, attempt=0)
        for attempt in range(1, self.max_continuations + 1):
            todo = [i for i, (c, _, _) in enumerate(outcomes) if c is not None and c.finish_reason == "abort"
                    and len(c.token_ids) < budget]
            if not todo:
                break
            more = self._requests([sequences[i] + outcomes[i][0].token_ids for i in todo], [keys[i] for i in todo],
                                  [budget - len(outcomes[i][0].token_ids) for i in todo],
                                  None if homes is None else [homes[i] for i in todo], attempt=attempt)
            for i, then in zip(todo, more):
                outcomes[i] = continued(outcomes[i], then)
        progress.update(len(sequences))
        return outcomes

    def _requests(self, sequences: list[list[int]], keys: list[str], budgets: list[int], homes: Optional[list[int]],
                  *, attempt: int) -> list[Outcome]:
        """One /generate batch request per ``batch_size`` chunk (the local engine's batches), in
        parallel; a chunk whose request finally failed comes back aborted with the reason, unless
        every request would fail alike (:meth:`_run_error`: then one ConfigError ends the run).
        Chunks never mix homes and go to their home first, failing over to the next server only
        when it fails; :meth:`served` says which server answered each key."""
        everything = list(range(len(sequences)))
        groups = [everything] if homes is None else [[i for i in everything if homes[i] == h] for h in sorted(set(homes))]
        futures = []
        for group in groups:
            for part in _chunks(len(group), self.batch_size):
                chunk = [group[j] for j in part]
                index = len(futures) if homes is None else homes[chunk[0]]
                futures.append((chunk, self._submit(index, chunk, sequences, keys, budgets, attempt)))
        outcomes: list[Optional[Outcome]] = [None] * len(sequences)
        for chunk, future in futures:
            try:
                url, answers = future.result()
                for i, outcome in zip(chunk, self._answers(answers, len(chunk))):
                    outcomes[i], self._served[keys[i]] = outcome, url
            except ServerError as exc:
                fatal = self._run_error(exc)
                if fatal is not None:
                    raise fatal from None
                for i in chunk:
                    outcomes[i] = (None, None, str(exc))
        return outcomes  # type: ignore[return-value]

    def served(self, key: str) -> Optional[str]:
        """The URL of the server that answered sequence ``key`` (None before it was sampled)."""
        return self._served.get(key)

    def _submit(self, number: int, chunk: list[int], sequences: list[list[int]], keys: list[str], budgets: list[int],
                attempt: int) -> Any:
        """Queue the request of one chunk on server ``number`` (mod n), each sequence with its own
        ``sampling_seed`` (a continuation's: another), budget and ``rid``; the future gives ``(url of
        the server that answered, answers)``. A chunk the server refuses whole (HTTP 4xx: one
        sequence too long, say) is sent again a sequence at a time, so only that one fails."""
        params = self.params
        suffix = "" if attempt == 0 else f"#continued{attempt}"
        per_seq = [{**self.sglang_params, "max_new_tokens": budgets[i],
                    "sampling_seed": sequence_seed(params.seed, keys[i] + suffix)} for i in chunk]
        ids = [sequences[i] for i in chunk]
        rids = [f"glmpost-{self._run_id}-{keys[i]}{suffix}" for i in chunk]
        fields = {"return_routed_experts": True} if self.routing is not None else {}
        return self.pool.submit(number, lambda c: (c.url, one_by_one(c, ids, per_seq, rids, **fields)))

    def _answers(self, answers: Any, expected: int) -> list[Outcome]:
        """A chunk's answers as outcomes, each version stamped; the wrong number of answers is a failed request."""

        if not isinstance(answers, list) or len(answers) != expected:
            raise ServerError(f"{len(answers) if isinstance(answers, list) else 'no'} answers for {expected} sequences",
                              url="?")
        outcomes = []
        for answer in answers:
            if isinstance(answer, ServerError):
                outcomes.append((None, None, str(answer)))
                continue
            completion, version, reason = completion_from_sglang(answer, self.params.stop_token_ids)
            if completion is not None and self.routing is not None:
                meta = answer.get("meta_info") or {}
                try:
                    completion.routed_experts = routed_from_sglang(meta["routed_experts"], int(meta["prompt_tokens"]),
                                                                   len(completion.token_ids), self.routing)
                except (KeyError, TypeError, ValueError) as exc:
                    completion, reason = None, f"server answer without the routed experts of its tokens ({exc})"
            outcomes.append((completion, self.stamp(version), reason))
        return outcomes

    def close(self) -> None:
        """Stop the pool's request threads."""
        self.pool.close()


def _routing_layout(model_config: Any) -> Any:
    """The checkpoint's :class:`~glmpost.kernel.routing.RoutingLayout` (None for a dense model);
    a config whose MoE layers glmpost cannot tell is one ConfigError."""
    try:
        return config_routing_layout(model_config)
    except ValueError as exc:
        raise ConfigError("{record_routing}: {reason}", reason=exc) from None


def _chunks(count: int, size: int) -> Iterator[list[int]]:
    """The indices ``0 .. count-1`` in consecutive chunks of ``size``."""
    for start in range(0, count, size):
        yield list(range(start, min(start + size, count)))
