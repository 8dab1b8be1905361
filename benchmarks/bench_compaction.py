"""CompactionRL's rollout: peak context and rollout tokens/s with and without compaction on the same tasks.

The tiny GLM-5 (init-model seed 0) after ``recipes/tiny-compaction.toml``'s SFT warm start on
``recipes/data/recall-demo.jsonl`` (``--sft-epochs``, default 7: the format, not the copying), in the kv-recall environment with a longer horizon than the recipe's
(``--steps`` ``<next>`` calls before the question; the store shown once, at the start). The same
``--tasks`` tasks (``glmpost.envs.kv_recall_tasks``, seed 7), the same sampling seed, one process per
side, in turn:

* ``compaction``: ``rollout --compaction summary --context-budget C`` (the recipe's C = 128): the policy
  summarises whenever the budget runs low and goes on in a rebuilt context;
* ``drop``: ``--compaction drop`` at the same budget: rebuilt without a summary (the baseline);
* ``full`` (the peer): ``--compaction off`` without a budget: the whole history stays in the context
  (the model's 512 positions hold the longest trajectory).

Reported per side: the peak context a turn was sampled on (mean and max over trajectories, from
``extra.env.peak_context``), rollout throughput (sampled tokens, actions and summaries, per second of
the engine's generation, from the shards' metrics), the tokens sampled per trajectory and those the
engine had to prefill without a KV cache to continue (the prompt and every rebuilt context),
compactions and summary tokens per trajectory, trajectories completed and their success. Ratios are
compaction / full.

    .venv/bin/python benchmarks/bench_compaction.py --out runs/bench_compaction.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench_sao import glmpost

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-compaction.toml"
DATA = ROOT / "recipes" / "data"


def side(name: str, options: list[str], *, sft: Path, tasks: Path, work: Path, log: Path, max_turns: int) -> dict:
    """One side's rollout of every task and what its records and metrics say."""
    from glmpost.formats import ShardReader, resolve_shard_paths

    out = work / name
    wall = glmpost("rollout", tasks, "--config", RECIPE, "--checkpoint", sft, "--out", out, "--group-size", 1,
                   "--seed", 1000, "--max-turns", max_turns, "--overwrite", *options, log=log)
    records = [r for path in resolve_shard_paths([out]) for r in ShardReader(path)]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # each shard's generation seconds: its response tokens over its tokens/s
    seconds = sum(m["rollout/response_length_mean"] * m["rollout/records"] / m["rollout/tokens_per_s"]
                  for m in metrics if m.get("rollout/tokens_per_s"))
    peaks = np.array([r["extra"]["env"]["peak_context"] for r in records])
    sampled = sum(int(r["action_mask"].sum()) for r in records)
    compaction = [r["extra"].get("compaction", {}) for r in records]
    return {
        "trajectories": len(records),
        "peak_context_mean": float(peaks.mean()),
        "peak_context_max": int(peaks.max()),
        "sampled_tokens_per_trajectory": sampled / len(records),
        "fresh_prefill_tokens_per_trajectory": float(np.mean([len(r["prompt_token_ids"]) + sum(
            len(s["context"]) for s in r["segments"] if "context" in s) for r in records])),
        "sampled_tokens_per_s": sampled / seconds,
        "compactions_per_trajectory": float(np.mean([c.get("windows", 1) - 1 for c in compaction])),
        "summary_tokens_per_trajectory": float(np.mean([sum(s["tokens"] for s in c.get("summaries", [])) for c in compaction])),
        "completed": sum(r["status"] == "completed" for r in records) / len(records),
        "success": float(np.mean([r["extra"]["env"]["reward"] for r in records])),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=64, help="kv-recall tasks (one trajectory each)")
    parser.add_argument("--steps", type=int, default=12, help="<next> calls before the question (the recipe trains on 4)")
    parser.add_argument("--sft-epochs", type=int, default=7,
                        help="epochs of the warm start (the recipe's 40 teach the dense-attention model to copy; the "
                        "contexts and costs measured here need the format only)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_compaction")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from glmpost.envs import kv_recall_tasks

    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "stages.log"
    sft = args.work / "sft"
    if not (sft / "LATEST").is_file():
        model, demo = args.work / "model", args.work / "demo"
        glmpost("init-model", "--out", model, "--seed", "0", log=log)
        glmpost("shards", "import", DATA / "recall-demo.jsonl", "--checkpoint", model, "--out", demo, log=log)
        glmpost("qat", demo, "--config", RECIPE, "--checkpoint", model, "--out", sft, "--epochs", args.sft_epochs, log=log)
    tasks = args.work / "tasks.jsonl"
    sample = json.loads((DATA / "recall-train.jsonl").read_text().splitlines()[0])["task"]
    lines = kv_recall_tasks(args.tasks, seed=7, steps=args.steps, keys=len(sample["store"]),
                            digits=len(sample["answer"]), letters="a" if sample["query"] == "aa" else "abcdefgh")
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    turns = args.steps + 4
    sides = {
        "compaction": side("compaction", ["--compaction", "summary"], sft=sft, tasks=tasks, work=args.work, log=log, max_turns=turns),
        "drop": side("drop", ["--compaction", "drop"], sft=sft, tasks=tasks, work=args.work, log=log, max_turns=turns),
        "full": side("full", ["--compaction", "off", "--context-budget", 512], sft=sft, tasks=tasks, work=args.work, log=log,
                     max_turns=turns),
    }
    compact, full = sides["compaction"], sides["full"]
    result = {
        "settings": {"tasks": args.tasks, "steps": args.steps, "recipe": str(RECIPE.relative_to(ROOT)), "max_turns": turns},
        "sides": sides,
        "ratios": {"peak_context_mean": compact["peak_context_mean"] / full["peak_context_mean"],
                   "peak_context_max": compact["peak_context_max"] / full["peak_context_max"],
                   "sampled_tokens_per_s": compact["sampled_tokens_per_s"] / full["sampled_tokens_per_s"]},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
