"""``glmpost serve`` and the SGLang client against SGLang's semantics: API keys, ``/server_info``,
``rid``, token texts, stop strings, what log-probs are of (the kind probe) and refused fields.

Every server here is a real ``glmpost serve`` process on 127.0.0.1 with ``--port 0``, but one:
``_OldSGLang``, a fake of an SGLang build from before ``sampling_seed`` (which cannot run here).
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler

import numpy as np
import pytest
import torch
from serve_process import start_server, stop_server
from test_serve import _prompts, _records

from glmpost.kernel.engine import SamplingParams
from glmpost.kernel.sglang_client import (
    ServerError,
    SGLangClient,
)

API_KEY = "k3y-Of-The-Test_42"


def _raw(url: str, path: str, *, method: str = "GET", headers: dict | None = None) -> tuple[int, object]:
    """One request without the client: ``(status, decoded JSON body or None)``."""
    import urllib.error
    import urllib.request

    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    return status, (json.loads(raw) if raw.strip() else None)


def test_api_key_guards_every_route_but_health_and_is_never_logged(tiny_checkpoint, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc, url = start_server(tiny_checkpoint, "--api-key", API_KEY, "--log-requests", "--metrics", metrics,
                             "--metrics-interval", "0.2")
    try:
        routes = [("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/model_info"), ("GET", "/get_weight_version"),
                  ("POST", "/generate"), ("POST", "/update_weights_from_disk"), ("GET", "/no/such/route")]
        refused = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                   {"Authorization": f"Bearer {API_KEY}x"}, {"x-api-key": API_KEY[:-1]}]
        for method, path in routes:
            for headers in refused:  # SGLang's middleware answer, before any routing
                assert _raw(url, path, method=method, headers=headers) == (401, {"error": "Unauthorized"}), (path, headers)
        assert _raw(url, "/health")[0] == 200  # probes carry no key
        assert _raw(url, "/model_info", headers={"Authorization": f"Bearer {API_KEY}"})[0] == 200
        assert _raw(url, "/model_info", headers={"authorization": f"bearer {API_KEY}"})[0] == 200
        assert _raw(url, "/model_info", headers={"x-api-key": API_KEY})[0] == 200
        answer = SGLangClient(url, api_key=API_KEY, retries=0).generate(
            [5, 6, 7], {"max_new_tokens": 2, "ignore_eos": True, "sampling_seed": 1})
        assert len(answer["output_ids"]) == 2
        started = time.monotonic()
        with pytest.raises(ServerError) as info:  # a 401 is not retried (the backoff would take 5 s)
            SGLangClient(url, retries=3, backoff=5.0).model_info()
        assert info.value.status == 401 and not info.value.retryable and time.monotonic() - started < 4
        assert "wants an API key and none was given" in str(info.value)
        with pytest.raises(ServerError) as info:
            SGLangClient(url, api_key="wrong-key-42", retries=0).generate([5], {"max_new_tokens": 1})
        assert "refused the API key" in str(info.value) and "wrong-key-42" not in str(info.value)
        time.sleep(0.5)  # a --metrics tick or two
    finally:
        stop_server(proc)
    assert proc.returncode == 0
    stderr = proc.stderr.read()
    assert '"POST /generate HTTP/1.1" 200' in stderr and '"GET /model_info HTTP/1.1" 401' in stderr  # --log-requests logs
    assert "API key required" in stderr
    assert API_KEY not in stderr and API_KEY not in metrics.read_text() and "serve/requests" in metrics.read_text()


def test_serve_refuses_an_unusable_api_key_or_log_prob_kind_in_one_line(glmpost_cli, tiny_checkpoint):
    bad_key = glmpost_cli("serve", "--checkpoint", tiny_checkpoint, "--port", "0", "--api-key", "two words")
    assert bad_key.exit_code == 2 and "--api-key: an API key must be printable ASCII" in bad_key.stderr
    assert "two words" not in bad_key.stderr and "Traceback" not in bad_key.stderr
    bad_kind = glmpost_cli("serve", "--checkpoint", tiny_checkpoint, "--port", "0", "--log-prob-kind", "filtered")
    assert bad_kind.exit_code == 2 and "--log-prob-kind must be one of sampled, tempered, raw" in bad_kind.stderr


def test_every_server_command_takes_the_api_key_and_records_none_of_it(glmpost_cli, tiny_checkpoint, tmp_path):
    """rollout, score-teacher, diff-logprobs and sync-weights against a `glmpost serve --api-key`:
    without the key (or with a wrong one) one clear error, with it the work; the key in no output."""
    proc, url = start_server(tiny_checkpoint, "--api-key", API_KEY)
    try:
        rollout = ["rollout", _prompts(tmp_path, 2), "--checkpoint", tiny_checkpoint, "--group-size", "2",
                   "--max-new-tokens", "3", "--engine", "sglang", "--server", url]
        for key in ([], ["--api-key", "wrong-key-42"]):
            refused = glmpost_cli(*rollout, "--out", tmp_path / "refused", *key)
            assert refused.exit_code == 1 and refused.stderr.count("\n") == 1, refused.stderr
            assert f"--server {url} refused the API key (HTTP 401): pass --api-key" in refused.stderr
            assert "wrong-key-42" not in refused.stderr and not list((tmp_path / "refused").glob("*.msgpack.zst"))
        shards = tmp_path / "o"
        done = glmpost_cli(*rollout, "--out", shards, "--api-key", API_KEY, "--json")
        assert done.exit_code == 0, done.stderr
        assert json.loads(done.stdout)["aborted"] == 0 and len(_records(shards)) == 4
        # another key on a rerun is not another option: nothing to redo
        again = glmpost_cli(*rollout, "--out", shards, "--api-key", API_KEY + "2", "--json")
        assert again.exit_code == 1 and "refused the API key" in again.stderr
        assert json.loads(glmpost_cli(*rollout, "--out", shards, "--api-key", API_KEY, "--json").stdout)["shards_skipped"] == 1

        teacher = ["score-teacher", shards, "--teacher", tiny_checkpoint, "--engine", "sglang", "--server", url]
        assert "HTTP 401" in glmpost_cli(*teacher, "--out", tmp_path / "t0").stderr
        scored = glmpost_cli(*teacher, "--out", tmp_path / "t", "--api-key", API_KEY)
        assert scored.exit_code == 0, scored.stderr
        diff = ["diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--against-server", url, "--no-plots"]
        unkeyed = glmpost_cli(*diff, "--out", tmp_path / "d0")
        assert unkeyed.exit_code == 1 and "HTTP 401" in unkeyed.stderr
        assert glmpost_cli(*diff, "--out", tmp_path / "d", "--api-key", API_KEY).exit_code == 0
        sync = ["sync-weights", "--checkpoint", tiny_checkpoint, "--server", url, "--retries", "0"]
        unkeyed = glmpost_cli(*sync, "--out", tmp_path / "r0")
        assert unkeyed.exit_code == 1 and "HTTP 401" in unkeyed.stderr
        synced = glmpost_cli(*sync, "--out", tmp_path / "r", "--api-key", API_KEY, "--json")
        assert synced.exit_code == 0, synced.stderr
        assert json.loads(synced.stdout)["servers"][0]["status"] in ("updated", "current")
        for command in (sync, diff, teacher):  # a key no header can carry: refused before any work
            out = tmp_path / f"bad-{command[0]}"
            bad = glmpost_cli(*command, "--out", out, "--api-key", "two words")
            assert bad.exit_code == 2 and "--api-key: an API key must be printable ASCII" in bad.stderr
            assert "two words" not in bad.stderr and not out.exists()
    finally:
        stop_server(proc)
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path


def test_server_info_is_get_server_info_with_the_settings_clients_read(server):
    from glmpost import __version__

    client = SGLangClient(server, retries=0)
    current, older = client.request("GET", "/server_info"), client.request("GET", "/get_server_info")
    assert current == older
    assert current["enable_deterministic_inference"] is True and current["version"] == __version__
    assert current["log_prob_kind"] == "tempered" and current["weight_version"] == "0" and "stats" in current
    assert current["attention"] == "native"  # glmpost serve's default GLM-5 attention path
    assert not any("key" in name for name in current)
    settings = client.settings()
    assert settings["log_prob_kind"] == "tempered" and client.settings() is settings  # read once per client


def test_generate_echoes_rid_and_returns_token_texts(server, tiny_checkpoint):
    from glmpost.kernel.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)[0]
    client = SGLangClient(server, retries=0)
    sampling = {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": 9}
    one = client.generate([5, 6, 7], sampling, rid="req-1", logprob_start_len=0, top_logprobs_num=2,
                          return_text_in_logprobs=True)
    meta = one["meta_info"]
    assert meta["id"] == "req-1"
    for entry in meta["output_token_logprobs"] + meta["input_token_logprobs"]:
        assert entry[2] == tokenizer.decode([entry[1]])  # (logprob, token_id, token_text)
    assert [e[1] for e in meta["input_token_logprobs"]] == [5, 6, 7] and meta["input_token_logprobs"][0][0] is None
    for row in meta["output_top_logprobs"] + meta["input_top_logprobs"][1:]:
        assert [e[2] for e in row] == [tokenizer.decode([e[1]]) for e in row]
    plain = client.generate([5, 6, 7], sampling, top_logprobs_num=2)["meta_info"]
    assert [e[:2] for e in plain["output_token_logprobs"]] == [e[:2] for e in meta["output_token_logprobs"]]
    assert all(e[2] is None for e in plain["output_token_logprobs"]) and len(plain["id"]) == 32  # a fresh id
    batch = client.generate([[5, 6], [7, 8], [9]], sampling, rid="job")
    assert [b["meta_info"]["id"] for b in batch] == ["job_0", "job_1", "job_2"]  # SGLang's _normalize_rid
    listed = client.generate([[5, 6], [7, 8]], sampling, rid=["a", "b"])
    assert [b["meta_info"]["id"] for b in listed] == ["a", "b"]
    for body, expected in [({"rid": ["a"]}, "rid: 1 ids for 2 sequences"), ({"rid": 7}, "rid must be a string"),
                           ({"return_text_in_logprobs": "yes"}, "return_text_in_logprobs")]:
        with pytest.raises(ServerError) as info:
            client.request("POST", "/generate", {"input_ids": [[5, 6], [7, 8]], "sampling_params": sampling, **body})
        assert info.value.status == 400 and expected in str(info.value)


def test_stop_strings_end_the_response_as_sglang_ends_it(server, engine, tiny_checkpoint):
    from glmpost.kernel.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)[0]
    client = SGLangClient(server, retries=0)
    prompt, sampling = [5, 6, 7], {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3, "temperature": 0.9}
    full = client.generate(prompt, sampling)
    ids = full["output_ids"]
    assert len(ids) == 12 and full["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    # a stop string first completed by token k (1-based) of the unstopped response
    text = tokenizer.decode(ids)
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].isprintable()
                and text[i : i + 2].strip() == text[i : i + 2])
    k = next(k for k in range(1, 13) if stop in tokenizer.decode(ids[:k]))
    assert k < 12
    for stops, keep in [(stop, False), (["never-there", stop], True)]:
        answer = client.generate(prompt, {**sampling, "stop": stops, "no_stop_trim": keep}, top_logprobs_num=2)
        meta = answer["meta_info"]
        assert answer["output_ids"] == ids[:k]  # token ids exact: the token completing the stop is kept
        assert meta["finish_reason"] == {"type": "stop", "matched": stop} and meta["completion_tokens"] == k
        assert [e[0] for e in meta["output_token_logprobs"]] == [e[0] for e in full["meta_info"]["output_token_logprobs"][:k]]
        assert len(meta["output_top_logprobs"]) == k
        decoded = tokenizer.decode(ids[:k])
        cut = decoded.find(stop)
        assert answer["text"] == (decoded[: cut + len(stop)] if keep else decoded[:cut])
    # a stop token: the token stays in output_ids, text drops it unless no_stop_trim (detokenizer's trim)
    token = client.generate(prompt, {**sampling, "ignore_eos": False, "stop_token_ids": [ids[2]]})
    assert token["output_ids"] == ids[:3] and token["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert token["text"] == tokenizer.decode(ids[:2])
    for bad in ("", 3, ["ok", ""]):
        with pytest.raises(ServerError) as info:
            client.generate(prompt, {**sampling, "stop": bad})
        assert info.value.status == 400 and "sampling_params.stop" in str(info.value)


def test_log_prob_kind_classifier_on_hand_made_values():
    from glmpost.kernel.server_settings import classify_log_prob_kind as kind

    r, t = -2.0, -0.9  # log_softmax(z)[a] and log_softmax(z / 0.5)[a] of an argmax a: sharpening raises it
    assert kind(r, 0.0, 0.0, 0.0) == "sampled"
    assert kind(r, r, t, r) == "tempered"
    assert kind(r, r, r, r) == "raw"
    assert kind(r, 0.0, 0.0, r) == "top_p_renormalized"
    assert kind(r, r * (1 + 1e-4), t, r) == "tempered"  # float noise between requests
    with pytest.raises(ValueError, match="nearly certain"):  # every kind gives about 0
        kind(-1e-4, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="nearly certain"):
        kind(0.0, 0.0, 0.0, 0.0)
    for values in [(r, r, -3.0, r), (r, -1.0, t, r), (r, 0.0, 0.0, -1.0), (r, r, t, 0.0), (r, 0.0, t, r)]:
        with pytest.raises(ValueError, match="fit no known kind"):
            kind(*values)
    with pytest.raises(ValueError, match="non-finite"):
        kind(r, float("-inf"), t, r)


def test_rejected_field_tells_a_refused_field_from_other_failures():
    from glmpost.kernel.server_settings import rejected_field

    def error(status, detail):
        return ServerError(f"POST http://top_k.example:1/generate: HTTP {status}: {detail}", url="http://x", status=status)

    fields = ["top_k", "sampling_seed", "stop_token_ids"]
    assert rejected_field(error(400, "sampling_params: unknown key(s) sampling_seed"), fields) == "sampling_seed"
    assert rejected_field(error(400, "sampling_params.top_k is not supported"), fields) == "top_k"
    assert rejected_field(error(500, "SamplingParams.__init__() got an unexpected keyword argument 'sampling_seed'"),
                          fields) == "sampling_seed"
    assert rejected_field(error(400, "input_ids must be a non-empty list"), fields) is None
    assert rejected_field(error(503, "sampling_seed queue full"), fields) is None  # transient: retried, then aborted
    assert rejected_field(error(400, "no route"), fields) is None  # the URL naming top_k does not count
    assert rejected_field(ServerError("POST http://x/generate: connection refused", url="http://x"), fields) is None


# The sampling keys of an SGLang from before v0.5.3 (no sampling_seed, stop_regex, structural_tag,
# logit_bias).
_OLD_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex", "ebnf", "ignore_eos", "skip_special_tokens",
             "spaces_between_special_tokens", "no_stop_trim", "stop", "stop_token_ids", "custom_params", "stream_interval"}


class _OldSGLang(BaseHTTPRequestHandler):
    """An SGLang build from before ``sampling_seed``, ``/server_info`` and ``weight_version``, which
    cannot run here: a fake that answers as it does (``/get_server_info`` only; ``/generate`` with a
    key its ``SamplingParams`` lacks is a TypeError, which /generate does not map: a bare HTTP 500
    that names nothing; otherwise one token). The one fake server of this file."""

    seen: list = []
    bodies: list = []

    def log_message(self, *args):
        pass

    def _answer(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.seen.append(self.path)
        if self.path == "/get_server_info":
            self._answer(200, {"version": "0.4.0", "random_seed": 1})
        elif self.path in ("/model_info", "/get_model_info"):
            self._answer(200, {"model_path": "old", "is_generation": True})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self):
        self.seen.append(self.path)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        sampling = body.get("sampling_params") or {}
        if any(set(sp) - _OLD_KEYS for sp in (sampling if isinstance(sampling, list) else [sampling])):
            text = b"Internal Server Error"
            self.send_response(500)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        self._answer(200, {"text": "", "output_ids": [5], "meta_info": {
            "id": "x", "finish_reason": {"type": "length", "length": 1}, "output_token_logprobs": [[-1.0, 5, None]]}})


@pytest.fixture
def old_sglang():
    import threading
    from http.server import ThreadingHTTPServer

    _OldSGLang.seen, _OldSGLang.bodies = [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _OldSGLang)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_an_sglang_without_sampling_seed_is_one_error_before_any_record(glmpost_cli, old_sglang, tiny_checkpoint, tmp_path):
    """An old SGLang answers the unknown key with a bare 500: rollout finds the key with 1-token
    requests (never retried as transient, never a batch) and names it, with the release that brought it."""
    client = SGLangClient(old_sglang, retries=0)
    assert client.settings() == {"version": "0.4.0", "random_seed": 1} and client.settings() is client.settings()
    assert _OldSGLang.seen == ["/server_info", "/get_server_info"]  # /server_info, then the old name; once
    _OldSGLang.seen.clear()
    out = tmp_path / "o"
    args = ["rollout", _prompts(tmp_path, 4), "--checkpoint", tiny_checkpoint, "--group-size", "4", "--engine", "sglang",
            "--server", old_sglang, "--server-log-prob-kind", "tempered", "--retries", "0"]
    unversioned = glmpost_cli(*args, "--out", out)
    assert unversioned.exit_code == 1 and "reports weight_version None, not a policy version" in unversioned.stderr
    assert "--unversioned-server unknown" in unversioned.stderr and "/generate" not in _OldSGLang.seen
    result = glmpost_cli(*args, "--out", out, "--unversioned-server", "unknown")
    *warnings, error = result.stderr.splitlines()  # no tokenizer revision, no deterministic inference; the error
    assert result.exit_code == 1 and len(warnings) == 2 and "Traceback" not in result.stderr, result.stderr
    assert "does not say enable_deterministic_inference" in warnings[1] and error.startswith("glmpost: error: ")
    assert (f"--server {old_sglang} refuses sampling_params.sampling_seed came with SGLang v0.5.3 (#10645): this server "
            "is older; upgrade it (HTTP 500)") in error
    assert all(b["sampling_params"]["max_new_tokens"] == 1 and not isinstance(b["input_ids"][0], list)
               for b in _OldSGLang.bodies)  # 1-token checks only, no batch
    assert [b for b in _OldSGLang.bodies if set(b["sampling_params"]) == {"max_new_tokens", "sampling_seed"}]
    assert not list(out.glob("*.msgpack.zst")) if out.exists() else True


def test_the_probe_finds_the_default_servers_kind(server, tiny_checkpoint):
    from glmpost.kernel.loading import load_tokenizer
    from glmpost.kernel.server_settings import probe_log_prob_kind, probe_prompts

    assert probe_log_prob_kind(SGLangClient(server, retries=0), probe_prompts(load_tokenizer(tiny_checkpoint)[0])) == "tempered"


@pytest.mark.parametrize("kind", ["tempered", "raw", "top_p_renormalized"])
def test_rollout_records_the_kind_its_server_returns(glmpost_cli, engine, tiny_checkpoint, tmp_path, kind):
    """serve --log-prob-kind KIND: /server_info says KIND, the probe finds KIND, rollout --engine sglang
    (auto) records KIND with seed_reproducible true, and the log-probs are of KIND."""
    from glmpost.kernel.engine import sequence_seed
    from glmpost.kernel.loading import load_tokenizer
    from glmpost.kernel.server_settings import probe_log_prob_kind, probe_prompts

    proc, url = start_server(tiny_checkpoint, "--log-prob-kind", kind, "--batch-size", "8")
    try:
        client = SGLangClient(url, retries=0)
        assert client.settings()["log_prob_kind"] == kind
        assert probe_log_prob_kind(client, probe_prompts(load_tokenizer(tiny_checkpoint)[0])) == kind
        args = ["rollout", _prompts(tmp_path, 2), "--checkpoint", tiny_checkpoint, "--group-size", "2", "--max-new-tokens", "5",
                "--seed", "4", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--batch-size", "4",
                "--engine", "sglang", "--server", url]
        result = glmpost_cli(*args, "--out", tmp_path / "o", "--json")
        assert result.exit_code == 0, result.stderr
        contradiction = glmpost_cli(*args, "--out", tmp_path / "x", "--server-log-prob-kind", "sampled")
        assert contradiction.exit_code == 2
        assert f"--server-log-prob-kind sampled contradicts --server {url}, which reports log_prob_kind {kind}" in contradiction.stderr
    finally:
        stop_server(proc)
    records = _records(tmp_path / "o")
    assert len(records) == 4
    # the local engine with that kind, on the same batch of 4 and the same seeds, gives the same bits
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=5,
                            stop_token_ids=[int(t) for t in np.atleast_1d(engine.model.generation_config.eos_token_id)])
    seeds = [sequence_seed(4, r["id"].split("@")[0] + "/" + r["id"].rsplit("/", 1)[1]) for r in records]
    prompts = [r["prompt_token_ids"].tolist() for r in records]
    local = engine.generate(prompts, None, SamplingParams(**{**params.__dict__, "log_prob_kind": kind}), seeds=seeds)
    sampled = engine.generate(prompts, None, params, seeds=seeds)
    for record, mine, other in zip(records, local, sampled):
        assert record["sampling"]["log_prob_kind"] == kind and record["sampling"]["seed_reproducible"] is True
        assert record["response_token_ids"].tolist() == mine.token_ids == other.token_ids
        assert record["rollout_log_probs"].tobytes() == np.asarray(mine.log_probs, dtype=np.float32).tobytes()
        assert np.abs(record["rollout_log_probs"] - np.asarray(other.log_probs)).max() > 1e-3  # not the sampled kind
    if kind == "tempered":  # log_softmax(z / T) of the first chosen token, from a forward of the prompt alone
        for record in records:
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor([record["prompt_token_ids"].tolist()])).logits[0, -1].float()
            expected = torch.log_softmax(logits / 0.8, -1)[int(record["response_token_ids"][0])]
            assert abs(float(record["rollout_log_probs"][0]) - float(expected)) < 1e-5
