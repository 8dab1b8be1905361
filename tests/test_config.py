"""Settings defined once (glmpost.config) and library errors that name config fields, said by a
command with its own flags (commands.options)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer
from typer.testing import CliRunner

from glmpost.commands.options import config_from, option, settings_of, spelled_with_flags, with_config
from glmpost.config import (SHARED_SETTINGS, ConfigError, SettingError, flat_values, from_values, leaves, section, setting,
                            setting_of, shared)
from glmpost.errors import GlmpostError, UsageError


@dataclasses.dataclass
class Toy:
    engine_name: str = setting("local", "local or remote.", flag="--engine")
    server: str | None = setting(None, "Server URL.")
    hosts: list = setting([], "Hosts.")
    device: str = shared("device")


def toy_run(config: Toy) -> str:
    if config.engine_name == "remote" and not config.server:
        raise ConfigError("{engine_name} remote needs {server} URL")
    if config.engine_name not in ("local", "remote"):
        raise ConfigError("{engine_name} {value!r}: expected local or remote", value=config.engine_name)
    if config.server == "down":
        raise ConfigError("{server} {url}: unreachable", url=config.server, exit_code=1)
    if config.server == "zero":
        raise SettingError("server", config.server, "is out of range")
    return "ok"


def toy_command(ctx: typer.Context, engine_name: str = option(Toy, "engine_name"), server: str = option(Toy, "server"),
                device: str = option(Toy, "device")) -> None:
    typer.echo(toy_run(config_from(ctx, Toy)))


def run_toy(*args: str):
    app = typer.Typer()
    app.command()(spelled_with_flags(toy_command))
    return CliRunner().invoke(app, list(args))


def test_a_setting_holds_default_help_and_flag_and_copies_a_list_default():
    default, meta = setting_of(Toy, "engine_name")
    assert (default, meta["help"], meta["flag"]) == ("local", "local or remote.", "--engine")
    first, second = Toy(), Toy()
    first.hosts.append("a")
    assert second.hosts == []
    default, meta = setting_of(Toy, "device")
    assert default == "auto" and meta["help"] == SHARED_SETTINGS["device"]["help"]


def test_a_config_error_names_fields_and_reads_as_recipe_keys_without_a_command():
    error = ConfigError("{engine_name} remote needs {server} URL")
    assert str(error) == "--engine-name remote needs --server URL" and error.exit_code == 2
    assert error.fields == ["engine_name", "server"]
    assert error.spelled(lambda name: name.upper()) == "ENGINE_NAME remote needs SERVER URL"
    braces = ConfigError("{out} {path}: bad", path="/tmp/{x}")  # values are never read as fields
    assert str(braces) == "--out /tmp/{x}: bad" and braces.fields == ["out"]
    assert isinstance(ConfigError("x", exit_code=1), UsageError) and ConfigError("x", exit_code=1).exit_code == 1


@pytest.mark.parametrize("args, exit_code, message", [
    (["--engine", "remote"], 2, "--engine remote needs --server URL"),
    (["--engine", "other"], 2, "--engine 'other': expected local or remote"),
    (["--server", "down"], 1, "--server down: unreachable"),
    (["--server", "zero"], 2, "--server 'zero' is out of range"),
])
def test_a_command_says_library_errors_with_its_flags(args, exit_code, message):
    result = run_toy(*args)
    assert isinstance(result.exception, GlmpostError), result.output
    assert str(result.exception) == message and result.exception.exit_code == exit_code
    assert isinstance(result.exception, UsageError) == (exit_code == 2)
    assert run_toy("--engine", "remote", "--server", "http://x").output.strip() == "ok"


def test_real_stages_spell_their_own_flags(glmpost_cli, tiny_checkpoint, tmp_path):
    z4 = tmp_path / "z4.json"
    z4.write_text(json.dumps({"zero_optimization": {"stage": 4}}))
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[train-grpo]\ndeepspeed = "{z4}"\n')
    checked = glmpost_cli("recipe", "check", recipe)
    assert checked.exit_code == 2
    assert f"[train-grpo] --deepspeed {z4}: zero_optimization.stage 4: ZeRO stages are 0, 1, 2 and 3" in checked.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "count: 3"}) + "\n")
    sglang = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", "--engine", "sglang")
    assert sglang.exit_code == 2 and sglang.stderr == "glmpost: error: --engine sglang needs --server URL[,URL...]\n"
    assert not (tmp_path / "r").exists()
    device = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", "--device", "tpu")
    assert device.exit_code == 2 and device.stderr.startswith("glmpost: error: --device must be one of ")


@dataclasses.dataclass
class Remote:
    server: str | None = setting(None, "Server URL.")
    retries: int = setting(3, "Retries.", min=0)


@dataclasses.dataclass
class Tree:
    group_size: int = setting(8, "Samples per prompt.", min=1)
    remote: Remote = section(Remote)
    overwrite: bool = shared("overwrite")


def tree_command(ctx: typer.Context, **settings) -> None:
    config = config_from(ctx, Tree)
    typer.echo(json.dumps({"group_size": config.group_size, "server": config.remote.server, "retries": config.remote.retries}))


def test_a_config_tree_is_flat_on_the_command_line_and_nested_in_the_code():
    app = typer.Typer()
    app.command()(spelled_with_flags(with_config(Tree)(tree_command)))
    result = CliRunner().invoke(app, ["--server", "http://h", "--retries", "5"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"group_size": 8, "server": "http://h", "retries": 5}
    refused = CliRunner().invoke(app, ["--retries", "-1"])  # the section's bound is the option's
    assert refused.exit_code == 2 and "--retries" in refused.output
    assert setting_of(Tree, "retries")[0] == 3 and settings_of(Tree) == ("group_size", "server", "retries", "overwrite")
    built = from_values(Tree, {"server": "s", "group_size": 2, "unrelated": 1})
    assert built == Tree(group_size=2, remote=Remote(server="s"))
    assert from_values(Tree, flat_values(built)) == built  # the flat form round-trips


@dataclasses.dataclass
class Worded:
    remote: Remote = section(Remote, help={"server": "The judge's server URL."})


def test_a_section_keeps_its_defaults_and_bounds_where_a_tree_words_a_setting_its_own_way():
    default, meta = setting_of(Worded, "server")
    assert (default, meta["help"]) == (None, "The judge's server URL.")
    default, meta = setting_of(Worded, "retries")  # not reworded: the section's own words
    assert (default, meta["help"], meta["min"]) == (3, "Retries.", 0)
    assert setting_of(Tree, "server")[1]["help"] == "Server URL."  # the section itself is unchanged


def test_every_consumer_of_a_spool_declares_the_same_follow_settings():
    from glmpost.rl.follow import FollowConfig
    from glmpost.spool.settings import FollowSettings

    shared_names = [f.name for f, _ in leaves(FollowSettings)]
    assert [f.name for f, _ in leaves(FollowConfig)][:len(shared_names)] == shared_names
    for name in shared_names:
        assert setting_of(FollowConfig, name)[0] == setting_of(FollowSettings, name)[0]
    assert setting_of(FollowConfig, "follow")[1]["help"].startswith("Consume shards from this spool")


def test_every_stage_config_tree_names_each_setting_once():
    # A tree's settings are one flat namespace (options, recipe keys, stage.json): a name twice would be ambiguous.
    from glmpost.rollout.settings import RolloutConfig

    names = [f.name for f, _ in leaves(RolloutConfig)]
    assert len(names) == len(set(names)) and {"server", "env", "context_budget", "group_size"} <= set(names)
    assert settings_of(RolloutConfig)[:3] == ("group_size", "temperature", "top_p")
