"""Memory at a size where it matters: one train-grpo update by 2 ZeRO-3 ranks vs one process.

A random-init Qwen3 layout (``--hidden`` 1,024, ``--layers`` 16, 16 / 8 heads, intermediate 4,096,
the quickstart's 512-id tokenizer: 252.7M parameters; ``shared/notes/scale-baseline.md``), saved in
size-bounded safetensors shards. 16 trajectories (rollout + judge with
``recipes/tiny-reasoning-rl.toml``), then one ``train-grpo`` update (``--epochs 1 --mini-batches 1``)
as one process and as ``torchrun --nproc_per_node 2 ... --zero-stage 3``. Each process's peak RSS
(``VmHWM``, loading and saving included) is read from its ``/proc/PID/status`` while it runs; the
worst rank is reported, and its ratio to the one process (goal <= 0.6); rank 0's peak when loading
is done (the stage logs it, with its resident memory before loading) against the full float32
model, as what loading added and above what the interpreter holds with torch, transformers and
DeepSpeed imported (goal <= 0.55: ZeRO-3 creates the parameters partitioned and each rank reads
its share, so no rank loads the whole model).

    .venv/bin/python benchmarks/bench_scale.py --out runs/bench_scale.json
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from reporting import emit

ROOT = Path(__file__).resolve().parents[1]
GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]
RECIPE = ROOT / "recipes" / "tiny-reasoning-rl.toml"


def hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run_watched(command: list[str], env: dict) -> tuple[dict[int, int], str]:
    """Run ``command``; the peak RSS (KiB) of it and every process under it, by pid, and its stderr."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peaks: dict[int, int] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            stack = [process.pid]
            while stack:
                pid = stack.pop()
                peaks[pid] = max(peaks.get(pid, 0), hwm_kib(pid))
                stack.extend(children(pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = process.communicate()
    done.set()
    watcher.join()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{err[-3000:]}")
    return peaks, err


def build(work: Path, hidden: int, layers: int) -> tuple[Path, int]:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tiny = work / "tiny"
    subprocess.run([*GLMPOST, "init-model", "--out", str(tiny)], check=True, capture_output=True, cwd=ROOT)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    config = Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    folder = work / "model"
    model.save_pretrained(folder, max_shard_size="200MB")
    tokenizer.save_pretrained(folder)
    return folder, parameters


def run_layout(measure_in, description: str, prefix: str) -> None:
    """A benchmark's command line on a layout (--hidden, --layers; default the 253M one) and --out:
    ``measure_in(work, hidden, layers)`` in a scratch folder, emitted."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix=prefix) as work:  # several GiB of checkpoints: gone afterwards
        emit(measure_in(Path(work), args.hidden, args.layers), args.out)


def main() -> None:
    run_layout(measure, __doc__, "bench-scale-")


def judged_batch(work: Path, model: Path, env: dict) -> list[str]:
    """Roll out and judge 4 prompts x 4 samples of the count task with ``model`` into ``work/judged``;
    returns the train-grpo arguments (after the command name) of one update on them."""
    common = ["--config", str(RECIPE)]
    subprocess.run([*GLMPOST, "rollout", str(ROOT / "recipes" / "data" / "count-train.jsonl"), *common, "--checkpoint", str(model),
                    "--out", str(work / "rollout"), "--limit", "4", "--group-size", "4", "--max-new-tokens", "16", "--seed", "3"],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    subprocess.run([*GLMPOST, "judge", str(work / "rollout"), *common, "--checkpoint", str(model), "--out", str(work / "judged")],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    return ["train-grpo", str(work / "judged"), *common, "--checkpoint", str(model), "--epochs", "1", "--mini-batches", "1"]


def measure(work: Path, hidden: int, layers: int) -> dict:
    env = {**os.environ, "TQDM_DISABLE": "1", "DS_ACCELERATOR": "cpu"}
    model, parameters = build(work, hidden, layers)
    train = judged_batch(work, model, env)
    started = time.perf_counter()
    imports, _ = run_watched([sys.executable, "-c", "import deepspeed, transformers, glmpost.rl.run"], env)
    one, _ = run_watched([*GLMPOST, *train, "--out", str(work / "one")], env)
    one_s = time.perf_counter() - started
    started = time.perf_counter()
    ranks, err = run_watched([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29561",
                         "-m", "glmpost.commands.app", *train, "--out", str(work / "zero3"), "--zero-stage", "3"], env)
    zero3_s = time.perf_counter() - started
    one_peak = max(one.values()) / 1024
    rank_peaks = sorted(ranks.values())[-2:]  # the two ranks (the launcher itself is small)
    full_fp32 = parameters * 4 / 2**20
    interpreter = max(imports.values()) / 1024  # python, torch, transformers, DeepSpeed: before any model
    found = re.search(r"resident before loading: ([\d,]+) MiB; peak so far: ([\d,]+) MiB", err)
    before, loading = (float(found.group(i).replace(",", "")) for i in (1, 2))
    report = {"parameters": parameters, "full_fp32_mib": round(full_fp32, 1), "one_process_peak_mib": round(one_peak, 1),
              "one_process_s": round(one_s, 1), "zero3_rank_peaks_mib": [round(p / 1024, 1) for p in rank_peaks],
              "zero3_s": round(zero3_s, 1), "zero3_worst_vs_one": round(rank_peaks[-1] / 1024 / one_peak, 3),
              "interpreter_mib": round(interpreter, 1), "zero3_rank0_loading_peak_mib": loading,
              "zero3_loading_above_interpreter_vs_full_fp32": round((loading - interpreter) / full_fp32, 3),
              "zero3_rank0_before_loading_mib": before,
              "zero3_loading_added_vs_full_fp32": round((loading - before) / full_fp32, 3),
              "published_files": sorted(p.name for p in (work / "zero3" / "v000001").glob("*.safetensors*"))}
    return report


if __name__ == "__main__":
    main()
