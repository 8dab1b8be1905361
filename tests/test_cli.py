"""The ``glmpost`` command tree: version, complete --help everywhere, errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys

import typer

from glmpost import __version__


def _walk(command, path: tuple[str, ...] = ()):
    yield path, command
    if hasattr(command, "commands"):  # a group (typer may bundle its own click)
        for name, sub in command.commands.items():
            yield from _walk(sub, path + (name,))


def test_version(glmpost_cli):
    result = glmpost_cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"glmpost {__version__}"


def test_every_command_and_option_has_help(glmpost_cli):
    from glmpost.commands.app import app

    root = typer.main.get_command(app)
    seen = []
    for path, command in _walk(root):
        seen.append(" ".join(path))
        assert (command.help or "").strip(), f"glmpost {' '.join(path)} has no help text"
        for param in command.params:
            if param.param_type_name == "option":
                assert (param.help or "").strip(), f"glmpost {' '.join(path)} {param.opts[0]} has no help"
        result = glmpost_cli(*path, "--help")
        assert result.exit_code == 0 and "Usage: glmpost" in result.stdout, path
    assert {"init-model", "shards", "shards inspect", "shards verify"} <= set(seen)


def test_usage_error_exit_code_and_no_traceback(tmp_path):
    glmpost = [sys.executable, "-m", "glmpost.commands.app"]
    result = subprocess.run(glmpost + ["init-model"], capture_output=True, text=True)
    assert result.returncode == 2 and "Missing option '--out'" in result.stderr
    result = subprocess.run(glmpost + ["shards", "verify", str(tmp_path / "nothing-here")], capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert str(tmp_path / "nothing-here") in result.stderr


def test_invocation_errors_are_one_line_with_exit_code_2(glmpost_cli, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[init-model]\nseeed = 1\n")
    cases = {
        ("init-model",): "glmpost: error: Missing option '--out'. (see 'glmpost init-model --help')",
        ("init-model", "--out", tmp_path / "x", "--seed", "abc"): "Invalid value for '--seed'",
        ("init-model", "--config", recipe, "--out", tmp_path / "x"): f"recipe {recipe}: unknown key 'seeed' in [init-model]",
        ("no-such-stage",): "No such command 'no-such-stage'",
    }
    for args, expected in cases.items():
        result = glmpost_cli(*args)
        assert result.exit_code == 2, args
        assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr, result.stderr
        assert result.stdout == ""
