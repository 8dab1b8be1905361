"""What an SGLang server samples from: every sampling key that changes the distribution sent
explicitly, the server's own defaults checked, and the key a server refuses named.

SGLang merges its ``--preferred-sampling-params`` into every request for the keys the request
leaves out (managers/tokenizer_manager.py: ``{**preferred_sampling_params, **obj.sampling_params}``),
so a key glmpost does not send can carry a server default (a repetition penalty, ``min_p``,
``min_new_tokens``, stop strings) into the sampled distribution while the record says otherwise.
:data:`EXPLICIT_DEFAULTS` lists every key of SGLang's ``SamplingParams`` (sampling/sampling_params.py,
read at sgl-project/sglang 00c17ca, 2026) that changes what is sampled, at the value that changes
nothing; glmpost sends them all. A key the server's preferred params set that is in neither list
is refused (:func:`check_preferred`).

An unknown key is, on SGLang 0.5.23, refused by ``/generate``'s contract check with HTTP 400
``{"error": "unknown field `X`, expected one of `max_new_tokens`, ..."}`` (api/v1/api_types.py
``_unknown_field``; :func:`~glmpost.kernel.server_settings.unknown_field` reads X); on older builds
it is a ``TypeError`` in ``SamplingParams(**kwargs)``, which ``/generate`` does not map (only
``ValueError`` becomes a 400): a bare HTTP 500 that names nothing. :func:`refused_fields` finds the
keys a server refuses with one 1-token request per key.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

# Every SGLang sampling key that changes what is sampled, at the value that changes nothing (None
# for the optional ones: SGLang reads None as its default).
EXPLICIT_DEFAULTS: dict[str, Any] = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "logit_bias": None,
    "custom_params": None, "stop": None, "stop_regex": None,
}
# Keys that decide the distribution and that glmpost always sets from the run's own settings.
RUN_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed")
# Keys that change only the text, never the ids or log-probs.
TEXT_KEYS = ("no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval")
# The SGLang release that introduced a key (where it is later than the rest); a server that refuses
# the key is older.
FIELD_SINCE = {"sampling_seed": "v0.5.3 (#10645)"}


def explicit(sampling: Mapping[str, Any], refused: Iterable[str] = ()) -> dict[str, Any]:
    """``sampling`` with every :data:`EXPLICIT_DEFAULTS` key it lacks, but the ``refused`` ones (a
    server without the key cannot apply it, nor take it from its preferred params)."""
    left_out = set(refused)
    return {**{k: v for k, v in EXPLICIT_DEFAULTS.items() if k not in left_out}, **sampling}


def check_preferred(preferred: Mapping[str, Any] | None, sent: Mapping[str, Any]) -> list[str]:
    """The keys of a server's ``preferred_sampling_params`` that ``sent`` does not override and that
    may change the distribution (empty: every request samples what its record says). Text-only keys
    are harmless."""
    return sorted(k for k in (preferred or {}) if k not in sent and k not in TEXT_KEYS)


def refused_fields(send: Callable[[dict[str, Any]], Any], sampling: Mapping[str, Any], failure: type[Exception]) -> list[str] | None:
    """The keys of ``sampling`` a server refuses: ``send(params)`` makes one 1-token request and raises
    ``failure`` when the server refuses it. A request with ``max_new_tokens`` alone first: when that
    fails too the failure is not a key's (None). Then each further key alone, in order."""
    base = {"max_new_tokens": 1}
    try:
        send(base)
    except failure:
        return None
    refused = []
    for key, value in sampling.items():
        if key in base:
            continue
        try:
            send({**base, key: value})
        except failure:
            refused.append(key)
    return refused


def refused_message(key: str) -> str:
    """Why a server refuses ``key``: the release that introduced it, where known."""
    since = FIELD_SINCE.get(key)
    return (f"sampling_params.{key} came with SGLang {since}: this server is older; upgrade it" if since
            else f"sampling_params.{key} is not a sampling key of this server")


__all__ = ["EXPLICIT_DEFAULTS", "FIELD_SINCE", "RUN_KEYS", "TEXT_KEYS", "check_preferred", "explicit", "refused_fields",
           "refused_message"]
