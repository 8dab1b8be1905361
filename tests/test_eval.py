"""``glmpost eval``: pass@k / avg@n / maj@n on hand-computed values, and the stage end to end on the
tiny checkpoint: report.json equals the metrics recomputed from the judged records it wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from glmpost.evaluation.metrics import avg_at_k, maj_at_k, majority_answer, pass_at_k
from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.rewards.verifiers import Verdict

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "recipes" / "data" / "count-train.jsonl"


def test_pass_at_k_hand_computed():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 = c/n
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(4, 1, 3) == pytest.approx(1 - 1 / 4)  # 1 - C(3,3)/C(4,3)
    assert pass_at_k(5, 0, 3) == 0.0  # no correct sample
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 5) == 1.0  # all correct
    assert pass_at_k(5, 1, 5) == 1.0 and pass_at_k(5, 0, 5) == 0.0  # k = n: any correct sample
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every k-subset holds a correct one
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)  # large n: the product form stays exact
    for bad in [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_avg_and_maj_hand_computed():
    assert avg_at_k([True, False, False, True]) == 0.5
    assert avg_at_k([False]) == 0.0
    # "7" twice (both wrong) beats "3" once (right): maj is wrong.
    assert maj_at_k(["7", "3", "7"], [False, True, False]) == 0.0
    assert maj_at_k(["3", "7", "3", None, None], [True, False, True, False, False]) == 1.0  # None does not vote
    # A tie goes to the answer seen first.
    assert majority_answer(["a", "b", "b", "a"]) == 0 and maj_at_k(["a", "b", "b", "a"], [True, False, False, True]) == 1.0
    assert majority_answer(["b", "a", "a", "b"]) == 0 and maj_at_k(["b", "a", "a", "b"], [False, True, True, False]) == 0.0
    assert majority_answer([None, None]) is None and maj_at_k([None, None], [True, True]) == 0.0


def parity_verifier(ctx) -> Verdict:
    """A verifier for the test: correct when the first response token id is even; its answer the id mod 3."""
    first = int(ctx.response_token_ids[0]) if len(ctx.response_token_ids) else -1
    return Verdict(float(first % 2 == 0), {"extracted": str(first % 3)})


def _recomputed(out: Path, n: int, ks: list[int]) -> tuple[dict, int]:
    """The overall metrics from the judged records eval wrote, by the formulas, not the library run."""
    groups: dict[str, list[dict]] = {}
    for path in resolve_shard_paths([str(out / "judged")]):
        for record in ShardReader(path):
            groups.setdefault(record["prompt_id"], []).append(record)
    per_prompt = []
    for records in groups.values():
        assert len(records) == n
        correct = [r["rewards"]["correct"] >= 1.0 for r in records]
        c = sum(correct)
        answers = [r["reward_info"]["components"]["correct"]["extracted"] for r in records]
        votes = {a: answers.count(a) for a in answers}
        winner = next(i for i, a in enumerate(answers) if votes[a] == max(votes.values()))
        row = {f"avg@{n}": c / n, f"maj@{n}": float(correct[winner])}
        row.update({f"pass@{k}": 1 - math.comb(n - c, k) / math.comb(n, k) for k in ks})
        per_prompt.append(row)
    return {key: sum(r[key] for r in per_prompt) / len(per_prompt) for key in per_prompt[0]}, len(groups)


def test_eval_end_to_end_report_equals_the_judged_records(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    result = glmpost_cli("eval", PROMPTS, "--checkpoint", tiny_checkpoint, "--out", out, "--n", 4, "--k", 2,
                         "--limit", 8, "--max-new-tokens", 4, "--domains", '{count = "test_eval:parity_verifier"}')
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    expected, prompts = _recomputed(out, 4, [2])
    assert prompts == 8 and report["overall"]["prompts"] == 8 and report["overall"]["samples"] == 32
    assert report["k"] == [2] and set(report["domains"]) == {"count"}
    for key, value in expected.items():
        assert report["overall"][key] == pytest.approx(value), key
        assert report["domains"]["count"][key] == pytest.approx(value), key
    assert 0 < expected["avg@4"] < 1  # the parity verifier makes a mix, so the comparison can fail
    line = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert all(line[f"eval/{key}"] == pytest.approx(value) for key, value in expected.items())
    assert line["eval/count/pass@2"] == pytest.approx(expected["pass@2"])
    assert json.loads((out / "stage.json").read_text())["stage"] == "eval"
    assert "pass@2" in result.stdout and "overall" in result.stdout


def test_eval_count_verifier_json(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    result = glmpost_cli("eval", PROMPTS, "--checkpoint", tiny_checkpoint, "--out", out, "--n", 2, "--limit", 3,
                         "--max-new-tokens", 4, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report == json.loads((out / "report.json").read_text())
    overall = report["overall"]
    assert report["k"] == [1, 2] and {"avg@2", "pass@1", "pass@2", "maj@2", "score_mean"} <= set(overall)
    assert overall["pass@1"] == pytest.approx(overall["avg@2"]) and overall["failures"] == 0


@pytest.mark.parametrize("args, words", [
    (["--n", 2, "--k", 3], "--k 3"),
    (["--threshold", 0], "--threshold"),
    (["--domains", "count"], "--domains"),
])
def test_eval_bad_input_is_one_line(glmpost_cli, tiny_checkpoint, tmp_path, args, words):
    out = tmp_path / "eval"
    result = glmpost_cli("eval", PROMPTS, "--checkpoint", tiny_checkpoint, "--out", out, *args)
    assert result.exit_code == 2
    assert words in result.stderr and "Traceback" not in result.stderr
    assert not (out / "report.json").exists()


def test_eval_missing_prompts_file(glmpost_cli, tiny_checkpoint, tmp_path):
    result = glmpost_cli("eval", tmp_path / "nope.jsonl", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "eval")
    assert result.exit_code != 0 and "nope.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_eval_rerun_keeps_samples_and_refuses_other_options(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "eval"
    args = ["eval", PROMPTS, "--checkpoint", tiny_checkpoint, "--out", out, "--limit", 2, "--max-new-tokens", 4,
            "--n", 2, "--domains", '{count = "test_eval:parity_verifier"}']
    assert glmpost_cli(*args).exit_code == 0
    first = json.loads((out / "report.json").read_text())
    again = glmpost_cli(*args, "--k", 1, "--threshold", 0.5)  # only the report changes
    assert again.exit_code == 0, again.stderr
    second = json.loads((out / "report.json").read_text())
    assert second["k"] == [1] and second["overall"]["pass@1"] == first["overall"]["pass@1"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    refused = glmpost_cli(*args[:-4], "--n", 3)
    assert refused.exit_code == 2 and "--n" in refused.stderr and "--overwrite" in refused.stderr
