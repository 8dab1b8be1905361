"""The reward library: math / count verifiers, rules, hooks, spec parsing, the mixture formula, ORM, judge."""

from __future__ import annotations

import math
import re
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from glmpost.checkpoints import CheckpointError, tokenizer_revision
from glmpost.errors import GlmpostError, UsageError
from glmpost.kernel.loading import load_tokenizer
from glmpost.registry import load_hook
from glmpost.rewards import (
    ComponentResult,
    ComponentSpec,
    Verdict,
    VerifierError,
    VerifierTable,
    VerifyContext,
    check_components,
    combine,
    count_verifier,
    extract_math_answer,
    format_score,
    last_boxed,
    length_penalty,
    math_answers_equal,
    math_verifier,
    normalize_math_answer,
    parse_component,
    parse_spec_string,
    scalarize,
    truncated_penalty,
)
from glmpost.rewards.models import (
    DEFAULT_SCORE_PATTERN,
    GenerativeJudge,
    GenerativeJudgeConfig,
    OrmConfig,
    OutcomeRewardModel,
    ScoreParseError,
    excerpt,
    parse_score,
    render_rubric,
    score_output,
)
from glmpost.rewards.verifiers import run_verifier

HOOKS = '''
from glmpost.rewards import Verdict
def quarter(ctx):
    return 0.25
def with_details(ctx):
    return Verdict(1.0, {"seen": ctx.text})
def too_big(ctx):
    return 2.0
def boom(ctx):
    raise RuntimeError("the sandbox is down")
NOT_CALLABLE = 3
'''


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    """A user module ``judge_hooks_test`` importable for this test."""
    (tmp_path / "judge_hooks_test.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "judge_hooks_test"
    sys.modules.pop("judge_hooks_test", None)


def ctx(text="", ids=(), action=None, task=None, status="completed", tokenizer=None, sampling=None,
        options=None) -> VerifyContext:
    ids = np.asarray(ids, dtype=np.int32)
    action = np.ones(len(ids), dtype=bool) if action is None else np.asarray(action, dtype=bool)
    return VerifyContext(text, ids, action, task or {}, status, tokenizer, sampling=sampling or {}, options=options or {})


# --------------------------------------------------------------------------------------------
# math


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}} is it", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{ {a}+{b} }", " {a}+{b} "),
        (r"\boxed{3 and unbalanced", "3"),  # no balanced box: the last number
        ("The answer is 1,234.", "1,234"),
        ("It is -5", "-5"),
        ("pages 3-5", "5"),  # a binary minus is not a sign
        ("ratio 3/4 here", "3/4"),
        ("x = .5", ".5"),
        ("no digits at all", None),
    ],
)
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


def test_last_boxed_handles_fbox_and_missing():
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    "a, b",
    [
        ("2.0", "2"),
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac{3}{4}", "3/4"),
        (r"\tfrac12", "1/2"),
        ("$1,234$", "1234"),
        ("42.", 42),
        ("x = 5", "5"),
        (r"\left(1, 2\right)", "(1,2)"),
        (r"-\frac{1}{2}", "-0.5"),
        (r"50\%", "50"),
        (r"\text{5}", "5"),
        (r"\!7\,", "7"),
        (r"\$5", "5"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", 90),
        (0.25, "1/4"),
    ],
)
def test_equal_answers(a, b):
    assert math_answers_equal(a, b)


@pytest.mark.parametrize("a, b", [("2", "3"), ("0.333", "1/3"), ("1,234", "1.234"), ("(1,2)", "(2,1)"), ("x+1", "x+2")])
def test_unequal_answers(a, b):
    assert not math_answers_equal(a, b)


def test_normalize_gives_exact_fractions_or_strings():
    assert normalize_math_answer(r"\frac{6}{4}") == Fraction(3, 2)
    assert normalize_math_answer("-3/4") == Fraction(-3, 4)
    assert normalize_math_answer("1/0") == "1/0"
    assert normalize_math_answer(r"\sqrt{2}") == r"\sqrt{2}"


@pytest.mark.parametrize("checker", ["math-verify", "normalise"])
def test_math_verifier(checker):
    """The details gained ``checker`` and the canonical ``answer`` (issue 34, "math-verify"); the
    default checker is Math-Verify, and both agree on these cases."""
    options = {"math_checker": checker}
    right = math_verifier(ctx(r"6*7 = \boxed{42}.", task={"answer": 42}, options=options))
    assert right == Verdict(1.0, {"checker": checker, "extracted": "42", "answer": "42", "expected": "42"})
    assert math_verifier(ctx("I think 41", task={"answer": "42"}, options=options)).score == 0.0
    none = math_verifier(ctx("no idea", task={"answer": "42"}, options=options))
    assert none == Verdict(0.0, {"checker": checker, "extracted": None, "answer": None, "expected": "42"})
    either = math_verifier(ctx(r"\boxed{0.5}", task={"answer": ["1/3", r"\frac{1}{2}"]}, options=options))
    assert either == Verdict(1.0, {"checker": checker, "extracted": "0.5", "answer": "1/2",
                                   "expected": ["1/3", r"\frac{1}{2}"]})
    with pytest.raises(VerifierError, match="no 'answer'"):
        math_verifier(ctx("42", task={}, options=options))
    with pytest.raises(VerifierError, match="empty list"):
        math_verifier(ctx("42", task={"answer": []}, options=options))
    assert math_verifier(ctx(r"\boxed{42}", task={"answer": 42})).details["checker"] == "math-verify"  # the default


# --------------------------------------------------------------------------------------------
# count


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)[0]


def test_count_verifier_counts_digit_action_tokens(tokenizer):
    three = tokenizer.convert_tokens_to_ids("3")
    assert tokenizer.encode("3", add_special_tokens=False) == [three]
    eos = tokenizer.eos_token_id
    merged = tokenizer.encode("33333333", add_special_tokens=False)
    assert len(merged) == 1 and merged[0] != three  # a merged token is not the digit token

    assert count_verifier(ctx(ids=[three] * 8, task={"digit": "3"}, tokenizer=tokenizer)).score == 1.0
    # 4 digits then a stop token: the stop counts as non-matching; max_new_tokens 8 fixes the denominator
    early = [three] * 4 + [eos]
    assert count_verifier(ctx(ids=early, task={"digit": 3}, tokenizer=tokenizer)).score == 4 / 5
    verdict = count_verifier(ctx(ids=early, task={"digit": 3}, tokenizer=tokenizer, sampling={"max_new_tokens": 8}))
    assert verdict == Verdict(0.5, {"matches": 4, "of": 8})
    # observation tokens (not actions) neither match nor count
    mixed = count_verifier(ctx(ids=[three] * 4, action=[1, 0, 1, 1], task={"digit": "3"}, tokenizer=tokenizer))
    assert mixed.score == 1.0 and mixed.details == {"matches": 3, "of": 3}
    assert count_verifier(ctx(ids=merged * 8, task={"digit": "3"}, tokenizer=tokenizer)).score == 0.0
    assert count_verifier(ctx(ids=[], task={"digit": "3"}, tokenizer=tokenizer)).score == 0.0
    with pytest.raises(VerifierError, match="not a single digit"):
        count_verifier(ctx(ids=[three], task={"digit": "12"}, tokenizer=tokenizer))
    with pytest.raises(VerifierError, match="no 'digit'"):
        count_verifier(ctx(ids=[three], task={}, tokenizer=tokenizer))


def test_count_verifier_chance_level(tokenizer):
    """Uniformly random ids over the 512-id vocabulary hit the digit 1/512 ~ 0.002 of the time."""
    ids = np.random.default_rng(0).integers(0, 512, 200_000)
    score = count_verifier(ctx(ids=ids, task={"digit": "7"}, tokenizer=tokenizer)).score
    assert abs(score - 1 / 512) < 0.0005


# --------------------------------------------------------------------------------------------
# rules


def test_rules_on_hand_numbers():
    boxed = re.compile(r"\\boxed\{")
    assert format_score(r"so \boxed{4}", boxed) == 1.0 and format_score("so 4", boxed) == 0.0
    assert [length_penalty(n, 10, 5) for n in (0, 10, 11, 12, 15, 30)] == [0.0, 0.0, 0.2, 0.4, 1.0, 1.0]
    assert truncated_penalty("truncated") == 1.0
    assert [truncated_penalty(s) for s in ("completed", "aborted", "env_error")] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        length_penalty(3, 1, 0)


# --------------------------------------------------------------------------------------------
# hooks and routing


def test_hooks_load_and_are_checked(hooks):
    assert run_verifier(load_hook(f"{hooks}:quarter", where="t"), ctx()) == Verdict(0.25)
    assert run_verifier(load_hook(f"{hooks}:with_details", where="t"), ctx("hi")).details == {"seen": "hi"}
    with pytest.raises(VerifierError, match=r"2\.0, outside \[0, 1\]"):
        run_verifier(load_hook(f"{hooks}:too_big", where="t"), ctx())
    with pytest.raises(RuntimeError):
        run_verifier(load_hook(f"{hooks}:boom", where="t"), ctx())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:fn", r"--verifier: cannot import no_such_module_xyz for no_such_module_xyz:fn \(ModuleNotFoundError"),
        ("json:nope", "json has no attribute 'nope'"),
        ("json:__doc__", "is a str, not a function"),
        ("json", "is not package.module:function"),
    ],
)
def test_bad_hooks_are_one_line_usage_errors(spec, message):
    with pytest.raises(UsageError, match=message) as exc:
        load_hook(spec, where="--verifier")
    assert "\n" not in str(exc.value)


def test_verifier_table_routes_domains(hooks):
    table = VerifierTable({"gsm8k": "math", "mine": f"{hooks}:quarter"})
    assert table.lookup("math")[0] == "math" and table.lookup("gsm8k")[0] == "math"
    assert table.lookup("mine")[0] == f"{hooks}:quarter"
    with pytest.raises(UsageError, match=r"domain 'poetry' has no verifier \(known: count, env, gsm8k, math, mine\)"):
        table.lookup("poetry")
    with pytest.raises(UsageError, match="no domain to route to a verifier"):
        table.lookup("")
    fallback = VerifierTable(default="math")
    assert fallback.lookup("poetry")[0] == "math" and fallback.lookup(None)[0] == "math"
    with pytest.raises(UsageError, match="unknown verifier 'mathh'"):
        VerifierTable({"x": "mathh"})


# --------------------------------------------------------------------------------------------
# specs


def test_parse_spec_forms_agree():
    flag = parse_spec_string(r"name=fmt,source=format,pattern=\\boxed\{,weight=0.5")
    table = parse_spec_string(r"{name = 'fmt', source = 'format', pattern = '\\boxed\{', weight = 0.5}")
    assert flag == table == {"name": "fmt", "source": "format", "pattern": r"\\boxed\{", "weight": 0.5}
    assert parse_spec_string("source=length,max_tokens=512")["max_tokens"] == 512
    assert parse_spec_string('{source = "format", pattern = "a,b"}')["pattern"] == "a,b"  # commas need a table
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_spec_string('source=format,pattern="a,b"')
    with pytest.raises(ValueError, match="given twice"):
        parse_spec_string("source=format,source=length")
    with pytest.raises(ValueError, match="not a TOML inline table"):
        parse_spec_string("{source = }")


def test_parse_component_validates():
    spec = parse_component("name=too_long,source=length,max_tokens=512,weight=0.1", kind="penalty")
    assert spec == ComponentSpec("too_long", "length", 0.1, "penalty", {"max_tokens": 512})
    assert parse_component({"source": "truncated"}, kind="penalty").name == "truncated"
    assert parse_component({"source": "judge", "checkpoint": "x", "max_score": 5}, kind="reward").options["max_score"] == 5.0
    bad = [
        ({"source": "magic"}, r"unknown source 'magic' \(known: verifier, format, length, overlong, truncated, orm, judge\)"),
        ({"name": "x"}, "needs a source"),
        ({"source": "format", "pattern": "a", "colour": "red"}, "unknown key 'colour' for source 'format'"),
        ({"source": "format"}, "needs 'pattern'"),
        ({"source": "format", "pattern": "("}, "is not a regex"),
        ({"source": "truncated", "weight": -1}, "weight must be a finite number >= 0"),
        ({"source": "truncated", "weight": float("inf")}, "weight must be a finite number >= 0"),
        ({"source": "length", "max_tokens": "many"}, "max_tokens must be int"),
        ({"source": "length", "max_tokens": True}, "max_tokens must be int"),
        ({"source": "orm", "checkpoint": "x", "activation": "tanh"}, "activation must be sigmoid or none"),
        ({"source": "judge", "checkpoint": "x", "template": "no placeholder"}, r"no \{response\} placeholder"),
        ({"source": "judge", "checkpoint": "x", "score_pattern": "Score: \\d+"}, "needs a capture group"),
        ({"source": "judge", "checkpoint": "x", "max_score": 0}, "max_score must be a finite number > 0"),
        ({"source": "truncated", "name": ""}, "name must be a non-empty string"),
    ]
    for table, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_component(table, kind="reward")
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_component("source=truncated,oops", kind="reward")
    a = ComponentSpec("x", "truncated", 1.0, "reward")
    with pytest.raises(UsageError, match="'x' is used twice"):
        check_components([a, ComponentSpec("x", "format", 1.0, "penalty", {"pattern": "a"})])


# --------------------------------------------------------------------------------------------
# the formula

SPECS = [
    ComponentSpec("correct", "verifier", 1.0, "reward"),
    ComponentSpec("orm", "orm", 0.5, "reward"),
    ComponentSpec("too_long", "length", 0.1, "penalty"),
    ComponentSpec("truncated", "truncated", 0.5, "penalty"),
]


def test_scalarize_is_the_brief_formula():
    # R = 1*1.0 + 0.5*0.8 - 0.1*0.4 - 0.5*1.0 = 0.86
    values = {"correct": 1.0, "orm": 0.8, "too_long": 0.4, "truncated": 1.0}
    assert scalarize(values, SPECS) == pytest.approx(0.86, abs=1e-12)
    assert scalarize({"correct": 0.0, "orm": 0.2, "too_long": 0.0, "truncated": 0.0}, SPECS) == pytest.approx(0.1)
    assert math.isnan(scalarize({**values, "orm": math.nan}, SPECS))


def test_combine_records_every_component_and_the_failure():
    ok = {
        "correct": ComponentResult(1.0, details={"verifier": "math"}),
        "orm": ComponentResult(0.8, details={"logit": 1.386}),
        "too_long": ComponentResult(0.4),
        "truncated": ComponentResult(0.0),
    }
    rewards, reward, info = combine(SPECS, ok)
    assert rewards == {"correct": 1.0, "orm": 0.8, "too_long": 0.4, "truncated": 0.0}
    assert reward == pytest.approx(1.36)
    assert "failure" not in info
    assert info["components"]["orm"] == {"source": "orm", "kind": "reward", "weight": 0.5, "logit": 1.386}

    failed = {**ok, "orm": ComponentResult(math.nan, "44 tokens exceed\nthe context")}
    rewards, reward, info = combine(SPECS, failed)
    assert math.isnan(rewards["orm"]) and math.isnan(reward)
    assert info["failure"] == "orm (orm): 44 tokens exceed the context"
    assert info["failed_components"] == ["orm"]
    assert info["components"]["orm"]["failure"] == "44 tokens exceed the context"


# --------------------------------------------------------------------------------------------
# generative judge: parsing and scaling on known text, then the random tiny model


def test_parse_score_and_scaling():
    pattern = re.compile(DEFAULT_SCORE_PATTERN)
    assert parse_score("Good reply.\nScore: 7", pattern, 10) == (7.0, 0.7)
    assert parse_score("Score: 3 ... on reflection Score: 8.5", pattern, 10) == (8.5, 0.85)
    assert parse_score("4/5", r"(\d+)/5", 5) == (4.0, 0.8)
    for text, message in [("no verdict", "no score matching"), ("Score: 12", r"outside \[0, 10\]")]:
        with pytest.raises(ScoreParseError, match=message):
            parse_score(text, pattern, 10)
    with pytest.raises(ScoreParseError, match="not a number"):
        parse_score("Score: high", r"Score: (\w+)", 10)


def test_score_output_keeps_an_excerpt():
    good = score_output("Fine.\nScore: 9", DEFAULT_SCORE_PATTERN, 10)
    assert good.value == pytest.approx(0.9) and good.failure is None
    assert good.details == {"output": "Fine.\nScore: 9", "raw_score": 9.0}
    bad = score_output("blah " * 100, DEFAULT_SCORE_PATTERN, 10)
    assert math.isnan(bad.value) and bad.failure.startswith("unparsable judge output: no score matching")
    assert len(bad.details["output"]) == 200 and bad.details["output"].endswith("…")
    assert excerpt("short") == "short"


def test_render_rubric_fills_placeholders_once():
    template = r"Q: {prompt}\nA: {response}\nUse \boxed{{}} style. Max {max_score}."
    rendered = render_rubric(template, prompt="say {response}", response="ok", max_score=10.0)
    assert rendered == r"Q: say {response}\nA: ok\nUse \boxed{{}} style. Max 10."


def test_generative_judge_on_the_random_tiny_model(tiny_checkpoint):
    judge = GenerativeJudge(GenerativeJudgeConfig(str(tiny_checkpoint), max_new_tokens=4, batch_size=2))
    outputs = judge.generate(["count: 3", "What is 2+2?"], ["3333", "4"], ["a", "b"])
    assert all(isinstance(o, str) for o in outputs)
    assert judge.generate(["count: 3", "What is 2+2?"], ["3333", "4"], ["a", "b"]) == outputs  # greedy
    scores = judge.scores(outputs)
    for output, score in zip(outputs, scores):  # a random model writes no "Score: N": recorded failure
        assert math.isnan(score.value) and "unparsable judge output" in score.failure
        assert score.details["output"] == excerpt(output)
    # the same object's parse-and-scale path on known text
    known = judge.scores(["The reply is right. Score: 8"])[0]
    assert known.value == pytest.approx(0.8) and known.details["raw_score"] == 8.0
    # a rubric longer than the judge's context fails without generating
    too_long = judge.score(["q"], ["x " * 600], ["c"])[0]
    assert math.isnan(too_long.value) and "the judge's context leaves room for" in too_long.failure


# --------------------------------------------------------------------------------------------
# ORM: a tiny sequence classifier sharing the policy tokenizer


def build_tiny_orm(directory: Path, tokenizer_dir: Path, *, num_labels: int = 1) -> Path:
    """A random one-label Qwen2 sequence classifier with the policy's tokenizer files beside it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=num_labels, pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def tiny_orm(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_tiny_orm(tmp_path_factory.mktemp("orm") / "orm", tiny_checkpoint)


def test_orm_scores_batched_like_alone(tiny_orm, tiny_checkpoint):
    revision = tokenizer_revision(tiny_checkpoint)
    orm = OutcomeRewardModel(OrmConfig(str(tiny_orm), batch_size=3), tokenizer_revision=revision)
    sequences = [[1, 2, 3, 4, 5], [5, 6, 7], [8, 9, 10, 11, 12, 13, 0], list(range(1, 300)), []]
    batched = orm.score(sequences)
    alone = [orm.score([s])[0] for s in sequences]
    for b, a in zip(batched[:3], alone[:3]):
        assert 0.0 < b.value < 1.0 and b.failure is None
        assert b.value == pytest.approx(a.value, abs=1e-6)
        assert b.value == pytest.approx(1 / (1 + math.exp(-b.details["logit"])), abs=1e-12)
    assert math.isnan(batched[3].value) and batched[3].failure == "299 tokens exceed the ORM's 256-token context"
    assert math.isnan(batched[4].value) and batched[4].failure == "empty sequence"
    raw = OutcomeRewardModel(OrmConfig(str(tiny_orm), activation="none"), tokenizer_revision=revision).score(sequences[:1])
    assert raw[0].value == pytest.approx(batched[0].details["logit"], abs=1e-6)


def test_orm_refusals(tiny_orm, tiny_checkpoint, tmp_path):
    revision = tokenizer_revision(tiny_checkpoint)
    with pytest.raises(CheckpointError, match=f"revision {revision} differs from the policy's sha256:0000000000000000"):
        OutcomeRewardModel(OrmConfig(str(tiny_orm)), tokenizer_revision="sha256:0000000000000000")
    with pytest.raises(CheckpointError, match="does not load as a sequence classifier"):
        OutcomeRewardModel(OrmConfig(str(tiny_checkpoint)), tokenizer_revision=revision)  # a causal LM
    two = build_tiny_orm(tmp_path / "two", tiny_checkpoint, num_labels=2)
    with pytest.raises(CheckpointError, match="num_labels is 2, expected 1"):
        OutcomeRewardModel(OrmConfig(str(two)), tokenizer_revision=revision)
    with pytest.raises(CheckpointError, match="does not exist"):
        OutcomeRewardModel(OrmConfig(str(tmp_path / "nowhere")), tokenizer_revision=revision)


# --------------------------------------------------------------------------------------------
# RewardMixture on in-memory records


def test_mixture_adds_rewards_to_new_records(tokenizer, tiny_checkpoint):
    from glmpost.rewards import RewardMixture, default_components

    revision = tokenizer_revision(tiny_checkpoint)
    ids = tokenizer.encode(r"so \boxed{7}", add_special_tokens=False)
    base = {
        "id": "r", "domain": "math", "task": {"answer": "7"}, "status": "truncated",
        "prompt_token_ids": np.array([1, 2], dtype=np.int32), "response_token_ids": np.array(ids, dtype=np.int32),
        "action_mask": np.ones(len(ids), dtype=bool), "rewards": {"old": 1.0},
    }
    specs = [*default_components(), parse_component("source=truncated,weight=0.25", kind="penalty")]
    mixture = RewardMixture(specs, tokenizer=tokenizer, tokenizer_revision=revision, verifiers=VerifierTable())
    [out] = mixture.judge([base])
    assert out["rewards"] == {"correct": 1.0, "truncated": 1.0} and out["reward"] == 0.75
    assert base["rewards"] == {"old": 1.0} and "reward" not in base  # the input record is not modified
    assert out["response_token_ids"] is base["response_token_ids"]

    # an error that takes down a whole batch (e.g. a model forward) fails each record of it, with the reason
    mixture._scorers["truncated"] = lambda views: 1 / 0
    outs = mixture.judge([base, {**base, "id": "s"}])
    for o in outs:
        assert math.isnan(o["reward"]) and o["rewards"]["correct"] == 1.0
        assert o["reward_info"]["failure"] == "truncated (truncated): truncated failed on a batch of 2: ZeroDivisionError: division by zero"


def test_overlong_penalty_is_dapos_soft_overlong_punishment():
    from glmpost.rewards.verifiers import overlong_penalty

    # DAPO eq. 13 with L_max = 20, L_cache = 8: free up to 12 tokens, then -1/8 per token, -1 at the limit
    assert [overlong_penalty(n, 20, 8) for n in (0, 12, 13, 16, 19, 20, 25)] == [0.0, 0.0, 0.125, 0.5, 0.875, 1.0, 1.0]
    assert overlong_penalty(5, 5, 5) == 1.0 and overlong_penalty(0, 5, 5) == 0.0  # L_cache = L_max: from the first token
    for bad in ((3, 4, 0), (3, 4, 5)):
        with pytest.raises(ValueError, match="cache_tokens"):
            overlong_penalty(*bad)


def test_overlong_component_reads_the_rollouts_limit(tokenizer, tiny_checkpoint):
    from glmpost.rewards import RewardMixture

    revision = tokenizer_revision(tiny_checkpoint)

    def rec(rid, n, **extra):
        return {"id": rid, "domain": "math", "task": {"answer": "7"}, "status": "completed",
                "prompt_token_ids": np.array([1, 2], dtype=np.int32), "response_token_ids": np.arange(3, 3 + n, dtype=np.int32),
                "action_mask": np.ones(n, dtype=bool), **extra}

    records = [rec("a", 10, sampling={"max_new_tokens": 16}), rec("b", 14, sampling={"max_new_tokens": 16}),
               rec("c", 16, sampling={"max_new_tokens": 16}), rec("d", 14, sampling={}),
               rec("e", 14, sampling={"max_new_tokens": 16}, extra={"env": {"name": "calculator"}})]
    spec = parse_component("name=long,source=overlong,cache_tokens=4", kind="penalty")
    mixture = RewardMixture([spec], tokenizer=tokenizer, tokenizer_revision=revision, verifiers=VerifierTable())
    a, b, c, d, e = mixture.judge(records)
    # L_max 16, L_cache 4: 10 tokens free, 14 -> (14 - 12) / 4 = 0.5, 16 (at the limit) -> 1; penalties subtract
    assert (a["reward"], b["reward"], c["reward"]) == (0.0, -0.5, -1.0)
    info = b["reward_info"]["components"]["long"]
    assert (info["source"], info["kind"], info["action_tokens"], info["max_tokens"]) == ("overlong", "penalty", 14, 16)
    assert math.isnan(d["reward"]) and "no max_new_tokens" in d["reward_info"]["failure"]
    assert math.isnan(e["reward"]) and "per turn" in e["reward_info"]["failure"]
    pinned = parse_component("name=long,source=overlong,cache_tokens=4,max_tokens=14", kind="penalty")
    [d2, e2] = RewardMixture([pinned], tokenizer=tokenizer, tokenizer_revision=revision, verifiers=VerifierTable()).judge([records[3], records[4]])
    assert d2["reward"] == e2["reward"] == -1.0  # 14 tokens at a 14-token limit
    with pytest.raises(ValueError, match="cache_tokens"):
        parse_component("name=x,source=overlong,cache_tokens=0", kind="penalty")
    with pytest.raises(ValueError, match="max_tokens 3 must be >= cache_tokens 4"):
        parse_component("name=x,source=overlong,cache_tokens=4,max_tokens=3", kind="penalty")


def test_mixture_names_the_component_whose_checkpoint_fails(tokenizer, tiny_checkpoint, tmp_path):
    from glmpost.rewards import RewardMixture

    spec = parse_component(f"name=rm,source=orm,checkpoint={tmp_path / 'none'}", kind="reward")
    with pytest.raises(GlmpostError, match=r"^component 'rm' \(orm\): checkpoint .* does not exist$"):
        RewardMixture([spec], tokenizer=tokenizer, tokenizer_revision="x", verifiers=VerifierTable())
