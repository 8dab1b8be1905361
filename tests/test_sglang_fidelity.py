"""Issue 32, SGLang at its current release: nothing a real server does may be recorded as something
else. Each test asserts what is recorded.

Servers are real ``glmpost serve`` processes, except where the behaviour is SGLang's and cannot come
from serve deterministically: :class:`_Relay` sits in front of a real serve and changes one thing
in an answer (aborts a sequence after a few tokens, reports another weight version, holds a request
until it is aborted), as a real SGLang does under ``/abort_request`` or a weight switch.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from serve_process import start_server, stop_server
from test_serve import _prompts, _records

from glmpost.kernel.engine import Completion, LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model
from glmpost.kernel.server_settings import ServerSettings
from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.sglang_sampling import EXPLICIT_DEFAULTS, check_preferred, refused_fields
from glmpost.rl.batches import check_version_lags
from glmpost.rollout.records import completion_from_sglang, sglang_sampling_params
from glmpost.rollout.servers import checked_sampling, continued

KEY, ADMIN = "user-key-1", "admin-key-2"


# ------------------------------------------------------------------ versions (item 1)

def test_an_unversioned_server_is_refused_or_recorded_unknown_never_the_checkpoints(glmpost_cli, tiny_checkpoint, tmp_path):
    proc, url = start_server(tiny_checkpoint, "--weight-version", "default", "--batch-size", "4")
    try:
        args = ["rollout", _prompts(tmp_path, 2), "--checkpoint", tiny_checkpoint, "--group-size", "2", "--max-new-tokens", "4",
                "--engine", "sglang", "--server", url]
        refused = glmpost_cli(*args, "--out", tmp_path / "refused")
        assert refused.exit_code == 1 and "reports weight_version 'default', not a policy version" in refused.stderr
        assert not (tmp_path / "refused").exists() or not list((tmp_path / "refused").glob("*.msgpack.zst"))
        unknown = glmpost_cli(*args, "--out", tmp_path / "unknown", "--unversioned-server", "unknown")
        assert unknown.exit_code == 0, unknown.stderr
        records = _records(tmp_path / "unknown")
        assert records and all((r["policy_versions"] == -1).all() and len(r["policy_versions"]) for r in records)
        told = glmpost_cli(*args, "--out", tmp_path / "told", "--unversioned-server", "checkpoint")
        assert told.exit_code == 0 and all((r["policy_versions"] == 0).all() for r in _records(tmp_path / "told"))
        from glmpost import __version__

        stage = json.loads((tmp_path / "told" / "stage.json").read_text())  # which server, which release
        assert stage["servers"] == [{"url": url, "engine": "glmpost-serve", "version": __version__}]
    finally:
        stop_server(proc)
    # A trainer cannot check such records' staleness, and says so.
    lags = check_version_lags(records, 3, max_lag=0, stage="train-grpo")
    assert lags == {"unknown": len(records)}


# ------------------------------------------------------------------ sampling keys (items 2, 4)

def test_every_key_that_changes_the_distribution_is_sent_and_preferred_params_are_checked():
    sent = sglang_sampling_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=8, stop_token_ids=[2]),
                                  [2])
    assert {k: sent[k] for k in EXPLICIT_DEFAULTS} == EXPLICIT_DEFAULTS  # penalties, min_p, grammars, stops: stated
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["ignore_eos"]) == (0.7, 0.9, 5, False)
    # A server default for a key sent is overridden; one for a key not sent (not a text key) is refused.
    assert check_preferred({"repetition_penalty": 1.2, "min_p": 0.1, "skip_special_tokens": True}, sent) == []
    assert check_preferred({"future_penalty": 0.5, "repetition_penalty": 1.2}, sent) == ["future_penalty"]
    settings = ServerSettings("http://x", {}, {"preferred_sampling_params": json.dumps({"future_penalty": 0.5})})
    assert settings.preferred_sampling_params == {"future_penalty": 0.5}


def test_refused_fields_finds_the_keys_a_bare_500_does_not_name():
    calls = []

    def send(params):
        calls.append(dict(params))
        if set(params) & {"sampling_seed", "stop_regex"}:
            raise ServerError("HTTP 500: Internal Server Error", url="x", status=500, retryable=True)

    assert refused_fields(send, {"max_new_tokens": 8, "min_p": 0.0, "sampling_seed": 3, "stop_regex": None}, ServerError) == [
        "sampling_seed", "stop_regex"]
    assert calls[0] == {"max_new_tokens": 1} and all(c["max_new_tokens"] == 1 and len(c) <= 2 for c in calls)
    assert refused_fields(lambda p: (_ for _ in ()).throw(ServerError("down", url="x")), {"min_p": 0.0}, ServerError) is None


def test_serve_answers_an_unknown_sampling_key_as_sglang_and_takes_its_defaults(server, tiny_checkpoint):
    client = SGLangClient(server, retries=0)
    with pytest.raises(ServerError) as refused:
        client.generate([5, 6, 7], {"max_new_tokens": 2, "future_key": 1})
    assert refused.value.status == 400 and str(refused.value).endswith(
        "HTTP 400: unknown field `future_key` (not one of the server's 28 keys)")
    request = urllib.request.Request(server + "/generate", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"input_ids": [5], "sampling_params": {"future_key": 1}}).encode())
    with pytest.raises(urllib.error.HTTPError) as raw:  # SGLang's body, word for word
        urllib.request.urlopen(request, timeout=30)
    assert raw.value.code == 400 and json.loads(raw.value.read()) == {"error": _sglang_unknown_field("future_key",
                                                                                                     SGLANG_0523_KEYS)}
    explicit = {**EXPLICIT_DEFAULTS, "max_new_tokens": 2, "temperature": 0.0}
    answer = client.generate([5, 6, 7], explicit, return_logprob=True)
    assert len(answer["output_ids"]) == 2 and answer["meta_info"]["input_token_logprobs"] == []  # start -1: none
    settings = ServerSettings.read(client)
    sampling = checked_sampling(client, settings, {**EXPLICIT_DEFAULTS, "max_new_tokens": 2}, [5, 6, 7], lambda exc: None)
    assert sampling == {**EXPLICIT_DEFAULTS, "max_new_tokens": 2}
    preferred = ServerSettings(server, settings.info, {"preferred_sampling_params": {"dry_multiplier": 0.8}})
    from glmpost.config import ConfigError

    with pytest.raises(ConfigError, match="preferred_sampling_params setting dry_multiplier"):
        checked_sampling(client, preferred, {**EXPLICIT_DEFAULTS, "max_new_tokens": 2}, [5, 6, 7], lambda exc: None)


# SGLang 0.5.23's sampling keys, in the order its 400 lists them (api/v1/api_types.py SamplingParams).
SGLANG_0523_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                    "custom_params", "beam_width", "watermark", "choice")


def _sglang_unknown_field(key: str, keys: tuple) -> str:
    """serde's unknown_field text, as SGLang 0.5.23's api/v1/api_types.py ``_unknown_field`` writes it."""
    return f"unknown field `{key}`, expected one of " + ", ".join(f"`{k}`" for k in keys)


class _ContractServer(BaseHTTPRequestHandler):
    """SGLang 0.5.23's /generate contract check for a build whose sampling keys are ``keys``: a key
    outside them is HTTP 400 ``{"error": "unknown field `X`, expected one of ..."}``; any other
    request is answered with one token."""

    keys: tuple = ()
    sent: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).sent.append(body)
        unknown = [k for k in body["sampling_params"] if k not in self.keys]
        status, payload = (400, {"error": _sglang_unknown_field(unknown[0], self.keys)}) if unknown else (200, {
            "text": "", "output_ids": [3], "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": 1},
                                                          "output_token_logprobs": [[-0.5, 3, None]], "weight_version": "1"}})
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def contract_server():
    handler = type("Contract", (_ContractServer,), {"keys": SGLANG_0523_KEYS, "sent": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_400_listing_every_valid_key_names_the_key_it_refuses(contract_server):
    """Issue 42, case 9: SGLang 0.5.23 lists every valid key after the refused one; the refusal is
    the key named first, never a key of the list (``max_new_tokens`` comes first there)."""
    from glmpost.kernel.server_settings import rejected_field

    handler, url = contract_server
    handler.keys = tuple(k for k in SGLANG_0523_KEYS if k != "sampling_seed")  # a build without sampling_seed
    with pytest.raises(ServerError) as refused:
        SGLangClient(url, retries=0).generate([5, 6], {"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": 3})
    assert refused.value.status == 400 and not refused.value.retryable
    assert str(refused.value).endswith("HTTP 400: unknown field `sampling_seed` (not one of the server's 27 keys)")
    assert rejected_field(refused.value, ["max_new_tokens", "temperature", "top_k", "sampling_seed"]) == "sampling_seed"
    assert rejected_field(refused.value, ["max_new_tokens", "temperature"]) is None  # not a key of this run


def test_a_key_a_contract_checked_server_lacks_is_named_or_dropped_when_it_restates_the_default(contract_server):
    from glmpost.config import ConfigError

    handler, url = contract_server
    client = SGLangClient(url, retries=0)
    settings = ServerSettings(url, {}, {})
    sampling = {**EXPLICIT_DEFAULTS, "max_new_tokens": 4, "temperature": 1.0}
    handler.keys = tuple(k for k in SGLANG_0523_KEYS if k != "sampling_seed")
    with pytest.raises(ConfigError) as needed:
        checked_sampling(client, settings, sampling, [5, 6], lambda exc: None)
    assert "refuses sampling_params.sampling_seed came with SGLang v0.5.3" in str(needed.value) and "(HTTP 400)" in str(
        needed.value)
    handler.keys = tuple(k for k in SGLANG_0523_KEYS if k != "stop_regex")  # only ever sent at its default: dropped
    assert checked_sampling(client, settings, sampling, [5, 6], lambda exc: None) == {
        k: v for k, v in sampling.items() if k != "stop_regex"}


# ------------------------------------------------------------------ keys (item 3)

def test_the_admin_key_alone_opens_the_control_routes(glmpost_cli, tiny_checkpoint, tmp_path):
    proc, url = start_server(tiny_checkpoint, "--api-key", KEY, "--admin-api-key", ADMIN)
    try:
        user = SGLangClient(url, api_key=KEY, retries=0)
        assert user.generate([5, 6], {"max_new_tokens": 1})["output_ids"]  # a normal route: the API key
        with pytest.raises(ServerError) as refused:
            user.update_weights_from_disk(str(tiny_checkpoint))
        assert refused.value.status == 401 and "a server launched with --admin-api-key takes only that key" in str(refused.value)
        with pytest.raises(ServerError, match="the server refused the admin API key"):
            SGLangClient(url, api_key=KEY, admin_api_key="wrong", retries=0).abort_request(abort_all=True)
        admin = SGLangClient(url, api_key=KEY, admin_api_key=ADMIN, retries=0)
        assert admin.abort_request(abort_all=True) is None
        assert admin.update_weights_from_disk(str(tiny_checkpoint), weight_version="7")["success"] is True
        with pytest.raises(ServerError) as only_admin:  # the admin key is not the API key on normal routes
            SGLangClient(url, api_key=ADMIN, retries=0).model_info()
        assert only_admin.value.status == 401
        synced = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "rollout", "--server", url,
                             "--api-key", KEY, "--admin-api-key", ADMIN, "--json")
        assert synced.exit_code == 0, synced.stderr
        assert json.loads(synced.stdout)["servers"][0]["status"] == "updated"
        recorded = (tmp_path / "rollout" / "stage.json").read_text() if (tmp_path / "rollout" / "stage.json").exists() else ""
        assert ADMIN not in recorded and KEY not in recorded
    finally:
        stop_server(proc)


# ------------------------------------------------------------------ stops (item 7)

def test_a_server_stop_on_an_id_outside_the_runs_set_is_completed_not_truncated():
    answer = {"output_ids": [11, 12, 7], "meta_info": {"finish_reason": {"type": "stop", "matched": 7},
                                                       "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None], [-1.0, 7, None]],
                                                       "weight_version": "3"}}
    completion, version, reason = completion_from_sglang(answer, stop_token_ids=[2])
    assert completion.finish_reason == "stop" and version == "3" and reason is None
    answer["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert completion_from_sglang(answer, stop_token_ids=[2])[0].finish_reason == "length"
    assert completion_from_sglang(answer, stop_token_ids=[7])[0].finish_reason == "stop"  # the last id, reported length


# ------------------------------------------------------------------ aborts (items 5, 6)

def test_an_aborted_sequence_keeps_its_partial_output_in_the_engine_and_in_serve(tiny_checkpoint):
    engine = LocalEngine(load_model(tiny_checkpoint), batch_size=4, pad_token_id=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, stop_token_ids=[])
    whole = engine.generate([[5, 6, 7], [8, 9]], ["a", "b"], params)
    steps = {"n": 0}

    def abort(i):  # row 0 stops after its 4th token, row 1 runs on
        steps["n"] += i == 0
        return i == 0 and steps["n"] >= 4

    cut = engine.generate([[5, 6, 7], [8, 9]], ["a", "b"], params, abort=abort)
    assert cut[0].finish_reason == "abort" and cut[0].token_ids == whole[0].token_ids[:4]
    assert cut[0].log_probs == whole[0].log_probs[:4] and cut[1].token_ids == whole[1].token_ids


def test_serve_aborts_queued_requests_by_rid_and_answers_them(tiny_checkpoint):
    from glmpost.server.engine import EngineServer, Job
    from glmpost.server.parsing import parse_generate

    server = EngineServer(tiny_checkpoint)  # the worker is not started: jobs stay queued
    items, _ = parse_generate({"input_ids": [[5, 6], [7, 8]], "rid": "job", "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 3}}, server.loaded)
    job = Job("generate", items, batch=True)
    server._queue.append(job)
    assert server.abort_request({"rid": "job"}) == 2 and job.done.is_set() and not server._queue
    for answer, rid in zip(job.result, ("job_0", "job_1")):
        assert answer["output_ids"] == [] and answer["meta_info"]["id"] == rid
        assert answer["meta_info"]["finish_reason"]["type"] == "abort"


def test_serve_stops_a_running_sequence_by_rid_with_its_partial_output(tiny_checkpoint, monkeypatch):
    """/abort_request while a batch decodes: that sequence answers ``abort`` with the tokens and
    log-probs it has (the abort sent deterministically from inside the decode loop's third check)."""
    from glmpost.server.engine import EngineServer
    from glmpost.server.parsing import parse_generate

    server = EngineServer(tiny_checkpoint)
    items, _ = parse_generate({"input_ids": [[5, 6], [7, 8]], "rid": "r", "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}, server.loaded)
    real, checks = server.loaded.engine.generate, {"n": 0}

    def generate(*args, abort=None, **kwargs):
        def checked(i):
            checks["n"] += 1
            if checks["n"] == 3:  # step 2, row 0: /abort_request arrives
                assert server.abort_request({"rid": "r_0"}) == 1
            return abort(i)
        return real(*args, abort=checked, **kwargs)

    monkeypatch.setattr(server.loaded.engine, "generate", generate)
    server._run_generate(items)
    stopped, whole = items[0].result, items[1].result
    assert stopped["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort by /abort_request",
                                                     "status_code": None, "err_type": None}
    assert len(stopped["output_ids"]) == 2 and len(stopped["meta_info"]["output_token_logprobs"]) == 2
    assert len(whole["output_ids"]) == 6 and whole["meta_info"]["finish_reason"]["type"] == "length"


class _Relay(BaseHTTPRequestHandler):
    """In front of a real ``glmpost serve``: answers what it answers, but (``abort_after``) the first
    ``/generate`` is cut after that many tokens and answered aborted, as SGLang answers a sequence
    stopped by ``/abort_request`` or an update's ``abort_all_requests``; (``versions``) each answer's
    weight_version taken in turn; (``hold``) the first ``/generate`` held until an ``/abort_request``
    names its rids."""

    target = ""
    abort_after = 0
    versions: list = []
    hold = False
    hold_update_s = 0.0
    updates: list = []
    generates: list = []
    aborts: list = []
    released = threading.Event()

    def log_message(self, *args):
        pass

    def _forward(self, path, body):
        request = urllib.request.Request(self.target + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def _send(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        with urllib.request.urlopen(self.target + self.path, timeout=60) as response:
            payload = json.loads(response.read())
        if self.path == "/model_info" and self.versions:
            payload["weight_version"] = self.versions[0]
        self._send(payload)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            type(self).aborts.append(body.get("rid"))
            type(self).released.set()
            return self._send(None)
        if self.path == "/update_weights_from_disk":  # done on the server, but answered too late
            type(self).updates.append(body)
            answer = self._forward(self.path, body)
            self.released.wait(self.hold_update_s)
            return self._send(answer)
        if not isinstance(body["input_ids"][0], list):  # a single check request: answered as the server does
            return self._send(self._forward(self.path, body))
        first = not self.generates
        type(self).generates.append(body)
        if first and self.hold:
            self.released.wait(60)
            return None  # no answer: the client has given up on this request
        if first and self.abort_after:
            body = {**body, "sampling_params": [{**sp, "max_new_tokens": self.abort_after} for sp in body["sampling_params"]]}
        answers = self._forward(self.path, body)
        for answer in answers:
            if first and self.abort_after:
                answer["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort by update_weights_from_disk"}
            if self.versions:
                answer["meta_info"]["weight_version"] = self.versions[min(len(self.generates) - 1, len(self.versions) - 1)]
        self._send(answers)


@pytest.fixture
def relay():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("Relay", (_Relay,), {"generates": [], "aborts": [], "updates": [],
                                                                             "released": threading.Event()}))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.RequestHandlerClass, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_an_aborted_sequence_is_continued_with_its_budget_and_each_token_keeps_its_version(glmpost_cli, tiny_checkpoint,
                                                                                           tmp_path, relay, server):
    handler, url = relay
    handler.target, handler.abort_after, handler.versions = server, 3, ["5", "6"]
    args = ["rollout", _prompts(tmp_path, 2), "--checkpoint", tiny_checkpoint, "--group-size", "2", "--max-new-tokens", "8",
            "--seed", "3", "--batch-size", "4", "--engine", "sglang", "--stop-token-ids", "none",
            "--server-log-prob-kind", "tempered"]
    result = glmpost_cli(*args, "--server", url, "--out", tmp_path / "relayed")
    assert result.exit_code == 0, result.stderr
    first, more = handler.generates[0], handler.generates[-1]
    assert len(handler.generates) == 2 and [sp["max_new_tokens"] for sp in more["sampling_params"]] == [5] * 4
    assert [len(ids) for ids in more["input_ids"]] == [len(ids) + 3 for ids in first["input_ids"]]  # prompt + partial
    records = _records(tmp_path / "relayed")
    for record in records:
        assert record["status"] == "truncated" and len(record["response_token_ids"]) == 8
        assert record["policy_versions"].tolist() == [5, 5, 5, 6, 6, 6, 6, 6]  # the switch, token by token
    # Closure: each continued sequence's tokens and log-probs are what the server gives for that prefix.
    client = SGLangClient(server, retries=0)
    for record in records:
        prompt, response = record["prompt_token_ids"].tolist(), record["response_token_ids"].tolist()
        scored = client.score(prompt + response, len(prompt))["token_log_probs"]
        assert np.allclose(scored, record["rollout_log_probs"], atol=1e-5)  # temperature 1: tempered = raw


def test_an_aborted_sequence_past_its_continuations_is_recorded_aborted_with_its_tokens():
    partial = (Completion([4, 5], [-0.1, -0.2], "abort"), 5, "aborted by the server (x)")
    assert continued(partial, (None, None, "HTTP 503")) == (partial[0], 5, "HTTP 503")
    merged, version, reason = continued(partial, (Completion([6], [-0.3], "stop"), 6, None))
    assert merged.token_ids == [4, 5, 6] and merged.token_versions == [5, 5, 6] and version == 6 and reason is None
    same, _, _ = continued(partial, (Completion([6], [-0.3], "length"), 5, None))
    assert same.token_versions is None and same.finish_reason == "length"


def test_a_request_that_timed_out_is_aborted_by_rid_before_it_is_sent_again(relay, server):
    handler, url = relay
    handler.target, handler.hold = server, True
    client = SGLangClient(url, timeout=10.0, retries=1, backoff=0.0)  # the first attempt is held: it times out
    answers = client.generate([[5, 6], [7, 8]], [{"max_new_tokens": 2, "ignore_eos": True}] * 2, rid=["r-a", "r-b"])
    assert [len(a["output_ids"]) for a in answers] == [2, 2]
    assert handler.aborts == ["r-a", "r-b"] and len(handler.generates) == 2  # aborted, then sent once more
    resent = handler.generates[1]["rid"]  # under fresh ids: SGLang holds an aborted id until the abort is answered
    assert [r.partition("~resend-")[0] for r in resent] == ["r-a", "r-b"] and len(set(resent) | {"r-a", "r-b"}) == 4


# ------------------------------------------------------------------ a resend's ids (issue 42, case 8)

@pytest.fixture
def inprocess_serve(tiny_checkpoint):
    """``glmpost serve``'s engine and HTTP server in this process (so a test can slow its worker); (engine, url)."""
    from glmpost.server.engine import EngineServer
    from glmpost.server.http import make_http_server

    engine = EngineServer(tiny_checkpoint, batch_wait_s=0.0)
    httpd = make_http_server(engine, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    engine.start()
    thread.start()
    yield engine, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    engine.stop()


def test_serve_refuses_an_id_it_still_holds_as_sglang_does(tiny_checkpoint):
    from glmpost.server.engine import EngineServer
    from glmpost.server.parsing import RequestError

    engine = EngineServer(tiny_checkpoint)  # the worker is not started: the first request stays queued
    body = {"input_ids": [[5, 6], [7, 8]], "rid": ["r-a", "r-b"], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    first: list = []
    waiting = threading.Thread(target=lambda: first.append(engine.generate(body)))
    waiting.start()
    while not engine.queued:
        time.sleep(0.01)
    refused: list = []

    def second():  # answered at once; a server that queued it instead would leave this thread waiting
        try:
            engine.generate({**body, "rid": ["r-c", "r-b"]})
        except RequestError as exc:
            refused.append(exc)

    again = threading.Thread(target=second, daemon=True)
    again.start()
    again.join(10)
    assert len(refused) == 1, "the second request under a held id was queued, not refused"
    assert (refused[0].status, str(refused[0])) == (400, "Duplicate request ID detected: r-b")
    with pytest.raises(RequestError, match=r"^Duplicate request IDs detected within the request: \['r-x'\]$"):
        engine.generate({**body, "rid": ["r-x", "r-x"]})
    assert engine.abort_request({"rid": "r-a"}) == 2  # a queued job is answered whole
    waiting.join(10)
    assert [a["meta_info"]["finish_reason"]["type"] for a in first[0]] == ["abort", "abort"]
    engine.start()  # answered: the ids are free again
    try:
        answers = engine.generate(body)
        assert [a["meta_info"]["id"] for a in answers] == ["r-a", "r-b"] and [len(a["output_ids"]) for a in answers] == [2, 2]
    finally:
        engine.stop()


def test_a_timed_out_request_is_resent_under_fresh_ids_and_no_sequence_is_lost(inprocess_serve):
    """The first attempt outlasts the client's timeout; its abort takes 0.5 s to be answered (as
    SGLang's scheduler answers an abort later), and the resend arrives meanwhile: under the ids first
    sent, the server answers 400 Duplicate request ID and both sequences are lost."""
    engine, url = inprocess_serve
    real, calls = engine._run_generate, []

    def slow_first(items):
        calls.append([it.rid for it in items])
        if len(calls) == 1:
            with engine._cond:
                engine._running = list(items)  # running, as /abort_request finds it
            deadline = time.monotonic() + 30
            while not all(it.abort_message for it in items) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # the abort is in flight: the ids are still held
        return real(items)

    engine._run_generate = slow_first
    client = SGLangClient(url, timeout=2.0, retries=1, backoff=0.0)
    answers = client.generate([[5, 6], [7, 8]], [{"max_new_tokens": 2, "ignore_eos": True}] * 2, rid=["r-a", "r-b"])
    assert [len(a["output_ids"]) for a in answers] == [2, 2]
    assert [a["meta_info"]["finish_reason"]["type"] for a in answers] == ["length", "length"]
    assert calls[0] == ["r-a", "r-b"] and len(calls) == 2
    assert [r.partition("~resend-")[0] for r in calls[1]] == ["r-a", "r-b"] and not set(calls[1]) & {"r-a", "r-b"}
    assert [a["meta_info"]["id"] for a in answers] == calls[1]


def test_an_update_that_got_no_answer_is_watched_never_sent_twice(relay, tiny_checkpoint):
    """The client gives up on update_weights_from_disk (the relay answers after 30 s, the client waits
    3 s) while the server switched: the sync sees the new version and sends nothing again."""
    from glmpost.weight_sync.sync import sync_server

    proc, target = start_server(tiny_checkpoint)
    handler, url = relay
    handler.target, handler.hold_update_s = target, 30.0
    try:
        result = sync_server(url, tiny_checkpoint, "9", retries=3, backoff=0.1, timeout=3.0)
        assert result.status == "updated" and result.version_after == "9", result.error
        assert len(handler.updates) == 1 and handler.updates[0]["abort_all_requests"] is True
    finally:
        handler.released.set()
        stop_server(proc)


# ------------------------------------------------------------------ formats (item 8)

class _SGLangInfo:
    """What SGLang 0.5.23's /model_info and /server_info say (not glmpost serve): ``model_path`` the
    checkpoint it loaded, ``quantization`` the launch flag (None unless given, or filled on sm100)."""

    def __init__(self, quantization, model_path="/not/here"):
        self.quantization, self.model_path, self.url = quantization, str(model_path), "http://sglang:30000"

    def model_info(self):
        return {"model_path": self.model_path, "weight_version": "1"}

    def settings(self):
        return {"quantization": self.quantization, "version": "0.5.23"}


def _fp8_checkpoint(tiny_checkpoint, where):
    """The tiny checkpoint's files with an fp8 ``quantization_config`` (all the format check reads)."""
    import shutil

    shutil.copytree(tiny_checkpoint, where)
    config = json.loads((where / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    (where / "config.json").write_text(json.dumps(config))
    return where


def test_a_quantized_version_is_refused_for_a_server_launched_in_another_format(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.weight_sync.sync import check_server_format

    quantized = tmp_path / "w4"
    assert glmpost_cli("quantize", tiny_checkpoint, "--out", quantized, "--scheme", "w4a16", "--group-size", "16").exit_code == 0
    # The server loaded the float checkpoint (its model_path), launched without --quantization.
    refusal = check_server_format(_SGLangInfo(None, tiny_checkpoint), quantized)
    assert f"is compressed-tensors-quantized, but the server loaded a float model (read from {tiny_checkpoint} (the " in refusal
    assert "launch it with a compressed-tensors checkpoint" in refusal
    assert check_server_format(_SGLangInfo(None, quantized), quantized) is None  # loaded from a w4a16 checkpoint
    assert check_server_format(_SGLangInfo("compressed-tensors"), quantized) is None  # nothing readable: the flag
    assert "is not quantized, but the server loaded a fp8-quantized model (read from the launch flag" in check_server_format(
        _SGLangInfo("fp8"), tiny_checkpoint)
    assert check_server_format(_SGLangInfo(None), tiny_checkpoint) is None  # nothing tells: unchecked, said in a line
    assert check_server_format(_SGLangInfo("w8a8_fp8", quantized), quantized) is None  # a flag SGLang keeps for it


def test_the_format_check_reads_what_the_server_loaded_not_the_launch_flag(tiny_checkpoint, tmp_path):
    """Issue 42, case 4: off sm100 SGLang leaves /server_info.quantization None for an FP8 checkpoint
    it loaded as FP8. A matching fp8 version goes on; a float one is refused."""
    from glmpost.weight_sync.sync import check_server_format, served_quantization

    served = _SGLangInfo(None, _fp8_checkpoint(tiny_checkpoint, tmp_path / "served-fp8"))
    version = _fp8_checkpoint(tiny_checkpoint, tmp_path / "v2-fp8")
    assert served_quantization(served) == ("fp8", f"{served.model_path} (the checkpoint the server loaded)")
    assert check_server_format(served, version) is None
    refusal = check_server_format(served, tiny_checkpoint)
    assert refusal == (f"{tiny_checkpoint} is not quantized, but the server loaded a fp8-quantized model (read from "
                       f"{served.model_path} (the checkpoint the server loaded)): SGLang loads tensors by name into the "
                       "model it loaded without checking their format; launch it with a float checkpoint and no "
                       "--quantization (or sync with the --quantize it was launched for)")


def test_serve_reports_its_launch_flag_and_loaded_checkpoint_where_sglang_does(server, tiny_checkpoint):
    from glmpost.weight_sync.sync import served_quantization

    client = SGLangClient(server, retries=0)
    assert client.settings()["quantization"] is None and client.model_info()["model_path"] == str(tiny_checkpoint)
    assert served_quantization(client) == (None, f"{tiny_checkpoint} (the checkpoint the server loaded)")


# ------------------------------------------------------------------ routing through a server (issue 33)

def test_sglang_rollout_records_the_servers_routed_experts_as_the_local_engine_does(glmpost_cli, tiny_checkpoint, tmp_path):
    """--record-routing through --engine sglang: the server's return_routed_experts rows (serve
    answers them as SGLang shapes them: base64 int32 [prompt + output - 1, L, k]) give the local
    engine's routed_experts, token for token."""
    common = [_prompts(tmp_path, 2), "--checkpoint", tiny_checkpoint, "--group-size", "2", "--max-new-tokens", "5",
              "--seed", "7", "--batch-size", "4", "--record-routing"]
    local = glmpost_cli("rollout", *common, "--out", tmp_path / "local")
    assert local.exit_code == 0, local.stderr
    proc, url = start_server(tiny_checkpoint, "--batch-size", "8", "--log-prob-kind", "sampled")
    try:
        answer = SGLangClient(url, retries=0).generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True},
                                                       return_routed_experts=True)
        import base64

        rows = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32)
        layers, k = _records(tmp_path / "local")[0]["routed_experts"].shape[1:]
        hidden = json.loads((tiny_checkpoint / "config.json").read_text())["num_hidden_layers"]
        assert (layers, hidden) == (1, 2)  # tiny GLM-5: layer 0 dense (first_k_dense_replace 1), layer 1 MoE
        # SGLang's shape: every position but the last, every hidden layer, the dense one's rows 0
        rows = rows.reshape(3 + 3 - 1, hidden, k)
        assert not rows[:, 0].any() and (rows[:, 1] != rows[:, 1, :1]).any(axis=-1).all()
        remote = glmpost_cli("rollout", *common, "--out", tmp_path / "remote", "--engine", "sglang", "--server", url)
        assert remote.exit_code == 0, remote.stderr
    finally:
        stop_server(proc)
    a, b = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x["response_token_ids"].tolist() == y["response_token_ids"].tolist()
        assert x["routed_experts"].dtype == y["routed_experts"].dtype
        assert np.array_equal(x["routed_experts"], y["routed_experts"])


def test_a_server_without_routed_experts_is_refused_for_record_routing():
    from glmpost.config import ConfigError
    from glmpost.kernel.routing import routed_from_sglang
    from glmpost.rollout.servers import check_routing_returned

    class Plain:  # an SGLang launched without --enable-return-routed-experts
        url = "http://x"

        def generate(self, *args, **kwargs):
            return {"output_ids": [3], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}

    with pytest.raises(ConfigError, match="returns no routed_experts"):
        check_routing_returned(Plain(), [5, 6], (2, 2, 16))
    import base64

    rows = base64.b64encode(np.arange(4 * 2 * 2, dtype=np.int32)[::-1].copy().tobytes()).decode()  # 4 positions
    got = routed_from_sglang(rows, prompt_tokens=3, tokens=2, shape=(2, 2, 16))  # positions 2, 3
    assert got.tolist() == [[[6, 7], [4, 5]], [[2, 3], [0, 1]]] and got.dtype == np.uint8
    with pytest.raises(ValueError, match="not 5 positions x 2 MoE layers x 2"):
        routed_from_sglang(rows, prompt_tokens=3, tokens=3, shape=(2, 2, 16))
    with pytest.raises(ValueError, match="not 4 positions x 3 MoE layers x 2"):  # rows of all layers, say: refused
        routed_from_sglang(rows, prompt_tokens=3, tokens=2, shape=(3, 2, 16))
