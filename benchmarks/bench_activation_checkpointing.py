"""Activation checkpointing: one training step with it vs the same step without it (the peer).

A random-init model with real width (``--model qwen3``: a Qwen3 layout, hidden 1,024, 8 layers, 16 /
8 heads, intermediate 3,072, vocab 512; ``--model glm5``: the tiny GLM-5 model on the native
attention path), float32, one sequence of ``--tokens`` tokens: forward + backward of the trainer's
log-prob path (:func:`glmpost.kernel.logprobs.sequence_log_probs`, the sum of the log-probs).
Each side runs in a fresh child process (glibc ``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors
leave RSS): the peak memory of the step above the level before it (the kernel's VmHWM through
:class:`memory.PeakMemory`) and the best step time of ``--repeats``. Reported: peak and speed of
the checkpointed step as ratios of the plain one, and the gradients' relative difference.

Goals (issue 31): at 4,096 tokens peak <= 0.5x without, speed >= 0.7x.

    .venv/bin/python benchmarks/bench_activation_checkpointing.py --out runs/bench_activation_checkpointing.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from memory import PeakMemory

from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.rl.precision import checkpoint_layers


def build(name: str):
    torch.manual_seed(0)
    if name == "glm5":
        from glmpost.models.tiny import build_model, tiny_glm5_config

        return build_model(tiny_glm5_config(max_position_embeddings=16384), seed=0)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                                        max_position_embeddings=16384, tie_word_embeddings=False))


def child(model_name: str, side: str, tokens: int, repeats: int, threads: int) -> dict:
    """One side in this process: the step's peak above its start, its best time, the gradient."""
    torch.set_num_threads(threads)
    model = build(model_name).train()
    if side == "checkpointed":
        checkpoint_layers(model)
    ids = torch.randint(3, 500, (1, tokens), generator=torch.Generator().manual_seed(0))
    times, peak = [], None
    for repeat in range(repeats):
        model.zero_grad(set_to_none=True)
        with PeakMemory(torch.device("cpu")) as measured:
            started = time.perf_counter()
            sequence_log_probs(model, ids).log_probs.sum().backward()
            times.append(time.perf_counter() - started)
        if repeat == 0:
            peak = measured.hwm_bytes if measured.hwm_bytes is not None else measured.peak_bytes
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.save(grad, os.environ["BENCH_GRAD_OUT"])
    return {"peak_mib": peak / 2**20, "step_s": min(times), "parameters": sum(p.numel() for p in model.parameters())}


def run_side(model_name: str, side: str, tokens: int, repeats: int, threads: int, grad_path: Path) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "BENCH_GRAD_OUT": str(grad_path)}
    out = subprocess.run([sys.executable, __file__, "--child", model_name, side, str(tokens), str(repeats), str(threads)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3,glm5")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, side, tokens, repeats, threads = args.child
        print(json.dumps(child(name, side, int(tokens), int(repeats), int(threads))))
        return
    rows = []
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    for name in args.models.split(","):
        sides, grads = {}, {}
        for side in ("plain", "checkpointed"):
            path = scratch / f"bench-ac-{os.getpid()}-{name}-{side}.pt"
            sides[side] = run_side(name, side, args.tokens, args.repeats, args.threads, path)
            grads[side] = torch.load(path)
            path.unlink()
        plain, checkpointed = sides["plain"], sides["checkpointed"]
        row = {"model": name, "tokens": args.tokens, "parameters": plain["parameters"],
               "plain_peak_mib": round(plain["peak_mib"], 1), "checkpointed_peak_mib": round(checkpointed["peak_mib"], 1),
               "peak_ratio": round(checkpointed["peak_mib"] / plain["peak_mib"], 3),
               "plain_step_s": round(plain["step_s"], 3), "checkpointed_step_s": round(checkpointed["step_s"], 3),
               "speed_ratio": round(plain["step_s"] / checkpointed["step_s"], 3),
               "grad_rel_diff": float((grads["checkpointed"] - grads["plain"]).norm() / grads["plain"].norm())}
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                                        "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
