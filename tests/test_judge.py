"""`glmpost judge`: rewards added to copies of rollout shards, recipes and flags, crash-resume, refusals."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from glmpost.errors import GlmpostError
from glmpost.formats import read_shard, write_shard
from glmpost.formats.prompts import encode_prompt
from glmpost.kernel.loading import load_tokenizer


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    tokenizer, revision = load_tokenizer(tiny_checkpoint)
    return tokenizer, revision


def record(policy, rid: str, prompt: str, response: str, *, domain: str | None, task: dict, status="completed",
           eos=True, observation_from: int | None = None, revision: str | None = None) -> dict[str, Any]:
    """A rollout record whose ids come from the tiny tokenizer (response text, then end-of-text)."""
    tokenizer, rev = policy
    ids = tokenizer.encode(response, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
    action = np.ones(len(ids), dtype=bool)
    if observation_from is not None:
        action[observation_from:] = False
    out = {
        "id": rid,
        "prompt_id": rid,
        "group_id": rid,
        "task": task,
        "prompt_token_ids": encode_prompt(tokenizer, [{"role": "user", "content": prompt}]),
        "response_token_ids": ids,
        "action_mask": action,
        "observation_mask": ~action,
        "rollout_log_probs": np.where(action, -0.5, np.nan).astype(np.float32),
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "status": status,
        "tokenizer_revision": revision or rev,
    }
    if domain is not None:
        out["domain"] = domain
    return out


def write(directory: Path, name: str, records: list[dict[str, Any]], revision: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rev = revision or records[0]["tokenizer_revision"]
    return write_shard(directory / name, records, stage="rollout", tokenizer_revision=rev)


@pytest.fixture
def dataset(policy, tmp_path) -> Path:
    """Two rollout shards: count and math records, one math task without an answer."""
    tokenizer, _ = policy
    three = tokenizer.convert_tokens_to_ids("3")
    a = [
        record(policy, "c0", "count: 3", "", domain="count", task={"digit": "3"}, eos=False),
        record(policy, "m0", "What is 6*7?", r"6*7 = \boxed{42}.", domain="math", task={"answer": "42"}),
    ]
    a[0]["response_token_ids"] = np.array([three] * 6 + [5, 5], dtype=np.int32)  # 6 of 8 tokens are "3"
    a[0]["action_mask"] = np.ones(8, dtype=bool)
    a[0]["observation_mask"] = np.zeros(8, dtype=bool)
    a[0]["rollout_log_probs"] = np.full(8, -0.5, dtype=np.float32)
    b = [
        record(policy, "m1", "What is 1/2?", "It is 0.5", domain="math", task={"answer": r"\frac{1}{2}"}, status="truncated"),
        record(policy, "m2", "What is 2+2?", "5", domain="math", task={}),
    ]
    directory = tmp_path / "rollout"
    write(directory, "shard-00000.msgpack.zst", a)
    write(directory, "shard-00001.msgpack.zst", b)
    return directory


def judged(directory: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for p in sorted(directory.glob("*.msgpack.zst")) for r in read_shard(p).records}


def failed_cleanly(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("glmpost: error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------------------------
# the default mixture


def test_default_reward_is_the_domain_verifier(glmpost_cli, tiny_checkpoint, dataset, tmp_path):
    before = {p.name: p.read_bytes() for p in dataset.iterdir()}
    out = tmp_path / "judged"
    result = glmpost_cli("judge", dataset, "--out", out, "--checkpoint", tiny_checkpoint, "--json")
    assert result.exit_code == 0, result.stderr
    assert {p.name: p.read_bytes() for p in dataset.iterdir()} == before  # inputs untouched
    assert sorted(p.name for p in out.glob("*.msgpack.zst")) == sorted(before)

    inputs, outputs = judged(dataset), judged(out)
    for rid, original in inputs.items():  # every input field kept, exactly
        for key, value in original.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(outputs[rid][key], value)
            else:
                assert outputs[rid][key] == value, key
    assert outputs["c0"]["rewards"] == {"correct": 0.75} and outputs["c0"]["reward"] == 0.75
    assert outputs["c0"]["reward_info"]["components"]["correct"] == {
        "source": "verifier", "kind": "reward", "weight": 1.0, "verifier": "count", "matches": 6, "of": 8,
    }
    assert outputs["m0"]["reward"] == 1.0 and outputs["m0"]["reward_info"]["components"]["correct"]["extracted"] == "42"
    assert outputs["m1"]["reward"] == 1.0  # 0.5 == \frac{1}{2}
    failed = outputs["m2"]
    assert math.isnan(failed["reward"]) and math.isnan(failed["rewards"]["correct"])
    assert failed["reward_info"]["failure"] == "correct (verifier): VerifierError: task has no 'answer' to compare with"
    assert failed["reward_info"]["failed_components"] == ["correct"]

    header = read_shard(out / "shard-00000.msgpack.zst").header
    assert header["stage"] == "judge" and header["options"]["input_shard"].endswith("shard-00000.msgpack.zst")
    assert header["options"]["rewards"] == [{"name": "correct", "source": "verifier", "weight": 1.0}]

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["shard"] for m in metrics] == ["shard-00000.msgpack.zst", "shard-00001.msgpack.zst"]
    assert metrics[0]["judge/reward_mean"] == pytest.approx(0.875) and metrics[0]["judge/reward_std"] == pytest.approx(0.125)
    assert metrics[0]["judge/reward_min"] == 0.75 and metrics[0]["judge/reward_max"] == 1.0
    assert metrics[1]["judge/failures"] == 1 and metrics[1]["judge/reward_mean"] == 1.0
    assert metrics[1]["judge/components/correct/mean"] == 1.0 and metrics[1]["judge/components/correct/failures"] == 1

    summary = json.loads(result.stdout)
    assert summary["records"] == 4 and summary["failures"] == 1 and summary["shards"] == 2 and summary["skipped"] == 0
    assert summary["reward_mean"] == pytest.approx((0.75 + 1 + 1) / 3)
    stage = json.loads((out / "stage.json").read_text())
    assert stage["stage"] == "judge" and stage["tokenizer_revision"] == header["tokenizer_revision"]


# --------------------------------------------------------------------------------------------
# recipes and flags

RECIPE = r"""
[judge]
default-verifier = "math"

[judge.domains]
gsm8k = "math"

[[judge.rewards]]
name = "correct"
source = "verifier"
weight = 1.0

[[judge.rewards]]
name = "boxed"
source = "format"
pattern = '\\boxed\{'
weight = 0.2

[[judge.penalties]]
name = "too_long"
source = "length"
max_tokens = 4
ramp_tokens = 8
weight = 0.5

[[judge.penalties]]
name = "cut"
source = "truncated"
weight = 1.0
"""


def test_recipe_mixture_on_hand_computed_numbers(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    boxed = r"\boxed{4}"
    n_boxed = len(policy[0].encode(boxed, add_special_tokens=False)) + 1  # + end-of-text
    records = [
        record(policy, "g0", "2+2?", boxed, domain="gsm8k", task={"answer": 4}),
        record(policy, "g1", "2+2?", "4", domain="gsm8k", task={"answer": 4}, status="truncated"),
    ]
    write(tmp_path / "in", "s.msgpack.zst", records)
    recipe = tmp_path / "general.toml"
    recipe.write_text(RECIPE)
    out = tmp_path / "out"
    result = glmpost_cli("judge", tmp_path / "in", "--out", out, "--checkpoint", tiny_checkpoint, "--config", recipe)
    assert result.exit_code == 0, result.stderr
    got = judged(out)
    too_long = min(1.0, max(0, n_boxed - 4) / 8)
    assert got["g0"]["rewards"] == {"correct": 1.0, "boxed": 1.0, "too_long": too_long, "cut": 0.0}
    assert got["g0"]["reward"] == pytest.approx(1.0 + 0.2 - 0.5 * too_long)
    # "4" + end-of-text = 2 tokens, within budget; truncated costs 1
    assert got["g1"]["rewards"] == {"correct": 1.0, "boxed": 0.0, "too_long": 0.0, "cut": 1.0}
    assert got["g1"]["reward"] == pytest.approx(0.0)
    assert "correct" in result.stdout and "-0.5 x too_long (length)" in result.stdout

    # a flag wins over the recipe: --penalty replaces the recipe's penalties
    out2 = tmp_path / "out2"
    result = glmpost_cli(
        "judge", tmp_path / "in", "--out", out2, "--checkpoint", tiny_checkpoint, "--config", recipe,
        "--penalty", "name=cut,source=truncated,weight=0.25",
    )
    assert result.exit_code == 0, result.stderr
    got = judged(out2)
    assert set(got["g1"]["rewards"]) == {"correct", "boxed", "cut"} and got["g1"]["reward"] == pytest.approx(0.75)
    options = json.loads((out2 / "stage.json").read_text())["options"]
    assert options["penalties"] == [{"name": "cut", "source": "truncated", "weight": 0.25}]
    assert options["domains"] == {"gsm8k": "math"}


def test_shipped_general_rl_recipe(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    """recipes/general-rl.toml runs as shipped: correct + 0.1 boxed - 0.5 too_long - 1 truncated."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "general-rl.toml"
    records = [
        record(policy, "m", "2+2?", r"\boxed{4}", domain="math", task={"answer": 4}),
        record(policy, "g", "2+2?", "5", domain="gsm8k", task={"answer": 4}, status="truncated"),
    ]
    write(tmp_path / "in", "s.msgpack.zst", records)
    result = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint,
                         "--config", recipe)
    assert result.exit_code == 0, result.stderr
    got = judged(tmp_path / "out")
    assert got["m"]["rewards"] == {"correct": 1.0, "boxed": 1.0, "too_long": 0.0, "truncated": 0.0}
    assert got["m"]["reward"] == pytest.approx(1.1)
    assert got["g"]["rewards"] == {"correct": 0.0, "boxed": 0.0, "too_long": 0.0, "truncated": 1.0}
    assert got["g"]["reward"] == pytest.approx(-1.0)


HOOKS = """
def quarter(ctx):
    return 0.25
def boom(ctx):
    raise RuntimeError("sandbox down")
def too_big(ctx):
    return 2.0
"""


def test_python_hook_verifiers(glmpost_cli, tiny_checkpoint, policy, tmp_path, monkeypatch):
    (tmp_path / "judge_cli_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [
        record(policy, "q", "hi", "hello", domain="quarter", task={}),
        record(policy, "b", "hi", "hello", domain="boom", task={}),
        record(policy, "t", "hi", "hello", domain="big", task={}),
    ]
    write(tmp_path / "in", "s.msgpack.zst", records)
    result = glmpost_cli(
        "judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint,
        "--verifier", "quarter=judge_cli_hooks:quarter", "--verifier", "boom=judge_cli_hooks:boom",
        "--domains", '{big = "judge_cli_hooks:too_big"}',
    )
    sys.modules.pop("judge_cli_hooks", None)
    assert result.exit_code == 0, result.stderr
    got = judged(tmp_path / "out")
    assert got["q"]["reward"] == 0.25
    assert got["q"]["reward_info"]["components"]["correct"]["verifier"] == "judge_cli_hooks:quarter"
    assert math.isnan(got["b"]["reward"])
    assert got["b"]["reward_info"]["failure"] == "correct (verifier): RuntimeError: sandbox down"
    assert "VerifierError: returned 2.0, outside [0, 1]" in got["t"]["reward_info"]["failure"]
    assert "failed records: 2" in result.stdout


# --------------------------------------------------------------------------------------------
# reward models end to end


def test_orm_and_generative_judge_components(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    from test_rewards import build_tiny_orm

    orm = build_tiny_orm(tmp_path / "orm", tiny_checkpoint)
    records = [record(policy, f"r{i}", "count: 3", "3 3 3", domain="count", task={"digit": "3"}) for i in range(2)]
    write(tmp_path / "in", "s.msgpack.zst", records)
    result = glmpost_cli(
        "judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint, "--device", "cpu",
        "--reward", "name=correct,source=verifier",
        "--reward", f"name=orm,source=orm,checkpoint={orm},weight=0.5",
        "--reward", f'{{name = "judge", source = "judge", checkpoint = "{tiny_checkpoint}", max_new_tokens = 3, weight = 0.2}}',
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    for r in judged(tmp_path / "out").values():
        assert 0 < r["rewards"]["orm"] < 1 and r["rewards"]["correct"] == 1 / 8  # " 3" is another token than "3"
        # the random tiny judge writes no "Score: N": a recorded failure with the output, not a 0
        assert math.isnan(r["rewards"]["judge"]) and math.isnan(r["reward"])
        assert r["reward_info"]["failure"].startswith("judge (judge): unparsable judge output")
        assert "output" in r["reward_info"]["components"]["judge"]
    summary = json.loads(result.stdout)
    assert summary["failures"] == 2 and summary["components/judge/failures"] == 2
    assert summary["components/orm/failures"] == 0


# --------------------------------------------------------------------------------------------
# crash-resume, overwrite, Slurm splits


def test_rerun_finishes_only_what_is_missing(glmpost_cli, tiny_checkpoint, dataset, tmp_path):
    out = tmp_path / "out"
    args = ("judge", dataset, "--out", out, "--checkpoint", tiny_checkpoint)
    assert glmpost_cli(*args).exit_code == 0
    first, second = out / "shard-00000.msgpack.zst", out / "shard-00001.msgpack.zst"
    kept = first.stat().st_mtime_ns
    second.unlink()  # as if the run died before writing it
    result = glmpost_cli(*args, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["skipped"] == 1 and json.loads(result.stdout)["shards"] == 1
    assert first.stat().st_mtime_ns == kept and second.exists()

    second.write_bytes(second.read_bytes()[:-30])  # a damaged output is judged again
    result = glmpost_cli(*args, "--json")
    assert json.loads(result.stdout)["shards"] == 1 and "judging again" in result.stderr
    assert len(judged(out)) == 4

    result = glmpost_cli(*args, "--json", "--penalty", "source=truncated")  # other options: refused
    failed_cleanly(result, 2, "was written with --penalty [], now [{", "pass --overwrite")
    result = glmpost_cli(*args, "--json", "--overwrite", "--penalty", "source=truncated")
    assert json.loads(result.stdout)["shards"] == 2 and first.stat().st_mtime_ns != kept
    assert set(judged(out)["m1"]["rewards"]) == {"correct", "truncated"}


def test_shard_index_splits_the_work(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    for s in range(3):
        write(tmp_path / "in", f"s{s}.msgpack.zst", [record(policy, f"r{s}", "2+2?", "4", domain="math", task={"answer": 4})])
    out = tmp_path / "out"
    result = glmpost_cli("judge", tmp_path / "in", "--out", out, "--checkpoint", tiny_checkpoint,
                         "--shard-index", "1", "--num-shards", "2")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.glob("*.msgpack.zst")) == ["s1.msgpack.zst"]


# --------------------------------------------------------------------------------------------
# refusals: one line, no traceback, no output directory


def test_unknown_domain(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    write(tmp_path / "in", "s.msgpack.zst", [record(policy, "p", "a poem", "roses", domain="poetry", task={})])
    result = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint)
    failed_cleanly(result, 2, "record 'p'", "domain 'poetry' has no verifier (known: count, env, math)")
    assert not (tmp_path / "out").exists()
    # with a default verifier the same shard is judged
    result = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint,
                         "--default-verifier", "math")
    assert result.exit_code == 0, result.stderr


def test_missing_domain_names_rollout(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    write(tmp_path / "in", "s.msgpack.zst", [record(policy, "p", "2+2?", "4", domain=None, task={"answer": 4})])
    result = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint)
    failed_cleanly(result, 1, "record 'p' has no domain", "`glmpost rollout`")
    assert not (tmp_path / "out").exists()


def test_not_a_rollout_shard(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.msgpack.zst"
    prompts.write_text('{"prompt": "count: 3", "domain": "count"}\n')
    result = glmpost_cli("judge", prompts, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint)
    failed_cleanly(result, 1, "prompts.msgpack.zst", "not a glmpost shard")
    assert not (tmp_path / "out").exists()


def test_hook_that_does_not_import(glmpost_cli, tiny_checkpoint, dataset, tmp_path):
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint,
                         "--verifier", "math=no_such_pkg_xyz.mod:score")
    failed_cleanly(result, 2, "cannot import no_such_pkg_xyz.mod", "no_such_pkg_xyz.mod:score", "ModuleNotFoundError")
    assert not (tmp_path / "out").exists()
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint, "--verifier", "math")
    failed_cleanly(result, 2, "--verifier 'math': expected DOMAIN=VERIFIER")


def test_tokenizer_revision_mismatch(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    other = "sha256:0123456789abcdef"
    write(tmp_path / "in", "s.msgpack.zst", [record(policy, "p", "2+2?", "4", domain="math", task={"answer": 4}, revision=other)])
    result = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint)
    failed_cleanly(result, 1, other, policy[1], "tokenizer revision")
    assert not (tmp_path / "out").exists()


def test_orm_that_does_not_load(glmpost_cli, tiny_checkpoint, dataset, tmp_path):
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint,
                         "--reward", f"source=orm,checkpoint={tiny_checkpoint}")  # a causal LM, not a classifier
    failed_cleanly(result, 1, "does not load as a sequence classifier")
    assert not (tmp_path / "out").exists()
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint,
                         "--reward", f"source=orm,checkpoint={tmp_path / 'missing'}")
    failed_cleanly(result, 1, "does not exist")


@pytest.mark.parametrize(
    "flag, spec, needle",
    [
        ("--reward", "name=x,source=format,pattern=a,colour=red", "unknown key 'colour' for source 'format'"),
        ("--penalty", "name=x,source=magic", "unknown source 'magic'"),
        ("--reward", "name=x,source=length", "needs 'max_tokens'"),
        ("--reward", "name=x,source=truncated,weight=-1", "weight must be a finite number >= 0"),
    ],
)
def test_bad_component_flags(glmpost_cli, tiny_checkpoint, dataset, tmp_path, flag, spec, needle):
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint, flag, spec)
    failed_cleanly(result, 2, flag, needle)
    assert not (tmp_path / "out").exists()


def test_bad_component_in_recipe(glmpost_cli, tiny_checkpoint, dataset, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[judge.rewards]]\nname = "x"\nsource = "format"\npatern = "a"\n')
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint, "--config", recipe)
    failed_cleanly(result, 2, "unknown key 'patern'", "(known: name, source, weight, pattern)")
    recipe.write_text('[[judge.rewards]]\nname = "a"\nsource = "truncated"\n[[judge.penalties]]\nname = "a"\nsource = "truncated"\n')
    result = glmpost_cli("judge", dataset, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint, "--config", recipe)
    failed_cleanly(result, 2, "'a' is used twice")
    assert not (tmp_path / "out").exists()


def test_output_must_not_replace_inputs(glmpost_cli, tiny_checkpoint, dataset, tmp_path):
    result = glmpost_cli("judge", dataset, "--out", dataset, "--checkpoint", tiny_checkpoint)
    failed_cleanly(result, 2, "must not replace their inputs")
    twin = tmp_path / "twin"
    twin.mkdir()
    shutil.copy(dataset / "shard-00000.msgpack.zst", twin)
    result = glmpost_cli("judge", dataset, twin, "--out", tmp_path / "out", "--checkpoint", tiny_checkpoint)
    failed_cleanly(result, 2, "share the file name shard-00000.msgpack.zst")
    assert not (tmp_path / "out").exists()


def test_help_documents_every_option(glmpost_cli):
    result = glmpost_cli("judge", "--help")
    assert result.exit_code == 0
    for option in ("--out", "--checkpoint", "--reward", "--penalty", "--verifier", "--domains", "--default-verifier",
                   "--device", "--batch-size", "--shard-index", "--num-shards", "--zstd-level", "--overwrite",
                   "--json", "--config"):
        assert option in result.stdout, option
    assert "R = sum_k w_k R_k - sum_j" in result.stdout


def test_dynamic_sampling_leaves_out_groups_whose_rewards_are_all_equal(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    """DAPO eq. 11: a group is kept iff its rewards differ; counted per shard and in the summary."""
    def member(group: str, index: int, answer: str, **kw):
        r = record(policy, f"{group}/{index}", "2+2?", rf"\boxed{{{answer}}}", domain="math", task={"answer": 4}, **kw)
        return {**r, "prompt_id": group, "group_id": group}

    first = [member("mixed", 0, "4"), member("mixed", 1, "5"), member("right", 0, "4"), member("right", 1, "4")]
    second = [member("wrong", 0, "5"), member("wrong", 1, "3"), member("wrong", 2, "7"),
              member("lonely", 0, "4"), member("lonely", 1, "5") | {"task": {}},  # no answer: a NaN reward
              member("three", 0, "4"), member("three", 1, "4"), member("three", 2, "1")]
    write(tmp_path / "in", "a.msgpack.zst", first)
    write(tmp_path / "in", "b.msgpack.zst", second)
    out = tmp_path / "out"
    result = glmpost_cli("judge", tmp_path / "in", "--out", out, "--checkpoint", tiny_checkpoint, "--dynamic-sampling", "--json")
    assert result.exit_code == 0, result.stderr
    got = judged(out)
    assert sorted(got) == ["mixed/0", "mixed/1", "three/0", "three/1", "three/2"]
    summary = json.loads(result.stdout)
    assert (summary["records"], summary["dynamic_sampling/groups_kept"], summary["dynamic_sampling/groups_dropped"],
            summary["dynamic_sampling/records_dropped"]) == (12, 2, 3, 7)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_shard = {line["shard"]: line for line in lines if "shard" in line}
    assert per_shard["a.msgpack.zst"]["judge/dynamic_sampling/groups_dropped"] == 1
    assert per_shard["b.msgpack.zst"]["judge/dynamic_sampling/groups_dropped"] == 2
    assert json.loads((out / "stage.json").read_text())["options"]["dynamic_sampling"] is True
    human = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "out2", "--checkpoint", tiny_checkpoint,
                        "--dynamic-sampling")
    assert "dynamic sampling: kept 2 group(s), left out 3 whose rewards are all equal (7 records)" in human.stdout
    # without the option every record is judged and written, as before
    plain = glmpost_cli("judge", tmp_path / "in", "--out", tmp_path / "plain", "--checkpoint", tiny_checkpoint)
    assert plain.exit_code == 0 and len(judged(tmp_path / "plain")) == 12


def test_dynamic_sampling_following_a_spool(glmpost_cli, tiny_checkpoint, policy, tmp_path):
    """judge --follow --dynamic-sampling: the judged spool holds informative groups only, so a trainer
    following it fills --follow-records with them (the rollout over-samples)."""
    from glmpost.checkpoints import tokenizer_revision
    from glmpost.spool.spool import Spool

    def member(group: str, index: int, answer: str):
        r = record(policy, f"{group}/{index}", "2+2?", rf"\boxed{{{answer}}}", domain="math", task={"answer": 4})
        return {**r, "prompt_id": group, "group_id": group}

    revision = tokenizer_revision(tiny_checkpoint)
    rolled = Spool(tmp_path / "rolled", tokenizer_revision=revision)
    parts = {"p-1.msgpack.zst": [member("a", 0, "4"), member("a", 1, "4"), member("b", 0, "4"), member("b", 1, "1")],
             "p-2.msgpack.zst": [member("c", 0, "2"), member("c", 1, "2"), member("d", 0, "9"), member("d", 1, "4")]}
    for name, records in parts.items():
        write(tmp_path / "made", name, records)
        target = rolled.publish_path(name)
        shutil.copyfile(tmp_path / "made" / name, target.with_name("." + name + ".tmp"))
        (target.with_name("." + name + ".tmp")).rename(target)
    out = tmp_path / "judged"
    result = glmpost_cli("judge", "--follow", rolled.path, "--out", out, "--checkpoint", tiny_checkpoint, "--dynamic-sampling",
                         "--poll-s", "0.05", "--idle-timeout", "1", "--json")
    assert result.exit_code == 0, result.stderr
    judged_spool = Spool(out, tokenizer_revision=revision, create=False)
    kept = sorted(r["id"] for p in judged_spool.ready_dir.glob("*.msgpack.zst") for r in read_shard(p).records)
    assert kept == ["b/0", "b/1", "d/0", "d/1"] and rolled.depth().done == 2


def test_informative_groups_and_their_counts():
    from glmpost.rewards.dynamic_sampling import GroupFilter, informative

    assert informative([0.0, 1.0]) and informative([0.2, 0.2, 0.3]) and informative([1.0, float("nan"), 0.0])
    assert not informative([1.0, 1.0, 1.0]) and not informative([0.0, float("nan")]) and not informative([0.7])
    counts = GroupFilter()
    records = [{"id": "a", "group_id": 1, "reward": 1.0}, {"id": "b", "group_id": 2, "reward": 0.0},
               {"id": "c", "group_id": 1, "reward": 0.0}, {"id": "d", "group_id": 2, "reward": 0.0}]
    assert [r["id"] for r in counts.keep_informative(records, where="s")] == ["a", "c"]
    assert counts.metrics() == {"judge/dynamic_sampling/groups_kept": 1, "judge/dynamic_sampling/groups_dropped": 1,
                                "judge/dynamic_sampling/records_dropped": 2}
    with pytest.raises(GlmpostError, match="s: record 'x' has no group_id"):
        GroupFilter().keep_informative([{"id": "x", "reward": 1.0}], where="s")
