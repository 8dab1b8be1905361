"""Asynchronous vs synchronous agentic RL: wall-clock to train N trajectories, and the held-out reward.

The tiny GLM-5 after the quickstart's calculator warm start (init-model seed 0, SFT on
``recipes/data/calc-demo.jsonl`` with ``recipes/tiny-agentic.toml``'s [qat]); the environment is the
calculator behind ``latency`` (each tool step delayed log-normally: median ``--median-s``, shape
``--sigma``: a long tail), tool-use reward 1. Both sides train ``--iterations`` versions of 128
trajectories (the 16 ``calc-train`` prompts x group 8) with ``tiny-agentic.toml``'s hyper-parameters:

* ``sync``: ``--iterations`` x (``rollout`` -> ``judge`` -> ``train-grpo``), each stage a process that
  starts, works and exits, in turn (the shell loop of the README);
* ``async``: ``rollout --follow`` (up to twice the iterations in rounds, stopped when the trainer is
  done; parts of 2 prompts published when complete, switching to each new version) | ``judge --follow`` | ``train-grpo --follow
  --follow-records 128 --max-versions ITERATIONS --max-version-lag 4`` (DIS and the recipe's
  ``--max-staleness 2`` on lagged records), side by side.

``--max-queued Q`` makes the async producers wait while Q shards wait in the two spools (the
producer-side staleness bound). ``--rollout-tasks N`` runs N rollout processes on each side (sync: a Slurm array's N tasks per
iteration, side by side; async: N producers of the spool). Reported: wall-clock per side and the ratio sync / async (goal >= 2x), records trained and dropped,
and the held-out tool-use reward of each final policy (``calc-heldout``, 4 samples per prompt, seed
1000, no latency) with the warm start's for reference. Both outcomes depend on the sampling seed,
the async one also on which shards land before which version: ``--repeats R`` runs each side R
times (run k from seed 1 + 1000 k) and reports mean and sd of wall-clock and held-out reward, and
per async run the trained records per version lag.

    .venv/bin/python benchmarks/bench_async.py --repeats 3 --out runs/bench_async.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-agentic.toml"
GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def glmpost(*args, log: Path) -> None:
    with open(log, "ab") as err:
        subprocess.run([*GLMPOST, *map(str, args)], check=True, stdout=subprocess.DEVNULL, stderr=err, env=ENV)


def warm_start(work: Path, log: Path, *, demos: Path = ROOT / "recipes/data/calc-demo.jsonl", recipe: Path = RECIPE) -> Path:
    """The tiny model (init-model seed 0) after ``recipe``'s [qat] SFT on ``demos``, made once under ``work``."""
    model, demo, sft = work / "model", work / "demo", work / "sft"
    if not (model / "config.json").is_file():
        glmpost("init-model", "--out", model, "--seed", "0", log=log)
    if not demo.is_dir():
        glmpost("shards", "import", demos, "--checkpoint", model, "--out", demo, log=log)
    if not (sft / "LATEST").is_file():
        glmpost("qat", demo, "--config", recipe, "--checkpoint", model, "--out", sft, log=log)
    return sft


def env_args(args) -> list[str]:
    options = {"inner": "calculator", "inner_options": {"tool_reward": 1.0}, "median_s": args.median_s, "sigma": args.sigma}
    return ["--env", "latency", "--env-options", json.dumps(options)]


def train_args(args) -> list[str]:
    """Both sides' train-grpo overrides of the recipe (matched hyper-parameters)."""
    return [*(("--lr", str(args.lr)) if args.lr is not None else ()), *(("--epochs", str(args.epochs)) if args.epochs is not None else ())]


def run_sync(args, sft: Path, work: Path, log: Path, *, seed: int) -> float:
    root = work / "sync-policy"
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    for i in range(1, args.iterations + 1):
        checkpoint = root if (root / "LATEST").is_file() else sft
        it = work / f"sync-it{i}"
        tasks = [subprocess.Popen([*GLMPOST, *map(str, ("rollout", ROOT / "recipes/data/calc-train.jsonl", "--config", RECIPE,
                                                         "--checkpoint", checkpoint, "--out", it / "rollout", "--seed", seed + i - 1,
                                                         "--prompts-per-shard", 16 // args.rollout_tasks, "--shard-index", task,
                                                         "--num-shards", args.rollout_tasks, *env_args(args)))],
                                  stdout=subprocess.DEVNULL, stderr=open(log, "ab"), env=ENV)
                 for task in range(args.rollout_tasks)]  # a Slurm array's tasks, here side by side
        if any(task.wait() != 0 for task in tasks):
            raise SystemExit(f"sync rollout failed (see {log})")
        glmpost("judge", it / "rollout", "--config", RECIPE, "--checkpoint", checkpoint, "--out", it / "judged", log=log)
        glmpost("train-grpo", it / "judged", "--config", RECIPE, "--checkpoint", checkpoint, "--out", root, *train_args(args), log=log)
    return time.perf_counter() - started


def run_async(args, sft: Path, work: Path, log: Path, *, seed: int) -> tuple[float, dict]:
    root, rolled, judged = work / "async-policy", work / "async-rolled", work / "async-judged"
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)

    def start(*cli):
        return subprocess.Popen([*GLMPOST, *map(str, cli)], stdout=subprocess.PIPE, stderr=open(log, "ab"), env=ENV, text=True)

    started = time.perf_counter()
    rollouts = [start("rollout", ROOT / "recipes/data/calc-train.jsonl", "--config", RECIPE, "--checkpoint", sft, "--follow", rolled,
                      "--reload-root", root, "--max-rounds", 2 * args.iterations, "--prompts-per-shard", "2", "--seed", seed,
                      "--shard-index", task, "--num-shards", args.rollout_tasks, *env_args(args),
                      *(("--max-queued", args.max_queued, "--queue", judged) if args.max_queued else ()))
                for task in range(args.rollout_tasks)]
    judge = start("judge", "--config", RECIPE, "--checkpoint", sft, "--follow", rolled, "--out", judged, "--poll-s", "0.1")
    trainer = start("train-grpo", "--config", RECIPE, "--checkpoint", sft, "--follow", judged, "--out", root, "--follow-records", "128",
                    "--max-versions", args.iterations, "--max-version-lag", "4", "--poll-s", "0.1", "--idle-timeout", "120", "--json",
                    *train_args(args),
                    *(("--max-staleness", args.max_staleness) if args.max_staleness is not None else ()))
    out, _ = trainer.communicate()
    seconds = time.perf_counter() - started
    for process in (*rollouts, judge):
        process.terminate()
        process.wait()
    if trainer.returncode != 0:
        raise SystemExit(f"async trainer failed (see {log})")
    return seconds, json.loads(out)


def staleness(root: Path) -> dict[str, int]:
    """Trained records per version lag, over the async trainer's versions (its follow/version_lag/L)."""
    lags: dict[str, int] = {}
    for line in (root / "metrics.jsonl").read_text().splitlines():
        for key, value in json.loads(line).items():
            if key.startswith("follow/version_lag/"):
                lag = key.rsplit("/", 1)[1]
                lags[lag] = lags.get(lag, 0) + int(value)
    return dict(sorted(lags.items()))


def mean_sd(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": round(mean, 3), "sd": round(sd, 3), "runs": [round(v, 3) for v in values]}


def held_out(checkpoint: Path, out: Path, log: Path) -> float:
    if not (out / "metrics.jsonl").is_file():
        glmpost("rollout", ROOT / "recipes/data/calc-heldout.jsonl", "--config", RECIPE, "--checkpoint", checkpoint, "--out", out,
                "--group-size", "4", "--seed", "1000", log=log)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "rollout/env_reward_mean" in line][-1]["rollout/env_reward_mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rollout-tasks", type=int, default=1, help="rollout processes per side (sync: per iteration)")
    parser.add_argument("--max-queued", type=int, default=None, help="async producers' --max-queued (shards waiting in both spools)")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="the async trainer's --max-staleness (default: the recipe's 2)")
    parser.add_argument("--lr", type=float, default=None, help="both sides' train-grpo --lr (default: the recipe's)")
    parser.add_argument("--epochs", type=int, default=None, help="both sides' train-grpo --epochs (default: the recipe's)")
    parser.add_argument("--median-s", type=float, default=0.02)
    parser.add_argument("--sigma", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per side, run k sampling from seed 1 + 1000 k (both sides alike)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_async")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "stages.log"
    sft = warm_start(args.work, log)
    sync_runs, async_runs = [], []
    for repeat in range(args.repeats):
        seed = 1 + 1000 * repeat
        work = args.work / f"sync-{repeat}"
        seconds = run_sync(args, sft, work, log, seed=seed)
        sync_runs.append({"seconds": seconds, "reward": held_out(work / "sync-policy", work / "eval", log)})
        print(f"sync {repeat}: {seconds:.1f} s, held-out reward {sync_runs[-1]['reward']:.3f}", flush=True)
        work = args.work / f"async-{repeat}"
        seconds, summary = run_async(args, sft, work, log, seed=seed)
        async_runs.append({"seconds": seconds, "summary": summary, "staleness": staleness(work / "async-policy"),
                           "shards_sampled": len(list((work / "async-rolled").glob("*/*.msgpack.zst"))),
                           "reward": held_out(work / "async-policy", work / "eval", log)})
        print(f"async {repeat}: {seconds:.1f} s ({summary['versions']}, {summary['dropped_records']} records dropped, "
              f"staleness {async_runs[-1]['staleness']}, held-out reward {async_runs[-1]['reward']:.3f})", flush=True)
    sync_s, async_s = mean_sd([run["seconds"] for run in sync_runs]), mean_sd([run["seconds"] for run in async_runs])
    result = {
        "iterations": args.iterations, "trajectories_per_version": 128, "rollout_tasks": args.rollout_tasks,
        "max_queued": args.max_queued, "max_staleness": args.max_staleness, "lr": args.lr, "epochs": args.epochs, "latency": {"median_s": args.median_s, "sigma": args.sigma}, "repeats": args.repeats,
        "sync_s": sync_s, "async_s": async_s, "speedup": round(sync_s["mean"] / async_s["mean"], 2),
        "async_dropped_records": [run["summary"]["dropped_records"] for run in async_runs],
        "async_stale_dropped": [run["summary"]["stale_dropped"] for run in async_runs],
        "async_trainer_idle_fraction": mean_sd([run["summary"]["idle_fraction"] for run in async_runs]),
        "async_shards_sampled": [run["shards_sampled"] for run in async_runs],
        "async_staleness": [run["staleness"] for run in async_runs],
        "held_out_reward": {"warm_start": held_out(sft, args.work / "eval-warm", log),
                            "sync": mean_sd([run["reward"] for run in sync_runs]),
                            "async": mean_sd([run["reward"] for run in async_runs])},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
