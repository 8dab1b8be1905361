"""LoRA vs full fine-tuning at a size where it matters: one train-grpo update of each, in one run.

The 252.7M-parameter random-init Qwen3 layout ``bench_scale.py`` builds (``--hidden`` 1,024,
``--layers`` 16, the quickstart's 512-id tokenizer), 16 trajectories (rollout + judge with
``recipes/tiny-reasoning-rl.toml``), then one ``train-grpo`` update (``--epochs 1 --mini-batches 1``)
twice, each in its own process: full fine-tuning, and ``--lora-rank 16 --lora-alpha 32`` on every
linear layer of attention and MLP (the default targets: q k v o gate up down). Reported, LoRA over full:

* peak RSS (``VmHWM`` of the process, loading and publishing included; goal <= 0.5): full training
  holds float32 weights, gradients and two AdamW moments (16 bytes a parameter), LoRA the frozen
  float32 base (4) and the adapter's share;
* the step's action tokens per second (``train/action_tokens_per_s``, the optimizer step's forward,
  backward and update; goal >= 1.0), and the whole process's seconds;
* the published bytes: the adapter (``adapter_model.safetensors``) over the full version's weights.

    .venv/bin/python benchmarks/bench_lora.py --out runs/bench_lora.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench_scale import GLMPOST, build, judged_batch, run_layout, run_watched

LORA = ["--lora-rank", "16", "--lora-alpha", "32"]


def main() -> None:
    run_layout(measure, __doc__, "bench-lora-")


def _step(version: Path) -> dict:
    line = json.loads((version / "metrics.jsonl").read_text().splitlines()[0])
    return {"action_tokens_per_s": line["train/action_tokens_per_s"], "action_tokens": line["train/action_tokens"]}


def measure(work: Path, hidden: int, layers: int) -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1"}
    model, parameters = build(work, hidden, layers)
    train = [*GLMPOST, *judged_batch(work, model, env)]
    runs = {}
    for name, extra in (("full", []), ("lora", LORA)):
        started = time.perf_counter()
        peaks, _ = run_watched([*train, "--out", str(work / name), *extra], env)
        version = work / name / "v000001"
        weights = sum(p.stat().st_size for p in version.glob("*.safetensors"))
        runs[name] = {"peak_mib": round(max(peaks.values()) / 1024, 1), "process_s": round(time.perf_counter() - started, 1),
                      "published_weight_bytes": weights, **_step(version)}
    adapter = json.loads((work / "lora" / "v000001" / "adapter_config.json").read_text())
    trained = sum(t.numel() for t in _adapter_tensors(work / "lora" / "v000001"))
    full, lora = runs["full"], runs["lora"]
    return {
        "parameters": parameters, "adapter_parameters": trained, "lora_rank": adapter["r"], "lora_alpha": adapter["lora_alpha"],
        "lora_targets": sorted(adapter["target_modules"]), "full": full, "lora": lora,
        "peak_rss_lora_vs_full": round(lora["peak_mib"] / full["peak_mib"], 3),
        "step_tokens_per_s_lora_vs_full": round(lora["action_tokens_per_s"] / full["action_tokens_per_s"], 3),
        "process_s_lora_vs_full": round(lora["process_s"] / full["process_s"], 3),
        "adapter_bytes_vs_full_checkpoint": round(lora["published_weight_bytes"] / full["published_weight_bytes"], 5),
        "python": sys.version.split()[0],
    }


def _adapter_tensors(version: Path):
    from safetensors.torch import load_file

    return load_file(str(version / "adapter_model.safetensors")).values()


if __name__ == "__main__":
    main()
