"""The SGLang-API servers a rollout samples from, checked before anything is sampled: reachable,
taking the keys, serving the checkpoint's tokenizer, reporting which weights they hold, sampling
the distribution the records will name.

* :func:`connect_servers` / :func:`check_server`: one read of each server's ``/model_info`` and
  ``/server_info`` (:class:`~glmpost.kernel.server_settings.ServerSettings`).
* :func:`version_stamp`: what ``policy_versions`` say of a server's tokens. SGLang reports
  ``weight_version`` ``"default"`` when launched without ``--weight-version`` and never synced
  (server_args.py); such tokens' version is unknown, and the run refuses them unless told otherwise
  (``unversioned_server``).
* :func:`checked_sampling`: the run's sampling params as the server will apply them: keys a server
  does not have dropped when they only restate a default, a refused key the run needs named in one
  line with the release that introduced it, and the server's ``--preferred-sampling-params`` refused
  where a request cannot override them (:mod:`glmpost.kernel.sglang_sampling`).
* :func:`one_by_one` and :func:`continued`: one failed sequence never fails its batch, and a
  sequence the server aborted keeps its partial output, continued.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from glmpost.config import ConfigError
from glmpost.formats.schema import UNKNOWN_VERSION
from glmpost.kernel.engine import Completion
from glmpost.kernel.routing import routed_from_sglang
from glmpost.kernel.server_settings import ServerSettings, unknown_field
from glmpost.kernel.sglang_client import ServerError, SGLangClient, fresh_rid
from glmpost.kernel.sglang_pool import SGLangPool
from glmpost.kernel.sglang_sampling import EXPLICIT_DEFAULTS, check_preferred, refused_fields, refused_message
from glmpost.kernel.vllm_client import VLLMClient
from glmpost.rollout.records import as_version
from glmpost.rollout.settings import RolloutConfig
from glmpost.stage import log

# What an engine returns per sequence: (completion | None, weight_version, abort_reason).
Outcome = tuple[Optional[Completion], Any, Optional[str]]


def api_key_error(exc: Any) -> ConfigError:
    """A server's HTTP 401 as the run's one error (the message never holds the key)."""
    return ConfigError("{server} {url} refused the API key (HTTP 401): pass {api_key}", url=exc.url, exit_code=1)


def connect_servers(config: RolloutConfig, *, revision: str, version_dir: Path) -> tuple[Any, list[Any]]:
    """A pool over the ``server`` URLs, each checked (reachable, serving our tokenizer revision, taking
    our API key), and each server's settings, in pool order."""

    try:
        e = config.engine
        pool = SGLangPool(e.server, concurrency=e.concurrency, timeout=e.timeout, retries=e.retries, api_key=e.api_key,
                          admin_api_key=e.admin_api_key, client_class=VLLMClient if e.engine_name == "vllm" else SGLangClient)
    except ValueError as exc:
        raise ConfigError("{server} {value!r}: {reason}", value=config.engine.server, reason=exc) from None
    return pool, [check_server(client, config, revision=revision, version_dir=version_dir) for client in pool.clients]


def check_server(client: Any, config: RolloutConfig, *, revision: str, version_dir: Path) -> ServerSettings:
    """Ask one server for its model info and settings (quickly); returns its
    :class:`~glmpost.kernel.server_settings.ServerSettings`, the run's one read of them. An unreachable
    server, a refused API key or another tokenizer revision is an error; a server that batches fewer
    sequences than ``batch_size``, or does not say its seeds reproduce, is warned about."""

    quick = client.copy(timeout=min(config.engine.timeout, 30.0), retries=min(config.engine.retries, 1), backoff=0.2)
    try:
        info = quick.model_info()
        settings = replace(ServerSettings.read(quick), model=info if isinstance(info, dict) else {})
    except ServerError as exc:
        if exc.status == 401:
            raise api_key_error(exc) from None
        raise ConfigError("{server} {url}: unreachable ({reason})", url=client.url, reason=exc, exit_code=1) from None
    served = settings.model.get("tokenizer_revision")
    if served is None:
        log(f"--server {client.url} does not report a tokenizer revision (not `glmpost serve`); "
            f"make sure it serves the tokenizer of {version_dir}")
    elif served != revision:
        raise ConfigError("{server} {url} serves tokenizer revision {served}; {checkpoint} {version_dir} has {revision}",
                          url=client.url, served=served, version_dir=version_dir, revision=revision, exit_code=1)
    batch = settings.model.get("batch_size")
    if isinstance(batch, int) and batch < config.batch_size:
        log(f"--server {client.url} batches {batch} sequences, fewer than --batch-size {config.batch_size}: "
            "log-probs may differ from --engine local in the last bits")
    if not settings.seed_reproducible:
        log(f"--server {client.url} does not say enable_deterministic_inference: records get seed_reproducible false "
            "(a seed may not give the same samples twice)")
    return settings


def version_stamp(settings: ServerSettings, unversioned: str, checkpoint_version: int) -> Callable[[Any], int]:
    """What ``policy_versions`` record for a token a server answered with ``weight_version`` w: w when
    it is an integer; otherwise the ``unversioned`` rule: ``refuse`` (checked here, at connection),
    ``unknown`` (:data:`~glmpost.formats.schema.UNKNOWN_VERSION`) or ``checkpoint`` (the checkpoint's
    version, on the user's word). A server that answers a non-integer later is recorded unknown."""
    reported = settings.model.get("weight_version")
    if as_version(reported) is None and unversioned == "refuse":
        raise ConfigError("{server} {url} reports weight_version {reported!r}, not a policy version (an SGLang server "
                          "launched without a weight_version and never synced by glmpost sync-weights): which weights "
                          "sample is unknown; launch it with weight_version {version}, sync it, or pass "
                          "{unversioned_server} unknown (tokens recorded of unknown version) or checkpoint (stamped "
                          "{version}, on your word)", url=settings.url, reported=reported, version=checkpoint_version,
                          exit_code=1)
    fallback = checkpoint_version if unversioned == "checkpoint" else UNKNOWN_VERSION

    def stamp(version: Any) -> int:
        number = as_version(version)
        return fallback if number is None else number

    return stamp


def checked_sampling(client: Any, settings: ServerSettings, sampling: dict[str, Any], probe: list[int],
                     run_error: Callable[[ServerError], ConfigError | None]) -> dict[str, Any]:
    """``sampling`` as ``client``'s server takes it, checked with one 1-token request (more only when
    it is refused). Raises ConfigError for a refused key the run needs, a refused API key, or
    preferred sampling params a request cannot override."""
    try:
        client.generate(probe, {**sampling, "max_new_tokens": 1, "sampling_seed": 0}, return_logprob=True)
    except ServerError as exc:
        # SGLang 0.5.23 answers a key it does not have with 400 "unknown field `X`, ...", older builds
        # with a bare 500: either way a key that only restates the default is dropped (_without_refused).
        unknown = unknown_field(exc)
        fatal = None if unknown is not None else run_error(exc)
        if fatal is not None or (exc.status != 500 and unknown is None):  # another 400 names its field (run_error)
            raise (fatal or ConfigError("{server} {url} refused this rollout's sampling settings ({reason})",
                                        url=client.url, reason=exc, exit_code=1)) from None
        sampling = _without_refused(client, sampling, probe, exc)
    unset = check_preferred(settings.preferred_sampling_params, sampling)
    if unset:
        raise ConfigError("{server} {url} was launched with preferred_sampling_params setting {keys}, which this "
                          "rollout cannot override (the records would name another distribution): relaunch it without "
                          "them", url=client.url, keys=", ".join(unset), exit_code=1)
    return sampling


def _without_refused(client: Any, sampling: dict[str, Any], probe: list[int], exc: ServerError) -> dict[str, Any]:
    """``sampling`` less the keys the server does not have that only restate its default; one
    ConfigError naming the first refused key the run needs (or the failure, when no key is to blame)."""
    once = client.copy(retries=0)
    per_key = {**sampling, "sampling_seed": 0}
    refused = refused_fields(lambda sp: once.generate(probe, sp, return_logprob=True), per_key, ServerError)
    needed = [k for k in refused or () if k not in EXPLICIT_DEFAULTS]
    if refused is None or not refused:
        raise ConfigError("{server} {url} refused this rollout's sampling settings ({reason})", url=client.url,
                          reason=exc, exit_code=1) from None
    if needed:
        raise ConfigError("{server} {url} refuses {why} (HTTP {status})", url=client.url, why=refused_message(needed[0]),
                          status=exc.status, exit_code=1) from None
    log(f"--server {client.url} has no sampling key {', '.join(refused)} (an older SGLang): not sent, "
        "it cannot change what that server samples")
    return {k: v for k, v in sampling.items() if k not in refused}


def one_by_one(client: Any, ids: list[list[int]], sampling: list[dict], rids: list[str], **fields: Any) -> list[Any]:
    """One batch request; when the server refuses it whole with HTTP 400 (SGLang fails a batch for
    one bad sequence), each sequence alone under a fresh id (:func:`~glmpost.kernel.sglang_client.fresh_rid`:
    the batch may have been a resend whose first ids the server still holds), a refused one answered
    by its :class:`ServerError`."""
    try:
        return client.generate(ids, sampling, return_logprob=True, rid=rids, **fields)
    except ServerError as exc:
        if exc.status != 400 or len(ids) == 1:
            raise
    answers = []
    for one, sp, rid in zip(ids, sampling, rids):
        try:
            answers.append(client.generate([one], [sp], return_logprob=True, rid=[fresh_rid(rid)], **fields)[0])
        except ServerError as exc:
            if exc.status != 400:
                raise
            answers.append(exc)
    return answers


def continued(first: Outcome, then: Outcome) -> Outcome:
    """An aborted sequence's partial outcome ``first`` followed by its continuation ``then``: the
    tokens and log-probs of both, each token with its weights' version (recorded per token only
    where they differ); still the partial one, aborted, when the continuation failed."""
    done, version, _ = first
    more, new_version, reason = then
    if more is None:
        return done, version, reason
    versions = ((done.token_versions or [version] * len(done.token_ids))
                + (more.token_versions or [new_version] * len(more.token_ids)))
    routed = (np.concatenate([done.routed_experts, more.routed_experts])
              if done.routed_experts is not None and more.routed_experts is not None else None)
    merged = Completion(done.token_ids + more.token_ids, done.log_probs + more.log_probs, more.finish_reason,
                        token_versions=versions if len(set(versions)) > 1 else None, routed_experts=routed)
    return merged, new_version, reason


def check_routing_returned(client: Any, probe: list[int], layout: Any) -> None:
    """Refuse, in one line and before anything is sampled, a server whose routed experts the run
    cannot record: one real 1-token request asking for them (``return_routed_experts``), its
    payload decoded and shape-checked by the code that reads every answer
    (:func:`~glmpost.kernel.routing.routed_from_sglang` against ``layout``, the checkpoint's
    :class:`~glmpost.kernel.routing.RoutingLayout`). No payload: SGLang launched without
    ``--enable-return-routed-experts``, or a vLLM without it (or older than its per-choice
    ``routed_experts``); a payload of another shape: a server of another model."""
    engine = getattr(client, "engine", "sglang")
    launch = "vLLM" if engine == "vllm" else "SGLang"
    try:
        answer = client.generate(probe, {"max_new_tokens": 1}, return_logprob=True, return_routed_experts=True)
    except ServerError as exc:
        raise ConfigError("{server} {url}: the {record_routing} check request failed ({reason})", url=client.url,
                          reason=str(exc).splitlines()[0], exit_code=1) from None
    meta = (answer.get("meta_info") or {}) if isinstance(answer, dict) else {}
    if meta.get("routed_experts") is None:
        raise ConfigError("{server} {url} returns no routed_experts ({record_routing}): launch {launch} with "
                          "`--enable-return-routed-experts`", url=client.url, launch=launch, exit_code=1)
    try:
        routed_from_sglang(meta["routed_experts"], int(meta["prompt_tokens"]), len(answer.get("output_ids") or []), layout)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError("{server} {url} returns routed experts the checkpoint's model cannot have ({record_routing}): "
                          "{reason}", url=client.url, reason=exc, exit_code=1) from None


__all__ = ["Outcome", "api_key_error", "check_routing_returned", "check_server", "checked_sampling", "connect_servers", "continued", "one_by_one",
           "version_stamp"]
