"""Build a tiny GLM-5-architecture checkpoint and its locally trained tokenizer (no download).

The output directory is a normal Hugging Face checkpoint (AutoModelForCausalLM and AutoTokenizer
load it) plus glmpost.json (policy version 0). The same --seed gives byte-identical files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from glmpost.checkpoints import CheckpointManifest, tokenizer_revision, write_manifest
from glmpost.commands.common import (
    config_option,
    effective_options,
    print_summary,
    staged_output_dir,
)
from glmpost.errors import UsageError
from glmpost.models.tiny import PRESETS, build_model
from glmpost.models.tokenizer import stop_token_ids, train_tokenizer
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
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Optional[Path] = config_option(),
) -> None:
    import torch
    from transformers import GlmMoeDsaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if preset not in PRESETS:
        raise UsageError(f"--preset {preset!r}: unknown preset (known: {', '.join(PRESETS)})")
    if dtype not in ("float32", "bfloat16"):
        raise UsageError(f"--dtype {dtype!r}: expected float32 or bfloat16")
    settings = {**PRESETS[preset], **parse_overrides(overrides)}
    if index_topk is not None:
        settings["index_topk"] = index_topk
    unknown = sorted(set(settings) - set(GlmMoeDsaConfig.__dataclass_fields__) - {"rope_parameters"})
    if unknown:
        raise UsageError(f"--set: unknown GlmMoeDsaConfig field(s): {', '.join(unknown)}")

    options = effective_options(ctx)
    started = time.perf_counter()
    with staged_output_dir(out, overwrite=overwrite, complete_marker="glmpost.json", stage=STAGE,
                           options=options, ctx=ctx) as staging:
        if staging is None:
            log(f"{out} already holds a checkpoint; nothing to do (--overwrite replaces it)")
            summary = {"out": str(out), "skipped": True}
            print_summary(summary, as_json=as_json, human=f"{out}: already complete (skipped)")
            return
        log(f"training a {settings['vocab_size']}-id byte-level BPE tokenizer on the shipped task text")
        tokenizer = train_tokenizer(settings["vocab_size"])
        stops = stop_token_ids(tokenizer)
        settings.update(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
        try:
            model_config = GlmMoeDsaConfig(**settings)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"model config: {exc}") from None
        model = build_model(model_config, seed=seed)
        if dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        model.generation_config.eos_token_id = stops
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        revision = tokenizer_revision(staging)
        manifest = CheckpointManifest(
            policy_version=0,
            tokenizer_revision=revision,
            stage=STAGE,
            step=0,
            parent=None,
            extra={"preset": preset, "seed": seed},
        )
        write_manifest(staging, manifest)
        parameters = sum(p.numel() for p in model.parameters())
        with MetricsWriter(staging / "metrics.jsonl") as metrics:
            metrics.write(**{"init/parameters": parameters, "init/vocab_size": model_config.vocab_size,
                             "init/tokenizer_size": len(tokenizer), "init/seconds": round(time.perf_counter() - started, 3)})
        write_stage_json(staging, STAGE, options)

    summary = {
        "out": str(out),
        "preset": preset,
        "parameters": parameters,
        "vocab_size": model_config.vocab_size,
        "index_topk": model_config.index_topk,
        "policy_version": 0,
        "tokenizer_revision": revision,
    }
    human = (
        f"{out}: {preset} GlmMoeDsaForCausalLM, {parameters:,} parameters, vocab {model_config.vocab_size}, "
        f"DSA index_topk {model_config.index_topk}, policy version 0, tokenizer {revision}"
    )
    print_summary(summary, as_json=as_json, human=human)
