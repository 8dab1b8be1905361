"""Parsing and validating ``POST /generate`` requests for ``glmpost serve`` (see :mod:`glmpost.server.engine`).

A body follows SGLang's ``GenerateReqInput`` (managers/io_struct.py): ``input_ids`` (one list or a
batch), ``sampling_params`` (a dict or one per sequence), ``return_logprob``, ``logprob_start_len``,
``top_logprobs_num``, ``return_text_in_logprobs``, ``rid`` (a string; for a batch a string, which
becomes ``RID_i`` per sequence as ``GenerateReqInput._normalize_rid`` makes it, or one string per
sequence). :func:`parse_generate` turns it into one checked item per sequence, or refuses it with a
one-line :class:`RequestError` (HTTP 4xx); sampling parameters that would change the output if
honoured are refused unless at SGLang's default.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from glmpost.kernel.distribution import DEFAULT_LOG_PROB_KIND
from glmpost.kernel.engine import SamplingParams
from glmpost.server.loading import LoadedCheckpoint

# Sampling parameters that would change the output if honoured; refused unless at SGLang's default
# (None is SGLang's default for every key: SamplingParams.__post_init__; an empty ``logit_bias`` or
# ``choice`` is no bias, no choice).
_UNSUPPORTED_DEFAULTS = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                         "min_new_tokens": 0, "min_p": 0.0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
                         "structural_tag": None, "logit_bias": None, "stop_regex": None, "beam_width": None,
                         "watermark": None, "choice": None}
# SGLang's sampling keys in the order its /generate contract check lists them (sglang 0.5.23:
# api/v1/api_types.py ``SamplingParams``, "unknown keys rejected"; entrypoints/api_contract.py
# ``generate_contract_error``); any other key is refused before the request runs (:func:`unknown_key_message`).
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                 "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                 "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
                 "watermark", "choice")
_KNOWN = set(SAMPLING_KEYS)


def unknown_key_message(key: str, keys: tuple[str, ...] = SAMPLING_KEYS) -> str:
    """SGLang's answer to an unknown sampling key: serde's ``unknown_field`` text, which its
    /generate sends as HTTP 400 ``{"error": TEXT}`` (sglang 0.5.23: api/v1/api_types.py
    ``_unknown_field``; entrypoints/http_server.py ``generate_request``)."""
    listed = ", ".join(f"`{k}`" for k in keys)
    return f"unknown field `{key}`, expected one of {listed}"


class RequestError(Exception):
    """A request the server refuses (HTTP 4xx) with a one-line message; ``bare``: answered as SGLang's
    framework answers an exception it does not map, HTTP 500 ``Internal Server Error`` in plain text
    (the message goes to the server's log only); ``contract``: answered as SGLang's /generate
    contract check answers, ``{"error": message}``."""

    def __init__(self, message: str, status: int = 400, *, bare: bool = False, contract: bool = False):
        super().__init__(message)
        self.status = status
        self.bare = bare
        self.contract = contract


@dataclass
class SequenceRequest:
    """One sequence of a /generate request."""

    prompt: list[int]
    params: SamplingParams  # max_new_tokens may be 0 here (prefill only)
    seed: int
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str | None = None  # echoed as meta_info["id"] (None: a fresh id)
    stop_strs: list[str] = field(default_factory=list)  # sampling_params.stop
    no_stop_trim: bool = False  # keep the matched stop (string or token) in ``text``
    return_text_in_logprobs: bool = False  # log-prob entries carry each token's text
    result: dict | None = None
    abort_message: str | None = None  # set when /abort_request (or an update's abort_all_requests) stops it
    return_routed_experts: bool = False  # meta_info.routed_experts (SGLang's, base64 int32 [P + n - 1, L, k])
    target: Any = None  # the adapter's model it runs on (lora_path: glmpost.server.adapters); None: the served weights


def parse_generate(body: Any, loaded: LoadedCheckpoint, *, log_prob_kind: str = DEFAULT_LOG_PROB_KIND) -> tuple[list[SequenceRequest], bool]:
    """The sequences of a ``/generate`` body, checked against the served model ``loaded``, and
    whether it is a batch request (``input_ids`` a list of lists); every item's params return
    log-probs of ``log_prob_kind`` (greedy ones ``raw``: ``SamplingParams.recorded_kind``)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("text") is not None and body.get("input_ids") is None:
        raise RequestError("glmpost serve takes token ids: send input_ids, not text")
    input_ids = body.get("input_ids")
    batch = isinstance(input_ids, list) and len(input_ids) > 0 and isinstance(input_ids[0], list)
    prompts = input_ids if batch else [input_ids]
    if not isinstance(input_ids, list) or not input_ids or not all(_is_ids(p) for p in prompts):
        raise RequestError("input_ids must be a non-empty list of token ids, or a list of such lists")
    sampling = body.get("sampling_params") or {}
    per_item = _per_item(sampling, len(prompts), "sampling_params")
    flags = {name: _per_item(body.get(name, default), len(prompts), name)
             for name, default in (("return_logprob", False), ("logprob_start_len", -1), ("top_logprobs_num", 0))}
    if body.get("stream"):
        raise RequestError("stream is not supported by glmpost serve")
    rids = _rids(body.get("rid"), len(prompts), batch)
    with_text, routed = body.get("return_text_in_logprobs", False), body.get("return_routed_experts", False)
    if not isinstance(with_text, bool) or not isinstance(routed, bool):
        raise RequestError("return_text_in_logprobs and return_routed_experts must be true or false")
    items = [_parse_item(prompts[i], per_item[i], flags["return_logprob"][i], flags["logprob_start_len"][i],
                         flags["top_logprobs_num"][i], loaded) for i in range(len(prompts))]
    for item, rid in zip(items, rids):
        item.rid, item.return_text_in_logprobs, item.return_routed_experts = rid, with_text, routed
        item.params = replace(item.params, log_prob_kind=log_prob_kind)
    return items, batch


def _rids(rid: Any, count: int, batch: bool) -> list[str | None]:
    """One request id per sequence: a single request's string; a batch's string ``RID`` as
    ``RID_0 .. RID_{n-1}``, or its list of ``count`` strings (SGLang's ``_normalize_rid``)."""
    if rid is None:
        return [None] * count
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batch else [rid]
    if batch and isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != count:
            raise RequestError(f"rid: {len(rid)} ids for {count} sequences")
        duplicates = [r for r, n in Counter(rid).items() if n > 1]
        if duplicates:  # GenerateReqInput._validate_rid_uniqueness (managers/io_struct.py, sglang 0.5.23)
            raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
        return list(rid)
    raise RequestError("rid must be a string (or, for a batch, a list of strings, one per sequence)")


def _stop_strings(value: Any) -> list[str]:
    """``sampling_params.stop``: a string or a list of non-empty strings (None or [] for none)."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("sampling_params.stop must be a non-empty string or a list of them")
    return list(stops)


def _parse_item(prompt: list[int], sp: Any, return_logprob: Any, start: Any, top_n: Any, loaded: LoadedCheckpoint) -> SequenceRequest:
    """One sequence of a request, checked against the served model ``loaded`` (its config and eos ids)."""
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object (or a list of objects, one per sequence)")
    unknown = [key for key in sp if key not in _KNOWN]
    if unknown:  # SGLang 0.5.23: its contract check names the first, before SamplingParams is made
        raise RequestError(unknown_key_message(unknown[0]), 400, contract=True)
    sp = {key: value for key, value in sp.items() if value is not None}  # None: SGLang's default
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        value = sp.get(key, default)
        if value not in (default, None) and not (default is None and value in ([], {})):
            raise RequestError(f"sampling_params.{key} is not supported by glmpost serve")
    try:
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        top_k = int(sp.get("top_k", -1))
        stops = [int(t) for t in (sp.get("stop_token_ids") or [])]
        seed = sp.get("sampling_seed")
        seed = secrets.randbits(63) if seed is None else int(seed)
        start, top_n = int(start), int(top_n)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"sampling_params: {exc}") from None
    if max_new < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new}")
    # SGLang's Req._check_token_based_finish: ignore_eos turns off every token stop; otherwise
    # stop_token_ids and the model's eos ids both end a sequence.
    stops = [] if sp.get("ignore_eos", False) else sorted(set(stops) | set(_eos_ids(loaded)))
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=0 if top_k in (-1, 0) else top_k,
                            max_new_tokens=max(max_new, 1), seed=0, stop_token_ids=stops)
    try:
        params.validate()
    except ValueError as exc:
        raise RequestError(f"sampling_params: {exc}") from None
    if top_k < -1:
        raise RequestError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    params = replace(params, max_new_tokens=max_new)  # 0 (prefill only) once validated
    vocab = loaded.config.get("vocab_size")
    if vocab is not None and any(not 0 <= t < vocab for t in prompt):
        raise RequestError(f"input_ids: a token id is outside the vocabulary [0, {vocab})")
    context = loaded.config.get("max_position_embeddings")
    if context is not None and len(prompt) + max_new > context:
        raise RequestError(f"{len(prompt)} input tokens + max_new_tokens {max_new} exceed the context of {context}")
    if start > len(prompt):
        raise RequestError(f"logprob_start_len {start} must be <= the {len(prompt)} input tokens")
    if top_n < 0:
        raise RequestError("top_logprobs_num must be >= 0")
    return SequenceRequest(list(prompt), params, seed, bool(return_logprob), start, top_n, stop_strs=_stop_strings(sp.get("stop")),
                 no_stop_trim=bool(sp.get("no_stop_trim", False)))


def _eos_ids(loaded: LoadedCheckpoint) -> list[int]:
    eos = getattr(loaded.engine.model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _per_item(value: Any, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name}: {len(value)} entries for {count} sequences")
        return value
    return [value] * count


__all__ = [
    "SAMPLING_KEYS",
    "RequestError",
    "parse_generate",
    "unknown_key_message",
]
