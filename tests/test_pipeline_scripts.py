"""bin/pipeline (plain shell) on the tiny recipe, and glmpost/pipeline/'s [pipeline] validation and plan."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from glmpost.errors import UsageError
from glmpost.pipeline import STAGE_ORDER, load_pipeline, plan
from glmpost.pipeline.steps import PIPELINE_STAGES, pipeline_steps

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "bin" / "pipeline"
RECIPE = ROOT / "recipes" / "tiny-pipeline.toml"
PROMPTS = ROOT / "recipes" / "data" / "count-train.jsonl"


def write_recipe(tmp_path: Path, pipeline: str, rest: str = "") -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(f"[pipeline]\nrun-dir = \"{tmp_path / 'run'}\"\n{pipeline}\n{rest}")
    return path


# --- [pipeline] validation: one line naming the file and the key -----------------------------------

@pytest.mark.parametrize("pipeline, message", [
    ('stages = ["init-model"]\nbogus = 1', "[pipeline]: unknown key 'bogus' (known: base-checkpoint,"),
    ('stages = ["init-model", "rl", "qat"]\nprompts = ["P"]\nsft-data = ["P"]',
     "[pipeline] stages: 'qat' cannot run after 'rl' (each stage consumes the one before; order: init-model, qat, rl, opd, quantize, diff-logprobs)"),
    ('stages = ["init-model", "diff-logprobs"]', "[pipeline] stages: 'diff-logprobs' needs rollouts to check: add 'rl' or 'opd' before it"),
    ('stages = ["init-model", "quantize", "quantize"]', "[pipeline] stages: 'quantize' is listed twice"),
    ('stages = ["init-model", "sft"]', "[pipeline] stages: unknown stage 'sft' (known: init-model, qat, rl, opd, quantize, diff-logprobs)"),
    ('stages = ["rl"]\nprompts = ["P"]', "[pipeline]: missing key 'base-checkpoint' (the model to post-train), or put 'init-model' first in stages"),
    ('stages = ["rl"]\nprompts = ["P"]\nbase-checkpoint = "/nonexistent/ckpt"', "[pipeline] base-checkpoint: /nonexistent/ckpt does not exist"),
    ('stages = ["init-model", "rl"]\nprompts = ["/nonexistent/prompts.jsonl"]', "[pipeline] prompts: /nonexistent/prompts.jsonl does not exist"),
    ('stages = ["init-model", "rl"]', "[pipeline]: stage 'rl' needs 'prompts' (its input data files)"),
    ('stages = ["init-model", "rl"]\nprompts = ["P"]\niterations = "2"', "[pipeline] iterations: must be an integer, not '2'"),
    ('stages = ["init-model", "rl"]\nprompts = ["P"]\ntrain-ranks = 0', "[pipeline] train_ranks: must be at least 1, not 0".replace("train_ranks", "train-ranks")),
    ('stages = ["init-model", "rl"]\nprompts = ["P"]\nlauncher = "tpu"', "[pipeline] launcher: 'tpu' is not one of cpu, cuda, npu"),
    ('stages = ["init-model", "rl", "opd"]\nprompts = ["P"]\nopd-default-teacher = "sft"',
     "[pipeline] opd-default-teacher: 'sft' names the qat stage's checkpoint, but stages has no 'qat'"),
    ('stages = ["init-model"]\n[pipeline.slurm]\nnodes = 2', "[pipeline].slurm: unknown key 'nodes' (known: account, cpus-per-task,"),
])
def test_bad_pipeline_sections_are_one_line_usage_errors(tmp_path, pipeline, message):
    recipe = write_recipe(tmp_path, pipeline.replace('"P"', f'"{PROMPTS}"'))
    with pytest.raises(UsageError) as error:
        load_pipeline(recipe)
    assert str(error.value).startswith(f"{recipe}: {message}"), str(error.value)
    assert "\n" not in str(error.value)


def test_a_recipe_without_pipeline_section_is_refused(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[rollout]\ngroup-size = 4\n")
    with pytest.raises(UsageError, match=r"has no \[pipeline\] table"):
        load_pipeline(recipe)


def test_plan_fixes_every_version_before_anything_runs(tmp_path):
    """Base v0 (init-model) -> qat v1 -> RL iterations v2, v3 -> OPD v4; rollouts sample the synced previous version."""
    config = load_pipeline(RECIPE, {"run-dir": str(tmp_path)})
    steps = plan(config)
    assert config.stages == ["init-model", "qat", "rl", "opd", "quantize", "diff-logprobs"] and config.world_size == 2
    assert steps.base == str(tmp_path / "model") and steps.sft == str(tmp_path / "sft" / "v000001")
    assert steps.rl_train_from == {1: str(tmp_path / "sft" / "v000001"), 2: str(tmp_path / "policy" / "v000002")}
    assert steps.rl_sample_with == {1: str(tmp_path / "rollout-weights" / "v000001"), 2: str(tmp_path / "rollout-weights" / "v000002")}
    assert steps.rl_trained == {1: str(tmp_path / "policy" / "v000002"), 2: str(tmp_path / "policy" / "v000003")}
    assert steps.opd_student == str(tmp_path / "policy" / "v000003")
    assert steps.opd_routes == {"count": str(tmp_path / "policy" / "v000003")}
    assert steps.opd_default_teacher == str(tmp_path / "sft" / "v000001")
    assert steps.final == str(tmp_path / "opd-policy" / "v000004")
    assert (steps.gate_rollout, steps.gate_checkpoint) == (str(tmp_path / "opd" / "rollout"), str(tmp_path / "policy" / "v000003"))


def test_plan_starts_from_a_base_checkpoints_policy_version(tmp_path, tiny_checkpoint):
    """A base at policy version 0 without qat: iteration 1 trains from it, publishes v1; no sync: samples the same."""
    recipe = write_recipe(tmp_path, f'stages = ["rl", "quantize"]\nbase-checkpoint = "{tiny_checkpoint}"\nprompts = ["{PROMPTS}"]')
    steps = plan(load_pipeline(recipe))
    assert steps.rl_train_from == steps.rl_sample_with == {1: str(tiny_checkpoint)}
    assert steps.rl_trained == {1: str(tmp_path / "run" / "policy" / "v000001")} and steps.final == steps.rl_trained[1]
    assert steps.gate_rollout == str(tmp_path / "run" / "rl" / "iter-001" / "rollout")


def test_shell_output_evaluates_in_bash(tmp_path):
    script = (f'eval "$({sys.executable} -m glmpost.pipeline {RECIPE} --shell --run-dir {tmp_path} --set iterations=3)"; '
              'echo "${PIPELINE_RL_TRAINED[3]} ${#PIPELINE_STAGES[@]} ${PIPELINE_OPD_ROUTES[0]} $PIPELINE_WORLD_SIZE"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "policy" / "v000004"), "6", f"count={tmp_path / 'policy' / 'v000004'}", "2"]


def test_module_cli_reports_errors_in_one_line(tmp_path):
    recipe = write_recipe(tmp_path, 'stages = ["init-model"]\nbogus = 1')
    result = subprocess.run([sys.executable, "-m", "glmpost.pipeline", str(recipe)], capture_output=True, text=True, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"glmpost: error: {recipe}: [pipeline]: unknown key 'bogus'") and result.stderr.count("\n") == 1


# --- bin/pipeline ---------------------------------------------------------------------------------

# One RL iteration on one rank without sync-weights (the 2-rank DeepSpeed run and sync-weights are
# covered through Slurm in test_slurm_pipeline.py); every other stage of the tiny recipe, OPD included.
OVERRIDES = ["--set", "iterations=1", "--set", "train-ranks=1", "--set", "sync-weights=false"]


def run_pipeline(recipe: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PIPELINE), str(recipe), "--run-dir", str(run), *OVERRIDES, *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)


@pytest.fixture(scope="module")
def shell_runs(tmp_path_factory):
    """A run whose gate fails (threshold -1 in a copy of the recipe), then the fixed recipe's rerun."""
    tmp = tmp_path_factory.mktemp("shell-pipeline")
    recipe, run = tmp / "tiny-pipeline.toml", tmp / "run"
    text = RECIPE.read_text()
    recipe.write_text(text.replace('fail-above = ["max_abs=1e-3"]', 'fail-above = ["max_abs=-1.0"]'))
    failed = run_pipeline(recipe, run)
    shards = {p: p.stat().st_mtime_ns for p in run.rglob("*.msgpack.zst")}
    checkpoints = {p: p.stat().st_mtime_ns for p in run.rglob("model.safetensors")}
    recipe.write_text(text)
    fixed = run_pipeline(recipe, run)
    return {"run": run, "recipe": recipe, "failed": failed, "fixed": fixed, "shards": shards, "checkpoints": checkpoints}


def test_failed_gate_stops_the_pipeline_and_says_how_to_resume(shell_runs):
    failed = shell_runs["failed"]
    assert failed.returncode == 1, failed.stderr[-3000:]
    lines = failed.stderr.splitlines()
    assert "bin/pipeline: step 'diff-logprobs: gate' failed (exit 1); the steps after it did not run." in lines
    resume = f"bin/pipeline: fix the cause above, then resume with: bin/pipeline {shell_runs['recipe']} --run-dir {shell_runs['run']} " \
             f"--set iterations=1 --set train-ranks=1 --set sync-weights=false   (finished steps are skipped)"
    assert resume in lines
    assert (shell_runs["run"] / "deploy" / "glmpost.json").is_file()  # the steps before the gate finished


def test_rerun_completes_every_stage_without_redoing_work(shell_runs, glmpost_cli):
    fixed, run = shell_runs["fixed"], shell_runs["run"]
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "bin/pipeline: done in" in fixed.stderr and str(run / "opd-policy" / "v000003") in fixed.stderr
    for folder, records in (("rl/iter-001/rollout", 80), ("rl/iter-001/judged", 80), ("opd/rollout", 10), ("opd/scored", 10)):
        verified = glmpost_cli("shards", "verify", run / folder, "--json")
        assert verified.exit_code == 0, verified.stderr
        assert json.loads(verified.stdout)["records"] == records
    assert (run / "policy" / "LATEST").read_text().strip() == "v000002"
    assert (run / "opd-policy" / "LATEST").read_text().strip() == "v000003"
    assert json.loads((run / "policy" / "v000002" / "stage.json").read_text())["world_size"] == 1
    assert json.loads((run / "deploy" / "glmpost.json").read_text())["policy_version"] == 3
    assert {p: p.stat().st_mtime_ns for p in shell_runs["shards"]} == shell_runs["shards"]
    assert {p: p.stat().st_mtime_ns for p in shell_runs["checkpoints"]} == shell_runs["checkpoints"]
    for step in ("init-model", "qat", "train-grpo", "opd-merge", "quantize"):
        assert any(line.startswith(f"glmpost pipeline: {step}: ") and line.endswith("is already published; skipped")
                   for line in fixed.stderr.splitlines()), step
    report = json.loads((run / "diff-logprobs" / "report.json").read_text())
    assert report  # the gate was measured again on the rerun and passed


def test_bin_pipeline_refuses_a_bad_recipe_before_any_work(tmp_path):
    recipe = write_recipe(tmp_path, 'stages = ["init-model", "rl"]\nprompts = ["/nonexistent/p.jsonl"]')
    result = run_pipeline(recipe, tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr == f"glmpost: error: {recipe}: [pipeline] prompts: /nonexistent/p.jsonl does not exist\n"
    assert not (tmp_path / "run").exists()


def test_bin_pipeline_refuses_an_unknown_stage_option(tmp_path):
    recipe = write_recipe(tmp_path, 'stages = ["init-model"]', "[init-model]\nseeds = 1\n")
    result = run_pipeline(recipe, tmp_path / "run")
    assert result.returncode == 2 and "seeds" in result.stderr and "[init-model]" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_glm5_recipe_leaves_site_paths_to_the_environment(tmp_path, tiny_checkpoint, monkeypatch):
    """recipes/glm5-pipeline.toml loads without its ${GLM5_*} paths; planning a run needs them, naming the variable."""
    monkeypatch.delenv("GLM5_SFT_CHECKPOINT", raising=False)
    monkeypatch.delenv("GLM5_DATA", raising=False)
    glm5 = ROOT / "recipes" / "glm5-pipeline.toml"
    config = load_pipeline(glm5)
    assert config.unresolved == {"base-checkpoint": "${GLM5_SFT_CHECKPOINT}", "sft-data": "${GLM5_DATA}/sft.jsonl",
                                 "prompts": "${GLM5_DATA}/reasoning-rl.jsonl", "opd-prompts": "${GLM5_DATA}/reasoning-rl.jsonl"}
    with pytest.raises(UsageError) as error:
        plan(config)
    assert str(error.value) == (f"{glm5}: [pipeline] base-checkpoint: ${{GLM5_SFT_CHECKPOINT}} names the unset environment "
                                "variable GLM5_SFT_CHECKPOINT; export it or pass `--set base-checkpoint=...`")
    for name in ("sft", "reasoning-rl", "general"):
        (tmp_path / f"{name}.jsonl").write_text("")
    monkeypatch.setenv("GLM5_DATA", str(tmp_path))
    monkeypatch.setenv("GLM5_SFT_CHECKPOINT", str(tmp_path / "missing"))
    with pytest.raises(UsageError, match=r"\[pipeline\] base-checkpoint: .*missing does not exist"):
        load_pipeline(glm5)
    monkeypatch.setenv("GLM5_SFT_CHECKPOINT", str(tiny_checkpoint))
    config = load_pipeline(glm5, {"run-dir": str(tmp_path / "run")})
    steps = plan(config)
    assert config.world_size == 128 and config.launcher == "npu" and config.sft_data == [tmp_path / "sft.jsonl"]
    # base v0 -> QAT v1 -> 100 GRPO updates v2..v101 -> cross-stage OPD v102
    assert steps.rl_trained[100] == str(tmp_path / "run" / "policy" / "v000101")
    assert steps.rl_sample_with[100] == str(tmp_path / "run" / "rollout-weights" / "v000100")
    assert steps.final == str(tmp_path / "run" / "opd-policy" / "v000102")
    assert steps.opd_routes["math"] == steps.rl_trained[100] and steps.opd_default_teacher == steps.sft


# --- the pipeline as a list of steps --------------------------------------------------------------

def test_the_plan_is_a_list_of_steps_each_reading_what_an_earlier_one_wrote(tmp_path):
    config = load_pipeline(RECIPE, {"run-dir": str(tmp_path)})
    steps = pipeline_steps(config, plan(config))
    assert [s.name for s in steps] == ["init-model", "qat", "sync-start", "rollout-1", "judge-1", "train-1", "sync-1",
                                       "rollout-2", "judge-2", "train-2", "sync-2", "opd-rollout", "score-teacher",
                                       "opd-merge", "quantize", "diff-logprobs"]
    by_name = {s.name: s for s in steps}
    assert by_name["train-2"].argv == ["train-grpo", str(tmp_path / "rl" / "iter-002" / "judged"), "--config", str(RECIPE),
                                       "--checkpoint", str(tmp_path / "policy" / "v000002"), "--out", str(tmp_path / "policy")]
    assert {s.name for s in steps if s.ranks} == {"qat", "train-1", "train-2", "opd-merge"}
    assert {s.name: s.tasks for s in steps if s.tasks} == {"rollout-1": 2, "rollout-2": 2, "opd-rollout": 2}
    assert by_name["train-1"].published == str(tmp_path / "policy" / "v000002")
    assert by_name["train-1"].resume_root == str(tmp_path / "policy")
    assert by_name["rollout-1"].argv[-2:] == ["--seed", "1"] and by_name["opd-rollout"].argv[-2:] == ["--seed", "1000"]
    # every input is a data file of the recipe or lies in what an earlier step wrote
    written: list[Path] = []
    for step in steps:
        for path in map(Path, step.inputs):
            assert path.is_file() or any(path == out or out in path.parents for out in written), (step.name, path)
        written += map(Path, step.outputs)
    assert steps[0].argv[0] == "init-model" and all(s.argv[0] == s.stage for s in steps)


def test_every_pipeline_stage_has_a_step_function_in_stage_order():
    assert tuple(PIPELINE_STAGES) == STAGE_ORDER == ("init-model", "qat", "rl", "opd", "quantize", "diff-logprobs")


def test_the_scripts_spell_no_stage_order():
    # The order is STAGE_ORDER's alone (glmpost/pipeline/recipe.py): the scripts run the steps the plan
    # lists (python -m glmpost.pipeline RECIPE --shell), so no line of their code names two stages.
    spelled = []
    for script in [PIPELINE, *sorted((ROOT / "bin" / "slurm").iterdir())]:
        for number, line in enumerate(script.read_text().splitlines(), 1):
            code = "" if line.lstrip().startswith("#") else line
            named = [s for s in STAGE_ORDER if re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", code)]
            if len(named) > 1:
                spelled.append(f"{script.relative_to(ROOT)}:{number}: {', '.join(named)}")
    assert spelled == []


def test_steps_evaluate_in_bash_with_their_argv(tmp_path):
    script = (f'eval "$({sys.executable} -m glmpost.pipeline {RECIPE} --shell --run-dir {tmp_path} --set iterations=1)"; '
              'echo "$PIPELINE_STEP_COUNT|${PIPELINE_STEP_NAME[5]}|${PIPELINE_STEP_LABEL[5]}|${PIPELINE_STEP_RANKS[5]}|'
              '${PIPELINE_STEP_TASKS[3]}|${#PIPELINE_STEP_ARGV_5[@]}|${PIPELINE_STEP_ARGV_5[0]}"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip().split("|")
    assert out == ["12", "train-1", "train-grpo: RL iteration 1 (2 rank(s))", "1", "2", "8", "train-grpo"]
