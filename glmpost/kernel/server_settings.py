"""What a client must know of a server before sampling from it: its settings (read once), what its
log-probs are log-probs of, and which of its refusals are the whole run's rather than one request's.

* :class:`ServerSettings`: ``GET /server_info`` (``/get_server_info`` on older SGLang) as read once
  per server; ``seed_reproducible`` is SGLang's ``enable_deterministic_inference`` (``glmpost serve``
  always says true), ``log_prob_kind`` what ``glmpost serve`` reports (SGLang reports none).
* :func:`probe_log_prob_kind`: the kind (:data:`glmpost.kernel.distribution.LOG_PROB_KINDS`) told
  from four 1-token requests whose sampled token is the argmax by construction
  (:data:`PROBE_REQUESTS`, :func:`classify_log_prob_kind`).
* :func:`rejected_field`: the sampling field a refusal names (an SGLang build without
  ``sampling_seed`` refuses every request of a run the same way).

Why these probe requests: SGLang takes any request with ``top_k <= 1`` (temperature 0 included) down
its greedy path, whose log-probs are ``log_softmax(logits)`` whatever the temperature
(layers/sampler.py ``is_all_greedy``), so a ``top_k`` 1 request cannot tell ``tempered`` from ``raw``
there; a tiny ``top_p`` keeps only the argmax too, on the sampling path. Values, for the argmax
``a`` with model log-prob ``r = log_softmax(z)[a]`` and ``t = log_softmax(z / 0.5)[a]``:

    request                         sampled  tempered  raw  top_p_renormalized   (SGLang greedy path)
    greedy (temperature 0)          r        r         r    r                    r
    top_p_t1: T 1,   top_p 1e-6     0        r         r    0
    top_p_t05: T 0.5, top_p 1e-6    0        t         r    0
    top_k1_t1: T 1,   top_k 1       0        r         r    r                    r

Nothing can be told when the model is nearly certain of ``a`` (``|r| < 1e-3``): then every kind
gives about 0.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from glmpost.kernel.distribution import LOG_PROB_KINDS
from glmpost.kernel.sglang_client import ServerError

# The probe's 1-token requests (each also max_new_tokens 1, ignore_eos, return_logprob).
PROBE_REQUESTS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top_p_t1": {"temperature": 1.0, "top_k": -1, "top_p": 1e-6},
    "top_p_t05": {"temperature": 0.5, "top_k": -1, "top_p": 1e-6},
    "top_k1_t1": {"temperature": 1.0, "top_k": 1, "top_p": 1.0},
}
PROBE_TEXTS = ("Hello", "The", "1 2 3")  # prompts tried in turn until the model is unsure of its next token
ZERO = 1e-6  # |log-prob| below this is the log-prob of a point mass
DECISIVE = 1e-3  # |greedy log-prob| below this: the model is too sure for the kinds to differ


@dataclass(frozen=True)
class ServerSettings:
    """A server's settings as its ``/server_info`` answered them (``{}`` when it has no such route)."""

    url: str
    info: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # its /model_info answer, where read

    @classmethod
    def read(cls, client) -> "ServerSettings":
        """Read ``client``'s settings (once per client: :meth:`SGLangClient.settings`); raises ServerError."""
        return cls(client.url, client.settings())

    @property
    def seed_reproducible(self) -> bool:
        """True only when the server says ``enable_deterministic_inference``: then a sequence's
        samples are a function of its ``sampling_seed``."""
        return self.info.get("enable_deterministic_inference") is True

    @property
    def version(self) -> str | None:
        """The server's release (SGLang's ``version``; ``glmpost serve`` reports glmpost's)."""
        version = self.info.get("version")
        return None if version is None else str(version)

    @property
    def engine(self) -> str:
        """``glmpost-serve`` for ``glmpost serve`` (its /model_info says so), else ``sglang``."""
        return str(self.model.get("engine") or "sglang")

    @property
    def preferred_sampling_params(self) -> dict:
        """SGLang's ``--preferred-sampling-params`` (/model_info, else /server_info; a JSON string
        there), ``{}`` for none."""
        value = self.model.get("preferred_sampling_params", self.info.get("preferred_sampling_params"))
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return {"<unreadable>": value}
        return value if isinstance(value, dict) else {}

    def facts(self) -> dict:
        """What a stage records of the server: its URL, engine and release."""
        return {"url": self.url, "engine": self.engine, "version": self.version}

    @property
    def log_prob_kind(self) -> str | None:
        """The kind the server reports (None when it reports none, or one glmpost does not know)."""
        kind = self.info.get("log_prob_kind")
        return kind if kind in LOG_PROB_KINDS else None


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 + 1e-3 * abs(b)


def classify_log_prob_kind(greedy: float, top_p_t1: float, top_p_t05: float, top_k1_t1: float) -> str:
    """The log-prob kind the four probe values fit (the table in this module's docstring).

    Raises ValueError when the model is nearly certain of its next token (``|greedy| < DECISIVE``),
    or when the values fit no kind."""
    values = {"greedy": greedy, "top_p_t1": top_p_t1, "top_p_t05": top_p_t05, "top_k1_t1": top_k1_t1}
    if not all(math.isfinite(v) for v in values.values()):
        raise ValueError(f"the probe got non-finite log-probs {values}")
    if abs(greedy) < DECISIVE:
        raise ValueError(f"the model is nearly certain of the probe's next token (greedy log-prob {greedy:.3g}), "
                         "so every kind gives about 0")
    zero = {name: abs(v) < ZERO for name, v in values.items()}
    if zero["top_p_t1"] and zero["top_p_t05"]:
        if zero["top_k1_t1"]:
            return "sampled"
        if _same(top_k1_t1, greedy):
            return "top_p_renormalized"
    elif _same(top_p_t1, greedy) and _same(top_k1_t1, greedy):
        if _same(top_p_t05, greedy):
            return "raw"
        if top_p_t05 > greedy:  # sharpening raises the argmax's probability
            return "tempered"
    shown = ", ".join(f"{name} {v:.6g}" for name, v in values.items())
    raise ValueError(f"the probe's log-probs ({shown}) fit no known kind")


def probe_prompts(tokenizer) -> list[list[int]]:
    """The probe's prompts as token ids (the tokenizer's encodings of :data:`PROBE_TEXTS`)."""
    prompts = [list(tokenizer.encode(text, add_special_tokens=False)) for text in PROBE_TEXTS]
    return [p for p in prompts if p] or [[int(tokenizer.eos_token_id or 0)]]


def probe_values(client, prompt_ids: Sequence[int]) -> dict[str, float]:
    """The log-prob of the one token each :data:`PROBE_REQUESTS` request gets on ``prompt_ids``.

    Raises ValueError when an answer lacks it or the answers sampled different tokens, ServerError
    when a request fails."""
    values, tokens = {}, set()
    for name, sampling in PROBE_REQUESTS.items():
        answer = client.generate(list(prompt_ids), {"max_new_tokens": 1, "ignore_eos": True, **sampling},
                                 return_logprob=True)
        entries = (answer.get("meta_info") or {}).get("output_token_logprobs") if isinstance(answer, dict) else None
        if not entries or len(entries) != 1 or entries[0][0] is None:
            raise ValueError(f"the {name} probe request got no log-prob for its one token")
        values[name] = float(entries[0][0])
        tokens.add(int(entries[0][1]))
    if len(tokens) != 1:
        raise ValueError(f"the probe requests sampled different tokens {sorted(tokens)} (each keeps only the argmax)")
    return values


def probe_log_prob_kind(client, prompts: Iterable[Sequence[int]]) -> str:
    """The kind of log-probs ``client``'s server returns, from the first of ``prompts`` on which the
    model is unsure enough (:func:`classify_log_prob_kind`). Raises ValueError when none tells,
    ServerError when a request fails."""
    reason = "no probe prompt"
    for prompt in prompts:
        values = probe_values(client, prompt)
        if abs(values["greedy"]) < DECISIVE:
            reason = f"the model is nearly certain of every probe prompt's next token (greedy log-prob {values['greedy']:.3g})"
            continue
        return classify_log_prob_kind(**values)
    raise ValueError(reason)


_KEYWORD_ARGUMENT = re.compile(r"unexpected keyword argument '(\w+)'")
# serde's unknown_field text, which SGLang 0.5.23's /generate contract check answers with HTTP 400
# (api/v1/api_types.py ``_unknown_field``): "unknown field `X`, expected one of `a`, `b`, ...".
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


def unknown_field(exc: ServerError) -> str | None:
    """The key an HTTP 400 ``unknown field `X`, expected one of ...`` refuses (SGLang 0.5.23 lists
    every valid key after it: only the first name is the refused one), else None."""
    if exc.status != 400:
        return None
    found = _UNKNOWN_FIELD.search(str(exc).split(": HTTP", 1)[-1])
    return found.group(1) if found else None


def rejected_field(exc: ServerError, fields: Iterable[str]) -> str | None:
    """The one of ``fields`` (sampling field names) a server's refusal names: SGLang 0.5.23's HTTP
    400 ``unknown field `X`, expected one of ...`` (X, never a key of the list that follows: None
    when X is not one of ``fields``), an HTTP 400 or 422 whose message names it (``glmpost serve``:
    ``sampling_params.X is not supported``; pydantic: ``X: Extra inputs are not permitted``), or
    any answer saying ``unexpected keyword argument 'X'`` (a ``SamplingParams`` TypeError of an
    older SGLang build). None for every other failure."""
    message, names = str(exc), list(fields)
    unknown = unknown_field(exc)
    if unknown is not None:
        return unknown if unknown in names else None
    typed = _KEYWORD_ARGUMENT.search(message)
    if typed and typed.group(1) in names:
        return typed.group(1)
    if exc.status not in (400, 422):
        return None
    detail = message.split(": HTTP", 1)[-1]  # the server's words, not the URL
    return next((name for name in names if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", detail)), None)


__all__ = [
    "DECISIVE",
    "PROBE_REQUESTS",
    "ServerSettings",
    "classify_log_prob_kind",
    "probe_log_prob_kind",
    "probe_prompts",
    "probe_values",
    "rejected_field",
    "unknown_field",
]
