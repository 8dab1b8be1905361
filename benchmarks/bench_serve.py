"""Serving throughput: ``glmpost serve`` under concurrent HTTP clients vs the in-process engine.

One tiny GLM-5 checkpoint (``glmpost init-model --seed 0``, written to a temporary directory),
the same requests on both sides: ``--requests`` single-prompt requests ("count: d", 6 tokens), each
generating exactly ``--new-tokens`` tokens (no stop ids), temperature 1, each with its own
``sampling_seed``.

Sides (timed: all requests, best of ``--repeats``, interleaved):

* ``serve``: ``glmpost serve`` as its own process (as a deployment runs it) on 127.0.0.1, port
  picked free, with ``--concurrency`` client threads in this process (``SGLangClient.generate``
  over HTTP, JSON, one request per prompt); the engine thread batches whatever requests are
  waiting, up to ``--batch-size``. ``--in-process`` runs the server in this process instead, so
  the clients share its interpreter (and its GIL).
* ``local``: ``LocalEngine.generate`` in this process on the same prompts and seeds in batches of
  ``--concurrency`` (what the server can at best batch with that many clients), no HTTP.

Both engines run on the same CPU: on a machine with two or more CPUs the server process and the
``local`` side are pinned to one CPU and the client threads to another (``--no-pin`` turns this
off), so the ratio compares the two stacks, not two CPUs of a shared virtual machine.

Reported: generated tokens/s of each and ``serve / local`` (goal >= 0.8); per serve run, the
engine batches and the fraction of the wall time the server's engine was busy (from
``GET /get_server_info``). Sanity (untimed): the server's tokens equal the in-process engine's for
the same seeds.

    .venv/bin/python benchmarks/bench_serve.py --out runs/bench_serve.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="client threads (and the local side's batch)")
    parser.add_argument("--batch-size", type=int, default=32, help="the server's --batch-size")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 keeps torch's default)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--in-process", action="store_true",
                        help="run the server in this process (clients share its interpreter) instead of as `glmpost serve`")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the engines and the clients to CPUs")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    from glmpost.commands.app import main as glmpost_main
    from glmpost.kernel.engine import SamplingParams
    from glmpost.kernel.loading import load_tokenizer
    from glmpost.kernel.sglang_client import SGLangClient
    from glmpost.server.engine import EngineServer
    from glmpost.server.loading import load_checkpoint
    from glmpost.server.http import bound_address, make_http_server

    tmp = Path(tempfile.mkdtemp(prefix="bench_serve."))
    try:
        glmpost_main(["init-model", "--out", str(tmp / "ckpt"), "--seed", "0"])
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = not args.no_pin and len(cpus) >= 2
    engine_cpu, client_cpu = (cpus[0], cpus[1]) if pin else (None, None)

    def on_cpu(cpu):  # this thread, and the threads and processes it starts from now on
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    on_cpu(engine_cpu)
    engine_server = http = server_proc = None
    if args.in_process:
        engine_server = EngineServer(tmp / "ckpt", device="cpu", batch_size=args.batch_size)
        http = make_http_server(engine_server, "127.0.0.1", 0)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        engine_server.start()
        host, port = bound_address(http)
        url = f"http://{host}:{port}"
        engine = engine_server.loaded.engine  # the same model object serves both sides
    else:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or torch.get_num_threads())}
        server_proc = subprocess.Popen([sys.executable, "-m", "glmpost.commands.app", "serve", "--checkpoint", str(tmp / "ckpt"),
                                        "--port", "0", "--batch-size", str(args.batch_size), "--device", "cpu"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        ready = server_proc.stdout.readline()
        if "listening on" not in ready:
            raise SystemExit(f"glmpost serve did not start: {ready!r}")
        url = ready.strip().rsplit(" ", 1)[-1]
        engine = load_checkpoint(tmp / "ckpt", device="cpu", batch_size=args.batch_size, deterministic_topk=True).engine
    tokenizer, _ = load_tokenizer(tmp / "ckpt")
    prompts = [tokenizer(f"count: {i % 10}")["input_ids"] for i in range(args.requests)]
    seeds = list(range(1000, 1000 + args.requests))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[])
    client = SGLangClient(url, retries=0)
    tokens = args.requests * args.new_tokens

    def run_serve():
        on_cpu(client_cpu)
        def one(i):
            sp = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seeds[i]}
            return client.generate(prompts[i], sp)["output_ids"]
        with ThreadPoolExecutor(args.concurrency) as pool:
            return list(pool.map(one, range(args.requests)))

    def run_local():
        on_cpu(engine_cpu)
        out = []
        for start in range(0, args.requests, args.concurrency):
            out += [c.token_ids for c in engine.generate(prompts[start:start + args.concurrency], None, params,
                                                         seeds=seeds[start:start + args.concurrency])]
        return out

    served, local = run_serve(), run_local()  # warm-up and sanity
    assert all(len(t) == args.new_tokens for t in served + local)
    same = sum(a == b for a, b in zip(served, local)) / args.requests
    times = {"serve": [], "local": []}
    batches, busy = [], []  # per serve run: engine batches, fraction of the wall time the engine ran
    for r in range(args.repeats):
        for name, fn in (("serve", run_serve), ("local", run_local)) if r % 2 == 0 else (("local", run_local), ("serve", run_serve)):
            before = client.request("GET", "/get_server_info")["stats"] if name == "serve" else None
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            if before is not None:
                after = client.request("GET", "/get_server_info")["stats"]
                batches.append(after["batches"] - before["batches"])
                busy.append((after["engine_busy_s"] - before["engine_busy_s"]) / times[name][-1])
    if args.in_process:
        http.shutdown()
        engine_server.stop()
    else:
        server_proc.terminate()
        server_proc.wait(timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = {name: {"best_s": min(t), "tokens_per_s": tokens / min(t), "times_s": t} for name, t in times.items()}
    result = {
        "benchmark": "bench_serve",
        "requests": args.requests, "concurrency": args.concurrency, "batch_size": args.batch_size,
        "new_tokens": args.new_tokens, "server_process": not args.in_process, "pinned_cpus": {"engines": engine_cpu, "clients": client_cpu}, "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "same_tokens_fraction": same,
        "sides": rows,
        "serve_engine_batches": batches, "serve_engine_busy_fraction": [round(b, 3) for b in busy],
        "ratio_serve_over_local": rows["serve"]["tokens_per_s"] / rows["local"]["tokens_per_s"],
        "goal": ">= 0.8",
    }
    print(f"serve: {rows['serve']['tokens_per_s']:.1f} tokens/s ({args.concurrency} clients), "
          f"local: {rows['local']['tokens_per_s']:.1f} tokens/s (batches of {args.concurrency}), "
          f"ratio {result['ratio_serve_over_local']:.2f} (goal >= 0.8); same tokens {same:.0%}; server engine batches "
          f"per run {batches}, busy {min(busy):.0%}-{max(busy):.0%} of the wall time")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
