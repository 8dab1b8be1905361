"""The ``math`` verifier's checkers (issue 34, "math-verify"): Math-Verify, the default, on the
equivalences it must accept and reject, where it differs from glmpost's normaliser (kept as
``math_checker = "normalise"``), the canonical answers maj@n votes with, running off the main thread,
and ``--math-checker`` through ``glmpost judge`` and ``glmpost eval``. Every verdict here is the real
library's (math_verify 0.9), through glmpost's verifier."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_judge import judged, policy, record, write  # noqa: F401 (policy: the fixture the records use)

from glmpost.evaluation.run import answer_of
from glmpost.rewards import math_answers
from glmpost.rewards.math_answers import MATH_CHECKERS, canonical_answer, judge_math
from glmpost.rewards.verifiers import VerifierTable, VerifyContext, math_verifier

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "recipes" / "data" / "count-train.jsonl"


def verdict(text: str, answer, checker: str | None = None):
    """The math verifier on one response; ``checker`` None: the default (no option given)."""
    options = {} if checker is None else {"math_checker": checker}
    return math_verifier(VerifyContext(text, np.zeros(0, np.int32), np.zeros(0, bool), {"answer": answer}, "completed",
                                       None, options=options))


# --------------------------------------------------------------------------------------------
# what Math-Verify (the default) accepts and rejects

ACCEPTED = [
    (r"so the answer is $\boxed{\frac{1}{2}}$", "0.5"),  # fraction vs decimal
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{0.333333}", "1/3"),  # a decimal equals a fraction to 6 places
    (r"first \boxed{3}, finally \boxed{4}", "4"),  # the last box is the answer
    (r"\boxed{\{1,2\}}", r"\{2,1\}"),  # sets in any order
    (r"\boxed{[0,1)}", "[0,1)"),  # intervals
    (r"\boxed{5\text{ cm}}", "5"),  # units are dropped ...
    ("The rod is 5 cm long.", "5"),
    (r"\boxed{5}", "5 cm"),
    (r"\boxed{5 m}", "5 cm"),  # ... on both sides, so they are not compared at all
    ("The answer is 42", 42),  # plain integers, without a box: the last expression
    (r"\boxed{42}", "42"),
    (r"\boxed{-3}", "-3"),  # negative numbers
    (r"\boxed{-\frac{1}{2}}", "-0.5"),
    (r"\boxed{\sqrt{4}}", "2"),  # LaTeX vs plain
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{x = 2}", "2"),
    (r"\boxed{1,234}", "1234"),
]

REJECTED = [
    (r"\boxed{0.33}", "1/3"),  # 0.33 is not 1/3 (Math-Verify rounds to 6 places)
    (r"first \boxed{3}, finally \boxed{4}", "3"),  # an earlier box is not the answer
    (r"\boxed{\{1,2\}}", r"\{1,3\}"),
    (r"\boxed{[0,1)}", "(0,1)"),  # the bracket matters
    (r"\boxed{41}", 42),
    ("I think 41", "42"),
    (r"\boxed{-3}", "3"),
    (r"\boxed{\sqrt{2}}", "2"),
    ("no answer here", "2"),
]


@pytest.mark.parametrize("text, answer", ACCEPTED)
def test_math_verify_accepts(text, answer):
    got = verdict(text, answer)
    assert got.score == 1.0 and got.details["checker"] == "math-verify", got


@pytest.mark.parametrize("text, answer", REJECTED)
def test_math_verify_rejects(text, answer):
    got = verdict(text, answer)
    assert got.score == 0.0 and got.details["checker"] == "math-verify", got


def test_a_list_of_answers_accepts_any_and_an_unreadable_reference_fails():
    assert verdict(r"\boxed{0.5}", ["1/3", r"\frac{1}{2}"]).score == 1.0
    with pytest.raises(Exception, match="cannot read the reference answer ''"):
        verdict(r"\boxed{1}", "")


# --------------------------------------------------------------------------------------------
# where the normaliser (math_checker = "normalise") differs

# (response, reference, Math-Verify's verdict, the normaliser's verdict)
DIFFERENCES = [
    (r"\boxed{\sqrt{4}}", "2", 1.0, 0.0),  # the normaliser compares strings: \sqrt{4} is not 2
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0, 0.0),  # nor sets in another order
    (r"\boxed{0.333333}", "1/3", 1.0, 0.0),  # exact numbers only
    (r"\boxed{x+1}", "1+x", 1.0, 0.0),  # nor expressions
    ("The rod is 5 cm long.", "5", 1.0, 1.0),  # the same here: the normaliser's last number is 5
    (r"\boxed{x = 1,234}", "1234", 0.0, 1.0),  # Math-Verify reads x = (1, 234); the normaliser drops x= and the comma
]


@pytest.mark.parametrize("text, answer, by_math_verify, by_normaliser", DIFFERENCES)
def test_checkers_differ_where_documented(text, answer, by_math_verify, by_normaliser):
    assert verdict(text, answer, "math-verify").score == by_math_verify
    old = verdict(text, answer, "normalise")
    assert old.score == by_normaliser and old.details["checker"] == "normalise"


def test_normalise_keeps_the_old_verdicts():
    """``normalise`` is the old verifier: its score is ``math_answers_equal`` on the extracted answer."""
    for text, answer in ACCEPTED + REJECTED:
        old = verdict(text, answer, "normalise")
        extracted = math_answers.extract_math_answer(text)
        assert old.details["extracted"] == extracted
        assert old.score == float(extracted is not None and math_answers.math_answers_equal(extracted, answer))


def test_unknown_checker_is_refused():
    with pytest.raises(Exception, match="must be one of math-verify, normalise, got 'sympy'"):
        VerifierTable(options={"math_checker": "sympy"})
    assert VerifierTable().options == {"math_checker": "math-verify"} and MATH_CHECKERS == ("math-verify", "normalise")


# --------------------------------------------------------------------------------------------
# canonical answers (maj@n), determinism, threads, the timeout


def test_equal_answers_get_one_canonical_string():
    halves = [r"\boxed{0.5}", r"\boxed{\frac{1}{2}}", r"\boxed{1/2}", r"\boxed{\dfrac{2}{4}}", "it is 0.50"]
    assert {verdict(t, "0.5").details["answer"] for t in halves} == {"1/2"}
    assert verdict(r"\boxed{\sqrt{4}}", "2").details["answer"] == verdict(r"\boxed{2}", "2").details["answer"] == "2"
    sets = {verdict(t, "{1,2}").details["answer"] for t in (r"\boxed{\{2,1\}}", r"\boxed{\{1,2\}}")}
    assert sets == {"{1, 2}"}
    assert verdict("no answer here", "2").details["answer"] is None
    assert canonical_answer("  yes ") == "yes"


def test_eval_votes_with_the_canonical_answer():
    def judged_record(details):
        return {"reward_info": {"components": {"correct": details}}, "response_token_ids": []}

    assert answer_of(judged_record(verdict(r"\boxed{0.5}", "0.5").details), None) == "1/2"
    assert answer_of(judged_record(verdict("nothing", "0.5").details), None) is None
    assert answer_of(judged_record({"extracted": "0.5"}), None) == "1/2"  # a verifier without `answer`: normalised


def test_deterministic_and_the_same_off_the_main_thread():
    cases = [(t, a) for t, a in ACCEPTED + REJECTED]
    here = [verdict(t, a) for t, a in cases]
    assert [verdict(t, a) for t, a in cases] == here
    there: list = []
    worker = threading.Thread(target=lambda: there.extend(verdict(t, a) for t, a in cases))  # no signal.alarm there
    worker.start()
    worker.join()
    assert there == here


def test_a_check_past_the_timeout_fails_loudly(monkeypatch):
    def slow(text, references):
        time.sleep(5)

    monkeypatch.setattr(math_answers, "MATH_VERIFY_TIMEOUT_S", 1)
    monkeypatch.setattr(math_answers, "_math_verify", slow)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="math-verify took over 1 s"):
        judge_math(r"\boxed{1}", ["1"], "math-verify")
    assert time.monotonic() - started < 4


# --------------------------------------------------------------------------------------------
# through the CLI


def test_judge_math_checker_flag_and_recipe(glmpost_cli, tiny_checkpoint, policy, tmp_path):  # noqa: F811
    records = [record(policy, "root", "sqrt 4?", r"so \boxed{\sqrt{4}}", domain="math", task={"answer": "2"}),
               record(policy, "comma", "1234?", r"\boxed{x = 1,234}", domain="math", task={"answer": "1234"}),
               record(policy, "half", "1/2?", r"\boxed{0.5}", domain="math", task={"answer": r"\frac{1}{2}"})]
    write(tmp_path / "in", "s.msgpack.zst", records)
    scores = {}
    for checker, extra in [("math-verify", []), ("normalise", ["--math-checker", "normalise"])]:
        out = tmp_path / checker
        result = glmpost_cli("judge", tmp_path / "in", "--out", out, "--checkpoint", tiny_checkpoint, *extra)
        assert result.exit_code == 0, result.stderr
        assert "Timeout" not in result.stderr  # Math-Verify's notice about its own (unused) timeouts is muted
        got = judged(out)
        scores[checker] = {rid: r["reward"] for rid, r in got.items()}
        assert {r["reward_info"]["components"]["correct"]["checker"] for r in got.values()} == {checker}
        assert json.loads((out / "stage.json").read_text())["options"]["math_checker"] == checker
    assert scores == {"math-verify": {"root": 1.0, "comma": 0.0, "half": 1.0},
                      "normalise": {"root": 0.0, "comma": 1.0, "half": 1.0}}

    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[judge]\nmath-checker = "normalise"\n')
    out = tmp_path / "recipe"
    result = glmpost_cli("judge", tmp_path / "in", "--out", out, "--checkpoint", tiny_checkpoint, "--config", recipe)
    assert result.exit_code == 0, result.stderr
    assert {rid: r["reward"] for rid, r in judged(out).items()} == scores["normalise"]

    again = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "normalise", "--checkpoint", tiny_checkpoint)
    assert again.exit_code == 2 and "--math-checker" in again.stderr, again.stderr  # a rerun keeps its checker

    bad = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "bad", "--checkpoint", tiny_checkpoint,
                      "--math-checker", "sympy")
    assert bad.exit_code == 2 and "Traceback" not in bad.stderr
    assert "--math-checker must be one of math-verify, normalise, got 'sympy'" in bad.stderr
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").glob("*.msgpack.zst"))


def test_eval_math_checker(glmpost_cli, tiny_checkpoint, tmp_path):
    bad = glmpost_cli("eval", PROMPTS, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad",
                      "--math-checker", "x")
    assert bad.exit_code == 2 and "--math-checker" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad" / "rollout").exists()  # refused before sampling
    out = tmp_path / "eval"
    result = glmpost_cli("eval", PROMPTS, "--checkpoint", tiny_checkpoint, "--out", out, "--n", 2, "--limit", 2,
                         "--max-new-tokens", 4, "--math-checker", "normalise", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "stage.json").read_text())["options"]["math_checker"] == "normalise"
    headers = json.loads(result.stdout)
    assert not math.isnan(headers["overall"]["avg@2"])
