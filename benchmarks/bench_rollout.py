"""Rollout throughput: glmpost's ``LocalEngine.generate`` vs Hugging Face ``model.generate``.

Both run side by side in one process on the tiny GLM-5 model (``build_model(tiny_glm5_config(),
seed=0)``, one instance shared by both) with the same prompts - ``--prompts`` chat-template prompts
("add: a+b=", 12 tokens), each repeated ``--group`` times - in one batch of ``prompts x group``
sequences, and the same sampling distribution: temperature 1, top-p 1, no top-k. Every sequence
generates exactly ``--new-tokens`` tokens: glmpost gets no stop ids; HF gets ``min_new_tokens =
max_new_tokens`` and ``eos_token_id=None``.

Sides (timed: one whole batch, best of ``--repeats``, interleaved, the side that goes first
alternating):

* ``glmpost``: ``LocalEngine(model, batch_size=B).generate(prompts, keys, SamplingParams(...))`` -
  left-padded batch, KV cache, per-sequence seeded generators, and the sampling log-prob of every
  token (what a rollout record needs).
* ``hf``: ``model.generate(input_ids, attention_mask, do_sample=True, temperature=1.0, top_p=1.0,
  top_k=0, max_new_tokens=N, min_new_tokens=N, eos_token_id=None)`` on the same left-padded batch -
  tokens only.
* ``hf+logprobs``: the same with ``output_scores=True, return_dict_in_generate=True`` and the
  log-prob of each sampled token taken from the scores (``log_softmax(score).gather``): the HF
  counterpart of what glmpost returns. The goal (glmpost / HF >= 1.0) is checked against plain
  ``hf``, the stricter of the two.

Sanity check (untimed): greedy decoding (temperature 0 / ``do_sample=False``) on both sides gives
the same tokens, so both run the same model on the same inputs.

``--profile`` adds a cProfile of one glmpost batch (top functions by own time).

    .venv/bin/python benchmarks/bench_rollout.py --out runs/bench_rollout.json
    .venv/bin/python benchmarks/bench_rollout.py --new-tokens 128 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import platform
import pstats
import random
import time
import warnings
from pathlib import Path

import torch

from glmpost.formats.prompts import encode_prompt
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.models.tiny import build_model, tiny_glm5_config
from glmpost.models.tokenizer import train_tokenizer

GOAL_SPEED_RATIO = 1.0


def make_prompts(tokenizer, *, prompts: int, group: int, seed: int) -> tuple[list[list[int]], list[str]]:
    rng = random.Random(seed)
    flat, keys = [], []
    for i in range(prompts):
        text = f"add: {rng.randint(0, 9)}+{rng.randint(0, 9)}="
        ids = encode_prompt(tokenizer, [{"role": "user", "content": text}])
        for j in range(group):
            flat.append(ids)
            keys.append(f"p{i}/{j}")
    return flat, keys


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


class GlmpostSide:
    name = "glmpost"

    def __init__(self, model, prompts, keys, *, new_tokens, pad_token_id, temperature=1.0):
        self.engine = LocalEngine(model, batch_size=len(prompts), pad_token_id=pad_token_id)
        self.prompts, self.keys = prompts, keys
        self.params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                                     seed=0, stop_token_ids=[])

    def run(self) -> list[list[int]]:
        return [c.token_ids for c in self.engine.generate(self.prompts, self.keys, self.params)]


class HfSide:
    def __init__(self, model, prompts, *, new_tokens, pad_token_id, logprobs: bool, sample: bool = True):
        self.name = "hf+logprobs" if logprobs else "hf"
        self.model = model
        self.input_ids, self.attention_mask = left_padded(prompts, pad_token_id)
        self.logprobs = logprobs
        self.kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_token_id,
                           eos_token_id=None)
        if sample:
            self.kwargs.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        else:
            self.kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if logprobs:
            self.kwargs.update(output_scores=True, return_dict_in_generate=True)

    @torch.no_grad()
    def run(self) -> list[list[int]]:
        out = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention_mask, **self.kwargs)
        sequences = out.sequences if self.logprobs else out
        new = sequences[:, self.input_ids.shape[1]:]
        if self.logprobs:
            scores = torch.stack(out.scores, dim=1).float()  # [B, N, V]
            self.last_log_probs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return new.tolist()


def time_sides(sides, repeats: int):
    times = {s.name: [] for s in sides}
    cpu = {s.name: [] for s in sides}
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            side.run()
            times[side.name].append(time.perf_counter() - start)
            cpu[side.name].append(time.process_time() - start_cpu)
    return times, cpu


def profile_glmpost(side: GlmpostSide, top: int = 15) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    side.run()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per side (best wins)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine, 2 threads under load are "
                             "several times slower and far noisier); 0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one glmpost batch")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = train_tokenizer(512)
    pad = tokenizer.pad_token_id
    model = build_model(tiny_glm5_config(), seed=0)
    prompts, keys = make_prompts(tokenizer, prompts=args.prompts, group=args.group, seed=args.seed)
    batch = len(prompts)
    tokens = batch * args.new_tokens

    # Sanity: greedy decoding agrees (same model, same inputs, same layout).
    greedy_glm = GlmpostSide(model, prompts, keys, new_tokens=args.new_tokens, pad_token_id=pad, temperature=0.0).run()
    greedy_hf = HfSide(model, prompts, new_tokens=args.new_tokens, pad_token_id=pad, logprobs=False,
                       sample=False).run()
    greedy_agree = sum(a == b for ga, gb in zip(greedy_glm, greedy_hf) for a, b in zip(ga, gb)) / tokens

    sides = [
        GlmpostSide(model, prompts, keys, new_tokens=args.new_tokens, pad_token_id=pad),
        HfSide(model, prompts, new_tokens=args.new_tokens, pad_token_id=pad, logprobs=False),
        HfSide(model, prompts, new_tokens=args.new_tokens, pad_token_id=pad, logprobs=True),
    ]
    lengths = {}
    for side in sides:  # warm-up, and every sequence really has new_tokens tokens
        out = side.run()
        lengths[side.name] = sorted({len(t) for t in out})
        if lengths[side.name] != [args.new_tokens] or len(out) != batch:
            raise SystemExit(f"{side.name}: generated lengths {lengths[side.name]} for {len(out)} sequences")
    times, cpu = time_sides(sides, args.repeats)

    rows = {}
    for side in sides:
        best = min(times[side.name])
        rows[side.name] = {
            "best_s": best,
            "median_s": sorted(times[side.name])[len(times[side.name]) // 2],
            "best_cpu_s": min(cpu[side.name]),
            "tokens_per_s": tokens / best,
            "tokens_per_cpu_s": tokens / min(cpu[side.name]),
            "times_s": times[side.name],
            "cpu_times_s": cpu[side.name],
        }
    ratios = {
        f"glmpost/{name}": rows["glmpost"]["tokens_per_s"] / rows[name]["tokens_per_s"]
        for name in rows if name != "glmpost"
    }
    cpu_ratios = {
        f"glmpost/{name}": rows["glmpost"]["tokens_per_cpu_s"] / rows[name]["tokens_per_cpu_s"]
        for name in rows if name != "glmpost"
    }
    speed_ratio = ratios["glmpost/hf"]
    profile = profile_glmpost(sides[0]) if args.profile else None

    import transformers

    result = {
        "benchmark": "bench_rollout",
        "setting": {
            "prompts": args.prompts, "group": args.group, "batch": batch, "prompt_tokens": len(prompts[0]),
            "new_tokens": args.new_tokens, "tokens": tokens, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "cpu_count": os.cpu_count()},
        "greedy_token_agreement": greedy_agree,
        "results": rows,
        "speed_ratios": ratios,
        "cpu_speed_ratios": cpu_ratios,
        "goal": {"speed_ratio_min": GOAL_SPEED_RATIO, "against": "hf", "met": speed_ratio >= GOAL_SPEED_RATIO},
        "profile_glmpost": profile,
    }

    print(f"rollout: {args.prompts} prompts x {args.group} = {batch} seqs, prompt {len(prompts[0])} tokens, "
          f"{args.new_tokens} new tokens, T=1 top_p=1 top_k=0, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"greedy sanity: glmpost and HF agree on {greedy_agree:.1%} of tokens")
    print(f"{'side':<12} {'best s':>8} {'median s':>9} {'cpu s':>8} {'tokens/s':>9}")
    for name, row in rows.items():
        print(f"{name:<12} {row['best_s']:>8.4f} {row['median_s']:>9.4f} {row['best_cpu_s']:>8.4f} "
              f"{row['tokens_per_s']:>9.0f}")
    for name, ratio in ratios.items():
        print(f"throughput {name} = {ratio:.2f}x wall, {cpu_ratios[name]:.2f}x CPU time")
    print(f"goal glmpost/hf >= {GOAL_SPEED_RATIO}: {'met' if speed_ratio >= GOAL_SPEED_RATIO else 'MISSED'}")
    if profile:
        print(profile)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
