"""``glmpost serve`` (SGLang's native API subset), the SGLang client and ``rollout --engine sglang``.

Every server here is a real ``glmpost serve`` process on 127.0.0.1 with ``--port 0``
(tests/test_serve_sglang.py: API keys, ``/server_info``, stop strings, log-prob kinds).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from serve_process import start_server, stop_server

from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.kernel.engine import SamplingParams
from glmpost.kernel.sglang_client import SGLangClient, ServerError, parse_server_urls
from glmpost.kernel.sglang_pool import SGLangPool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(tmp_path, count=4):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "domain": "count"}) + "\n" for d in range(count)))
    return path


def _records(directory):
    return [r for p in resolve_shard_paths([directory]) for r in ShardReader(p)]


def test_generate_answers_as_sglang_shapes_them(server, engine):
    client = SGLangClient(server)
    assert client.health() == {} and client.get_weight_version() == "0"
    info = client.model_info()
    assert info["weight_version"] == "0" and info["tokenizer_revision"].startswith("sha256:")
    assert info["architectures"] == ["GlmMoeDsaForCausalLM"] and info["is_generation"] is True

    prompt, seed = [5, 6, 7, 8, 9], 1234
    answer = client.generate(prompt, {"max_new_tokens": 4, "temperature": 0.8, "top_k": 50, "ignore_eos": True,
                                      "sampling_seed": seed}, logprob_start_len=2, top_logprobs_num=3)
    meta = answer["meta_info"]
    local = engine.generate([prompt], None, SamplingParams(temperature=0.8, top_k=50, max_new_tokens=4,  # serve's default kind
                                                           log_prob_kind="tempered"), seeds=[seed], top_logprobs_num=3)[0]
    assert answer["output_ids"] == local.token_ids and len(local.token_ids) == 4
    assert meta["output_token_logprobs"] == [[lp, t, None] for lp, t in zip(local.log_probs, local.token_ids)]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (5, 4, "0")
    # input_token_logprobs: positions 2..4, the first without a log-prob (SGLang's leading None)
    assert [e[1] for e in meta["input_token_logprobs"]] == [7, 8, 9] and meta["input_token_logprobs"][0][0] is None
    scored = engine.score([prompt], [3], top_logprobs_num=3)[0]
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == scored.log_probs
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 3
    assert [[e[1] for e in row] for row in meta["input_top_logprobs"][1:]] == scored.top_ids
    for row in meta["output_top_logprobs"]:  # k entries per output token, most likely first
        assert len(row) == 3 and row[0][0] >= row[1][0] >= row[2][0]
    # the input log-probs are the model's own: they match an independent log_softmax
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[[2, 3], [8, 9]]
    np.testing.assert_allclose([e[0] for e in meta["input_token_logprobs"][1:]], expected.numpy(), atol=1e-5)

    # stop tokens: finish_reason stop with the matched id, the stop token kept
    stop = local.token_ids[1]
    stopped = client.generate(prompt, {"max_new_tokens": 4, "temperature": 0.8, "top_k": 50, "ignore_eos": False,
                                       "stop_token_ids": [stop], "sampling_seed": seed})
    assert stopped["output_ids"] == local.token_ids[:2]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # a batch request answers a list; max_new_tokens 0 scores the input only
    batch = client.generate([prompt, [9, 8]], {"max_new_tokens": 0}, logprob_start_len=0)
    assert isinstance(batch, list) and [b["output_ids"] for b in batch] == [[], []]
    assert batch[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(batch[0]["meta_info"]["input_token_logprobs"]) == 5 and len(batch[1]["meta_info"]["input_token_logprobs"]) == 2
    assert client.score(prompt, 3)["token_log_probs"] == scored.log_probs


def test_concurrent_requests_are_batched_and_counted(server, engine):
    """Single requests from 8 concurrent clients share engine batches; each answer is still the
    one its own sampling_seed gives alone, and /get_server_info counts what was done."""
    from concurrent.futures import ThreadPoolExecutor

    client = SGLangClient(server, retries=0)
    before = client.request("GET", "/get_server_info")
    prompts = [[5 + i % 7, 6, 7, 8] for i in range(16)]

    def one(i):
        return client.generate(prompts[i], {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True,
                                            "sampling_seed": 100 + i})["output_ids"]

    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(one, range(16)))
    after = client.request("GET", "/get_server_info")
    alone = [engine.generate([p], None, SamplingParams(temperature=1.0, max_new_tokens=4), seeds=[100 + i])[0].token_ids
             for i, p in enumerate(prompts)]
    assert served == alone
    delta = {key: after["stats"][key] - before["stats"][key] for key in after["stats"]}
    assert (delta["requests"], delta["sequences"], delta["generated_tokens"]) == (16, 16, 64)
    assert 2 <= delta["batches"] < 16  # merged: fewer engine batches than requests (at most 8 per batch)
    assert delta["engine_busy_s"] > 0 and after["weight_version"] == "0" and after["batch_size"] == 8


def test_a_request_extending_a_cached_sequence_prefills_only_its_new_tokens(server, engine):
    """The next turn of a trajectory (input_ids = the last prompt, its output, an observation) reads
    the cached part from the server's prefix cache (meta_info.cached_tokens: every id the engine fed,
    i.e. all but the last output token) and samples what a full prefill samples."""
    client = SGLangClient(server, retries=0)
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    first_prompt = [31, 32, 33, 34, 35, 36, 37]
    first = client.generate(first_prompt, {**sampling, "sampling_seed": 7})
    assert first["meta_info"]["cached_tokens"] == 0
    second_prompt = first_prompt + first["output_ids"] + [40, 41, 42]
    before = client.request("GET", "/get_server_info")["stats"]["cached_tokens"]
    second = client.generate(second_prompt, {**sampling, "sampling_seed": 8})
    assert second["meta_info"]["cached_tokens"] == len(first_prompt) + len(first["output_ids"]) - 1
    assert client.request("GET", "/get_server_info")["stats"]["cached_tokens"] - before == second["meta_info"]["cached_tokens"]
    fresh = engine.generate([second_prompt], None, SamplingParams(temperature=1.0, max_new_tokens=6), seeds=[8])[0]
    assert second["output_ids"] == fresh.token_ids
    np.testing.assert_allclose([e[0] for e in second["meta_info"]["output_token_logprobs"]], fresh.log_probs, atol=1e-5)


def test_metrics_file_gets_the_counters_periodically_and_at_stop(tiny_checkpoint, tmp_path):
    metrics = tmp_path / "serve-metrics.jsonl"
    proc, url = start_server(tiny_checkpoint, "--metrics", metrics, "--metrics-interval", "0.2")
    try:
        client = SGLangClient(url, retries=0)
        for seed in (1, 2):
            client.generate([5, 6, 7], {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed})
        time.sleep(0.6)
    finally:
        stop_server(proc)
    assert proc.returncode == 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(lines) >= 3 and [line["serve/final"] for line in lines].count(True) == 1 and lines[-1]["serve/final"]
    last = lines[-1]
    assert (last["serve/requests"], last["serve/sequences"], last["serve/generated_tokens"]) == (2, 2, 6)
    assert last["serve/weight_version"] == "0" and last["serve/engine_busy_s"] > 0 and last["serve/batches"] in (1, 2)
    # tokens/s of each interval times its length adds up to the tokens generated
    uptimes = [0.0] + [line["serve/uptime_s"] for line in lines]
    assert sum(line["serve/tokens_per_s"] * (b - a) for line, a, b in zip(lines, uptimes, uptimes[1:])) == pytest.approx(6, rel=0.05)
    assert all(a["serve/uptime_s"] <= b["serve/uptime_s"] for a, b in zip(lines, lines[1:]))


def test_an_idle_server_sleeps(tiny_checkpoint):
    """An idle server's main thread waits instead of spinning, with or without --metrics (a spin
    would take the GIL from the engine and the HTTP threads)."""
    import os

    proc, _ = start_server(tiny_checkpoint, "--metrics-interval", "0.1")  # ticks, nothing to write
    try:
        def cpu_seconds() -> float:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

        time.sleep(0.5)
        before = cpu_seconds()
        time.sleep(2.0)
        assert cpu_seconds() - before < 0.4
    finally:
        stop_server(proc)
    assert proc.returncode == 0


def test_unwritable_metrics_file_is_a_one_line_usage_error(glmpost_cli, tiny_checkpoint, tmp_path):
    result = glmpost_cli("serve", "--checkpoint", tiny_checkpoint, "--port", "0", "--metrics", tmp_path / "no" / "such" / "m.jsonl")
    assert result.exit_code == 2 and "--metrics" in result.stderr and "Traceback" not in result.stderr


def test_bad_requests_are_json_errors_and_the_server_keeps_serving(server):
    client = SGLangClient(server, retries=0)
    for body, expected in [
        ({"input_ids": [], "sampling_params": {}}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1, 99999], "sampling_params": {}}, "vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hello"}, "input_ids"),
    ]:
        with pytest.raises(ServerError) as info:
            client.request("POST", "/generate", body)
        assert info.value.status == 400 and expected in str(info.value) and not info.value.retryable
    with pytest.raises(ServerError) as info:
        client.request("GET", "/nope")
    assert info.value.status == 404
    assert client.health() == {}


def test_client_retries_then_fails_and_the_pool_fails_over(server):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError) as info:
        SGLangClient(dead, retries=2, backoff=0.01).health()
    assert info.value.retryable and info.value.status is None and "after 3 attempts" in str(info.value)
    assert parse_server_urls(f"{dead}/, 127.0.0.1:1") == [dead, "http://127.0.0.1:1"]
    with SGLangPool([dead, server], concurrency=2, retries=0) as pool:
        versions = pool.map(lambda client, _: client.get_weight_version(), range(4))
    assert versions == ["0"] * 4  # requests meant for the dead server went to the live one


def test_rollout_through_the_server_equals_the_local_engine(glmpost_cli, tiny_checkpoint, tmp_path):
    """A server returning the local engine's kind (serve --log-prob-kind sampled; SGLang's own,
    tempered, is serve's default) gives the local engine's records bit for bit."""
    prompts = _prompts(tmp_path)
    common = [prompts, "--checkpoint", tiny_checkpoint, "--group-size", "3", "--max-new-tokens", "6", "--seed", "11",
              "--batch-size", "5", "--prompts-per-shard", "3", "--temperature", "0.9", "--top-p", "0.95"]
    local = glmpost_cli("rollout", *common, "--out", tmp_path / "local")
    assert local.exit_code == 0, local.stderr
    proc, server = start_server(tiny_checkpoint, "--batch-size", "8", "--log-prob-kind", "sampled")
    try:
        remote = glmpost_cli("rollout", *common, "--out", tmp_path / "remote", "--engine", "sglang", "--server", server,
                             "--concurrency", "3", "--json")
    finally:
        stop_server(proc)
    assert remote.exit_code == 0, remote.stderr
    assert json.loads(remote.stdout)["aborted"] == 0
    a, b = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], np.ndarray):  # token ids, masks, log-probs: bit for bit
                assert x[key].dtype == y[key].dtype and x[key].tobytes() == y[key].tobytes(), key
            elif key == "sampling":
                assert {**x[key], "engine": "sglang"} == y[key]
            else:
                assert x[key] == y[key], key


def test_update_weights_from_disk_swaps_or_refuses(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    root = tmp_path / "root"
    shutil.copytree(tiny_checkpoint, root / "v000000")
    (root / "LATEST").write_text("v000000\n")
    new = root / "v000001"
    shutil.copytree(tiny_checkpoint, new)
    manifest = json.loads((new / "glmpost.json").read_text())
    (new / "glmpost.json").write_text(json.dumps({**manifest, "policy_version": 1}))
    weights = sorted(new.glob("*.safetensors"))[0]
    tensors = load_file(weights)
    tensors = {k: (v * 1.5 if v.is_floating_point() else v) for k, v in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    missing = sorted(load_file(sorted(broken.glob("*.safetensors"))[0]))[0]
    save_file({k: v for k, v in load_file(sorted(broken.glob("*.safetensors"))[0]).items() if k != missing},
              sorted(broken.glob("*.safetensors"))[0], metadata={"format": "pt"})

    proc, url = start_server(root)
    try:
        client = SGLangClient(url)
        request = ([3, 4, 5], {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 5})
        before = client.generate(*request)
        for path, reason in [(tmp_path / "nowhere", "does not exist"), (broken, f"missing tensors {missing}")]:
            answer = client.update_weights_from_disk(str(path), weight_version="9")
            assert answer["success"] is False and reason in answer["message"]
            assert client.get_weight_version() == "0"
            assert client.generate(*request)["output_ids"] == before["output_ids"]
        answer = client.update_weights_from_disk(str(new), weight_version="1")
        assert answer["success"] is True and client.get_weight_version() == "1"
        assert client.model_info()["model_path"] == str(new) and client.model_info()["policy_version"] == 1
        after = client.generate(*request)
        assert after["meta_info"]["weight_version"] == "1"
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    finally:
        stop_server(proc)


def test_unreachable_server_is_a_one_line_error(glmpost_cli, tiny_checkpoint, tmp_path):
    result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o",
                         "--engine", "sglang", "--server", f"127.0.0.1:{free_port()}", "--retries", "0")
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "unreachable" in result.stderr and "Traceback" not in result.stderr
    missing = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "o",
                          "--engine", "sglang")
    assert missing.exit_code == 2 and "--server" in missing.stderr


def test_a_server_killed_mid_run_leaves_aborted_records_with_reasons(tiny_checkpoint, tmp_path):
    proc, url = start_server(tiny_checkpoint)
    out = tmp_path / "out"
    rollout = subprocess.Popen(
        [sys.executable, "-m", "glmpost.commands.app", "rollout", str(_prompts(tmp_path, 8)), "--checkpoint",
         str(tiny_checkpoint), "--out", str(out), "--group-size", "4", "--max-new-tokens", "24", "--stop-token-ids", "none",
         "--prompts-per-shard", "1", "--batch-size", "4", "--engine", "sglang", "--server", url, "--retries", "1",
         "--timeout", "20", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("rollout-*.msgpack.zst")) and rollout.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()  # the server dies with the rest of the prompts still to do
        stdout, stderr = rollout.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert rollout.returncode == 0, stderr
    summary = json.loads(stdout)
    records = _records(out)
    assert len(records) == summary["records"] == 32  # no prompt is lost
    aborted = [r for r in records if r["status"] == "aborted"]
    assert 0 < len(aborted) == summary["aborted"] < 32
    for record in aborted:
        assert url in record["extra"]["status_reason"] and len(record["response_token_ids"]) == 0
    assert records[0]["status"] == "truncated" and len(records[0]["response_token_ids"]) == 24


# ----------------------------------------------------------------------------- SGLang fidelity (issue 14)
