"""sync-weights wall time per GB vs copying the same safetensors files (the floor on this disk).

    .venv/bin/python benchmarks/bench_sync.py --work /tmp/bench_sync --out runs/bench_sync.json

A synthetic bf16 GLM-5-architecture checkpoint of a few hundred MB is built once with
``glmpost init-model`` (``--hidden`` etc. set its width; cached in ``--work``). Then, best of
``--repeats`` in this one process (imports warm, one warm-up run first):

- **copy** (the peer): ``shutil.copy`` of every ``*.safetensors`` file to a new directory, then
  ``fsync`` of each file and the directory (a published version must be on disk; ``copy (no
  fsync)`` is reported too);
- **sync-weights --quantize S** for S in none, fp8-block, w4a16: the whole stage as the CLI runs
  it (read + check against the architecture + quantize + write shards + fsync + rename + LATEST)
  into a fresh rollout root, no servers.

Reported as seconds per GB of input weights and as the ratio to the copy (goal: <= 3x).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path


def _glmpost(*args: str) -> None:
    from glmpost.commands.app import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(f"glmpost {' '.join(map(str, args))} failed: {err.getvalue()[-2000:]}") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(files: list[Path], dst: Path, *, fsync: bool) -> None:
    dst.mkdir(parents=True)
    for f in files:
        shutil.copy(f, dst / f.name)
        if fsync:
            _fsync(dst / f.name)
    if fsync:
        _fsync(dst)


def _best(fn, prepare, repeats: int) -> float:
    prepare()
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        prepare()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench_sync"), help="scratch directory (the checkpoint is cached here)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--schemes", default="none,fp8-block,w4a16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    src = args.work / f"ckpt-h{args.hidden}-l{args.layers}-e{args.experts}-m{args.moe_intermediate}-v{args.vocab}"
    if not (src / "glmpost.json").is_file():
        h = args.hidden
        sets = {"hidden_size": h, "intermediate_size": 4 * h, "moe_intermediate_size": args.moe_intermediate,
                "num_hidden_layers": args.layers, "n_routed_experts": args.experts, "num_attention_heads": 8,
                "num_key_value_heads": 8, "q_lora_rank": h // 2, "kv_lora_rank": h // 4, "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 64, "v_head_dim": 128, "index_head_dim": 128, "index_n_heads": 4,
                "vocab_size": args.vocab}
        print(f"building the synthetic checkpoint {src} ...", file=sys.stderr)
        _glmpost("init-model", "--out", src, "--dtype", "bfloat16", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")])
    files = sorted(src.glob("*.safetensors"))
    gb = sum(f.stat().st_size for f in files) / 1e9

    counter = iter(range(10**9))
    targets: dict[str, Path] = {}

    def fresh(name: str):
        def prepare() -> None:
            if name in targets:
                shutil.rmtree(targets[name], ignore_errors=True)
            targets[name] = args.work / f"{name}-{next(counter)}"
        return prepare

    seconds: dict[str, float] = {}
    seconds["copy (fsync)"] = _best(lambda: _copy(files, targets["copy"], fsync=True), fresh("copy"), args.repeats)
    seconds["copy (no fsync)"] = _best(lambda: _copy(files, targets["copyn"], fsync=False), fresh("copyn"), args.repeats)
    for scheme in args.schemes.split(","):
        name = f"sync-weights --quantize {scheme}"
        extra = ["--quantize", scheme]
        seconds[name] = _best(lambda extra=extra, key=scheme: _glmpost("sync-weights", "--checkpoint", src, "--out", targets[key], *extra),
                              fresh(scheme), args.repeats)
    for path in targets.values():
        shutil.rmtree(path, ignore_errors=True)

    floor = seconds["copy (fsync)"]
    print(f"sync-weights vs copy: {len(files)} safetensors file(s), {gb:.3f} GB bf16, best of {args.repeats}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'operation':<34} {'s':>7} {'s/GB':>7} {'vs copy (fsync)':>16}")
    for name, s in seconds.items():
        print(f"{name:<34} {s:>7.3f} {s / gb:>7.3f} {s / floor:>15.2f}x")
    payload = {
        "gb": gb, "seconds": seconds, "seconds_per_gb": {k: v / gb for k, v in seconds.items()},
        "ratio_vs_copy_fsync": {k: v / floor for k, v in seconds.items()}, "goal": "sync-weights <= 3x copy",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
