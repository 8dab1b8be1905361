"""Build a tiny GLM-5-architecture checkpoint and its locally trained tokenizer (no download).

The output directory is a normal Hugging Face checkpoint (AutoModelForCausalLM and AutoTokenizer
load it) plus glmpost.json (policy version 0). The same --seed gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.commands.options import json_option
from glmpost.errors import UsageError
from glmpost.models.tiny import PRESETS, model_settings, write_tiny_checkpoint
from glmpost.stage import MetricsWriter, log, write_stage_json

STAGE = "init-model"


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` pairs; values are JSON (numbers, lists, true/false), else strings."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set hidden_size=128")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    return overrides


def init_model(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory to write the checkpoint into (created; never silently replaced)."),
    preset: str = typer.Option("tiny-glm5", "--preset", help=f"Model preset: {', '.join(PRESETS)}."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weight initialisation; the same seed gives identical files."),
    index_topk: Optional[int] = typer.Option(
        None, "--index-topk", help="DSA indexer top-k (keys each query may attend to); default from the preset (8)."
    ),
    overrides: List[str] = typer.Option(
        [], "--set", help="Override any GlmMoeDsaConfig field, KEY=VALUE with a JSON value (repeatable)."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="Dtype the weights are saved in: float32 or bfloat16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
) -> None:
    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    settings = model_settings(preset, parse_overrides(overrides), index_topk=index_topk)
    options = effective_options(ctx)
    with staged_output_dir(out, overwrite=overwrite, complete_marker="glmpost.json", stage=STAGE,
                           options=options, ctx=ctx) as staging:
        if staging is None:
            log(f"{out} already holds a checkpoint; nothing to do (--overwrite replaces it)")
            print_summary({"out": str(out), "skipped": True}, as_json=as_json, human=f"{out}: already complete (skipped)")
            return
        facts = write_tiny_checkpoint(staging, settings, preset=preset, seed=seed, dtype=dtype)
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            metrics.write(**{"init/parameters": facts["parameters"], "init/vocab_size": facts["vocab_size"],
                             "init/tokenizer_size": facts["tokenizer_size"], "init/seconds": facts["seconds"]})
        write_stage_json(staging, STAGE, options)
    summary = {"out": str(out), "preset": preset, "parameters": facts["parameters"], "vocab_size": facts["vocab_size"],
               "index_topk": facts["index_topk"], "policy_version": 0, "tokenizer_revision": facts["tokenizer_revision"]}
    human = (
        f"{out}: {preset} GlmMoeDsaForCausalLM, {facts['parameters']:,} parameters, vocab {facts['vocab_size']}, "
        f"DSA index_topk {facts['index_topk']}, policy version 0, tokenizer {facts['tokenizer_revision']}"
    )
    print_summary(summary, as_json=as_json, human=human)
