"""Every request glmpost's SGLang client sends, checked by SGLang's own classes, and every answer
``glmpost serve`` gives, decoded by SGLang's response classes (sglang 0.5.23, installed without its
dependencies: tests/sglang_contract.py says which modules and why).

The requests are the real ones: glmpost's code paths (rollout's batches, the sampling check, the
log-prob kind probe, scoring, routed experts, weight sync, aborts) run against a real ``glmpost
serve``, and each request body and answer is recorded as it crosses ``SGLangClient._once``.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
from transformers import AutoConfig
import sglang_contract

try:
    SGL = sglang_contract.load()
except ImportError as exc:
    pytest.skip(f"SGLang's classes are not importable ({exc})", allow_module_level=True)

from glmpost.kernel.routing import config_routing_layout  # noqa: E402
from glmpost.kernel.engine import SamplingParams, sequence_seed  # noqa: E402
from glmpost.kernel.server_settings import ServerSettings, probe_values  # noqa: E402
from glmpost.kernel.sglang_client import SGLangClient  # noqa: E402
from glmpost.rollout.records import sglang_sampling_params  # noqa: E402
from glmpost.rollout.servers import check_routing_returned, checked_sampling, one_by_one  # noqa: E402
from glmpost.server.parsing import SAMPLING_KEYS  # noqa: E402


@pytest.fixture
def recorded(monkeypatch):
    """``[(method, path, body sent, answer)]`` of every request an SGLangClient makes (then sent as usual)."""
    calls = []
    real = SGLangClient._once

    def once(self, method, path, data, ok, text=False):
        answer = real(self, method, path, data, ok, text)
        calls.append((method, path, None if data is None else json.loads(data), answer))
        return answer

    monkeypatch.setattr(SGLangClient, "_once", once)
    return calls


def _fields(cls) -> tuple[str, ...]:
    """The field names of an api_types class (msgspec or its stand-in), in order."""
    return getattr(cls, "__struct_fields__", None) or tuple(f.name for f in dataclasses.fields(cls))


def _check_generate(body: dict, vocab: int) -> list:
    """``body`` through SGLang's /generate contract check, its top-level keys among GenerateReqInput's
    fields (the check ignores unknown ones: they would be dropped silently), and each sampling-params
    dict through SamplingParams(**sp), verify(vocab) and normalize (the tokenizer manager's steps).
    Returns the SamplingParams SGLang would sample with."""
    assert SGL.generate_contract_error(body) is None, body
    fields = sglang_contract.io_struct_fields(SGL.io_struct, "GenerateReqInput")
    assert set(body) <= set(fields), sorted(set(body) - set(fields))
    sps = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
    made = []
    for sp in sps:
        params = SGL.SamplingParams(**sp)
        params.verify(vocab)
        params.normalize(None)
        made.append(params)
    return made


def _check_generate_answer(answer, body: dict) -> None:
    """Each answer decoded by SGLang's GenerateResponse, its ids, counts and log-prob entries consistent."""
    answers = answer if isinstance(answer, list) else [answer]
    rids = body.get("rid")
    for i, one in enumerate(answers):
        decoded = SGL.api_types.GenerateResponse.from_json_value(one)
        meta = decoded.meta_info
        assert meta.completion_tokens == len(decoded.output_ids) and meta.prompt_tokens > 0
        if isinstance(rids, list):
            assert meta.id == rids[i]
        elif isinstance(rids, str):
            assert meta.id == rids if not isinstance(body["input_ids"][0], list) else meta.id == f"{rids}_{i}"
        if body.get("return_logprob"):
            assert [e.token_id for e in meta.output_token_logprobs] == list(decoded.output_ids)
            assert all(e.logprob <= 0 for e in meta.output_token_logprobs)
        assert type(meta.finish_reason).__name__ in ("FinishStop", "FinishLength", "FinishAbort")


def test_the_sampling_keys_serve_knows_are_sglangs_in_its_order():
    assert SAMPLING_KEYS == _fields(SGL.api_types.SamplingParams)


def test_every_generate_request_passes_sglangs_checks_and_every_answer_decodes(server, recorded, tiny_checkpoint):
    client = SGLangClient(server, retries=0)
    vocab = int(client.model_info()["vocab_size"])
    # A rollout's batch as SGLangBackend._submit sends it: the run's params, a seed and a budget per sequence.
    for params in (SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4, stop_token_ids=[2], seed=7),
                   SamplingParams(temperature=1.0, top_k=0, max_new_tokens=3, stop_token_ids=[], seed=8)):
        sent = sglang_sampling_params(params, [2])
        keys = ["p0-s0", "p0-s1", "p1-s0"]
        per_seq = [{**sent, "max_new_tokens": params.max_new_tokens, "sampling_seed": sequence_seed(params.seed, k)}
                   for k in keys]
        answers = one_by_one(client, [[5, 6, 7], [5, 6, 7], [8, 9]], per_seq, [f"glmpost-run-{k}" for k in keys])
        assert [len(a["output_ids"]) <= params.max_new_tokens for a in answers] == [True] * 3
        checked_sampling(client, ServerSettings.read(client), sent, [5, 6, 7], lambda exc: None)
    probe_values(client, [5, 6, 7, 8])  # the log-prob kind probe
    scored = client.score([5, 6, 7, 8, 9], 2, top_logprobs_num=2)
    assert len(scored["token_log_probs"]) == 3 and len(scored["top_ids"]) == 3
    check_routing_returned(client, [5, 6, 7], config_routing_layout(AutoConfig.from_pretrained(tiny_checkpoint)))
    generates = [(body, answer) for method, path, body, answer in recorded if path == "/generate"]
    assert len(generates) >= 8
    for body, answer in generates:
        made = _check_generate(body, vocab)
        _check_generate_answer(answer, body)
        for sp, params in zip(body["sampling_params"] if isinstance(body["sampling_params"], list)
                              else [body["sampling_params"]], made):
            # What SGLang samples with is what glmpost sent (top_k -1: the whole vocabulary).
            assert params.max_new_tokens == sp["max_new_tokens"] and params.sampling_seed == sp.get("sampling_seed")
            if sp.get("temperature", 1.0) > 0:
                assert (params.temperature, params.top_p) == (sp.get("temperature", 1.0), sp.get("top_p", 1.0))
                assert params.top_k == (sp.get("top_k", -1) if sp.get("top_k", -1) > 0 else 1 << 30)
            assert params.stop_token_ids == (set(sp["stop_token_ids"]) if sp.get("stop_token_ids") else None)
    rollout = generates[0][0]
    assert rollout["rid"] == ["glmpost-run-p0-s0", "glmpost-run-p0-s1", "glmpost-run-p1-s0"]
    assert any(b.get("return_routed_experts") for b, _ in generates)


def test_sync_and_abort_requests_are_sglangs_and_so_are_serves_answers(server, recorded, tiny_checkpoint):
    client = SGLangClient(server, retries=0)
    answer = client.update_weights_from_disk(str(tiny_checkpoint), weight_version="7", abort_all_requests=True)
    client.abort_request("no-such-request")
    client.abort_request(abort_all=True)
    assert client.get_weight_version() == "7"
    update_fields = sglang_contract.io_struct_fields(SGL.io_struct, "UpdateWeightFromDiskReqInput")
    abort_fields = sglang_contract.io_struct_fields(SGL.io_struct, "AbortReq")
    kinds = {"str": str, "bool": bool, "int": int, "Optional[str]": (str, type(None))}
    for method, path, body, got in recorded:
        if path == "/update_weights_from_disk":
            assert set(body) <= set(update_fields) and "model_path" in body
            for key, value in body.items():
                assert isinstance(value, kinds[update_fields[key]]), (key, value)
            assert body == {"model_path": str(tiny_checkpoint), "flush_cache": True, "abort_all_requests": True,
                            "weight_version": "7"}
        elif path == "/abort_request":
            assert set(body) <= set(abort_fields)
            decoded = SGL.api_types.AbortRequest.from_json_value(body)
            assert (decoded.rid, decoded.abort_all) in (("no-such-request", False), ("", True))
            assert got is None  # SGLang: Response(status_code=200), no body
    output = sglang_contract.io_struct_fields(SGL.io_struct, "UpdateWeightFromDiskReqOutput")
    for key in ("success", "message", "num_paused_requests"):  # http_server.py update_weights_from_disk's answer
        assert key in output and isinstance(answer[key], kinds[output[key]]), key
    assert answer["success"] is True


def test_serves_info_answers_decode_as_sglangs(server):
    client = SGLangClient(server, retries=0)
    model = SGL.api_types.GetModelInfoResponse.from_json_value(client.model_info())
    assert model.is_generation is True and model.model_path and model.weight_version is not None
    info = SGL.api_types.GetServerInfoResponse.from_json_value(client.server_info())
    assert info.model_path == model.model_path and info.version


def test_serve_refuses_an_unknown_sampling_key_word_for_word_as_sglang(server):
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temprature": 0.5}}
    request = urllib.request.Request(server + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400  # http_server.py generate_request: {"error": the contract check's text}
    assert json.loads(refused.value.read()) == {"error": SGL.generate_contract_error(body)}
