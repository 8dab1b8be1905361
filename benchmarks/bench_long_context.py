"""Long contexts: glmpost's native GLM-5 attention vs transformers' reference modules and HF ``generate``.

One process, one thread, one tiny GLM-5 model (``build_model(tiny_glm5_config(max_position_embeddings=16384),
seed=0)``, float32, deterministic DSA top-k, ``index_topk`` 8) copied into two sides that share its
weights: ``native`` (:func:`glmpost.models.native_attention.set_attention`) and ``reference``.

* ``rollout``: ``--rollout-batch`` sequences of ``--new-tokens`` greedy tokens (no stop ids) after
  prompts of each ``--prompt-lengths`` length; sides: glmpost's ``LocalEngine`` on the native model,
  the same engine on the reference model, and HF ``model.generate(..., do_sample=False,
  min_new_tokens=N)`` on the reference model (tokens only). Reported: generated tokens/s of the
  whole rollout (prefill included), and for the two glmpost sides the decode cost per step: after
  one prefill, ``--decode-steps`` one-token forwards timed as the engine makes them (mask and
  positions grown per step, the cache passed back); the reference sides only up to
  ``--reference-max-prompt`` (they take minutes beyond).
* ``train``: forward + backward of one sequence through the trainer's log-prob path
  (:func:`glmpost.kernel.logprobs.sequence_log_probs`) at each ``--train-lengths`` length: tokens/s
  (best of ``--repeats``) and the peak memory of the step above its start, measured in a child
  process per side and length (the kernel's high-water mark, :class:`memory.PeakMemory`, of the
  first step after a 64-token warm-up, with glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` so that every
  tensor above 64 KiB is returned to the OS when freed and RSS follows the tensors alive).
* ``topk``: :func:`glmpost.npu.topk.deterministic_topk` vs ``torch.topk`` at ``[16, 8192]``,
  ``k = 2048``, on distinct scores and on indexer-like relu scores (many exact zeros).

Goals (issue 16): rollout at 2,048-token prompts >= 10x HF generate; decode cost per token at 8,192
<= 4x at 1,024; training at 4,096 >= 5x the reference; peak memory at 8,192 <= 2.2x at 4,096;
deterministic top-k >= 0.8x ``torch.topk``.

    .venv/bin/python benchmarks/bench_long_context.py --out runs/bench_long_context.json
    .venv/bin/python benchmarks/bench_long_context.py --only topk
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from memory import PeakMemory, check_rss_tracks_tensors

from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.models.native_attention import set_attention
from glmpost.models.tiny import build_model, tiny_glm5_config
from glmpost.npu.topk import deterministic_topk, install_deterministic_topk

PAD = 0


def models():
    reference = build_model(tiny_glm5_config(max_position_embeddings=16384), seed=0)
    install_deterministic_topk(reference)
    native = copy.deepcopy(reference)
    set_attention(native, "native")
    return native, reference


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(8, vocab, (batch, length), generator=generator).tolist()


def time_engine(model, batch_prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    engine = LocalEngine(model, batch_size=len(batch_prompts), pad_token_id=PAD)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=[])
    started = time.perf_counter()
    out = engine.generate(batch_prompts, [str(i) for i in range(len(batch_prompts))], params)
    return time.perf_counter() - started, [c.token_ids for c in out]


@torch.no_grad()
def decode_ms_per_step(model, batch_prompts, steps: int) -> float:
    ids = torch.tensor(batch_prompts)
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    cache, positions, step_ids = out.cache, torch.full((len(batch_prompts), 1), ids.shape[1] - 1), ids[:, -1:]
    started = None
    for step in range(steps + 2):  # two warm-up steps
        if step == 2:
            started = time.perf_counter()
        mask = torch.cat([mask, torch.ones((len(batch_prompts), 1), dtype=mask.dtype)], dim=-1)
        positions = positions + 1
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=1)
        cache, step_ids = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - started) / steps * 1e3


@torch.no_grad()
def time_hf(model, batch_prompts, new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(batch_prompts)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD)
    return time.perf_counter() - started, out[:, ids.shape[1]:].tolist()


def rollout_rows(native, reference, args) -> list[dict]:
    rows = []
    for length in args.prompt_lengths:
        batch_prompts = prompts(args.rollout_batch, length, native.config.vocab_size)
        sides = [("native", native, lambda n: time_engine(native, batch_prompts, n))]
        if length <= args.reference_max_prompt:
            sides += [("reference", reference, lambda n: time_engine(reference, batch_prompts, n)),
                      ("hf_generate", None, lambda n: time_hf(reference, batch_prompts, n))]
        row = {"prompt_tokens": length, "batch": args.rollout_batch, "new_tokens": args.new_tokens}
        tokens = {}
        for name, model, run in sides:
            gc.collect()
            whole, tokens[name] = run(args.new_tokens)
            row[f"{name}_tokens_per_s"] = round(args.rollout_batch * args.new_tokens / whole, 1)
            if model is not None:
                row[f"{name}_decode_ms_per_step"] = round(decode_ms_per_step(model, batch_prompts, args.decode_steps), 3)
            print(f"rollout {length}: {name} {row[f'{name}_tokens_per_s']} tok/s, decode {row.get(f'{name}_decode_ms_per_step')} ms/step",
                  flush=True)
        for name in tokens:
            row[f"{name}_same_tokens"] = sum(a == b for x, y in zip(tokens[name], tokens["native"]) for a, b in zip(x, y)) / (
                args.rollout_batch * args.new_tokens)
        if "hf_generate_tokens_per_s" in row:
            row["native_vs_hf"] = round(row["native_tokens_per_s"] / row["hf_generate_tokens_per_s"], 2)
            row["native_vs_reference"] = round(row["native_tokens_per_s"] / row["reference_tokens_per_s"], 2)
        rows.append(row)
    base = next((r for r in rows if r["prompt_tokens"] == min(args.prompt_lengths)), None)
    for row in rows:
        row["native_decode_cost_vs_shortest"] = round(row["native_decode_ms_per_step"] / base["native_decode_ms_per_step"], 2)
    return rows


def train_rows(native, reference, args) -> list[dict]:
    rows = []
    for length in args.train_lengths:
        ids = torch.randint(8, native.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        row = {"tokens": length}
        sides = [("native", native)] + ([("reference", reference)] if length <= args.reference_max_train else [])
        for name, model in sides:
            model.train()
            model.zero_grad(set_to_none=True)
            gc.collect()
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                sequence_log_probs(model, ids).log_probs.sum().backward()
                best = min(best, time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
            row[f"{name}_tokens_per_s"] = round(length / best)
            row[f"{name}_peak_mib"] = round(child_peak_bytes(name, length, args.threads) / 2**20, 1)
            print(f"train {length}: {name} {row[f'{name}_tokens_per_s']} tok/s, peak {row[f'{name}_peak_mib']} MiB", flush=True)
        if "reference_tokens_per_s" in row:
            row["native_vs_reference"] = round(row["native_tokens_per_s"] / row["reference_tokens_per_s"], 2)
        rows.append(row)
    for row in rows:
        half = next((r for r in rows if 2 * r["tokens"] == row["tokens"]), None)
        if half is not None:
            row["native_peak_vs_half_length"] = round(row["native_peak_mib"] / half["native_peak_mib"], 2)
    return rows


def child_peak_bytes(side: str, length: int, threads: int) -> int:
    """Peak bytes of one training step of ``side`` at ``length`` tokens, measured in a fresh process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--peak-child", side, str(length), "--threads", str(threads)],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def peak_child(side: str, length: int) -> None:
    native, reference = models()
    model = (native if side == "native" else reference).train()
    sequence_log_probs(model, torch.randint(8, 500, (1, 64))).log_probs.sum().backward()  # first-touch allocations
    model.zero_grad(set_to_none=True)
    ids = torch.randint(8, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with PeakMemory() as peak:
        sequence_log_probs(model, ids).log_probs.sum().backward()
    print(peak.hwm_bytes if peak.hwm_bytes is not None else peak.peak_bytes)


def topk_rows(args) -> list[dict]:
    rows = []
    for kind in ("distinct", "relu"):
        generator = torch.Generator().manual_seed(0)
        scores = torch.randn(16, 8192, generator=generator)
        if kind == "relu":
            scores = torch.relu(scores) * (torch.rand(16, 8192, generator=generator) < 0.5)
        timings = {}
        for name, fn in (("torch_topk", lambda: scores.topk(2048, dim=-1)), ("deterministic", lambda: deterministic_topk(scores, 2048))):
            fn()
            samples = []
            for _ in range(args.topk_repeats):
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
            timings[name] = sorted(samples)[len(samples) // 2]
        row = {"scores": kind, "shape": [16, 8192], "k": 2048, "torch_topk_ms": round(timings["torch_topk"] * 1e3, 3),
               "deterministic_ms": round(timings["deterministic"] * 1e3, 3),
               "speed_vs_torch_topk": round(timings["torch_topk"] / timings["deterministic"], 2)}
        print(f"topk {kind}: {row}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[1024, 2048, 8192])
    parser.add_argument("--rollout-batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--reference-max-prompt", type=int, default=2048)
    parser.add_argument("--train-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--reference-max-train", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--topk-repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("rollout", "train", "topk"), action="append")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--peak-child", nargs=2, metavar=("SIDE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_child:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        return peak_child(args.peak_child[0], int(args.peak_child[1]))
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    only = set(args.only or ("topk", "train", "rollout"))
    native, reference = models()
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
              "rss_tracks_tensors": check_rss_tracks_tensors()}
    if "topk" in only:
        result["topk"] = topk_rows(args)
    if "train" in only:
        result["train"] = train_rows(native, reference, args)
    if "rollout" in only:
        native.eval(), reference.eval()
        result["rollout"] = rollout_rows(native, reference, args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
