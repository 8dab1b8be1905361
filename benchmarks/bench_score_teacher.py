"""score-teacher's scoring function vs a naive full-logits teacher forward at GLM-5 vocabulary size.

Both score the same student records (prompt + response token ids, every response token an action)
with the same teacher model, side by side in one process:

- ``score-teacher``: :func:`glmpost.kernel.scoring.score_records`, what ``glmpost score-teacher`` runs per
  teacher (``--batch-size`` records per forward, only action rows reach the LM head, ``--chunk-size``
  rows at a time, so the largest logits buffer is ``[chunk, V]``);
- ``naive``: ``model(input_ids).logits`` (float32 ``[B, L, V]``), ``log_softmax`` over the vocabulary,
  gather of each response token, the same batches.

The teacher is the tiny GLM-5 (MoE, MLA, DSA indexer; ``glmpost.models.tiny``) with the vocabulary
widened to ``--vocab`` (GLM-5: 151,552), random weights and random token ids over the whole
vocabulary. For each: peak extra memory above the baseline (``benchmarks/memory.py``), best wall and
CPU time of ``--repeats`` timed runs (round-robin over the methods), teacher tokens/s (action tokens
scored per second) and the max absolute difference of the teacher log-probs from the naive path.
Ratios: memory score / naive (goal <= 0.3) and speed naive time / score time (goal >= 1.0), from the
best wall times ("speed"), the best CPU times ("cpu speed") and the median of per-round ratios
("paired", robust on a shared machine); the speed goal counts as met when the best-of or the paired
ratio meets it. ``--topk K`` also returns the teacher's top-k payload (``--payload topk``).

    .venv/bin/python benchmarks/bench_score_teacher.py --out runs/bench_score_teacher.json
    .venv/bin/python benchmarks/bench_score_teacher.py --chunk-sizes 256,512,1024 --topk 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import PeakMemory, check_rss_tracks_tensors

from glmpost.kernel.scoring import score_records
from glmpost.models.tiny import build_model, tiny_glm5_config

GOAL_MEMORY_RATIO = 0.3
GOAL_SPEED_RATIO = 1.0


def make_records(count: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[dict]:
    """Student rollout records as score-teacher reads them (every response token an action)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "prompt_token_ids": rng.integers(0, vocab, prompt_len, dtype=np.int32),
            "response_token_ids": rng.integers(0, vocab, response_len, dtype=np.int32),
            "action_mask": np.ones(response_len, dtype=bool),
            "observation_mask": np.zeros(response_len, dtype=bool),
        }
        for _ in range(count)
    ]


def batches(records: list[dict], batch_size: int):
    for start in range(0, len(records), batch_size):
        rows = records[start : start + batch_size]
        ids = torch.from_numpy(np.stack([np.concatenate([r["prompt_token_ids"], r["response_token_ids"]]) for r in rows])).long()
        yield rows, ids


@torch.no_grad()
def naive(model, records, *, batch_size: int, chunk_size: int, topk: int):
    """The reference: full float32 [B, L, V] logits, log_softmax over V, gather (and top-k)."""
    out = []
    for rows, ids in batches(records, batch_size):
        log_softmax = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)[:, :-1]
        token = log_softmax.gather(-1, ids[:, 1:, None]).squeeze(-1)
        top = torch.topk(log_softmax, topk, dim=-1) if topk else None
        for row, record in enumerate(rows):
            p = len(record["prompt_token_ids"])
            out.append((token[row, p - 1 :].numpy(), None if top is None else top.values[row, p - 1 :].numpy()))
        del log_softmax, top
    return out


@torch.no_grad()
def scored(model, records, *, batch_size: int, chunk_size: int, topk: int):
    payloads = score_records(model, records, topk=topk, batch_size=batch_size, chunk_size=chunk_size, pad_token_id=0)
    return [(p.log_probs, p.topk_log_probs) for p in payloads]


def max_diff(result, ref, index):
    values = [np.abs(a[index].astype(np.float64) - b[index].astype(np.float64)).max()
              for a, b in zip(result, ref) if a[index] is not None]
    return float(max(values)) if values else None


def format_table(rows):
    mib = 2**20
    columns = ["method", "peak MiB", "hwm MiB", "best s", "cpu s", "tokens/s"]
    columns += ["mem ratio", "speed", "paired", "cpu speed", "max|dlogp|", "goals"]
    lines = [columns]
    for row in rows:
        other = "memory_ratio" in row
        lines.append([
            row["method"],
            f"{row['peak_bytes'] / mib:.0f}",
            "-" if row["peak_hwm_bytes"] is None else f"{row['peak_hwm_bytes'] / mib:.0f}",
            f"{row['best_time_s']:.3f}",
            f"{row['best_cpu_time_s']:.3f}",
            f"{row['teacher_tokens_per_s']:.0f}",
            f"{row['memory_ratio']:.3f}" if other else "",
            f"{row['speed_ratio']:.2f}" if other else "",
            f"{row['paired_speed_ratio']:.2f}" if other else "",
            f"{row['cpu_speed_ratio']:.2f}" if other else "",
            f"{row['max_abs_diff_log_probs']:.2e}" if other else "",
            ("ok" if row["meets_goals"] else "MISSED") if other else "",
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(line, widths)))
        for line in lines
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_552)
    parser.add_argument("--records", type=int, default=16, help="student records scored per run")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=224, help="action tokens per record")
    parser.add_argument("--batch-size", type=int, default=8, help="records per forward (score-teacher's default)")
    parser.add_argument("--chunk-sizes", default="512", help="comma-separated score-teacher --chunk-size values")
    parser.add_argument("--topk", type=int, default=0, help="also return the teacher's top-k (payload topk)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (best wins)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    rss_check = check_rss_tracks_tensors()
    if not rss_check["ok"]:
        print(f"warning: RSS does not track tensor frees here {rss_check}", file=sys.stderr)
    length = args.prompt_len + args.response_len
    # index_topk >= the sequence: the DSA indexer selects every key, so both paths attend alike.
    config = tiny_glm5_config(vocab_size=args.vocab, max_position_embeddings=max(512, length), index_topk=length)
    model = build_model(config, seed=args.seed).eval()
    records = make_records(args.records, args.prompt_len, args.response_len, args.vocab, args.seed)
    action_tokens = args.records * args.response_len
    common = {"batch_size": args.batch_size, "topk": args.topk}

    # Warm up kernels and thread pools on two records.
    naive(model, records[:2], chunk_size=0, **common)
    scored(model, records[:2], chunk_size=64, **common)

    methods = [("naive", naive, {"chunk_size": 0})] + [
        (f"score-teacher[{c}]", scored, {"chunk_size": int(c)}) for c in args.chunk_sizes.split(",") if c
    ]
    rows, ref = [], None
    for name, fn, extra in methods:
        gc.collect()
        with PeakMemory("cpu") as peak:
            result = fn(model, records, **extra, **common)
        row = {"method": name, **extra, "peak_bytes": peak.peak_bytes, "peak_hwm_bytes": peak.hwm_bytes,
               "rss_samples": peak.samples, "times_s": [], "cpu_times_s": []}
        if ref is None:
            ref = result
        else:
            row["max_abs_diff_log_probs"] = max_diff(result, ref, 0)
            row["max_abs_diff_topk_log_probs"] = max_diff(result, ref, 1)
        del result
        rows.append(row)
    del ref
    for _ in range(args.repeats):  # round-robin, so load from other processes hits every method
        for row, (name, fn, extra) in zip(rows, methods):
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(model, records, **extra, **common)
            row["times_s"].append(time.perf_counter() - start)
            row["cpu_times_s"].append(time.process_time() - start_cpu)
    base = rows[0]
    for row in rows:
        row["best_time_s"] = min(row["times_s"])
        row["best_cpu_time_s"] = min(row["cpu_times_s"])
        row["teacher_tokens_per_s"] = action_tokens / row["best_time_s"]
    for row in rows[1:]:
        row["memory_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        row["speed_ratio"] = base["best_time_s"] / row["best_time_s"]
        row["cpu_speed_ratio"] = base["best_cpu_time_s"] / row["best_cpu_time_s"]
        row["paired_speed_ratio"] = statistics.median(n / s for n, s in zip(base["times_s"], row["times_s"]))
        row["meets_goals"] = (row["memory_ratio"] <= GOAL_MEMORY_RATIO
                              and max(row["speed_ratio"], row["paired_speed_ratio"]) >= GOAL_SPEED_RATIO)

    print(
        f"records={args.records} x (prompt {args.prompt_len} + response {args.response_len}) V={args.vocab} "
        f"batch={args.batch_size} topk={args.topk} threads={torch.get_num_threads()} "
        f"float32 [B,L,V] = {args.batch_size * length * args.vocab * 4 / 2**20:.0f} MiB; rss check {rss_check}"
    )
    print(format_table(rows))
    report = {
        "config": {**vars(args), "out": str(args.out) if args.out else None},
        "goals": {"memory_ratio_max": GOAL_MEMORY_RATIO, "speed_ratio_min": GOAL_SPEED_RATIO},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                        "machine": platform.machine(), "python": platform.python_version()},
        "rss_check": rss_check,
        "results": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
