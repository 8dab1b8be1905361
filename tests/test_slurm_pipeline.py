"""The tiny pipeline through bin/slurm/submit-pipeline on a real single-node Slurm (tests/slurm_cluster.py).

One chain per module: it is submitted, its train-grpo job (2 DeepSpeed ranks under srun) is killed
with scancel while it runs, the chain stops there with a message saying how to resume, and the
same command submitted again completes it without redoing the finished steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, install_reason

ROOT = Path(__file__).resolve().parents[1]
SUBMIT = ROOT / "bin" / "slurm" / "submit-pipeline"
RECIPE = ROOT / "recipes" / "tiny-pipeline.toml"
# The tiny recipe with one RL iteration, to keep the module to a few minutes.
OVERRIDES = ["--set", "iterations=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_reason()
    if reason is not None:
        pytest.skip(f"no Slurm on this machine: {reason}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def submit(cluster: SlurmCluster, run: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(SUBMIT), str(RECIPE), "--run-dir", str(run), *OVERRIDES, *extra], cwd=ROOT,
                          capture_output=True, text=True, env=cluster.env, timeout=timeout, check=False)


def jobs(run: Path) -> dict[str, str]:
    """Step name -> job id of the chain submitted last (RUN/slurm/jobs.tsv)."""
    rows = [line.split("\t") for line in (run / "slurm" / "jobs.tsv").read_text().splitlines()]
    return {name: job for job, name, _ in rows}


def mtimes(run: Path, *folders: str) -> dict[str, int]:
    """Modification times of the shards and checkpoint files (not logs, nor LATEST pointers that move on)."""
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for folder in folders for p in sorted((run / folder).rglob("*"))
            if p.is_file() and p.name not in ("metrics.jsonl", "stage.json", "LATEST")}


@pytest.fixture(scope="module")
def chain(cluster, tmp_path_factory):
    """Submit, kill train-1 while its ranks train, watch the chain stop, then resubmit and wait for it."""
    run = tmp_path_factory.mktemp("pipeline") / "run"
    queued = submit(cluster, run)
    assert queued.returncode == 0, queued.stderr
    first = jobs(run)
    deadline = time.time() + 500
    # One look at the state per round: a job that starts between two looks is not a failure.
    while (state := cluster.job_states(first["train-1"])) != ["RUNNING"]:
        assert time.time() < deadline, f"train-1 never started: {state}"
        assert state in (["PENDING"], ["CONFIGURING"], []), state
        time.sleep(0.5)
    staging = run / "policy" / ".staging-v000002"  # the update has begun writing: kill it mid-way
    while not staging.exists():
        assert cluster.job_states(first["train-1"]) == ["RUNNING"], "train-1 ended before it could be killed"
        time.sleep(0.1)
    cluster.run("scancel", first["train-1"])
    stopped = submit(cluster, run, "--watch", "--timeout", "300")
    states = {name: cluster.job_states(job) for name, job in first.items()}
    before = mtimes(run, "model", "sft", "rollout-weights", "rl")
    resumed = submit(cluster, run, "--wait", "--timeout", "500")
    return {"run": run, "first": first, "stopped": stopped, "states": states, "before": before, "resumed": resumed,
            "second": jobs(run)}


def test_killed_job_stops_the_chain_and_says_how_to_resume(chain):
    stopped, states = chain["stopped"], chain["states"]
    assert stopped.returncode == 1, stopped.stderr
    message = stopped.stderr.strip().splitlines()
    assert any(line.startswith("submit-pipeline: the chain stopped at train-1") and "CANCELLED" in line for line in message), stopped.stderr
    assert any("resume with: bin/slurm/submit-pipeline" in line and "--wait" in line for line in message), stopped.stderr
    alone = next(line for line in message if line.startswith("submit-pipeline: or rerun only that step: GLMPOST_ROOT="))
    assert alone.rstrip().endswith(" --nodes=1 --ntasks-per-node=2 " + str(ROOT / "bin" / "slurm" / "train-grpo.sbatch") + " 1")
    for name in ("init-model", "qat", "sync-start", "rollout-1", "judge-1"):
        assert set(states[name]) == {"COMPLETED"}, (name, states[name])
    for name in ("train-1", "sync-1", "opd-rollout", "score-teacher", "opd-merge", "quantize", "diff-logprobs"):
        assert set(states[name]) == {"CANCELLED"}, (name, states[name])
    assert chain["before"], "the steps before the killed one left no output"
    assert not any(key.startswith("rollout-weights/v000002") for key in chain["before"])


def test_resubmitted_chain_completes_every_stage(chain, glmpost_cli):
    resumed, run = chain["resumed"], chain["run"]
    assert resumed.returncode == 0, resumed.stderr
    assert "pipeline complete: final policy" in resumed.stderr
    for shards in ("rl/iter-001/rollout", "rl/iter-001/judged"):
        verified = glmpost_cli("shards", "verify", run / shards, "--json")
        assert verified.exit_code == 0, verified.stderr
        assert json.loads(verified.stdout) == {"ok": True, "shards": 5, "records": 80}
    assert (run / "sft" / "LATEST").read_text().strip() == "v000001"
    assert (run / "policy" / "LATEST").read_text().strip() == "v000002"
    assert (run / "rollout-weights" / "LATEST").read_text().strip() == "v000002"
    # cross-stage OPD: the RL policy (v2) learns from its routed teachers and becomes v3
    scored = glmpost_cli("shards", "cat", run / "opd" / "scored")
    assert scored.exit_code == 0, scored.stderr
    records = [json.loads(line) for line in scored.stdout.splitlines()]
    assert records and all(r["teacher"]["payload"] == "sampled" and len(r["teacher_log_probs"]) == len(r["response_token_ids"])
                           for r in records)
    assert (run / "opd-policy" / "LATEST").read_text().strip() == "v000003"
    assert json.loads((run / "opd-policy" / "v000003" / "stage.json").read_text())["world_size"] == 2
    assert json.loads((run / "deploy" / "glmpost.json").read_text())["policy_version"] == 3
    assert json.loads((run / "diff-logprobs" / "report.json").read_text())  # the gate ran and passed
    assert not list((run / "policy").glob(".staging-*")), "the killed update left its staging folder"


def test_train_step_ran_as_two_ranks(chain):
    stage = json.loads((chain["run"] / "policy" / "v000002" / "stage.json").read_text())
    assert stage["world_size"] == 2
    log = next((chain["run"] / "slurm" / "logs").glob(f"*-train-1-{chain['second']['train-1']}.out")).read_text()
    assert "on 2 rank(s)" in log
    # the killed attempt left its staging folder; this one was told to start the update over
    assert f"an interrupted attempt left {chain['run'] / 'policy' / '.staging-v000002'}; this attempt passes --overwrite" in log


def test_resubmission_redid_no_finished_work(chain):
    run, before = chain["run"], chain["before"]
    after = mtimes(run, "model", "sft", "rollout-weights", "rl")
    assert {k: after[k] for k in before} == before  # no file of a finished step was rewritten
    logs = {p.name: p.read_text() for p in (run / "slurm" / "logs").iterdir()}
    second = chain["second"]
    qat_log = next(text for name, text in logs.items() if name.endswith(f"-qat-{second['qat']}.out"))
    assert "already published; skipped" in qat_log
    rollout_logs = [text for name, text in logs.items() if f"-rollout-1-{second['rollout-1']}_" in name]
    assert len(rollout_logs) == 2 and all("0 new shard(s)" in text for text in rollout_logs)


def test_submit_without_sbatch_says_so(tmp_path):
    tools = tmp_path / "bin"  # a PATH with the shell tools the script needs, and no Slurm
    tools.mkdir()
    for tool in ("bash", "dirname", "sed"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(tools)}
    result = subprocess.run([str(SUBMIT), str(RECIPE), "--run-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                            text=True, env=env, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"submit-pipeline: sbatch not found on PATH: run this on a Slurm login node "
                                     f"(or run the same recipe on one machine with bin/pipeline {RECIPE})")


def test_dry_run_chains_every_job_after_the_previous_one(tmp_path):
    result = subprocess.run([str(SUBMIT), str(RECIPE), "--run-dir", str(tmp_path / "run"), "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    names = [line.split("--job-name=tiny-")[1].split()[0] for line in lines]
    assert names == ["init-model", "qat", "sync-start", "rollout-1", "judge-1", "train-1", "sync-1", "rollout-2", "judge-2",
                     "train-2", "sync-2", "opd-rollout", "score-teacher", "opd-merge", "quantize", "diff-logprobs"]
    for previous, line in zip(names, lines[1:]):
        assert f"--dependency=afterok:\\<{previous}\\> --kill-on-invalid-dep=yes" in line, line
    assert "--dependency" not in lines[0]
    train = next(line for line in lines if "tiny-train-1" in line)
    assert "--nodes=1 --ntasks-per-node=2" in train and train.endswith("train-grpo.sbatch 1 ")
    assert "--array=0-1" in next(line for line in lines if "tiny-rollout-1" in line)
