"""One ``/generate`` sequence's answer, as SGLang shapes it, for ``glmpost serve`` (see :mod:`glmpost.server.engine`).

From SGLang: ``meta_info`` and its log-prob entries (managers/tokenizer_manager.py
``detokenize_logprob_tokens``: ``(logprob, token_id, None)``, with ``return_text_in_logprobs``
``(logprob, token_id, token_text)``, each token decoded on its own), ``meta_info["id"]`` the request's
``rid``, ``finish_reason`` (managers/schedule_batch.py ``FINISH_MATCHED_TOKEN`` /
``FINISH_MATCHED_STR`` / ``FINISH_LENGTH``), and stop strings (``Req._check_str_based_finish``: a
sequence stops at the first token after which the decoded tail of its output contains a stop
string; a stop token at that same token wins). ``output_ids`` keep every generated token, the
one that completed a stop string or is a stop token included; ``text`` is cut before the matched
stop (detokenizer_manager.py ``trim_matched_stop``) unless ``no_stop_trim``, which keeps the text
up to the end of the matched stop string (or the stop token).

The engine has no stop strings: it decodes on to ``max_new_tokens`` (or a stop token) and the
sequence is cut here. Each sequence draws from its own generator and a batch decodes every row to
its end, so the cut sequence is token for token the one an engine stopping there would return.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Sequence

import numpy as np

from glmpost.kernel.engine import Completion, Scores
from glmpost.kernel.routing import RoutingLayout, all_layer_rows, moe_shape, prompt_routing
from glmpost.server.parsing import RequestError, SequenceRequest


def stop_string_cut(token_ids: Sequence[int], stops: Sequence[str], tokenizer, *, stopped_by_token: bool) -> tuple[int, str] | None:
    """``(length, matched)``: the fewest leading tokens whose decoded tail contains a stop string
    (the first of ``stops`` found there), or None.

    The tail is the last ``bytes(longest stop) + 2`` tokens: a token decodes to at least one byte,
    so a stop string of B bytes lies within B + 2 consecutive tokens. ``stopped_by_token``: the last
    token is a stop token, which wins over a stop string completed by that same token.
    """
    if not stops or not token_ids:
        return None
    window = max(len(s.encode()) for s in stops) + 2
    last = len(token_ids) - 1 if stopped_by_token else len(token_ids)
    for length in range(1, last + 1):
        tail = tokenizer.decode(list(token_ids[max(0, length - window) : length]))
        for stop in stops:
            if stop in tail:
                return length, stop
    return None


def cut_completion(completion: Completion, length: int) -> Completion:
    """The first ``length`` tokens of ``completion``, with their log-probs and top-k rows."""
    top = (lambda rows: rows[:length] if rows is not None else None)
    return Completion(completion.token_ids[:length], completion.log_probs[:length], "stop",
                      top(completion.top_ids), top(completion.top_log_probs))


def response_text(token_ids: list[int], finish: dict, tokenizer, *, no_stop_trim: bool) -> str:
    """``text`` as SGLang's detokenizer gives it: without the matched stop string (and what follows
    it) or stop token, unless ``no_stop_trim`` (then up to the stop string's end, or with the token)."""
    matched = finish.get("matched")
    if isinstance(matched, str):
        text = tokenizer.decode(token_ids)
        at = text.find(matched)
        if at < 0:
            return text
        return text[: at + len(matched)] if no_stop_trim else text[:at]
    if finish.get("type") == "stop" and not no_stop_trim:
        return tokenizer.decode(token_ids[:-1])
    return tokenizer.decode(token_ids)


def sequence_answer(item: SequenceRequest, completion: Completion | None, scores: Scores | None, *, tokenizer,
                    weight_version: str, latency: float, cached_tokens: int = 0, prompt_routing: Any = None,
                    routing_layout: RoutingLayout | None = None) -> dict[str, Any]:
    """``{"text", "output_ids", "meta_info"}`` of one sequence: ``completion`` is None for a
    prefill-only one (max_new_tokens 0); ``scores`` its input log-probs (None when not asked for,
    or when the window holds only the first, ``None``, entry); ``cached_tokens`` the prompt tokens
    read from the prefix cache (SGLang's ``meta_info.cached_tokens``). ``routed_experts`` (asked for
    with ``return_routed_experts``; ``prompt_routing`` the prompt's rows, MoE layers only) as SGLang's
    capturer returns them (``python/sglang/srt/state_capturer/routed_experts.py``): base64 of int32
    ``[P + n - 1, num_hidden_layers, k]``, the dense layers' rows 0 (``routing_layout`` says which)."""
    finish: dict[str, Any]
    if completion is not None:
        cut = stop_string_cut(completion.token_ids, item.stop_strs, tokenizer,
                              stopped_by_token=completion.finish_reason == "stop")
        if completion.finish_reason == "abort":  # SGLang's FINISH_ABORT.to_json, the partial output kept
            finish = {"type": "abort", "message": item.abort_message, "status_code": None, "err_type": None}
        elif cut is not None:
            completion = cut_completion(completion, cut[0])
            finish = {"type": "stop", "matched": cut[1]}
        elif completion.finish_reason == "stop":
            finish = {"type": "stop", "matched": completion.token_ids[-1]}
        else:
            finish = {"type": "length", "length": len(completion.token_ids)}
    else:
        finish = {"type": "length", "length": 0}
    out_ids = completion.token_ids if completion is not None else []
    meta: dict[str, Any] = {"id": item.rid if item.rid is not None else uuid.uuid4().hex, "finish_reason": finish,
                            "prompt_tokens": len(item.prompt), "completion_tokens": len(out_ids), "cached_tokens": cached_tokens,
                            "weight_version": weight_version, "e2e_latency": round(latency, 6)}
    if item.return_logprob:
        meta.update(_log_prob_meta(item, completion, scores, tokenizer))
    if item.return_routed_experts and prompt_routing is not None:  # SGLang: int32 [P + n - 1, layers, k], base64
        rows = np.concatenate([prompt_routing] + ([completion.routed_experts] if completion is not None
                                                  and completion.routed_experts is not None else []))
        rows = all_layer_rows(rows, routing_layout) if routing_layout is not None else rows.astype(np.int32)
        meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
    return {"text": response_text(out_ids, finish, tokenizer, no_stop_trim=item.no_stop_trim), "output_ids": out_ids,
            "meta_info": meta}


def prompt_rows(model, items: Sequence[SequenceRequest]) -> dict[int, Any]:
    """The prompt rows of SGLang's ``routed_experts`` for the items that ask for them (one forward
    each); refused for a dense model (SGLang's is launched with --enable-return-routed-experts)."""
    wanted = [i for i, it in enumerate(items) if it.return_routed_experts]
    if wanted and moe_shape(model) is None:
        raise RequestError("return_routed_experts: the served model has no MoE routers")
    return {i: prompt_routing(model, items[i].prompt) for i in wanted}


def _log_prob_meta(item: SequenceRequest, completion: Completion | None, scores: Scores | None, tokenizer) -> dict[str, Any]:
    """``output_token_logprobs``, ``input_token_logprobs`` (from ``start``, the first entry's
    log-prob None) and, with ``top_logprobs_num``, the top-k rows of both."""
    rows = _Rows(tokenizer if item.return_text_in_logprobs else None)
    start = input_start(item)
    out_ids = completion.token_ids if completion is not None else []
    meta: dict[str, Any] = {
        "output_token_logprobs": rows.entries(completion.log_probs, out_ids) if completion else [],
        "input_token_logprobs": (rows.entries([None], item.prompt[start : start + 1])
                                 + (rows.entries(scores.log_probs, item.prompt[start + 1 :]) if scores else [])),
    }
    if item.top_logprobs_num > 0:
        meta["output_top_logprobs"] = ([rows.entries(lps, ids) for ids, lps in zip(completion.top_ids, completion.top_log_probs)]
                                       if completion else [])
        meta["input_top_logprobs"] = [None] * len(item.prompt[start : start + 1]) + (
            [rows.entries(lps, ids) for ids, lps in zip(scores.top_ids, scores.top_log_probs)] if scores else [])
    return meta


class _Rows:
    """Log-prob entries ``[logprob, token_id, text]``: ``text`` None, or each token decoded on its own."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def entries(self, log_probs: Sequence[float | None], token_ids: Sequence[int]) -> list[list]:
        texts = [self.tokenizer.decode([t]) for t in token_ids] if self.tokenizer is not None else [None] * len(token_ids)
        return [[lp, t, text] for lp, t, text in zip(log_probs, token_ids, texts)]


def input_start(item: SequenceRequest) -> int:
    """SGLang's logprob_start_len -1 (its default) means no input log-probs since #15922
    (2025-12-28): the start is the prompt's length."""
    return len(item.prompt) if item.logprob_start_len < 0 else item.logprob_start_len


__all__ = [
    "cut_completion",
    "prompt_rows",
    "input_start",
    "response_text",
    "sequence_answer",
    "stop_string_cut",
]
