"""Every command's options table equals the stored one (``tests/data/cli_options.json``: the table
of the CLI before issue 29 restructured it, written by ``tests/cli_options.py``), apart from the
changes issue 29 names on purpose: IcePop beta spelled ``--icepop-beta`` everywhere, the DIS
band its own settings (``--dis-low`` / ``--dis-high``), the old spellings kept as hidden,
deprecated aliases; one wording of the spool consumer's settings."""

from __future__ import annotations

import json
from pathlib import Path

from cli_options import options_table

from glmpost.config import setting_of
from glmpost.server.http import ServeConfig
from glmpost.spool.settings import FollowSettings

STORED = Path(__file__).parent / "data" / "cli_options.json"
# (command, old name) -> new name: the old spelling stays, hidden, as a deprecated alias.
RENAMED = {("diff-logprobs", "beta"): "icepop_beta", ("diff-logprobs", "eps_low"): "dis_low",
           ("diff-logprobs", "eps_high"): "dis_high"}
# The DIS band, new in the trainers, and the trust-mask help that names it.
ADDED = {(command, name) for command in ("train-grpo", "opd-merge", "train-sao") for name in ("dis_low", "dis_high")}
# The learning-rate schedule of every training stage (issue 31): off by default (constant, no warmup).
SCHEDULE = {"lr_schedule": "constant", "lr_warmup_steps": 0, "lr_decay_steps": 0, "min_lr_ratio": 0.0}
ADDED |= {(command, name) for command in ("train-grpo", "opd-merge", "train-sao", "qat") for name in SCHEDULE}
# Mixed precision over float32 masters (issue 31): auto = bf16 on an accelerator, fp32 on a CPU.
# ... and activation checkpointing, off by default.
ADDED |= {(command, name) for command in ("train-grpo", "opd-merge", "train-sao", "qat")
          for name in ("precision", "activation_checkpointing")}
# ... and micro-batches by a token budget, off by default.
ADDED |= {(command, name) for command in ("train-grpo", "opd-merge", "train-sao", "qat")
          for name in ("micro_batch_tokens", "pack_sequences")}
# MoE routing closure (issue 33), off by default: recording in the rollout, the comparison in
# diff-logprobs, replay (R3) in the policy-gradient trainers.
ADDED |= {("rollout", "record_routing"), ("diff-logprobs", "routing"), ("diff-logprobs", "routing_replay")}
ADDED |= {(command, "routing_replay") for command in ("train-grpo", "opd-merge", "train-sao")}
ADDED_DEFAULTS = {"dis_low": 0.2, "dis_high": 0.28, **SCHEDULE, "precision": "auto", "activation_checkpointing": False,
                  "micro_batch_tokens": 0, "pack_sequences": False, "record_routing": False, "routing": False,
                  "routing_replay": False}
# Prompts from parquet, CSV, JSON arrays and datasets directories (issue 34, "Data"): the column
# mapping in rollout, eval and shards import, and the inputs' help that names the new sources.
DATA_COLUMNS = {"prompt_column": "prompt", "messages_column": "messages", "answer_column": None,
                "domain_column": "domain", "task_column": "task"}
ADDED_DATA = {(command, name): default for command in ("rollout", "shards import") for name, default in DATA_COLUMNS.items()}
DATA_HELP = {("rollout", "inputs"), ("shards import", "source"), ("qat", "inputs")}
# Commands added since: bringing your own model (issue 31); evaluating a checkpoint (issue 34: rollout's
# sampling and engine options but --group-size, the task split and refills, then n, k, threshold and the
# judge's verifier routing and math checker).
ADDED_COMMANDS = {"import-model": {"source", "out", "link", "overwrite", "as_json", "config"},
                  "eval": {"inputs", "checkpoint", "out", "as_json", "config", "n", "k", "threshold", "domains",
                           "default_verifier", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed",
                           "batch_size", "prompts_per_shard", "limit", "device", "deterministic_topk", "attention",
                           "record_routing", "engine_name", "server", "concurrency", "timeout", "retries", "api_key",
                           "admin_api_key", "server_log_prob_kind", "unversioned_server", "max_continuations",
                           "fingerprint_tolerance", "env", "env_options", "env_timeout", "env_workers", "max_turns",
                           "compaction", "context_budget", "compaction_threshold", "keep_last", "summary_prompt",
                           "resume_template", "max_summary_tokens", "zstd_level", "overwrite", *DATA_COLUMNS,
                           "chat_template_kwargs", "reasoning_parser", "tool_call_parser",
                           "follow", "every", "poll_s", "idle_timeout", "math_checker"},
                  # A run report (issue 34): RUN_DIRs, --out, the run names, the page's title and the PNGs' dpi.
                  "report": {"runs", "out", "as_json", "config", "names", "title", "dpi"}}
# The server's limits under load (issue 30).
ADDED_LIMITS = {("serve", "max_queued"): 1024, ("serve", "max_body_bytes"): 64 << 20}
# --engine vllm (issue 32): vLLM servers for rollout, score-teacher, diff-logprobs and sync-weights,
# and serve's vLLM API; the engine options' help names vllm.
ADDED_VLLM = {("rollout", "fingerprint_tolerance"): 0.05, ("sync-weights", "fingerprint_tolerance"): 0.05,
              ("sync-weights", "engine"): "sglang", ("diff-logprobs", "against_engine"): "sglang",
              ("serve", "api"): "sglang", ("serve", "logprobs_mode"): "raw_logprobs", ("serve", "max_logprobs"): 20}
# vLLM dev-mode gating and the release the stand-in mimics (issue 42).
ADDED_VLLM_SERVE = {("serve", "vllm_dev_mode"): (True, ["--vllm-dev-mode"], ["--no-vllm-dev-mode"]),
                    ("serve", "vllm_release"): ("0.32.0", ["--vllm-release"], []),
                    ("serve", "enable_return_routed_experts"): (False, ["--enable-return-routed-experts"], [])}
VLLM_HELP = {("rollout", "engine_name"), ("score-teacher", "engine")}
VLLM_HELP |= {("rollout", name) for name in ("server", "concurrency", "timeout", "retries", "api_key", "server_log_prob_kind")}
HELP_RENAMES = {(command, "trust_mask") for command in ("train-grpo", "opd-merge", "train-sao")}
# The settings of a spool's consumer are declared once (glmpost/spool/settings.py) for the shard
# stages and the trainers: the trainers' --consumer, --poll-s and --lease-s say the shared words.
CONSUMER_HELP = {(command, name) for command in ("train-grpo", "opd-merge", "train-sao") for name in ("consumer", "poll_s")}
CONSUMER_HELP |= {(command, "lease_s") for command in ("train-grpo", "opd-merge", "train-sao", "judge", "score-teacher")}
# SGLang at its current release (issue 32): the admin key, unversioned servers, continued aborts,
# aborting running requests on a switch; serve returns SGLang's log-prob kind by default.
ADDED_32 = {("rollout", "admin_api_key"): None, ("rollout", "unversioned_server"): "refuse",
            ("rollout", "max_continuations"): 3, ("serve", "admin_api_key"): None, ("sync-weights", "admin_api_key"): None,
            ("sync-weights", "abort_in_flight"): True}
# Issue 33's new record field and diff-logprobs gate, named in help texts that list them.
HELP_ADDITIONS = {("diff-logprobs", "fail_above"): ("indexer_differing_sets)", "indexer_differing_sets, routing_differing_tokens)"),
                  ("shards cat", "fields"): ("teacher, extra.", "teacher, routed_experts, extra."),
                  ("shards head", "fields"): ("teacher, extra.", "teacher, routed_experts, extra."),
                  # Issue 34: the built-in calculator speaking GLM's own tool-call format.
                  ("rollout", "env"): ("calculator, kv-lookup", "calculator, calculator-glm, kv-lookup"),
                  # Issue 46: DAPO's soft overlong penalty as a reward source.
                  ("judge", "rewards"): ("[ramp_tokens=N], truncated,", "[ramp_tokens=N], overlong cache_tokens=N [max_tokens=N] "
                                         "(DAPO's soft overlong penalty; max_tokens default: the rollout's max_new_tokens), truncated,")}
# Experiment trackers on every stage that writes metrics (issue 34).
TRACKED = ("init-model", "import-model", "init-critic", "qat", "rollout", "judge", "eval", "train-grpo", "train-sao",
           "sync-weights", "serve", "score-teacher", "opd-merge", "quantize", "diff-logprobs", "shards import", "report")
TRACKER_DEFAULTS = {"tracker": [], "tracker_dir": "glmpost-trackers", "tracker_project": "glmpost", "tracker_run": None}
ADDED_TRACKERS = {(command, name) for command in TRACKED for name in TRACKER_DEFAULTS}
# The math verifier's checker (issue 34, "math-verify"): Math-Verify by default, glmpost's normaliser on request.
ADDED_MATH = {("judge", "math_checker"): "math-verify"}
# Real GLM chat formats (issue 43): the chat template's own arguments wherever prompts are rendered,
# the reasoning split and the tool-call parser of multi-turn rollouts.
ADDED_43 = {(command, "chat_template_kwargs"): "{}" for command in ("rollout", "eval", "qat", "shards import")}
ADDED_43 |= {(command, name): default for command in ("rollout", "eval")
             for name, default in (("reasoning_parser", "auto"), ("tool_call_parser", "strict"))}
# DAPO's dynamic sampling in the judge (issue 46): groups whose rewards are all equal left out.
ADDED_46_JUDGE = {("judge", "dynamic_sampling"): False}
# The policy-optimisation variants (issue 46): the train-inference importance correction in every
# policy-gradient trainer, Dr. GRPO's constant where the loss normalisation is an option; the policy
# loss (ppo, gspo, cispo), CISPO's clip and the advantage scaling in train-grpo; the normalisation's
# help names the new ones.
ADDED_46 = {(command, name): default for command in ("train-grpo", "opd-merge", "train-sao")
            for name, default in (("importance_correction", "none"), ("importance_cap", 2.0))}
ADDED_46 |= {(command, "dr_grpo_max_tokens"): 0 for command in ("train-grpo", "train-sao")}
ADDED_46 |= {("train-grpo", "policy_loss"): "ppo", ("train-grpo", "cispo_eps_low"): 1.0,
             ("train-grpo", "cispo_eps_high"): 4.0, ("train-grpo", "advantage_scaling"): "group"}
HELP_ADDITIONS |= {(command, "loss_normalization"): (
    "up-weighted) or segment (each context window's mean, then the mean over windows: the per-segment mean it replaces).",
    "up-weighted); segment (each context window's mean, then the mean over windows: the per-segment mean it replaces, "
    "TRL's grpo); dapo (DAPO's token-level loss over the global batch: the same as token); bnpo (TRL's bnpo; glmpost's "
    "batch is always the whole mini-batch, so the same as token); dr_grpo (Dr. GRPO: the sum over tokens divided by "
    "sequences x --dr-grpo-max-tokens).") for command in ("train-grpo", "train-sao")}
# LoRA adapters loaded at run time by glmpost serve (issue 45), off by default as in SGLang and vLLM.
ADDED_45 = {("serve", "enable_lora"): False}
# LoRA training (issue 45): the policy as a PEFT adapter in the policy-gradient trainers; 0 = full fine-tuning.
ADDED_LORA = {(command, name): default for command in ("train-grpo", "opd-merge", "train-sao")
              for name, default in (("lora_rank", 0), ("lora_alpha", 16.0), ("lora_targets", []), ("lora_dropout", 0.0))}
# The rollout waiting for the servers' weights (issue 47's soak: records sampled too far behind were dropped).
ADDED_47 = {("rollout", "max_server_lag"): None}
# Bounds issue 30 added (every option bounded, checked before any work).
BOUNDS = {("rollout", "top_p"): {"max": 1.0}, ("sync-weights", "retries"): {"min": 0}, ("sync-weights", "backoff"): {"min": 0.0}}


def _expected(stored: dict) -> dict:
    """The stored table with the changes above applied (what the CLI must now show)."""
    table = json.loads(json.dumps(stored))
    for (command, old), new in RENAMED.items():
        row = table[command][old]
        table[command][new] = {**row, "opts": ["--" + new.replace("_", "-")]}
        table[command][old] = {**row, "default": None, "hidden": True, "min": None, "max": None,
                               "help": f"Deprecated: use --{new.replace('_', '-')}."}
    for command, name in HELP_RENAMES:
        row = table[command][name]
        row["help"] = row["help"].replace("eps-low", "dis-low").replace("eps-high", "dis-high")
    for command, name in CONSUMER_HELP:
        table[command][name]["help"] = setting_of(FollowSettings, name)[1]["help"]
    for (command, name), (old, new) in HELP_ADDITIONS.items():
        table[command][name]["help"] = table[command][name]["help"].replace(old, new)
    for (command, name), bounds in BOUNDS.items():
        table[command][name].update(bounds)
    table["serve"]["log_prob_kind"].update(default="tempered", help=setting_of(ServeConfig, "log_prob_kind")[1]["help"])
    return table


def test_every_command_keeps_its_options_flags_defaults_and_help():
    expected, now = _expected(json.loads(STORED.read_text())), json.loads(json.dumps(options_table()))
    for command, names in ADDED_COMMANDS.items():
        assert set(now.pop(command)) == names | (set(TRACKER_DEFAULTS) if command in TRACKED else set())
    assert sorted(now) == sorted(expected), "commands added or removed"
    changed = {}
    for command in expected:
        for name in set(expected[command]) | set(now[command]):
            before, after = expected[command].get(name), now[command].get(name)
            if (command, name) in ADDED or (command, name) in ADDED_LIMITS or (command, name) in ADDED_32 or (
                    command, name) in ADDED_VLLM or (command, name) in ADDED_DATA or (command, name) in ADDED_TRACKERS or (
                    command, name) in ADDED_MATH or (command, name) in ADDED_VLLM_SERVE or (command, name) == ("serve", "max_model_len") or (
                    command, name) in ADDED_43 or (command, name) in ADDED_46_JUDGE or (
                    command, name) in ADDED_46 or (command, name) in ADDED_45 or (command, name) in ADDED_LORA or (
                    command, name) in ADDED_47:
                continue
            if (command, name) in DATA_HELP:
                assert "parquet" in after["help"] and "datasets directory" in after["help"].replace("directories", "directory")
                before, after = ({k: v for k, v in row.items() if k != "help"} for row in (before, after))
            if (command, name) in VLLM_HELP:
                assert "vllm" in after["help"]
                before, after = ({k: v for k, v in row.items() if k != "help"} for row in (before, after))
            if (command, name) in {(c, new) for (c, _), new in RENAMED.items()}:
                before = {k: v for k, v in before.items() if k != "help"}
                after = {k: v for k, v in after.items() if k != "help"}  # the help says the old spelling
            if before != after:
                changed[f"{command} {name}"] = (before, after)
    assert changed == {}
    for (command, name), default in ADDED_32.items():
        assert now[command][name]["default"] == default and now[command][name]["help"]
    for (command, name), default in ADDED_VLLM.items():
        assert now[command][name]["default"] == default and now[command][name]["opts"] == ["--" + name.replace("_", "-")]
    assert now["serve"]["max_model_len"]["default"] is None and "max_position_embeddings" in now["serve"]["max_model_len"]["help"]
    for (command, name), (default, opts, secondary) in ADDED_VLLM_SERVE.items():
        row = now[command][name]
        assert (row["default"], row["opts"], row["secondary_opts"]) == (default, opts, secondary) and "--api vllm" in row["help"]
    for (command, name), default in ADDED_DATA.items():
        assert now[command][name]["default"] == default and now[command][name]["opts"] == ["--" + name.replace("_", "-")]
    for (command, name), default in ADDED_43.items():
        if command in ADDED_COMMANDS:  # eval's options are checked as a set above
            continue
        row = now[command][name]
        assert row["default"] == default and row["opts"] == ["--" + name.replace("_", "-")] and row["help"]
    for (command, name), default in ADDED_46_JUDGE.items():
        row = now[command][name]
        assert row["default"] == default and row["opts"] == ["--dynamic-sampling"] and "DAPO" in row["help"]
    for (command, name), default in ADDED_46.items():
        row = now[command][name]
        assert row["default"] == default and row["opts"] == ["--" + name.replace("_", "-")] and len(row["help"]) > 60
    for (command, name), default in ADDED_45.items():
        row = now[command][name]
        assert row["default"] == default and row["opts"] == ["--" + name.replace("_", "-")] and "unmerged" in row["help"]
    for (command, name), default in ADDED_LORA.items():
        row = now[command][name]
        assert row["default"] == default and row["opts"] == ["--" + name.replace("_", "-")] and "LoRA" in row["help"]
    for (command, name), default in ADDED_47.items():
        row = now[command][name]
        assert (row["default"], row["opts"], row["min"]) == (default, ["--max-server-lag"], 0) and "sync-weights" in row["help"]
    for (command, name), default in ADDED_MATH.items():
        row = now[command][name]
        assert row["default"] == default and row["opts"] == ["--math-checker"] and "normalise" in row["help"]
    for (command, name), default in ADDED_LIMITS.items():
        assert now[command][name]["default"] == default and now[command][name]["min"] == 1
    for command, name in ADDED_TRACKERS - {(c, n) for c in ADDED_COMMANDS for n in TRACKER_DEFAULTS}:
        assert now[command][name]["default"] == TRACKER_DEFAULTS[name] and now[command][name]["help"]
    for command, name in ADDED:
        assert now[command][name]["opts"] == ["--" + name.replace("_", "-")]
        assert now[command][name]["default"] == ADDED_DEFAULTS[name]
