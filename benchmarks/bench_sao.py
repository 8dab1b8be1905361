"""SAO vs GRPO + DIS on the same environment and the same number of sampled trajectories.

The tiny GLM-5 (init-model seed 0) after ``recipes/tiny-sao.toml``'s SFT warm start on
``recipes/data/kv-demo.jsonl``, in the kv-lookup environment (two chained look-ups, then the answer;
reward 1 per successful look-up and 1 for the right answer). Both sides sample ``--iterations`` x 64
trajectories and train one update per iteration with ``tiny-sao.toml``'s [train-sao] optimiser
settings (lr, epochs, mini-batches, micro-batch size; ``--grpo-lr`` sets GRPO's apart), each stage a
process, in turn:

* ``sao``: ``rollout`` of 64 ``kv-train`` prompts (the next 64 each iteration) with group size 1 -> ``judge`` -> ``train-sao``
  (the critic made from the warm start by ``--init-critic``; K = 2 critic steps per policy step);
* ``grpo``: ``rollout`` of 8 ``kv-train`` prompts (the next 8 each iteration) x group 8 -> ``judge`` ->
  ``train-grpo --trust-mask dis`` (the group baseline; DIS as SAO's).

Reported per side (mean and sd over ``--repeats`` R, run k sampling from seed 1 + 1000 k): the held-out
reward of the final policy (``kv-heldout``, 4 samples per prompt, seed 1000) with the warm start's, the
wall-clock of the whole loop, and the cost of an update: the train stage's wall-clock (process start,
two models to load for SAO) and its optimisation loop (``train/elapsed_s`` of the last step), with the
critic's share of SAO's loop (``sao/critic_s``: its K forward/backward passes and steps). Ratios are
SAO / GRPO.

    .venv/bin/python benchmarks/bench_sao.py --repeats 3 --out runs/bench_sao.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_async import warm_start

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-sao.toml"
DATA = ROOT / "recipes" / "data"
GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}


def glmpost(*args, log: Path) -> float:
    """Run one stage; its wall-clock seconds."""
    started = time.perf_counter()
    with open(log, "ab") as err:
        subprocess.run([*GLMPOST, *map(str, args)], check=True, stdout=subprocess.DEVNULL, stderr=err, env=ENV)
    return time.perf_counter() - started


def env_reward(rollout: Path) -> float:
    lines = [json.loads(line) for line in (rollout / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "rollout/env_reward_mean" in line][-1]["rollout/env_reward_mean"]


def held_out(checkpoint: Path, out: Path, log: Path) -> float:
    glmpost("rollout", DATA / "kv-heldout.jsonl", "--config", RECIPE, "--checkpoint", checkpoint, "--out", out,
            "--group-size", 4, "--seed", 1000, "--overwrite", log=log)
    return env_reward(out)


def run_side(side: str, args, sft: Path, work: Path, log: Path, *, seed: int) -> dict:
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    policy, critic = work / "policy", work / "critic"
    prompts = [line for line in (DATA / "kv-train.jsonl").read_text().splitlines() if line]
    train_s = loop_s = critic_s = 0.0
    started = time.perf_counter()
    for i in range(1, args.iterations + 1):
        checkpoint = policy if (policy / "LATEST").is_file() else sft
        it = work / f"it{i}"
        it.mkdir()
        # The same 64 trajectories per iteration: SAO 64 prompts x 1, GRPO 8 prompts x group 8, the next ones each time.
        width, group = (64, 1) if side == "sao" else (8, 8)
        source = it / "prompts.jsonl"
        source.write_text("\n".join(prompts[(width * (i - 1) + k) % len(prompts)] for k in range(width)) + "\n")
        glmpost("rollout", source, "--config", RECIPE, "--checkpoint", checkpoint, "--out", it / "rollout",
                "--group-size", group, "--seed", seed + i - 1, log=log)
        glmpost("judge", it / "rollout", "--config", RECIPE, "--checkpoint", checkpoint, "--out", it / "judged", log=log)
        if side == "sao":
            train_s += glmpost("train-sao", it / "judged", "--config", RECIPE, "--checkpoint", checkpoint, "--critic", critic,
                               "--init-critic", "--out", policy, log=log)
        else:  # the recipe's [train-sao] optimiser settings, for train-grpo
            train_s += glmpost("train-grpo", it / "judged", "--checkpoint", checkpoint, "--out", policy, "--trust-mask", "dis",
                               *optimiser_flags(), *(("--lr", args.grpo_lr) if args.grpo_lr is not None else ()), log=log)
        latest = int((policy / "LATEST").read_text().strip().removeprefix("v"))
        lines = [json.loads(line) for line in (policy / "metrics.jsonl").read_text().splitlines()]
        steps = [line for line in lines if line.get("train/policy_version") == latest]
        loop_s += steps[-1]["train/elapsed_s"]
        critic_s += sum(step.get("sao/critic_s", 0.0) for step in steps)
    wall = time.perf_counter() - started
    return {"reward": held_out(policy, work / "eval", log), "wall_s": wall, "train_stage_s": train_s / args.iterations,
            "update_loop_s": loop_s / args.iterations, "critic_s": critic_s / args.iterations}


def optimiser_flags() -> list[str]:
    import tomllib

    section = tomllib.loads(RECIPE.read_text())["train-sao"]
    return [item for key in ("lr", "epochs", "mini-batches", "micro-batch-size") for item in (f"--{key}", str(section[key]))]


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "runs": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3, help="updates per side (64 trajectories each)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, run k sampling from seed 1 + 1000 k")
    parser.add_argument("--grpo-lr", type=float, default=None, help="GRPO's learning rate (default: the recipe's, as SAO's)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_sao")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here too")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "stages.log"
    sft = warm_start(args.work, log, demos=DATA / "kv-demo.jsonl", recipe=RECIPE)
    report = {"iterations": args.iterations, "trajectories_per_iteration": 64, "repeats": args.repeats, "grpo_lr": args.grpo_lr,
              "warm_start_reward": held_out(sft, args.work / "eval-sft", log)}
    runs = {"sao": [], "grpo": []}
    for k in range(args.repeats):
        for side in runs:
            runs[side].append(run_side(side, args, sft, args.work / side, log, seed=1 + 1000 * k))
            print(f"run {k}: {side}: {json.dumps(runs[side][-1])}", file=sys.stderr)
    for side, results in runs.items():
        report[side] = {key: summary([r[key] for r in results]) for key in results[0]}
    sao, grpo = report["sao"], report["grpo"]
    report["ratios_sao_over_grpo"] = {key: sao[key]["mean"] / grpo[key]["mean"] for key in ("wall_s", "train_stage_s", "update_loop_s")}
    report["critic_share_of_sao_loop"] = sao["critic_s"]["mean"] / sao["update_loop_s"]["mean"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
