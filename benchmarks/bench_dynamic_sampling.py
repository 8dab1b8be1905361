"""DAPO's dynamic sampling on the tiny reasoning recipe: the rollout cost of one trained group with and
without it.

One rollout of ``--prompts`` with ``recipes/tiny-reasoning-rl.toml``'s sampling (group size 8, the count
task) from the quickstart's starting model (``init-model --seed 0``, or ``--checkpoint``), then the
judge twice on the same shards: as the recipe runs it (every group goes to the trainer, the peer:
GRPO as verl and TRL run it without dynamic sampling) and with ``--dynamic-sampling`` (DAPO: groups
whose rewards are all equal are left out, so the trainer's batch holds informative groups only and
the rollout samples until it is full).

Reported: groups sampled and kept, the rollout's seconds, the rollout seconds per trained group on
each side and their ratio (dynamic / plain: what a full batch of informative groups costs in sampling,
= groups sampled / groups kept), and per group that carries a gradient (a group with equal rewards has
all-zero advantages) on each side, which is the same sampling either way: dynamic sampling pays for
what plain GRPO trains on uselessly.

    .venv/bin/python benchmarks/bench_dynamic_sampling.py --out runs/bench_dynamic_sampling.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from bench_sao import glmpost

from glmpost.formats import ShardReader

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-reasoning-rl.toml"


def groups(judged: Path) -> dict[str, list[float]]:
    found: dict[str, list[float]] = defaultdict(list)
    for path in sorted(judged.glob("*.msgpack.zst")):
        for record in ShardReader(path):
            found[record["group_id"]].append(record["reward"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="the policy (default: init-model --seed 0 in a scratch folder)")
    parser.add_argument("--prompts", type=Path, default=ROOT / "recipes" / "data" / "count-train.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-dynamic-sampling-"))
    log = work / "stages.log"
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = work / "model"
        glmpost("init-model", "--out", checkpoint, "--seed", 0, log=log)
    rollout_s = glmpost("rollout", args.prompts, "--config", RECIPE, "--checkpoint", checkpoint, "--out", work / "rollout",
                        "--seed", args.seed, log=log)
    glmpost("judge", work / "rollout", "--config", RECIPE, "--checkpoint", checkpoint, "--out", work / "plain", log=log)
    glmpost("judge", work / "rollout", "--config", RECIPE, "--checkpoint", checkpoint, "--out", work / "dynamic",
            "--dynamic-sampling", log=log)
    sampled, kept = groups(work / "plain"), groups(work / "dynamic")
    informative = sum(1 for rewards in sampled.values() if max(rewards) > min(rewards))
    result = {
        "groups_sampled": len(sampled), "groups_kept": len(kept), "groups_informative_in_plain": informative,
        "rollout_s": round(rollout_s, 2),
        "plain": {"trained_groups": len(sampled), "rollout_s_per_trained_group": rollout_s / len(sampled),
                  "rollout_s_per_informative_group": rollout_s / max(informative, 1)},
        "dynamic": {"trained_groups": len(kept), "rollout_s_per_trained_group": rollout_s / max(len(kept), 1),
                    "rollout_s_per_informative_group": rollout_s / max(len(kept), 1)},
    }
    result["ratio_rollout_cost_per_trained_group"] = (result["dynamic"]["rollout_s_per_trained_group"]
                                                      / result["plain"]["rollout_s_per_trained_group"])
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
