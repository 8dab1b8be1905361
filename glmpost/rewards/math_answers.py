"""Final answers of math responses: extract one, compare it with the task's reference, and give it a
canonical string (what ``glmpost eval`` votes with for maj@n).

The ``math`` verifier's score is the binary verifiable outcome reward of the brief
("Reasoning RL：相对奖励与可信 token": "主要使用可验证的二值结果奖励"): 1 when the response's final
answer equals the reference, else 0. Two checkers decide "equals" (the judge's and eval's ``math_checker``):

- ``math-verify`` (the default, the field's standard): :mod:`math_verify` (Hugging Face's
  Math-Verify) parses both answers into SymPy (LaTeX, ``\\boxed{}`` first, then plain expressions:
  its ``LatexExtractionConfig(boxed_match_priority=0)`` and ``ExprExtractionConfig()``) and compares
  them symbolically and numerically: ``\\frac{1}{2}`` = ``0.5``, ``\\sqrt{4}`` = ``2``,
  ``\\{1,2\\}`` = ``\\{2,1\\}``, intervals by their ends and brackets, ``x = 2`` = ``2``; a
  decimal equals a fraction only to 6 places (``1/3`` = ``0.333333``, not ``0.33``). Units are
  dropped before comparing (``5 cm`` = ``5``, and so ``5 m`` = ``5 cm``: units are not checked).
- ``normalise``: glmpost's own normaliser (:func:`normalize_math_answer`): strip LaTeX dressing, then
  exact equality of numbers as fractions (``1/2`` = ``0.5``), else of the normalised strings
  (``\\sqrt{4}`` != ``2``, ``\\{1,2\\}`` != ``\\{2,1\\}``).

Both read the same final answer: the content of the response's last balanced ``\\boxed{...}`` when it
has one (Math-Verify by itself would join nearby boxes into one set; here the last box is the
answer), else, with ``math-verify``, the last LaTeX or plain expression it can parse, with
``normalise`` the last number. A reference is parsed as if it were boxed. Math-Verify's own timeouts
are ``signal.alarm`` and work only in the main thread, so it runs here without them; in the main
thread the whole check runs under one alarm of :data:`MATH_VERIFY_TIMEOUT_S`, and a check that
exceeds it raises (a failed judgement, never a silent 0). Elsewhere there is no time limit.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

from glmpost.config import ConfigError, setting

MATH_CHECKERS = ("math-verify", "normalise")
DEFAULT_MATH_CHECKER = "math-verify"
MATH_VERIFY_TIMEOUT_S = 10  # one response's whole check (parse, references, compare), main thread only


def math_checker_setting() -> Any:
    """The ``math_checker`` setting of the stages whose verifiers judge math (judge, eval)."""
    return setting(
        DEFAULT_MATH_CHECKER, "How the math verifier compares a response's final answer (its last \\boxed{...}) "
        "with the task's answer: math-verify (Math-Verify's symbolic and numeric equality: 1/2 = 0.5, \\sqrt{4} = 2, "
        "sets in any order, intervals, units dropped) or normalise (glmpost's normaliser: exact numbers and "
        "normalised strings).", cli={"metavar": "|".join(MATH_CHECKERS)})


def check_math_checker(value: Any) -> str:
    """``value`` when it names a checker; otherwise a :class:`~glmpost.config.ConfigError`."""
    if value not in MATH_CHECKERS:
        raise ConfigError("{math_checker} must be one of {choices}, got {value!r}",
                          choices=", ".join(MATH_CHECKERS), value=value)
    return value


class UnreadableReference(ValueError):
    """A reference answer the checker cannot read (the task's data, not the response, is at fault)."""


@dataclass(frozen=True)
class MathJudgement:
    """One response against its references: ``correct``; ``extracted``, the final answer as the
    checker read it (None: none found); ``answer``, its canonical string (equal answers, equal
    strings; None when there is none)."""

    correct: bool
    extracted: str | None
    answer: str | None


def judge_math(text: str, references: Sequence[Any], checker: str) -> MathJudgement:
    """Whether ``text``'s final answer equals one of ``references`` by ``checker`` (module doc)."""
    check_math_checker(checker)
    if checker == "normalise":
        predicted = extract_math_answer(text)
        if predicted is None:
            return MathJudgement(False, None, None)
        correct = any(math_answers_equal(predicted, r) for r in references)
        return MathJudgement(correct, predicted, str(normalize_math_answer(predicted)))
    if threading.current_thread() is not threading.main_thread():
        return _math_verify(text, references)
    from math_verify.errors import TimeoutException  # lazily: Math-Verify imports SymPy (~0.3 s)
    from math_verify.utils import timeout  # lazily, as above

    try:
        return timeout(timeout_seconds=MATH_VERIFY_TIMEOUT_S)(_math_verify)(text, references)
    except TimeoutException:
        raise TimeoutError(f"math-verify took over {MATH_VERIFY_TIMEOUT_S} s on this response") from None


# --------------------------------------------------------------------------------------------
# math-verify


def _math_verify(text: str, references: Sequence[Any]) -> MathJudgement:
    from math_verify import parse, verify  # lazily: Math-Verify imports SymPy (~0.3 s)

    targets = _targets()
    golds = []
    for reference in references:
        gold = str(reference).strip()
        parsed = parse(gold if "\\boxed" in gold else f"\\boxed{{{gold}}}", targets, parsing_timeout=None)
        if not parsed:
            raise UnreadableReference(f"math-verify cannot read the reference answer {gold!r}")
        golds.append(parsed)
    boxed = last_boxed(text)
    predicted = parse(text if boxed is None else f"\\boxed{{{boxed}}}", targets, parsing_timeout=None)
    if not predicted:
        return MathJudgement(False, None, None)
    correct = any(verify(gold, predicted, timeout_seconds=None) for gold in golds)
    extracted = boxed if boxed is not None else next((p for p in predicted if isinstance(p, str)), str(predicted[0]))
    answer = canonical_answer(predicted[0])
    return MathJudgement(correct, extracted, extracted.strip() if answer is None else answer)


@functools.lru_cache(maxsize=None)
def _targets() -> tuple[Any, ...]:
    """What Math-Verify extracts, in order: LaTeX with ``\\boxed{}`` first, then plain expressions.
    Built once; Math-Verify's "timeout is disabled" notice is muted (the timeout is this module's)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig  # lazily: Math-Verify imports SymPy

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda r: not r.getMessage().startswith("Timeout is disabled"))
    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def canonical_answer(value: Any) -> str | None:
    """A parsed answer as one string, equal for equal answers as far as SymPy's canonical forms go:
    evaluated (``doit``: ``\\sqrt{4}`` is ``2``), floats made exact fractions (``0.5`` and
    ``\\frac{1}{2}`` are both ``1/2``, ``2.50`` is ``5/2``), then SymPy's ``str`` (sets sorted:
    ``{1, 2}``). A string (an answer SymPy could not read) is itself, stripped; None when SymPy
    cannot evaluate or write it."""
    if isinstance(value, str):
        return value.strip()
    try:
        from sympy import Float, Rational  # lazily: SymPy comes with Math-Verify

        value = value.doit()  # Math-Verify's expressions are unevaluated: \sqrt{4} is sqrt(4) until now
        floats = value.atoms(Float)
        return str(value.xreplace({f: Rational(str(f)) for f in floats}) if floats else value)
    except Exception:  # e.g. an integer past str()'s digit limit: no canonical form, the caller falls back
        return None


# --------------------------------------------------------------------------------------------
# normalise: glmpost's normaliser

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"  # a minus sign, unless it is a binary minus after a word or bracket
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"  # 12, 1,234, 3.5, .5
    r"(?:\s*/\s*\d+(?:\.\d+)?)?"  # a/b
)
_LATEX_DROP = (
    r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", r"\displaystyle",
    r"\$", "$", r"\%", "%", r"^{\circ}", r"^\circ",
)
_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_VARIABLE_PREFIX = re.compile(r"^[A-Za-z]\s*=(?!=)")
_EXACT_NUMBER = re.compile(r"^-?(?:\d+(?:\.\d+)?|\.\d+)$")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found = text[start:i]
                    break
    return found


def extract_math_answer(text: str) -> str | None:
    """The final answer of a response: the last balanced ``\\boxed{...}``, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_math_answer(answer: Any) -> Fraction | str:
    """A canonical form of a final answer, so that equal answers compare equal.

    Rules, in order: drop ``$``, ``%``, degree signs ``^\\circ``, ``\\left``/``\\right``, LaTeX
    spacing (``\\,`` ``\\!`` ...) and ``\\displaystyle``; unwrap ``\\text{..}``/``\\mathrm{..}``/``\\mathbf{..}``; ``\\dfrac`` and
    ``\\tfrac`` become ``\\frac``; remove all whitespace, trailing ``.`` and a leading ``x=``; then
    ``\\frac{a}{b}`` and ``\\frac ab`` become ``a/b``, and thousands commas (``1,234``) go. If what
    is left is a number, integer or decimal, or a ratio of two (``-3/4``, ``0.5/2``), the result is
    an exact :class:`~fractions.Fraction` (so ``2.0 == 2`` and ``1/2 == 0.5``); otherwise the
    normalised string.
    """
    s = str(answer)
    for token in _LATEX_DROP:
        s = s.replace(token, "")
    s = _LATEX_WRAPPERS.sub(r"\1", s)
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = "".join(s.split()).rstrip(".")
    s = _VARIABLE_PREFIX.sub("", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = _FRAC_SHORT.sub(r"(\1)/(\2)", s)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    value = _as_fraction(s)
    return value if value is not None else s


def _as_fraction(s: str) -> Fraction | None:
    sign = 1
    if s.startswith("-") and s[1:].startswith("("):
        sign, s = -1, s[1:]
    parts = [p[1:-1] if p.startswith("(") and p.endswith(")") else p for p in s.split("/")]
    if not 1 <= len(parts) <= 2 or not all(_EXACT_NUMBER.match(p) for p in parts):
        return None
    numerator = Fraction(parts[0])
    if len(parts) == 1:
        return sign * numerator
    denominator = Fraction(parts[1])
    if denominator == 0:
        return None
    return sign * numerator / denominator


def math_answers_equal(predicted: Any, reference: Any) -> bool:
    """Whether two answers are equal after :func:`normalize_math_answer` (exact, no tolerance)."""
    return normalize_math_answer(predicted) == normalize_math_answer(reference)
