"""``--engine vllm`` against ``glmpost serve --api vllm`` (the stand-in for vLLM's OpenAI server): the
answers as vLLM shapes them, rollout (single- and multi-turn), score-teacher, diff-logprobs and
sync-weights through it equal to the local engine, the log-prob kinds, and versions only where a
fingerprint confirmed them.

The checkpoint is the wide tiny model (its DSA indexer selects every key on short sequences), so
the server's batches, which vLLM's one-sequence requests make differ from the local engine's, give
the same logits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from serve_process import start_server, stop_server
from test_agentic import STOPS
from test_agentic import _prompts as _turn_prompts
from test_serve import _prompts, _records

from glmpost.config import ConfigError
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.fingerprint import checkpoint_fingerprint, confirm_server, previous_version_dir
from glmpost.kernel.loading import load_model
from glmpost.kernel.server_settings import ServerSettings
from glmpost.kernel.sglang_client import ServerError
from glmpost.kernel.vllm_client import VLLMClient, vllm_settings

ATOL = 1e-6  # float32 engine on both sides


def _call(url, path, body=None, key=None):
    """``(status, decoded JSON or None)`` of a POST of ``body`` (a GET without one)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _post(url, path, body, key=None):
    return _call(url, path, body, key)


def _get(url, path, key=None):
    return _call(url, path, None, key)


@pytest.fixture(scope="module")
def vllm_server(wide_checkpoint):
    """``glmpost serve --api vllm --logprobs-mode processed_logprobs --max-logprobs -1`` of the wide
    checkpoint (diff-logprobs asks for the whole 512-id distribution at every position)."""
    proc, url = start_server(wide_checkpoint, "--api", "vllm", "--logprobs-mode", "processed_logprobs", "--batch-size", "8",
                             "--max-logprobs", "-1")
    yield url
    stop_server(proc)
    assert proc.returncode == 0


def test_completions_answer_as_vllm_shapes_them(vllm_server, wide_checkpoint):
    engine = LocalEngine(load_model(wide_checkpoint), batch_size=8, pad_token_id=0)
    prompt, seed = [5, 6, 7, 8, 9], 1234
    status, answer = _post(vllm_server, "/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "temperature": 0.8, "top_k": 50, "ignore_eos": True, "seed": seed,
        "logprobs": 0, "prompt_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200 and answer["object"] == "text_completion" and answer["model"] == str(wide_checkpoint)
    (choice,) = answer["choices"]
    local = engine.generate([prompt], None, SamplingParams(temperature=0.8, top_k=50, max_new_tokens=4), seeds=[seed])[0]
    assert choice["token_ids"] == local.token_ids and choice["prompt_token_ids"] == prompt
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], local.log_probs, rtol=0, atol=ATOL)
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in local.token_ids]
    assert [list(row) for row in choice["logprobs"]["top_logprobs"]] == [[f"token_id:{t}"] for t in local.token_ids]
    # prompt_logprobs: None first, then the prompt's token (plus the top 2) under its prefix, raw (T = 1)
    scores = engine.score([prompt], [1], top_logprobs_num=2)[0]
    rows = choice["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(prompt)
    for row, token, lp, top in zip(rows[1:], prompt[1:], scores.log_probs, scores.top_ids):
        assert abs(row[str(token)]["logprob"] - lp) <= ATOL and {str(t) for t in top} <= set(row)
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": None,
                               "completion_tokens_details": None}  # vLLM 0.32 answers the details keys (null)
    # max_tokens defaults to 16, as in vLLM, also when null; refused fields are an OpenAI error (HTTP 400)
    status, answer = _post(vllm_server, "/v1/completions", {"prompt": prompt, "ignore_eos": True})
    assert status == 200 and answer["choices"][0]["token_ids"] is None and answer["usage"]["completion_tokens"] == 16
    status, answer = _post(vllm_server, "/v1/completions", {"prompt": prompt, "ignore_eos": True, "max_tokens": None})
    assert status == 200 and answer["usage"]["completion_tokens"] == 16
    status, answer = _post(vllm_server, "/v1/completions", {"prompt": prompt, "temperature": 2.5})
    assert status == 400 and answer["error"]["message"] == "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"
    assert _post(vllm_server, "/reset_prefix_cache", {}) == (200, {"success": True})
    assert _get(vllm_server, "/version") == (200, {"version": "0.32.0"})
    for field, value in (("repetition_penalty", 1.2), ("n", 2), ("stop", ["x"]), ("stream", True), ("min_p", 0.1)):
        status, answer = _post(vllm_server, "/v1/completions", {"prompt": prompt, field: value})
        assert status == 400 and answer["error"]["type"] == "BadRequestError" and field in answer["error"]["message"]
    status, answer = _post(vllm_server, "/v1/completions", {"prompt": "count: 1"})
    assert status == 400 and "token ids" in answer["error"]["message"]
    status, info = _get(vllm_server, "/server_info?config_format=json")
    assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["vllm_env"]["VLLM_BATCH_INVARIANT"] is True


def test_client_maps_settings_and_refuses_logits_modes(vllm_server):
    client = VLLMClient(vllm_server)
    assert client.settings() == {"logprobs_mode": "processed_logprobs", "log_prob_kind": "sampled",
                                 "enable_deterministic_inference": True, "version": "0.32.0"}
    assert client.get_weight_version() is None  # vLLM reports none; nobody confirmed one yet
    assert vllm_settings({"vllm_config": {"model_config": {"logprobs_mode": "raw_logprobs"}},
                          "vllm_env": {"VLLM_BATCH_INVARIANT": False}})["log_prob_kind"] == "raw"
    from glmpost.rollout.vllm_engine import VLLMBackend

    backend = VLLMBackend.__new__(VLLMBackend)
    backend.kind_setting = "auto"
    for mode in ("raw_logits", "processed_logits"):
        settings = ServerSettings(vllm_server, vllm_settings({"vllm_config": {"model_config": {"logprobs_mode": mode}}}))
        with pytest.raises(ConfigError, match=f"returns logits \\(vLLM logprobs_mode {mode}\\)"):
            backend._server_kind(client, settings)


def test_rollout_through_vllm_equals_the_local_engine(glmpost_cli, vllm_server, wide_checkpoint, tmp_path):
    prompts = _prompts(tmp_path)
    common = [prompts, "--checkpoint", wide_checkpoint, "--group-size", "3", "--max-new-tokens", "6", "--seed", "11",
              "--batch-size", "5", "--prompts-per-shard", "3", "--temperature", "0.9", "--top-p", "0.95"]
    assert glmpost_cli("rollout", *common, "--out", tmp_path / "local").exit_code == 0
    remote = glmpost_cli("rollout", *common, "--out", tmp_path / "remote", "--engine", "vllm", "--server", vllm_server,
                         "--concurrency", "3", "--json")
    assert remote.exit_code == 0, remote.stderr
    assert json.loads(remote.stdout)["aborted"] == 0
    a, b = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert x.keys() == y.keys()  # policy_versions too: the fingerprint confirmed the server's weights
        for key in x:
            if key == "rollout_log_probs":
                np.testing.assert_allclose(y[key], x[key], rtol=0, atol=ATOL)
            elif isinstance(x[key], np.ndarray):
                assert x[key].dtype == y[key].dtype and x[key].tobytes() == y[key].tobytes(), key
            elif key == "sampling":  # processed_logprobs is glmpost's sampled, as the local engine records
                assert {**x[key], "engine": "vllm"} == y[key] and y[key]["log_prob_kind"] == "sampled"
            else:
                assert x[key] == y[key], key


def test_multi_turn_through_vllm_equals_the_local_engine(glmpost_cli, vllm_server, wide_checkpoint, tmp_path):
    def run(name, *extra):
        out = tmp_path / name
        result = glmpost_cli("rollout", _turn_prompts(tmp_path), "--checkpoint", wide_checkpoint, "--out", out, "--env",
                             "test_agentic:Countdown", "--group-size", "2", "--max-new-tokens", "16", "--max-turns", "4",
                             "--stop-token-ids", STOPS, "--temperature", "0.8", "--batch-size", "8", *extra)
        assert result.exit_code == 0, result.stderr
        return _records(out)

    local, remote = run("local"), run("remote", "--engine", "vllm", "--server", vllm_server)
    assert len(local) == len(remote) == 8 and any(r["extra"]["env"]["turns"] > 1 for r in remote)
    for x, y in zip(local, remote):
        assert x["response_token_ids"].tolist() == y["response_token_ids"].tolist()
        assert x["segments"] == y["segments"] and x["status"] == y["status"]
        np.testing.assert_array_equal(x["policy_versions"], y["policy_versions"])
        np.testing.assert_allclose(y["rollout_log_probs"], x["rollout_log_probs"], rtol=0, atol=ATOL)


def test_score_teacher_and_diff_logprobs_through_vllm(glmpost_cli, vllm_server, wide_checkpoint, tmp_path):
    prompts = _prompts(tmp_path)
    shards = tmp_path / "rollout"
    assert glmpost_cli("rollout", prompts, "--checkpoint", wide_checkpoint, "--out", shards, "--group-size", "2",
                       "--max-new-tokens", "6", "--stop-token-ids", "none").exit_code == 0
    for payload in ("sampled", "topk"):
        flags = ["--teacher", wide_checkpoint, "--payload", payload, "--topk", "4"]
        local = glmpost_cli("score-teacher", shards, "--out", tmp_path / f"l-{payload}", *flags)
        remote = glmpost_cli("score-teacher", shards, "--out", tmp_path / f"r-{payload}", *flags, "--engine", "vllm",
                             "--server", vllm_server)
        assert local.exit_code == 0 and remote.exit_code == 0, remote.stderr
        for a, b in zip(_records(tmp_path / f"l-{payload}"), _records(tmp_path / f"r-{payload}")):
            assert b["teacher"]["engine"] == "vllm"
            np.testing.assert_allclose(b["teacher_log_probs"], a["teacher_log_probs"], rtol=0, atol=ATOL)
            if payload == "topk":
                np.testing.assert_array_equal(b["teacher_topk_ids"], a["teacher_topk_ids"])
    result = glmpost_cli("diff-logprobs", shards, "--checkpoint", wide_checkpoint, "--against-server", vllm_server,
                         "--against-engine", "vllm", "--out", tmp_path / "d", "--fail-above", "max_abs=1e-4", "--no-plots",
                         "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["mode"] == "server" and report["path_b"]["engine"] == "vllm" and report["path_b"]["url"] == vllm_server
    assert report["overall"]["tokens"] == 48 and report["overall"]["sample_agreement"] == 1.0


def test_raw_logprobs_mode_and_the_api_key(glmpost_cli, wide_checkpoint, tmp_path):
    """--logprobs-mode raw_logprobs records kind raw: the model's own log-probs, what scoring gives;
    --api-key guards /v1 only, as vLLM's middleware does."""
    key = "k-123"
    proc, url = start_server(wide_checkpoint, "--api", "vllm", "--api-key", key)
    try:
        assert _get(url, "/v1/models")[0] == 401 and _get(url, "/v1/models", key)[0] == 200
        assert _get(url, "/server_info")[0] == 200 and _get(url, "/health")[0] == 200  # dev-mode routes are open
        status, answer = _post(url, "/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 21}, key)
        assert status == 400 and "Requested prompt logprobs of 21, which is greater than max allowed: 20" in answer["error"]["message"]
        rollout = ["rollout", _prompts(tmp_path, 2), "--checkpoint", wide_checkpoint, "--group-size", "2",
                   "--max-new-tokens", "4", "--temperature", "0.7", "--top-k", "20", "--engine", "vllm", "--server", url]
        refused = glmpost_cli(*rollout, "--out", tmp_path / "refused")
        assert refused.exit_code == 1 and "refused the API key (HTTP 401)" in refused.stderr
        done = glmpost_cli(*rollout, "--out", tmp_path / "raw", "--api-key", key)
        assert done.exit_code == 0, done.stderr
        client = VLLMClient(url, api_key=key)
        for record in _records(tmp_path / "raw"):
            assert record["sampling"]["log_prob_kind"] == "raw" and record["sampling"]["engine"] == "vllm"
            prompt, response = record["prompt_token_ids"].tolist(), record["response_token_ids"].tolist()
            scored = client.score(prompt + response, len(prompt))["token_log_probs"]
            np.testing.assert_allclose(record["rollout_log_probs"], scored, rtol=0, atol=1e-5)
        bad = glmpost_cli("serve", "--checkpoint", wide_checkpoint, "--api", "vllm", "--logprobs-mode", "raw_logits")
        assert bad.exit_code == 2 and "--logprobs-mode must be raw_logprobs or processed_logprobs" in bad.stderr
        assert "Traceback" not in bad.stderr
    finally:
        stop_server(proc)


def _perturbed(source, target, policy_version):
    """A copy of ``source`` with other weights (every float tensor scaled) and ``policy_version``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for path in target.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: (v * 1.5 if v.is_floating_point() else v) for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})
    manifest = json.loads((target / "glmpost.json").read_text())
    (target / "glmpost.json").write_text(json.dumps({**manifest, "policy_version": policy_version}))
    return target


def test_a_kept_fingerprint_holds_only_for_the_weights_it_was_computed_from(wide_checkpoint, tmp_path):
    original = checkpoint_fingerprint(wide_checkpoint)
    assert (wide_checkpoint / "glmpost-fingerprint.json").is_file()
    copied = tmp_path / "copy"
    shutil.copytree(wide_checkpoint, copied)  # the same files, times kept: the kept fingerprint holds
    assert checkpoint_fingerprint(copied) == original
    changed = _perturbed(wide_checkpoint, tmp_path / "changed", 1)  # the sidecar came along, stale
    assert checkpoint_fingerprint(changed).distance(original.log_probs) > 0.05


def test_sync_weights_to_vllm_is_confirmed_by_fingerprint(glmpost_cli, wide_checkpoint, tmp_path):
    """sync-weights --engine vllm reloads through /collective_rpc and confirms by fingerprint; a
    rollout stamps the version only where the fingerprint matches its checkpoint, else no
    policy_versions at all."""
    new = _perturbed(wide_checkpoint, tmp_path / "trained", 1)
    rollout_root = tmp_path / "rollout-root"
    first = glmpost_cli("sync-weights", "--checkpoint", wide_checkpoint, "--out", rollout_root, "--json")
    assert first.exit_code == 0, first.stderr
    proc, url = start_server(rollout_root, "--api", "vllm")
    try:
        client = VLLMClient(url)
        old_fp, new_fp = checkpoint_fingerprint(rollout_root / "v000000"), checkpoint_fingerprint(new)
        assert confirm_server(client, old_fp)[0] and not confirm_server(client, new_fp)[0]
        # a rollout of the new checkpoint while the server still serves the old weights: no version claimed
        rollout = ["rollout", _prompts(tmp_path, 2), "--group-size", "2", "--max-new-tokens", "3", "--engine", "vllm",
                   "--server", url]
        stale = glmpost_cli(*rollout, "--checkpoint", new, "--out", tmp_path / "stale")
        assert stale.exit_code == 0, stale.stderr
        assert "does not serve" in stale.stderr
        assert all((r["policy_versions"] == -1).all() for r in _records(tmp_path / "stale"))  # unknown

        synced = glmpost_cli("sync-weights", "--checkpoint", new, "--out", rollout_root, "--server", url, "--engine", "vllm",
                             "--retries", "0", "--json")
        assert synced.exit_code == 0, synced.stderr
        (row,) = json.loads(synced.stdout)["servers"]
        assert row["status"] == "updated" and row["version_before"] is None and row["version_after"] == "1"
        assert _get(url, "/weight_info") == (200, {"weight_version": "1"})  # labelled while paused, as vLLM labels
        assert (rollout_root / "v000001" / "glmpost-fingerprint.json").is_file()
        assert confirm_server(client, new_fp, previous=old_fp)[0]
        again = glmpost_cli("sync-weights", "--checkpoint", new, "--out", rollout_root, "--server", url, "--engine", "vllm",
                            "--json")
        assert json.loads(again.stdout)["servers"][0]["status"] == "current"

        assert previous_version_dir(rollout_root / "v000001") == rollout_root / "v000000"
        assert previous_version_dir(rollout_root / "v000000") is None and previous_version_dir(new) is None
        watched = _Proxy(url, ...)
        try:  # a labelled server is confirmed by its label: no fingerprint (prompt_logprobs) request at all
            fresh = glmpost_cli(*rollout[:-1], watched.url, "--checkpoint", rollout_root, "--out", tmp_path / "fresh")
        finally:
            watched.close()
        assert fresh.exit_code == 0, fresh.stderr
        assert not [b for b in watched.bodies if isinstance(b, dict) and "prompt_logprobs" in b]
        assert "/weight_info" in watched.seen
        records = _records(tmp_path / "fresh")
        assert records and all((r["policy_versions"] == 1).all() for r in records)
        stage = json.loads((tmp_path / "fresh" / "stage.json").read_text())
        assert stage["servers"] == [{"url": watched.url, "engine": "vllm", "version": "0.32.0"}]  # GET /version
        published = json.loads((rollout_root / "v000001" / "stage.json").read_text())
        assert published["servers"] == [{"url": url, "engine": "vllm", "version": "0.32.0"}]
        # the old version's rollout against the new weights: the server's label says which weights sampled
        old = glmpost_cli(*rollout, "--checkpoint", rollout_root / "v000000", "--out", tmp_path / "old")
        assert old.exit_code == 0 and "it reports weight version 1, not 0" in old.stderr
        assert all((r["policy_versions"] == 1).all() for r in _records(tmp_path / "old"))
    finally:
        stop_server(proc)


def test_bad_vllm_options_are_one_line_errors(glmpost_cli, wide_checkpoint, tmp_path):
    prompts = _prompts(tmp_path, 1)
    cases = [
        (("rollout", prompts, "--checkpoint", wide_checkpoint, "--out", tmp_path / "r", "--engine", "vllm"),
         "--engine vllm needs --server URL[,URL...]"),
        (("rollout", prompts, "--checkpoint", wide_checkpoint, "--out", tmp_path / "r", "--engine", "vllm", "--server",
          "127.0.0.1:1", "--fingerprint-tolerance", "0"), "--fingerprint-tolerance"),
        (("sync-weights", "--checkpoint", wide_checkpoint, "--out", tmp_path / "s", "--engine", "vllmx"),
         "--engine 'vllmx': expected sglang or vllm"),
        (("diff-logprobs", tmp_path, "--checkpoint", wide_checkpoint, "--out", tmp_path / "d", "--against-server",
          "127.0.0.1:1", "--against-engine", "x"), "--against-engine 'x': expected sglang or vllm"),
        (("score-teacher", tmp_path, "--out", tmp_path / "t", "--teacher", wide_checkpoint, "--engine", "vllm"),
         "--engine vllm needs --server URL"),
        (("serve", "--checkpoint", wide_checkpoint, "--api", "openai"), "--api must be sglang or vllm, got 'openai'"),
        (("serve", "--checkpoint", wide_checkpoint, "--api", "vllm", "--log-prob-kind", "raw"),
         "--log-prob-kind is for --api sglang; with --api vllm say --logprobs-mode"),
        (("serve", "--checkpoint", wide_checkpoint, "--logprobs-mode", "processed_logprobs"),
         "--logprobs-mode and --max-logprobs are for --api vllm"),
    ]
    for args, message in cases:
        result = glmpost_cli(*args)
        assert result.exit_code == 2, (args, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr


class _Proxy:
    """A loopback HTTP proxy to ``target`` that answers ``GET /server_info`` with ``server_info``
    (None: HTTP 404, a vLLM without dev mode; ``...``: forwarded), the ``missing`` routes with 404 (an
    older vLLM), and forwards every other request unchanged, answering the ``slow`` routes (path:
    seconds) that much later (the server acted at once: a slow drain or load); ``seen`` lists the
    paths asked, ``bodies`` the decoded request bodies (None for none)."""

    def __init__(self, target, server_info, missing=(), slow=None):
        self.seen = []
        self.bodies = []
        seen, bodies, slow = self.seen, self.bodies, dict(slow or {})
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, raw):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _forward(self, method):
                seen.append(self.path)
                if self.path.split("?")[0] in missing:
                    return self._answer(404, b'{"detail": "Not Found"}')
                if self.path.startswith("/server_info") and server_info is not ...:
                    if server_info is None:
                        return self._answer(404, b'{"detail": "Not Found"}')
                    return self._answer(200, json.dumps(server_info).encode())
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                bodies.append(json.loads(data) if data else None)
                request = urllib.request.Request(target + self.path, data=data, method=method,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        status, raw = response.status, response.read()
                except urllib.error.HTTPError as exc:
                    status, raw = exc.code, exc.read()
                time.sleep(slow.get(self.path.split("?")[0], 0))
                try:
                    self._answer(status, raw)
                except OSError:
                    pass  # the client gave up waiting

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_logits_modes_are_refused_and_without_dev_mode_the_probe_tells_the_kind(glmpost_cli, vllm_server, wide_checkpoint,
                                                                                 tmp_path):
    """A vLLM reporting a logits mode fails the rollout in one line; one without dev mode (no
    /server_info) is probed (processed_logprobs: sampled) and its records say seed_reproducible false."""
    rollout = ["rollout", _prompts(tmp_path, 2), "--checkpoint", wide_checkpoint, "--group-size", "2", "--max-new-tokens", "3",
               "--temperature", "0.9", "--top-k", "40", "--engine", "vllm", "--retries", "0"]
    logits = _Proxy(vllm_server, {"vllm_config": {"model_config": {"logprobs_mode": "processed_logits"}},
                                  "vllm_env": {"VLLM_BATCH_INVARIANT": True}})
    plain = _Proxy(vllm_server, None)
    try:
        refused = glmpost_cli(*rollout, "--out", tmp_path / "logits", "--server", logits.url)
        assert refused.exit_code == 1 and refused.stderr.count("error:") == 1 and "Traceback" not in refused.stderr
        assert f"error: --server {logits.url} returns logits (vLLM logprobs_mode processed_logits)" in refused.stderr
        assert not list((tmp_path / "logits").glob("*.msgpack.zst"))
        probed = glmpost_cli(*rollout, "--out", tmp_path / "probed", "--server", plain.url)
        assert probed.exit_code == 0, probed.stderr
        assert "the probe says sampled" in probed.stderr
        records = _records(tmp_path / "probed")
        assert records and all(r["sampling"]["log_prob_kind"] == "sampled" for r in records)
        assert all(r["sampling"]["seed_reproducible"] is False for r in records)
    finally:
        logits.close()
        plain.close()


def test_reload_without_pause_on_an_older_vllm(vllm_server, wide_checkpoint):
    """A vLLM older than /pause (2025-11) is reloaded unpaused; the fingerprint still confirms it."""
    proxy = _Proxy(vllm_server, None, missing=("/pause", "/resume"))
    try:
        client = VLLMClient(proxy.url, retries=0)
        answer = client.update_weights_from_disk(str(wide_checkpoint))
        assert answer["success"] is True and client.weight_version is None  # unconfirmed until the fingerprint
        assert [p.split("?")[0] for p in proxy.seen] == ["/pause", "/collective_rpc", "/reset_prefix_cache"]
        # both spellings: the first /pause took only wait_for_inflight_requests (else it aborts what is in flight)
        assert proxy.seen[0] == "/pause?mode=wait&wait_for_inflight_requests=true"
        assert confirm_server(client, checkpoint_fingerprint(wide_checkpoint))[0]
    finally:
        proxy.close()


def test_recipe_sections_set_the_vllm_options(glmpost_cli, wide_checkpoint, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[serve]\napi = "grpc"\n\n[sync-weights]\nengine = "vllm"\nfingerprint_tolerance = 0.5\n\n'
                      '[rollout]\nengine_name = "vllm"\n')
    served = glmpost_cli("serve", "--checkpoint", wide_checkpoint, "--config", recipe)
    assert served.exit_code == 2 and "--api must be sglang or vllm, got 'grpc'" in served.stderr
    rolled = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", wide_checkpoint, "--out", tmp_path / "r",
                         "--config", recipe)
    assert rolled.exit_code == 2 and "--engine vllm needs --server" in rolled.stderr
    synced = glmpost_cli("sync-weights", "--checkpoint", wide_checkpoint, "--out", tmp_path / "s", "--config", recipe, "--json")
    assert synced.exit_code == 0, synced.stderr  # no --server: published only
    options = json.loads((tmp_path / "s" / "v000000" / "stage.json").read_text())["options"]
    assert options["engine"] == "vllm" and options["fingerprint_tolerance"] == 0.5


def test_request_and_answer_translation():
    """What the client sends (every neutral field explicit, top_k -1 for off, the seed) and how vLLM's
    finish reasons come back in SGLang's shape (an abort keeps no tokens: the record is aborted)."""
    from glmpost.kernel.vllm_client import completion_request, sglang_answer
    from glmpost.rollout.records import completion_from_sglang

    body = completion_request([3, 4], {"max_new_tokens": 5, "temperature": 0.7, "top_k": -1, "sampling_seed": 9,
                                       "stop_token_ids": [2], "no_stop_trim": True}, model="m", logprobs=0)
    assert body == {"prompt": [3, 4], "max_tokens": 5, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop_token_ids": [2],
                    "ignore_eos": False, "skip_special_tokens": False, "return_token_ids": True, "min_p": 0.0,
                    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "model": "m", "seed": 9,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": 3, "min_p": 0.1}):
        with pytest.raises(ValueError):
            completion_request([1], bad, model=None, logprobs=None)

    def answer(reason, stop_reason=None, ids=(7, 2)):
        choice = {"token_ids": list(ids), "prompt_token_ids": [3, 4], "finish_reason": reason, "stop_reason": stop_reason,
                  "logprobs": {"token_logprobs": [-0.5, -0.25][: len(ids)]}}
        return sglang_answer({"id": "cmpl-1", "choices": [choice]}, weight_version="3")

    stopped = answer("stop", 2)
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    completion, version, reason = completion_from_sglang(stopped, [2])
    assert completion.token_ids == [7, 2] and completion.log_probs == [-0.5, -0.25] and completion.finish_reason == "stop"
    assert version == "3" and reason is None
    assert answer("length")["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    completion, _, reason = completion_from_sglang(answer("abort", ids=()), [2])
    assert completion.finish_reason == "abort" and completion.token_ids == [] and "abort" in reason  # kept, continued


def test_a_rollout_above_vllms_temperature_is_one_line(glmpost_cli, vllm_server, wide_checkpoint, tmp_path):
    result = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", wide_checkpoint, "--out", tmp_path / "r",
                         "--engine", "vllm", "--server", vllm_server, "--temperature", "2.5", "--max-new-tokens", "2")
    assert result.exit_code != 0 and result.stderr.count("error:") == 1 and "Traceback" not in result.stderr
    assert "vLLM takes temperature in [0, 2] (SamplingParams), got 2.5" in result.stderr, result.stderr


def test_the_client_refuses_what_vllm_refuses_before_sending():
    """vLLM's SamplingParams refuses temperature above 2: the client says so itself, in one line."""
    from glmpost.kernel.vllm_client import completion_request

    with pytest.raises(ValueError, match=r"^vLLM takes temperature in \[0, 2\] \(SamplingParams\), got 2.5$"):
        completion_request([1], {"max_new_tokens": 2, "temperature": 2.5}, model=None, logprobs=None)
    with pytest.raises(ServerError, match="HTTP 400: vLLM takes temperature in"):
        VLLMClient("http://127.0.0.1:1").generate([1, 2], {"max_new_tokens": 2, "temperature": 3.0})


@pytest.fixture(scope="module")
def vllm034(wide_checkpoint):
    """The stand-in as vLLM 0.34 answers: HTTP 503 to every new request while paused, and
    ``weight_versions`` per choice with ``return_weight_versions``."""
    proc, url = start_server(wide_checkpoint, "--api", "vllm", "--vllm-release", "0.34.0")
    yield url
    stop_server(proc)
    assert proc.returncode == 0


def test_a_paused_034_server_answers_503_and_the_client_waits_for_is_paused(vllm034):
    """Case 2: the 503 of a paused server waits for /is_paused to clear, longer than the client's
    retries last (3 retries, 0.5 s backoff: 3.5 s), and no sequence is lost."""
    assert _get(vllm034, "/version") == (200, {"version": "0.34.0"})
    assert _post(vllm034, "/pause?mode=wait", {}) == (200, {"status": "paused"})
    try:
        status, answer = _post(vllm034, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError"
        client, answers = VLLMClient(vllm034), []
        worker = threading.Thread(target=lambda: answers.append(
            client.generate([[5, 6, 7], [8, 9]], {"max_new_tokens": 3, "ignore_eos": True})))
        worker.start()
        time.sleep(5.0)
        assert worker.is_alive() and not answers
    finally:
        assert _post(vllm034, "/resume", {}) == (200, {"status": "resumed"})
    worker.join(60)
    (batch,) = answers
    assert [len(a["output_ids"]) for a in batch] == [3, 3]
    # a pause that outlasts pause_wait is one error, not a hang
    assert _post(vllm034, "/pause?mode=wait", {})[0] == 200
    try:
        with pytest.raises(ServerError, match=r"stayed paused \(GET /is_paused\) for more than 0.5 s"):
            VLLMClient(vllm034, retries=0, pause_wait=0.5).generate([5, 6], {"max_new_tokens": 1})
    finally:
        _post(vllm034, "/resume", {})


def test_034_labels_each_choice_and_the_client_reads_the_labels(vllm034):
    """Case 6: /update_weight_version and /weight_info in vLLM's shapes, per-choice weight_versions
    (0.34, return_weight_versions), read by the client in place of a fingerprint."""
    body = {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}
    status, answer = _post(vllm034, "/v1/completions", {**body, "return_weight_versions": True})
    assert status == 200 and answer["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    assert "weight_versions" not in _post(vllm034, "/v1/completions", body)[1]["choices"][0]  # opt-in only
    assert _post(vllm034, "/update_weight_version", {"new_version": "7"}) == (200, {"success": True, "new_version": "7"})
    assert _get(vllm034, "/weight_info") == (200, {"weight_version": "7"})
    client = VLLMClient(vllm034)
    assert client.get_weight_version() == "7" and client.labelled and client.settings()["version"] == "0.34.0"
    client.weight_version = "stale"  # the answer's own label wins over what the client last read
    answer = client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})
    assert answer["meta_info"]["weight_version"] == "7" and client.per_choice_versions
    assert answer["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 2}]
    from glmpost.kernel.vllm_client import sglang_answer

    mixed = {"choices": [{"token_ids": [1, 2], "finish_reason": "length", "weight_versions": [
        {"version": "7", "start": 0, "end": 1}, {"version": "8", "start": 1, "end": 2}]}]}
    assert sglang_answer(mixed, weight_version="7")["meta_info"]["weight_version"] is None  # two versions: none


def test_without_dev_mode_sync_weights_names_the_variable(glmpost_cli, wide_checkpoint, tmp_path):
    """Case 5: the stand-in gates the dev routes as vLLM does, and sync-weights says in one line, after
    one attempt, that the server needs VLLM_SERVER_DEV_MODE=1."""
    root = tmp_path / "root"
    assert glmpost_cli("sync-weights", "--checkpoint", wide_checkpoint, "--out", root).exit_code == 0
    proc, url = start_server(root, "--api", "vllm", "--no-vllm-dev-mode")
    try:
        for path in ("/server_info?config_format=json", "/is_paused", "/weight_info"):
            assert _get(url, path) == (404, {"detail": "Not Found"}), path
        for path in ("/pause?mode=wait", "/resume", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version"):
            assert _post(url, path, {}) == (404, {"detail": "Not Found"}), path
        assert _get(url, "/version") == (200, {"version": "0.32.0"}) and _get(url, "/v1/models")[0] == 200
        new = _perturbed(wide_checkpoint, tmp_path / "trained", 1)
        synced = glmpost_cli("sync-weights", "--checkpoint", new, "--out", root, "--server", url, "--engine", "vllm")
        assert synced.exit_code == 1 and synced.stderr.count("error:") == 1 and "Traceback" not in synced.stderr
        assert (f"error: server {url} is not on weight version 1 after 1 attempt(s): the server answers 404 on /pause "
                "and /collective_rpc: vLLM serves its weight-reload routes only in dev mode; start it with "
                "VLLM_SERVER_DEV_MODE=1") in synced.stderr, synced.stderr
    finally:
        stop_server(proc)


def test_scoring_refuses_a_server_that_returns_logits(glmpost_cli, vllm_server, wide_checkpoint, tmp_path):
    """Case 3: vLLM 0.32 returns prompt logits under the logits modes (_get_prompt_logprobs_dict), so
    score-teacher and diff-logprobs refuse such a server in one line; the log-prob modes score alike."""
    shards = tmp_path / "rollout"
    assert glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", wide_checkpoint, "--out", shards, "--group-size",
                       "1", "--max-new-tokens", "3").exit_code == 0
    for mode in ("raw_logits", "processed_logits"):
        proxy = _Proxy(vllm_server, {"vllm_config": {"model_config": {"logprobs_mode": mode}}, "vllm_env": {}})
        try:
            scored = glmpost_cli("score-teacher", shards, "--out", tmp_path / f"t-{mode}", "--teacher", wide_checkpoint,
                                 "--engine", "vllm", "--server", proxy.url)
            diffed = glmpost_cli("diff-logprobs", shards, "--checkpoint", wide_checkpoint, "--against-server", proxy.url,
                                 "--against-engine", "vllm", "--out", tmp_path / f"d-{mode}", "--no-plots")
        finally:
            proxy.close()
        words = f"{proxy.url} returns logits, not log-probs, as prompt log-probs (vLLM logprobs_mode {mode})"
        for result in (scored, diffed):
            assert result.exit_code == 1 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
        assert not [b for b in proxy.bodies if isinstance(b, dict) and "prompt_logprobs" in b]  # nothing was scored


def test_a_pause_timeout_leaves_the_server_resumed(vllm_server, wide_checkpoint):
    """Case 7: /pause answers too late (a slow drain): the client resumes the server before it fails."""
    proxy = _Proxy(vllm_server, ..., slow={"/pause": 3.0})
    try:
        with pytest.raises(ServerError, match="sent /resume so that the server is not left paused"):
            VLLMClient(proxy.url, timeout=1.0, retries=0).reload_weights(str(wide_checkpoint))
        time.sleep(2.5)  # the late answer came and went
        assert _get(vllm_server, "/is_paused") == (200, {"is_paused": False})
        assert [p.split("?")[0] for p in proxy.seen] == ["/pause", "/resume"]  # and nothing reloaded
    finally:
        proxy.close()
        _post(vllm_server, "/resume", {})


def test_a_reload_timeout_is_confirmed_and_never_reloaded_twice(glmpost_cli, wide_checkpoint, tmp_path):
    """Case 7: reload_weights answers after the client's timeout: the server is resumed once it
    answers again, the next attempt confirms by fingerprint that the reload took effect, labels it,
    and does not reload again."""
    from glmpost.weight_sync.vllm_sync import sync_vllm_server

    root = tmp_path / "root"
    assert glmpost_cli("sync-weights", "--checkpoint", wide_checkpoint, "--out", root).exit_code == 0
    new = _perturbed(wide_checkpoint, tmp_path / "trained", 1)
    expected, previous = checkpoint_fingerprint(new), checkpoint_fingerprint(root / "v000000")
    proc, url = start_server(root, "--api", "vllm")
    proxy = _Proxy(url, ..., slow={"/collective_rpc": 4.0})
    try:
        result = sync_vllm_server(proxy.url, new, "1", expected=expected, previous=previous, tolerance=0.05, retries=2,
                                  backoff=0.1, timeout=2.0)
        # The first attempt timed out on the reload; a loaded machine may time out a later request of
        # the second too (the client's timeout is 2 s), so more attempts may follow: never a second reload.
        assert result.status == "updated" and result.attempts >= 2, result
        assert [p.split("?")[0] for p in proxy.seen].count("/collective_rpc") == 1
        assert _get(url, "/is_paused") == (200, {"is_paused": False})
        assert _get(url, "/weight_info") == (200, {"weight_version": "1"})
        assert confirm_server(VLLMClient(url), expected, previous=previous)[0]
    finally:
        proxy.close()
        stop_server(proc)


def test_rollout_while_sync_weights_pauses_a_034_server_loses_no_sequence(glmpost_cli, wide_checkpoint, tmp_path):
    """Case 2 end to end: a rollout samples from a vLLM 0.34 stand-in while sync-weights holds it
    paused for 5 s (its reload answered late): the rollout's requests are answered 503, wait for
    /is_paused to clear, and every sequence is kept."""
    root = tmp_path / "root"
    assert glmpost_cli("sync-weights", "--checkpoint", wide_checkpoint, "--out", root).exit_code == 0
    proc, url = start_server(root / "v000000", "--api", "vllm", "--vllm-release", "0.34.0")
    new = _perturbed(wide_checkpoint, tmp_path / "trained", 1)
    assert glmpost_cli("sync-weights", "--checkpoint", new, "--out", root).exit_code == 0  # published, not yet served
    checkpoint_fingerprint(root / "v000001")  # kept beside the weights: the sync below only switches
    watched, slow = _Proxy(url, ...), _Proxy(url, ..., slow={"/collective_rpc": 5.0})
    try:
        rollout = subprocess.Popen(
            [sys.executable, "-m", "glmpost.commands.app", "rollout", str(_prompts(tmp_path, 8)), "--checkpoint",
             str(root / "v000000"), "--out", str(tmp_path / "r"), "--engine", "vllm", "--server", watched.url,
             "--group-size", "4", "--max-new-tokens", "32", "--concurrency", "1", "--batch-size", "1", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while sum(p == "/v1/completions" for p in watched.seen) < 8 and rollout.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        synced = glmpost_cli("sync-weights", "--checkpoint", new, "--out", root, "--server", slow.url, "--engine", "vllm",
                             "--json")
        out, err = rollout.communicate(timeout=600)
        assert synced.exit_code == 0, synced.stderr
        assert json.loads(synced.stdout)["servers"][0]["status"] == "updated"
        assert rollout.returncode == 0, err
        assert json.loads(out)["aborted"] == 0
        assert "/is_paused" in watched.seen  # the rollout met the pause
        records = _records(tmp_path / "r")
        assert len(records) == 32 and all(r["status"] != "aborted" for r in records)
        assert all(set(r["policy_versions"].tolist()) <= {0, 1, -1} for r in records)
    finally:
        watched.close()
        slow.close()
        stop_server(proc)
# ------------------------------------------------------------------ routed experts (issue 42)

def test_vllm_routed_experts_become_sglang_payloads():
    """vLLM's per-choice routed_experts (base64 .npy, uint8/uint16 [P + n - 1, layers, k]) as
    SGLang's meta_info.routed_experts (base64 int32, the same rows)."""
    import base64
    import io

    from glmpost.kernel.vllm_client import sglang_answer, sglang_routed_experts

    rows = np.array([[[0, 0], [300, 7]], [[0, 0], [2, 299]]], dtype=np.uint16)  # 2 positions x 2 layers x 2
    buffer = io.BytesIO()
    np.save(buffer, rows)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    assert np.frombuffer(base64.b64decode(sglang_routed_experts(encoded)), dtype=np.int32).tolist() == [0, 0, 300, 7, 0, 0, 2, 299]
    response = {"id": "c", "choices": [{"text": "", "token_ids": [4], "prompt_token_ids": [1, 2], "finish_reason": "length",
                                        "routed_experts": encoded}]}
    assert "routed_experts" not in sglang_answer(response, weight_version=None)["meta_info"]  # not asked for
    meta = sglang_answer(response, weight_version=None, routed_experts=True)["meta_info"]
    assert meta["routed_experts"] == sglang_routed_experts(encoded) and meta["prompt_tokens"] == 2
    for bad, words in (("%%", "not base64 of a .npy array"),
                       (base64.b64encode(b"\x93NUMPY nonsense").decode(), "not base64 of a .npy array")):
        with pytest.raises(ValueError, match=words):
            sglang_routed_experts(bad)
    flat = io.BytesIO()
    np.save(flat, np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"float32 array of shape \[4\], not integer \[positions, layers, k\]"):
        sglang_routed_experts(base64.b64encode(flat.getvalue()).decode())


def test_routed_experts_through_vllm_equal_the_local_engines_on_deepseek_v3(glmpost_cli, tiny_checkpoint, tmp_path):
    """``serve --api vllm --enable-return-routed-experts`` of a DeepSeek-V3-shaped model answers
    each choice's routed_experts as vLLM does (all hidden layers, the dense layer 0's rows 0);
    ``rollout --engine vllm --record-routing`` records the local engine's experts from them."""
    import base64
    import io

    from test_routing import _moe_checkpoint

    checkpoint = _moe_checkpoint("deepseek_v3", tiny_checkpoint, tmp_path / "dsv3")
    common = [_prompts(tmp_path, 2), "--checkpoint", checkpoint, "--group-size", "2", "--max-new-tokens", "5",
              "--seed", "7", "--batch-size", "4", "--record-routing"]
    assert glmpost_cli("rollout", *common, "--out", tmp_path / "local").exit_code == 0
    proc, url = start_server(checkpoint, "--api", "vllm", "--logprobs-mode", "processed_logprobs", "--batch-size", "8",
                             "--enable-return-routed-experts")
    try:
        status, answer = _post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True})
        assert status == 200, answer
        rows = np.load(io.BytesIO(base64.b64decode(answer["choices"][0]["routed_experts"])), allow_pickle=False)
        assert rows.dtype == np.uint8 and rows.shape == (3 + 3 - 1, 2, 2)  # positions x num_hidden_layers x k
        assert not rows[:, 0].any() and (rows[:, 1, 0] != rows[:, 1, 1]).all()
        remote = glmpost_cli("rollout", *common, "--out", tmp_path / "remote", "--engine", "vllm", "--server", url, "--json")
        assert remote.exit_code == 0, remote.stderr
        assert json.loads(remote.stdout)["aborted"] == 0
    finally:
        stop_server(proc)
    a, b = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x["response_token_ids"].tolist() == y["response_token_ids"].tolist()
        assert x["routed_experts"].shape == (len(x["response_token_ids"]), 1, 2)
        assert x["routed_experts"].dtype == y["routed_experts"].dtype and np.array_equal(x["routed_experts"], y["routed_experts"])


def test_a_vllm_without_routed_experts_is_refused_up_front(glmpost_cli, vllm_server, wide_checkpoint, tmp_path):
    """A vLLM launched without --enable-return-routed-experts answers routed_experts null: the
    pre-flight request says so in one line and nothing is written; serve refuses the flag with --api sglang."""
    status, answer = _post(vllm_server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1})
    assert status == 200 and answer["choices"][0]["routed_experts"] is None
    out = tmp_path / "r"
    result = glmpost_cli("rollout", _prompts(tmp_path, 1), "--checkpoint", wide_checkpoint, "--out", out, "--engine", "vllm",
                         "--server", vllm_server, "--max-new-tokens", "2", "--record-routing")
    errors = [line for line in result.stderr.splitlines() if line.startswith("glmpost: error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert (f"{vllm_server} returns no routed_experts (--record-routing): launch vLLM with `--enable-return-routed-experts`"
            in result.stderr) and not out.exists()
    refused = glmpost_cli("serve", "--checkpoint", wide_checkpoint, "--enable-return-routed-experts")
    assert refused.exit_code == 2 and "--enable-return-routed-experts is for --api vllm" in refused.stderr
