"""`glmpost recipe check`: shipped recipes pass; each kind of mistake is one line naming file, section, key."""

from __future__ import annotations

import enum
import json
from pathlib import Path

import pytest
import typer

from glmpost.commands.recipe_checks import check_recipe
from glmpost.rl.batch_rules import batch_arithmetic

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_passes(glmpost_cli, recipe, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their data relative to the repository, as bin/ runs them
    result = glmpost_cli("recipe", "check", recipe.relative_to(ROOT), "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["ok"] and summary["errors"] == []
    assert summary["stages"], "a shipped recipe configures at least one stage"


def test_summary_names_stages_and_option_counts(glmpost_cli, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = glmpost_cli("recipe", "check", "recipes/tiny-reasoning-rl.toml")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == (
        "recipes/tiny-reasoning-rl.toml: ok: 4 stage(s): rollout (6 options), judge (0 options), train-grpo (7 options), "
        "eval (4 options)"
    )


BAD = [
    ("[rollout]\nfrobnicate = 1\n", "[rollout]: unknown key 'frobnicate' (known: "),
    ("[rollout]\ngroup-size = \"many\"\n", "[rollout] group-size: Invalid value for '--group-size'"),
    ("[rollout]\nmax-new-tokens = 0\n", "[rollout] max-new-tokens: Invalid value for '--max-new-tokens'"),
    ("[rollout]\ninputs = [\"no/such/prompts.jsonl\"]\n", "[rollout] inputs: input file no/such/prompts.jsonl does not exist"),
    ("[train-grpo]\ndeepspeed = \"ds.json\"\n", "[train-grpo] deepspeed: input file ds.json does not exist"),
    ("[qat]\ninclude = \"lm_head\"\n", "[qat] include: expects a list (a TOML array such as ['lm_head'])"),
    ("[rolout]\nx = 1\n", "unknown section [rolout] (known: "),
    ("[shards.imprt]\nx = 1\n", "unknown section [shards.imprt]"),
    ("[shards.inspect]\nx = 1\n", "unknown section [shards.inspect]"),  # a command without a recipe section
    ("[train-grpo]\neps-low = 1.5\n", "[train-grpo] eps-low = 1.5 is out of range"),
    ("[train-grpo]\nicepop-beta = 0.5\n", "[train-grpo] icepop-beta = 0.5 is out of range"),
    ("[train-grpo]\nzero-stage = 4\n", "[train-grpo] zero-stage: Invalid value for '--zero-stage'"),
    ("[train-grpo]\nzero-stage = 3\n", None),
    ("[rollout]\nprompts-per-shard = 10\ngroup-size = 8\n[train-grpo]\nmini-batches = 3\n",
     "[train-grpo] mini-batches 3 does not divide the prompts-per-shard 10 x group-size 8 = 80 trajectories per update"),
    ("[rollout]\nprompts-per-shard = 2\ngroup-size = 2\n[train-grpo]\nmini-batches = 8\n",
     "[train-grpo] mini-batches 8 exceeds the prompts-per-shard 2 x group-size 2 = 4 trajectories per update"),
    ("[rollout]\ngroup-size = 1\n[train-grpo]\n", "[rollout] group-size 1 with [train-grpo]: GRPO needs at least 2"),
    ("[opd-merge]\nloss = \"forward-kl\"\n", "[opd-merge] loss = 'forward-kl' is not one of sampled, topk"),
    ("[qat]\nbatch-size = 30\n", None),  # fine on one rank (see test_ranks_enter_the_arithmetic)
    ("rollout = 3\n", "[rollout] must be a table"),
]


@pytest.mark.parametrize("text,expected", BAD, ids=[b[1] or "ok" for b in BAD])
def test_each_error_kind_is_one_line_with_file_section_and_key(glmpost_cli, tmp_path, monkeypatch, text, expected):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "bad.toml"
    recipe.write_text(text)
    result = glmpost_cli("recipe", "check", recipe)
    if expected is None:
        assert result.exit_code == 0, result.stderr
        return
    assert result.exit_code == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"glmpost: error: {recipe}: "), lines[0]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_all_errors_are_reported_each_on_its_own_line(glmpost_cli, tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[rollout]\nfoo = 1\nbar = 2\n[nosuch]\n")
    result = glmpost_cli("recipe", "check", recipe)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert [line.split(": ", 3)[-1][:30] for line in lines] == [
        "[rollout]: unknown key 'foo' (", "[rollout]: unknown key 'bar' (", "unknown section [nosuch] (know"]


def test_relative_input_paths_resolve_against_the_current_directory(glmpost_cli, tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text('{"prompt": "count: 3", "domain": "count"}\n')
    recipe = tmp_path / "r.toml"
    recipe.write_text('[rollout]\ninputs = ["data/prompts.jsonl"]\n')
    monkeypatch.chdir(tmp_path)
    assert glmpost_cli("recipe", "check", recipe).exit_code == 0
    monkeypatch.chdir(tmp_path / "data")  # the stage run from here would not find it either
    result = glmpost_cli("recipe", "check", recipe)
    assert result.exit_code == 2 and "input file data/prompts.jsonl does not exist" in result.stderr


def test_ranks_enter_the_arithmetic(glmpost_cli, monkeypatch):
    monkeypatch.chdir(ROOT)
    # tiny recipe: 10 prompts x 32 = 320 per update, 4 mini-batches -> 80 per step; 80 % 3 != 0
    result = glmpost_cli("recipe", "check", "recipes/tiny-reasoning-rl.toml", "--ranks", "3")
    assert result.exit_code == 2
    assert "[train-grpo] 80 trajectories per optimizer step" in result.stderr
    assert "do not split evenly over 3 ranks" in result.stderr
    result = glmpost_cli("recipe", "check", "recipes/tiny-reasoning-rl.toml", "--ranks", "2")
    assert result.exit_code == 0, result.stderr
    # 40 per rank, micro-batch 80: a warning, not an error
    assert "micro-batch-size 80 exceeds a rank's 40 trajectories per step" in result.stderr


def test_batch_arithmetic_rules_hand_computed():
    rollout = {"group_size": 32, "prompts_per_shard": 32, "temperature": 1.0}
    ok = {"mini_batches": 4, "micro_batch_size": 8, "temperature": 1.0}
    assert batch_arithmetic({"rollout": rollout, "train-grpo": ok}, ranks=4) == ([], [])  # 1024/4/4 = 64 = 8 x 8
    errors, warnings = batch_arithmetic({"rollout": rollout, "train-grpo": {**ok, "micro_batch_size": 48}}, ranks=4)
    assert errors == [] and warnings == [("train-grpo", "micro-batch-size 48 does not divide a rank's 64 trajectories per step; the last micro-batch holds 16")]
    errors, _ = batch_arithmetic({"rollout": rollout, "train-grpo": ok}, ranks=3)
    assert errors == [("train-grpo", ("256 trajectories per optimizer step (prompts-per-shard 32 x group-size 32 = 1024 "
                                      "trajectories per update / mini-batches 4) do not split evenly over 3 ranks"))]
    _, warnings = batch_arithmetic({"rollout": rollout, "train-grpo": {**ok, "temperature": 0.7}}, ranks=1)
    assert any("temperature 0.7 differs from [rollout] temperature 1.0" in m for _, m in warnings)
    errors, _ = batch_arithmetic({"qat": {"batch_size": 32, "micro_batch_size": 8}}, ranks=3)
    assert errors == [("qat", "batch-size 32 does not split evenly over 3 ranks")]


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


def test_a_choice_not_allowed_is_refused(tmp_path):
    """Choices are checked by the option's own type: a stage with an enum option, walked like the real tree."""
    from glmpost.commands.common import config_option

    demo = typer.Typer()

    @demo.command("paint")
    def paint(color: Color = typer.Option(Color.red, "--color", help="Color."),
              config: Path = config_option()) -> None:
        """Paint."""

    @demo.command("other")
    def other(n: int = typer.Option(1, "--n", help="N."), config: Path = config_option()) -> None:
        """Other."""

    recipe = tmp_path / "r.toml"
    recipe.write_text('[paint]\ncolor = "green"\n')
    report = check_recipe(recipe, root=typer.main.get_command(demo))
    assert len(report.errors) == 1
    assert report.errors[0].startswith(f"{recipe}: [paint] color: Invalid value for '--color'")
    assert "green" in report.errors[0]
    recipe.write_text('[paint]\ncolor = "blue"\n')
    assert check_recipe(recipe, root=typer.main.get_command(demo)).errors == []


def test_pipeline_section(tmp_path, glmpost_cli):
    """[pipeline] is checked by glmpost.pipeline.load_pipeline; without that module it is a warning."""
    recipe = tmp_path / "r.toml"
    recipe.write_text("[pipeline]\n")
    try:
        import glmpost.pipeline  # noqa: F401
    except ImportError:
        result = glmpost_cli("recipe", "check", recipe)
        assert result.exit_code == 0
        assert "[pipeline]: not checked (glmpost.pipeline is not available" in result.stderr
        return
    recipe.write_text("[pipeline]\nbogus-key-xyz = 1\n")
    result = glmpost_cli("recipe", "check", recipe)
    assert result.exit_code == 2
    assert f"{recipe}: [pipeline]: unknown key 'bogus-key-xyz'" in result.stderr


def test_missing_and_invalid_recipe_files(glmpost_cli, tmp_path):
    result = glmpost_cli("recipe", "check", tmp_path / "nope.toml")
    assert result.exit_code == 2 and "nope.toml does not exist" in result.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    result = glmpost_cli("recipe", "check", bad)
    assert result.exit_code == 2 and "is not valid TOML" in result.stderr
