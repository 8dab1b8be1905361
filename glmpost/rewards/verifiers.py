"""Rule-based rewards: verifiers routed by a record's ``domain``, and the format / length / truncation rules.

A *verifier* is a function ``fn(ctx: VerifyContext) -> float | Verdict`` returning a score in
``[0, 1]``. It may raise: the judge records that as a failed component (``reward`` NaN, the reason in
``reward_info``), never as a silent 0. Verifiers are looked up by name in :data:`VERIFIERS`
(built in: ``math``, ``count``, ``env``) or imported from a ``package.module:function`` spec
(:func:`glmpost.registry.load_hook`); :class:`VerifierTable` routes each record's ``domain`` to one.

Rules are small pure functions on what the record already says: :func:`format_score` (a regex the
response text must match), :func:`length_penalty` (action tokens over a budget, scaled to [0, 1])
and :func:`truncated_penalty` (1 when the rollout hit its token limit).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

import numpy as np

from glmpost.config import ConfigError
from glmpost.errors import UsageError
from glmpost.registry import load_hook
from glmpost.rewards.math_answers import (  # noqa: F401 (the normaliser's names, re-exported from here)
    DEFAULT_MATH_CHECKER,
    UnreadableReference,
    check_math_checker,
    extract_math_answer,
    judge_math,
    last_boxed,
    math_answers_equal,
    normalize_math_answer,
)


class VerifierError(Exception):
    """A verifier cannot judge this record (e.g. the task lacks its reference answer)."""


@dataclass(frozen=True)
class VerifyContext:
    """What a verifier sees of one trajectory.

    ``text`` is the whole response decoded with special tokens removed; ``response_token_ids`` and
    ``action_mask`` are the record's exact arrays (``[T]``); ``task``, ``status``, ``domain`` and
    ``sampling`` are the record's fields (empty when absent); ``tokenizer`` is the policy's;
    ``options`` are the run's verifier settings (:attr:`VerifierTable.options`: ``math_checker``).
    """

    text: str
    response_token_ids: np.ndarray
    action_mask: np.ndarray
    task: Mapping[str, Any]
    status: str
    tokenizer: Any
    domain: str = ""
    sampling: Mapping[str, Any] = field(default_factory=dict)
    record_id: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # the record's extra (extra.env: a multi-turn rollout's)
    options: Mapping[str, Any] = field(default_factory=dict)  # the run's verifier settings (math_checker)


@dataclass(frozen=True)
class Verdict:
    """A score in [0, 1] plus details worth keeping in ``reward_info`` (e.g. the extracted answer)."""

    score: float
    details: Mapping[str, Any] = field(default_factory=dict)


Verifier = Callable[[VerifyContext], Union[float, Verdict]]
VERIFIERS: dict[str, Verifier] = {}


def register_verifier(name: str) -> Callable[[Verifier], Verifier]:
    """Decorator adding a built-in verifier to :data:`VERIFIERS` under ``name``."""

    def decorate(fn: Verifier) -> Verifier:
        VERIFIERS[name] = fn
        return fn

    return decorate


def check_score(value: Any, *, low: float = 0.0, high: float = 1.0) -> float:
    """``value`` as a float in ``[low, high]``; anything else raises :class:`VerifierError`."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise VerifierError(f"returned {type(value).__name__}, expected a number in [{low:g}, {high:g}]")
    score = float(value)
    if not math.isfinite(score) or not low <= score <= high:
        raise VerifierError(f"returned {score!r}, outside [{low:g}, {high:g}]")
    return score


def run_verifier(fn: Verifier, ctx: VerifyContext) -> Verdict:
    """Call a verifier and check its answer (a number or :class:`Verdict` with a score in [0, 1])."""
    result = fn(ctx)
    if isinstance(result, Verdict):
        return Verdict(check_score(result.score), dict(result.details))
    return Verdict(check_score(result))


# --------------------------------------------------------------------------------------------
# Hooks and routing


def resolve_verifier(spec: str, *, where: str) -> Verifier:
    """A built-in verifier name (``math``, ``count``) or a ``package.module:function`` hook."""
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    if ":" in spec:
        return load_hook(spec, where=where)
    raise UsageError(
        f"{where}: unknown verifier {spec!r} (built in: {', '.join(sorted(VERIFIERS))}; "
        "or name a package.module:function)"
    )


class VerifierTable:
    """Routes a record's ``domain`` to a verifier.

    A domain named like a built-in verifier uses it; ``routes`` (domain -> built-in name or
    ``package.module:function``) add or override domains; ``default`` (a spec, optional) serves
    every other domain, including records without one. Hooks are imported on construction, so a
    bad spec fails before any work starts. ``options`` are the run's verifier settings every
    verifier sees as ``VerifyContext.options`` (``math_checker``, checked here).
    """

    def __init__(self, routes: Mapping[str, str] | None = None, default: str | None = None,
                 options: Mapping[str, Any] | None = None):
        self.options = dict(options or {})
        check_math_checker(self.options.setdefault("math_checker", DEFAULT_MATH_CHECKER))
        self.specs: dict[str, str] = {name: name for name in VERIFIERS}
        self.specs.update(routes or {})
        self._fns = {d: resolve_verifier(s, where=f"verifier for domain {d!r}") for d, s in self.specs.items()}
        self.default = default
        self._default_fn = resolve_verifier(default, where="--default-verifier") if default else None

    def lookup(self, domain: str | None) -> tuple[str, Verifier]:
        """``(spec, verifier)`` for ``domain``; a :class:`~glmpost.config.ConfigError` names it and the known ones."""
        if domain and domain in self._fns:
            return self.specs[domain], self._fns[domain]
        if self._default_fn is not None:
            return self.default, self._default_fn  # type: ignore[return-value]
        known = ", ".join(sorted(self._fns))
        if not domain:
            raise ConfigError("no domain to route to a verifier (known: {known}); set 'domain' in the prompt data "
                              "or give {default_verifier}", known=known)
        raise ConfigError("domain {domain!r} has no verifier (known: {known}); map it with {verifiers} "
                          "DOMAIN=package.module:function, [judge.domains], or give {default_verifier}",
                          domain=domain, known=known)


# --------------------------------------------------------------------------------------------
# math: final answers (the checkers: glmpost.rewards.math_answers)

@register_verifier("math")
def math_verifier(ctx: VerifyContext) -> Verdict:
    """1.0 when the response's final answer equals ``task["answer"]`` (or one of a list of
    acceptable answers), else 0.0: the brief's binary verifiable reward ("Reasoning RL").

    ``ctx.options["math_checker"]`` says how (:mod:`glmpost.rewards.math_answers`: ``math-verify``,
    the default, or ``normalise``). The final answer is the last ``\\boxed{...}``, else the last
    expression (``normalise``: number) of the response; a response without one scores 0. The details
    hold the ``checker``, the answer as ``extracted``, its canonical string ``answer`` (what
    ``glmpost eval`` votes with) and the ``expected`` answer(s). A task without ``answer``, or with
    one the checker cannot read, raises.
    """
    if "answer" not in ctx.task:
        raise VerifierError("task has no 'answer' to compare with")
    reference = ctx.task["answer"]
    accepted = reference if isinstance(reference, list) else [reference]
    if not accepted:
        raise VerifierError("task 'answer' is an empty list")
    checker = ctx.options.get("math_checker", DEFAULT_MATH_CHECKER)
    try:
        judgement = judge_math(ctx.text, accepted, checker)
    except UnreadableReference as exc:
        raise VerifierError(str(exc)) from None
    expected = [str(a) for a in accepted] if isinstance(reference, list) else str(reference)
    details = {"checker": checker, "extracted": judgement.extracted, "answer": judgement.answer, "expected": expected}
    return Verdict(float(judgement.correct), details)


# --------------------------------------------------------------------------------------------
# count: the tiny task the embedded model learns (prompt "count: d")


def digit_token_id(tokenizer: Any, digit: Any) -> int:
    """The single token id of ``digit`` (0-9, as int or one-character string)."""
    text = str(digit)
    if len(text) != 1 or not text.isdigit():
        raise VerifierError(f"task digit {digit!r} is not a single digit 0-9")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise VerifierError(f"digit {text!r} is {len(ids)} tokens in this tokenizer, not one")
    return int(ids[0])


@register_verifier("count")
def count_verifier(ctx: VerifyContext) -> Verdict:
    """Fraction of action tokens that are the digit token ``task["digit"]``.

    ``score = #{t : action_mask[t] and response_token_ids[t] == id(digit)} / max(A, M)`` where ``A``
    is the number of action tokens and ``M`` the rollout's ``sampling["max_new_tokens"]`` (0 when
    absent): a stop token counts as a non-matching token, and stopping early cannot raise the
    fraction. Merged tokens such as ``"33"`` do not match. A random model scores about 0.002.
    """
    if "digit" not in ctx.task:
        raise VerifierError("task has no 'digit'")
    target = digit_token_id(ctx.tokenizer, ctx.task["digit"])
    actions = np.asarray(ctx.action_mask, dtype=bool)
    hits = int(np.count_nonzero(actions & (np.asarray(ctx.response_token_ids) == target)))
    budget = ctx.sampling.get("max_new_tokens") if isinstance(ctx.sampling, Mapping) else None
    denominator = max(int(actions.sum()), int(budget) if isinstance(budget, int) and budget > 0 else 0)
    score = hits / denominator if denominator else 0.0
    return Verdict(score, {"matches": hits, "of": denominator})


@register_verifier("env")
def env_verifier(ctx: VerifyContext) -> Verdict:
    """The environment's own reward of a multi-turn rollout (``extra.env.reward``: the sum of its
    steps' rewards, ``rollout --env``), which must lie in [0, 1]; the turns and malformed tool calls
    ride along in the details."""
    env = ctx.extra.get("env") if isinstance(ctx.extra, Mapping) else None
    if not isinstance(env, Mapping) or "reward" not in env:
        raise VerifierError("record has no extra.env.reward: roll it out with `glmpost rollout --env`")
    return Verdict(check_score(env["reward"]), {"turns": env.get("turns"), "malformed": env.get("malformed")})


# --------------------------------------------------------------------------------------------
# Rules


def format_score(text: str, pattern: re.Pattern[str]) -> float:
    """1.0 when ``pattern`` is found anywhere in ``text`` (``re.search``), else 0.0."""
    return 1.0 if pattern.search(text) else 0.0


def length_penalty(num_tokens: int, max_tokens: int, ramp_tokens: int) -> float:
    """``clip((num_tokens - max_tokens) / ramp_tokens, 0, 1)``: 0 within budget, 1 at budget + ramp."""
    if ramp_tokens < 1:
        raise ValueError(f"ramp_tokens must be >= 1, got {ramp_tokens}")
    return min(1.0, max(0.0, (num_tokens - max_tokens) / ramp_tokens))


def overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), as the penalty ``P`` whose
    negative is its ``R_length``: with ``L_max`` = ``max_tokens`` and ``L_cache`` = ``cache_tokens``,

        P = 0                                       if |y| <= L_max - L_cache
        P = (|y| - (L_max - L_cache)) / L_cache     if L_max - L_cache < |y| <= L_max
        P = 1                                       if |y| > L_max

    so a response inside the last ``L_cache`` tokens before the limit loses up to the reward's unit,
    linearly, and one at the limit (truncated) loses all of it."""
    if cache_tokens < 1 or max_tokens < cache_tokens:
        raise ValueError(f"need 1 <= cache_tokens <= max_tokens, got cache_tokens {cache_tokens}, max_tokens {max_tokens}")
    return min(1.0, max(0.0, (num_tokens - (max_tokens - cache_tokens)) / cache_tokens))


def truncated_penalty(status: str) -> float:
    """1.0 when the rollout stopped at its token limit (``status == "truncated"``), else 0.0."""
    return 1.0 if status == "truncated" else 0.0
