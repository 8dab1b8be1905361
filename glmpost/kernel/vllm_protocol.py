"""The translation between SGLang's request/answer shapes and vLLM's OpenAI-compatible server, for
:class:`~glmpost.kernel.vllm_client.VLLMClient`: the ``/v1/completions`` body of one sequence
(:func:`completion_request`), its answer in SGLang's ``/generate`` shape (:func:`sglang_answer`), the
routed experts as SGLang's (:func:`sglang_routed_experts`) and ``/server_info`` under glmpost's keys
(:func:`vllm_settings`).

Fields as read in vLLM's source (upstream ``vllm-project/vllm``; the completions protocol at commit
002032e, ``vllm/entrypoints/openai/completion/protocol.py``; ``/server_info`` at 09cb327 / 0100a21,
``vllm/entrypoints/serve/instrumentator/server_info.py``):

* ``POST /v1/completions`` with a token-id ``prompt`` (one list per request: vLLM gives every prompt
  of a request the same ``seed``, and glmpost seeds each sequence on its own, so a batch is sent as
  concurrent single requests), an explicit ``max_tokens`` (vLLM's default is 16), ``temperature``,
  ``top_p``, ``top_k`` (-1 = off), ``seed``, ``stop_token_ids``, ``ignore_eos`` and, always, the
  neutral ``min_p`` 0, ``repetition_penalty`` 1, ``presence_penalty`` / ``frequency_penalty`` 0: a
  field left out takes the server's default from the model's generation config
  (``to_sampling_params``: "user -> server default -> OpenAI default"), which would change what
  is sampled while the record says otherwise. ``logprobs`` k (0: the sampled token's only),
  ``return_token_ids`` (``choices[].token_ids``, ``prompt_token_ids``), ``return_tokens_as_token_ids``
  (top-k keys ``token_id:N``). ``finish_reason`` ``stop`` (``stop_reason`` the stop token id, None
  for eos), ``length``, ``abort`` (or ``error``, ``repetition``: aborted here).
* ``GET /server_info?config_format=json`` (dev mode, ``VLLM_SERVER_DEV_MODE=1``):
  ``vllm_config.model_config.logprobs_mode`` and ``vllm_env.VLLM_BATCH_INVARIANT``, mapped by
  :func:`vllm_settings` onto glmpost's keys: ``raw_logprobs`` (vLLM's default) is glmpost's
  ``raw``, ``processed_logprobs`` (after temperature, top-k, top-p, renormalised) glmpost's
  ``sampled``; the logits modes have no log-prob kind (:data:`LOGITS_MODES`, refused by the rollout).
  ``enable_deterministic_inference`` is ``VLLM_BATCH_INVARIANT``: only then does a seed give the same
  tokens whatever else the server batches.
* ``temperature`` above 2 is refused by vLLM (0.32 ``SamplingParams._verify_args``: ``temperature
  must be in [0, 2]``), so the client refuses it before sending.

Routed experts (``rollout --record-routing``): a vLLM launched with ``--enable-return-routed-experts``
answers every ``/v1/completions`` choice with ``routed_experts``, base64 of ``.npy`` bytes of shape
``[prompt + output - 1, num_hidden_layers, num_experts_per_tok]`` (uint8 / uint16; None without the
flag, or for a request aborted before its first forward); there is no request field
(``CompletionResponseChoice.routed_experts`` in ``vllm/entrypoints/openai/completion/protocol.py`` as
read at ``local-inference-lab/vllm`` 7b2bff9, a mirror of upstream ``vllm-project/vllm``; the rows
come from ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` at vllm-project/vllm
42fa4c0, whose buffer is ``[tokens, num_hidden_layers, num_experts_per_tok]`` with zero rows for the
dense layers, as SGLang's). :func:`sglang_routed_experts` turns it into SGLang's
``meta_info.routed_experts`` (base64 of int32 of the same rows), which the routing code reads.
"""

from __future__ import annotations

import base64
import io
from typing import Any, Sequence

import numpy as np

from glmpost.kernel.sglang_sampling import EXPLICIT_DEFAULTS

LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "sampled"}  # vLLM --logprobs-mode -> glmpost kind
LOGITS_MODES = ("raw_logits", "processed_logits")
NEUTRAL_FIELDS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
_SGLANG_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed",
                "no_stop_trim", "skip_special_tokens"}
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more
DEFAULT_LABEL = "default"  # vLLM's weight_version before anyone sets one (v1/engine/core.py)
UNCONFIRMED_LABEL = "glmpost-unconfirmed"  # set where a reload may or may not have happened

__all__ = ["DEFAULT_LABEL", "LOGITS_MODES", "LOGPROBS_MODES", "UNCONFIRMED_LABEL", "completion_request", "release_parts",
           "sglang_answer", "sglang_routed_experts", "vllm_settings"]


def release_parts(release: Any) -> tuple[int, ...]:
    """A vLLM release as numbers, ``"0.34.0rc1"`` -> ``(0, 34, 0)``: each dotted part's leading digits, up
    to the first part that starts with none; ``()`` for no release number."""
    parts = []
    for piece in str(release or "").split("."):
        digits = piece[: len(piece) - len(piece.lstrip("0123456789"))]
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def completion_request(prompt: Sequence[int], sampling: dict[str, Any], *, model: str | None, logprobs: int | None) -> dict:
    """The ``/v1/completions`` body of one sequence from SGLang-style ``sampling`` params
    (``max_new_tokens`` >= 1, ``temperature``, ``top_p``, ``top_k`` -1/0 off, ``stop_token_ids``,
    ``ignore_eos``, ``sampling_seed``); raises ValueError for a key vLLM has no field for."""
    # SGLang's explicit no-op keys (glmpost.kernel.sglang_sampling) say nothing to vLLM: NEUTRAL_FIELDS does.
    unknown = sorted(k for k in set(sampling) - _SGLANG_KEYS if EXPLICIT_DEFAULTS.get(k, ...) != sampling[k])
    if unknown:
        raise ValueError(f"sampling_params {', '.join(unknown)} have no vLLM completions field here")
    max_tokens = int(sampling.get("max_new_tokens", 128))
    if max_tokens < 1:
        raise ValueError(f"vLLM samples at least one token (max_tokens >= 1), got max_new_tokens {max_tokens}")
    temperature = float(sampling.get("temperature", 1.0))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"vLLM takes temperature in [0, 2] (SamplingParams), got {temperature:g}")
    body: dict[str, Any] = {"prompt": [int(t) for t in prompt], "max_tokens": max_tokens,
                            "temperature": float(sampling.get("temperature", 1.0)), "top_p": float(sampling.get("top_p", 1.0)),
                            "top_k": _top_k(sampling.get("top_k", -1)),
                            "stop_token_ids": [int(t) for t in sampling.get("stop_token_ids") or []],
                            "ignore_eos": bool(sampling.get("ignore_eos", False)),
                            "skip_special_tokens": bool(sampling.get("skip_special_tokens", False)),
                            "return_token_ids": True, **NEUTRAL_FIELDS}
    if model is not None:
        body["model"] = model
    if sampling.get("sampling_seed") is not None:
        body["seed"] = int(sampling["sampling_seed"])
    if logprobs is not None:
        body["logprobs"] = int(logprobs)
        body["return_tokens_as_token_ids"] = True
    return body


def _top_k(value: Any) -> int:
    """-1 for no top-k: every vLLM release takes it (0 means off only since 2025; older ones refuse 0)."""
    k = int(value)
    return k if k > 0 else -1


def _top_row(row: Any) -> list[list]:
    """A ``top_logprobs`` dict (keys ``token_id:N``) as SGLang entries ``[lp, id, None]``, most likely first."""
    entries = [[float(lp), int(str(key).rsplit(":", 1)[-1]), None] for key, lp in (row or {}).items()]
    return sorted(entries, key=lambda e: -e[0])


def sglang_routed_experts(value: Any) -> str:
    """vLLM's per-choice ``routed_experts`` (base64 of ``.npy`` bytes, ``[positions, layers, k]``
    of an integer dtype) as SGLang's ``meta_info.routed_experts`` (base64 of int32, the same rows);
    raises ValueError (one line) for anything else."""
    try:
        array = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError, EOFError) as exc:
        raise ValueError(f"routed_experts is not base64 of a .npy array ({str(exc).splitlines()[0]})") from None
    if not isinstance(array, np.ndarray) or array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"routed_experts is a {getattr(array, 'dtype', type(array).__name__)} array of shape "
                         f"{list(getattr(array, 'shape', []))}, not integer [positions, layers, k]")
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode("ascii")


def sglang_answer(response: Any, *, weight_version: str | None, top_logprobs_num: int = 0,
                  routed_experts: bool = False) -> dict:
    """One ``/v1/completions`` answer (one choice) in the shape SGLang's ``/generate`` gives one
    sequence; with ``routed_experts``, the choice's routed experts as SGLang's (:func:`sglang_routed_experts`)."""
    choices = response.get("choices") if isinstance(response, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise ValueError(f"no choices in the answer {str(response)[:200]!r}")
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ValueError("the answer has no token_ids (a vLLM older than return_token_ids, 2025-08?)")
    ids = [int(t) for t in ids]
    reason = choice.get("finish_reason")
    if reason == "stop":
        stop = choice.get("stop_reason")
        finish: dict[str, Any] = {"type": "stop", "matched": stop if stop is not None else (ids[-1] if ids else None)}
    elif reason == "length":
        finish = {"type": "length", "length": len(ids)}
    else:
        finish = {"type": "abort", "message": f"vLLM finish_reason {reason!r}"}
    spans = choice.get("weight_versions")
    if isinstance(spans, list) and spans:  # vLLM 0.34 return_weight_versions: the labels that sampled the tokens
        labels = {str(span.get("version")) for span in spans if isinstance(span, dict)}
        if labels != {DEFAULT_LABEL}:  # vLLM's "default": no label set, what glmpost confirmed stands
            weight_version = labels.pop() if len(labels) == 1 else None  # several: no one version for the sequence
            weight_version = None if weight_version == UNCONFIRMED_LABEL else weight_version
    meta: dict[str, Any] = {"id": response.get("id"), "finish_reason": finish,
                            "prompt_tokens": len(choice.get("prompt_token_ids") or []), "completion_tokens": len(ids),
                            "weight_version": weight_version}
    if isinstance(spans, list):
        meta["weight_versions"] = spans
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        lps = logprobs.get("token_logprobs") or []
        meta["output_token_logprobs"] = [[None if lp is None else float(lp), t, None] for lp, t in zip(lps, ids)]
        if top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_top_row(row)[:top_logprobs_num] for row in logprobs.get("top_logprobs") or []]
    if routed_experts and choice.get("routed_experts") is not None:
        meta["routed_experts"] = sglang_routed_experts(choice["routed_experts"])
    return {"text": choice.get("text", ""), "output_ids": ids, "meta_info": meta}


def vllm_settings(info: dict) -> dict:
    """:meth:`VLLMClient.settings` from a ``/server_info?config_format=json`` answer."""
    config = info.get("vllm_config")
    model_config = config.get("model_config") if isinstance(config, dict) else None
    mode = model_config.get("logprobs_mode") if isinstance(model_config, dict) else None
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    invariant = env.get("VLLM_BATCH_INVARIANT")
    return {"logprobs_mode": mode, "log_prob_kind": LOGPROBS_MODES.get(mode),
            "enable_deterministic_inference": invariant is True or str(invariant).lower() in ("1", "true")}
