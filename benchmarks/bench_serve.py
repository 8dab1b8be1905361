"""Serving throughput: ``glmpost serve`` under concurrent HTTP clients vs the in-process engine.

Both sides run in this one process (with ``--server-process`` the server runs as a real
``glmpost serve`` process, as a deployment runs it, and only the clients share this process) on one tiny GLM-5 checkpoint (``glmpost init-model --seed 0``,
written to a temporary directory) with the same requests: ``--requests`` single-prompt requests
("count: d", 6 tokens), each generating exactly ``--new-tokens`` tokens (no stop ids), temperature 1,
each with its own ``sampling_seed``.

Sides (timed: all requests, best of ``--repeats``, interleaved):

* ``serve``: the ``glmpost serve`` stack (``glmpost.server.EngineServer`` behind its
  ``ThreadingHTTPServer`` on 127.0.0.1, port picked free) with ``--concurrency`` client threads
  (``SGLangClient.generate`` over HTTP, JSON, one request per prompt); the engine thread batches
  whatever requests are waiting, up to ``--batch-size``.
* ``local``: ``LocalEngine.generate`` on the same prompts and seeds in batches of ``--concurrency``
  (what the server can at best batch with that many clients), no HTTP.

Reported: generated tokens/s of each and ``serve / local`` (goal >= 0.8). Sanity (untimed): the
server's tokens equal the in-process engine's for the same seeds.

    .venv/bin/python benchmarks/bench_serve.py --out runs/bench_serve.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 keeps torch's default)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--server-process", action="store_true",
                        help="run `glmpost serve` as its own process (as a deployment does) instead of in this one")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    from glmpost.commands.app import main as glmpost_main
    from glmpost.engine import SamplingParams
    from glmpost.server import EngineServer, bound_address, make_http_server
    from glmpost.sglang_client import SGLangClient

    tmp = Path(tempfile.mkdtemp(prefix="bench_serve."))
    try:
        glmpost_main(["init-model", "--out", str(tmp / "ckpt"), "--seed", "0"])
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    engine_server = EngineServer(tmp / "ckpt", device="cpu", batch_size=args.batch_size)
    tokenizer = engine_server.loaded.tokenizer
    server_proc = None
    if args.server_process:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or torch.get_num_threads())}
        server_proc = subprocess.Popen([sys.executable, "-m", "glmpost.commands.app", "serve", "--checkpoint", str(tmp / "ckpt"),
                                   "--port", "0", "--batch-size", str(args.batch_size), "--device", "cpu"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        ready = server_proc.stdout.readline()
        if "listening on" not in ready:
            raise SystemExit(f"glmpost serve did not start: {ready!r}")
    prompts = [tokenizer(f"count: {i % 10}")["input_ids"] for i in range(args.requests)]
    seeds = list(range(1000, 1000 + args.requests))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[])
    http = make_http_server(engine_server, "127.0.0.1", 0)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    engine_server.start()
    host, port = bound_address(http)
    url = ready.strip().rsplit(" ", 1)[-1] if server_proc else f"http://{host}:{port}"
    client = SGLangClient(url, retries=0)
    engine = engine_server.loaded.engine  # the same model object serves both sides
    tokens = args.requests * args.new_tokens

    def run_serve():
        def one(i):
            sp = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seeds[i]}
            return client.generate(prompts[i], sp)["output_ids"]
        with ThreadPoolExecutor(args.concurrency) as pool:
            return list(pool.map(one, range(args.requests)))

    def run_local():
        out = []
        for start in range(0, args.requests, args.concurrency):
            out += [c.token_ids for c in engine.generate(prompts[start:start + args.concurrency], None, params,
                                                         seeds=seeds[start:start + args.concurrency])]
        return out

    served, local = run_serve(), run_local()  # warm-up and sanity
    assert all(len(t) == args.new_tokens for t in served + local)
    same = sum(a == b for a, b in zip(served, local)) / args.requests
    times = {"serve": [], "local": []}
    for r in range(args.repeats):
        for name, fn in (("serve", run_serve), ("local", run_local)) if r % 2 == 0 else (("local", run_local), ("serve", run_serve)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    http.shutdown()
    engine_server.stop()
    if server_proc:
        server_proc.terminate()
        server_proc.wait(timeout=30)
    rows = {name: {"best_s": min(t), "tokens_per_s": tokens / min(t), "times_s": t} for name, t in times.items()}
    result = {
        "benchmark": "bench_serve",
        "requests": args.requests, "concurrency": args.concurrency, "batch_size": args.batch_size,
        "new_tokens": args.new_tokens, "server_process": args.server_process, "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "same_tokens_fraction": same,
        "sides": rows,
        "ratio_serve_over_local": rows["serve"]["tokens_per_s"] / rows["local"]["tokens_per_s"],
        "goal": ">= 0.8",
    }
    print(f"serve: {rows['serve']['tokens_per_s']:.1f} tokens/s ({args.concurrency} clients), "
          f"local: {rows['local']['tokens_per_s']:.1f} tokens/s (batches of {args.concurrency}), "
          f"ratio {result['ratio_serve_over_local']:.2f} (goal >= 0.8); same tokens {same:.0%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
