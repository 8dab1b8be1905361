"""CONTRIBUTING.md "Add a setting to a stage", run: one field (``chat_template_kwargs``) gives the
flag and its ``--help`` line, the recipe key (a flag on the command line wins), the stage.json entry,
and a refusal said with the flag."""

from __future__ import annotations

import json

from glmpost.config import SHARED_SETTINGS


def test_one_field_gives_the_help_line_the_recipe_key_and_the_stage_json_entry(glmpost_cli, tiny_checkpoint, tmp_path):
    shown = glmpost_cli("rollout", "--help")
    assert shown.exit_code == 0 and "--chat-template-kwargs" in shown.stdout
    assert "Extra arguments of the checkpoint's chat template" in " ".join(shown.stdout.split())
    assert SHARED_SETTINGS["chat_template_kwargs"]["default"] == "{}"

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "count 1"}) + "\n")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[rollout]\nchat-template-kwargs = '{\"flavour\": 1}'\ngroup-size = 2\nmax-new-tokens = 2\n")
    common = ("rollout", prompts, "--checkpoint", tiny_checkpoint, "--config", recipe)
    assert glmpost_cli(*common, "--out", tmp_path / "recipe").exit_code == 0
    recorded = json.loads((tmp_path / "recipe" / "stage.json").read_text())["options"]
    assert recorded["chat_template_kwargs"] == '{"flavour": 1}' and recorded["group_size"] == 2
    assert glmpost_cli(*common, "--out", tmp_path / "flag", "--chat-template-kwargs", '{"flavour": 2}').exit_code == 0
    assert json.loads((tmp_path / "flag" / "stage.json").read_text())["options"]["chat_template_kwargs"] == '{"flavour": 2}'

    rerun = glmpost_cli(*common, "--out", tmp_path / "flag")  # the recipe's value differs from what the output holds
    assert rerun.exit_code == 2 and "chat_template_kwargs" in rerun.stderr.replace("-", "_")
    refused = glmpost_cli(*common, "--out", tmp_path / "bad", "--chat-template-kwargs", "not json")
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1 and "--chat-template-kwargs" in refused.stderr
