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


def _publish_copy(root: Path, source: Path, version: int) -> None:
    """``source``'s weights published in ``root`` as ``version`` (a staged copy moved into place, as trainers publish)."""
    import dataclasses
    import shutil

    from glmpost.checkpoints import read_manifest, version_dir_name, write_manifest

    staging = root / f".staging-{version}"
    shutil.copytree(source, staging)
    write_manifest(staging, dataclasses.replace(read_manifest(source), policy_version=version))
    staging.rename(root / version_dir_name(version))
    (root / "LATEST").write_text(version_dir_name(version) + "\n")


FOLLOW = ["--n", 2, "--limit", 2, "--max-new-tokens", 4, "--poll-s", 0.05]


def test_eval_follow_evaluates_each_published_version_once(glmpost_cli, tiny_checkpoint, tmp_path):
    root, out = tmp_path / "root", tmp_path / "eval"
    root.mkdir()
    _publish_copy(root, tiny_checkpoint, 0)
    first = glmpost_cli("eval", PROMPTS, "--follow", root, "--out", out, "--idle-timeout", 0, "--json", *FOLLOW)
    assert first.exit_code == 0, first.stderr
    assert json.loads(first.stdout)["evaluated"] == [0]
    for version in (1, 2, 3):
        _publish_copy(root, tiny_checkpoint, version)
    # A restart goes on after v0; --every 2 leaves out the odd versions.
    again = glmpost_cli("eval", PROMPTS, "--follow", root, "--out", out, "--idle-timeout", 0, "--every", 2, "--json", *FOLLOW)
    assert again.exit_code == 0, again.stderr
    summary = json.loads(again.stdout)
    assert summary["evaluated"] == [2] and not (out / "v000001").exists() and not (out / "v000003").exists()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["policy_version"] for line in lines] == [0, 2]
    reports = [json.loads((out / name / "report.json").read_text()) for name in ("v000000", "v000002")]
    assert [r["policy_version"] for r in reports] == [0, 2]
    # The same weights and seed: the same samples, the same scores.
    assert reports[0]["overall"] == reports[1]["overall"] == summary["reports"]["v000002"]
    assert lines[1]["eval/avg@2"] == reports[1]["overall"]["avg@2"]
    # Other sampling options than the ones OUT was evaluated with are refused.
    other = glmpost_cli("eval", PROMPTS, "--follow", root, "--out", out, "--idle-timeout", 0, *FOLLOW, "--temperature", 0.5)
    assert other.exit_code == 2 and "--temperature" in other.stderr


def test_eval_follow_waits_for_versions_and_stops_on_sigterm(tiny_checkpoint, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    root, out = tmp_path / "root", tmp_path / "eval"
    root.mkdir()
    _publish_copy(root, tiny_checkpoint, 0)
    proc = subprocess.Popen([sys.executable, "-m", "glmpost.commands.app", "eval", str(PROMPTS), "--follow", str(root),
                             "--out", str(out), "--json", *map(str, FOLLOW)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (out / "v000000" / "stage.json").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        _publish_copy(root, tiny_checkpoint, 1)  # published while it waits
        while not (out / "v000001" / "stage.json").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["evaluated"] == [0, 1] and "SIGTERM: stopped after 2 versions" in stderr


def test_eval_needs_a_checkpoint_or_a_root_to_follow(glmpost_cli, tiny_checkpoint, tmp_path):
    neither = glmpost_cli("eval", PROMPTS, "--out", tmp_path / "e")
    both = glmpost_cli("eval", PROMPTS, "--out", tmp_path / "e", "--checkpoint", tiny_checkpoint, "--follow", tmp_path)
    missing = glmpost_cli("eval", PROMPTS, "--out", tmp_path / "e", "--follow", tmp_path / "nope", "--idle-timeout", 0)
    for result in (neither, both):
        assert result.exit_code == 2 and "--checkpoint CKPT" in result.stderr and result.stderr.count("\n") == 1
    assert missing.exit_code == 1 and "--follow" in missing.stderr and "nope" in missing.stderr
    assert "Traceback" not in missing.stderr
