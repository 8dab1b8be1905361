"""`glmpost sync-weights`: train checkpoint -> rollout checkpoint -> atomic switch -> servers confirmed.

Brief 「稀疏与版本契约」: 权重同步包含训练分片 → 推理分片 → 量化 → 发送 → 原子切换 → 确认, and
"传输完成" is not "新策略已生效": a server is synced only when it reports the new weight version.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from serve_process import start_server, stop_server

from glmpost.checkpoints import (
    CheckpointManifest,
    CheckpointRoot,
    read_manifest,
    write_manifest,
)

GLMPOST = str(Path(sys.executable).with_name("glmpost"))


def _tensors(directory: Path) -> dict:
    from glmpost.quant.formats import read_tensors

    return read_tensors(directory)


def _same_bytes(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def make_version(src: Path, root: Path, version: int, *, noise: float = 0.05, drop: str | None = None) -> Path:
    """A training checkpoint root holding ``v{version}``: ``src``'s weights plus seeded noise."""
    import torch
    from safetensors.torch import save_file

    target = CheckpointRoot(root).version_dir(version)
    target.mkdir(parents=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "glmpost.json":
            shutil.copy2(item, target / item.name)
    gen = torch.Generator().manual_seed(version)
    tensors = {}
    for name, t in _tensors(src).items():
        if name == drop:
            continue
        tensors[name] = t + noise * torch.randn(t.shape, generator=gen, dtype=t.dtype) if noise else t
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    base = read_manifest(src)
    write_manifest(target, CheckpointManifest(policy_version=version, tokenizer_revision=base.tokenizer_revision,
                                              stage="train-grpo", step=3, parent=str(src)))
    CheckpointRoot(root).set_latest(version)
    return root


def test_plain_sync_is_bit_exact_and_published_atomically(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["policy_version"] == 0 and summary["skipped"] is False and summary["servers"] == []
    assert (out / "LATEST").read_text().strip() == "v000000"
    version_dir = out / "v000000"
    src, dst = _tensors(tiny_checkpoint), _tensors(version_dir)
    assert src.keys() == dst.keys()
    assert all(src[k].dtype == dst[k].dtype and src[k].equal(dst[k]) for k in src)
    manifest = read_manifest(version_dir)
    assert manifest.stage == "sync-weights" and manifest.policy_version == 0
    assert manifest.tokenizer_revision == read_manifest(tiny_checkpoint).tokenizer_revision
    assert manifest.extra["source"]["path"] == str(tiny_checkpoint)
    assert manifest.extra["source"]["revision"].startswith("sha256:")
    assert manifest.extra["quantization"] == {"scheme": "none", "group_size": None, "dtype": "auto"}
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".staging")) == []
    assert oct((version_dir / "model.safetensors").stat().st_mode & 0o044) == oct(0o044)  # readable by servers
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["sync/bytes_in"] == lines[0]["sync/bytes_out"] == sum(t.numel() * 4 for t in src.values())

    # the same source again is a skip: nothing rewritten
    mtime = (version_dir / "model.safetensors").stat().st_mtime_ns
    again = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["skipped"] is True
    assert (version_dir / "model.safetensors").stat().st_mtime_ns == mtime
    # ... but not with other quantization, which would need another directory for the same version
    other = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--quantize", "fp8-block")
    assert other.exit_code == 2
    assert "v000000 was synced with --quantize none" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.parametrize("scheme,args", [("fp8-block", []), ("w4a16", ["--group-size", "16"])])
def test_quantized_sync_writes_what_glmpost_quantize_writes(glmpost_cli, tiny_checkpoint, tmp_path, scheme, args):
    """One quantizer: the rollout checkpoint holds the same codes, scales and config as `glmpost quantize`."""
    from glmpost.kernel.loading import load_model
    from glmpost.quant.formats import load_quantized_state
    from glmpost.weight_sync.sync import load_rollout_state

    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--quantize", scheme, *args, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["quantized_layers"] > 0
    reference = tmp_path / "quantized"
    ref = glmpost_cli("quantize", tiny_checkpoint, "--out", reference, "--scheme", scheme, *args)
    assert ref.exit_code == 0, ref.stderr
    ours, theirs = _tensors(out / "v000000"), _tensors(reference)
    assert ours.keys() == theirs.keys()
    assert all(_same_bytes(ours[k], theirs[k]) for k in ours)
    config = json.loads((out / "v000000" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((reference / "config.json").read_text())["quantization_config"]
    state, expected = load_rollout_state(out / "v000000"), load_quantized_state(reference)
    assert state.keys() == expected.keys() == _tensors(tiny_checkpoint).keys()
    assert all(state[k].equal(expected[k]) for k in state)
    # servers load it as a float model whose weights are the dequantized ones
    model = load_model(out)
    assert model.model.layers[0].self_attn.o_proj.weight.equal(state["model.layers.0.self_attn.o_proj.weight"])


def test_small_shards_get_an_index_and_load_back(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.weight_sync.sync import load_rollout_state

    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--max-shard-size", "0.2")
    assert result.exit_code == 0, result.stderr
    files = sorted(p.name for p in (out / "v000000").glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "v000000" / "model.safetensors.index.json").read_text())
    src = _tensors(tiny_checkpoint)
    assert set(index["weight_map"]) == set(src) and set(index["weight_map"].values()) == set(files)
    state = load_rollout_state(out)
    assert all(state[k].equal(src[k]) for k in src)


def test_missing_tensor_is_one_line_naming_it_and_publishes_nothing(glmpost_cli, tiny_checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    train = make_version(tiny_checkpoint, tmp_path / "train", 1, drop=name)
    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", train, "--out", out)
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("glmpost: error:")]
    assert len(errors) == 1 and f"missing tensor {name} (shape [32, 64])" in errors[0] and "Traceback" not in result.stderr
    assert CheckpointRoot(out).versions() == [] and not (out / "LATEST").exists()


def test_bad_invocations_exit_2(glmpost_cli, tiny_checkpoint, tmp_path):
    cases = [
        (["--quantize", "int3"], "--quantize 'int3'"),
        (["--quantize", "fp8-block", "--group-size", "32"], "--group-size applies to --quantize w4a16"),
        (["--keep", "-1"], "--keep -1"),
        (["--base", tiny_checkpoint], "--base is only for a DeepSpeed checkpoint"),
    ]
    for args, message in cases:
        result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", *args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.stderr)
    # w4a16's default group of 128 does not divide the tiny model's 64-wide inputs: named, nothing written
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r", "--quantize", "w4a16")
    assert result.exit_code == 2 and "--group-size 128 does not divide" in result.stderr
    assert CheckpointRoot(tmp_path / "r").versions() == []


def test_versions_only_move_forward_and_keep_prunes(glmpost_cli, tiny_checkpoint, tmp_path):
    train, out = tmp_path / "train", tmp_path / "rollout"
    for version in (1, 2, 3):
        make_version(tiny_checkpoint, train, version)
        result = glmpost_cli("sync-weights", "--checkpoint", train, "--out", out, "--keep", "2", "--json")
        assert result.exit_code == 0, result.stderr
    assert CheckpointRoot(out).versions() == [2, 3] and CheckpointRoot(out).latest() == 3
    assert json.loads(result.stdout)["pruned"] == [1]
    assert all(_tensors(out / "v000003")[k].equal(v) for k, v in _tensors(train / "v000003").items())
    older = glmpost_cli("sync-weights", "--checkpoint", train / "v000001", "--out", out)
    assert older.exit_code == 2 and "older than" in older.stderr


def test_staging_left_by_a_crash_is_removed_and_never_served(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "rollout"
    stale = out / ".staging-v000000"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a file")
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out)
    assert result.exit_code == 0, result.stderr
    assert not stale.exists() and "removed staging left by an interrupted sync" in result.stderr
    assert CheckpointRoot(out).latest() == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_is_retried_reported_and_exits_1(glmpost_cli, tiny_checkpoint, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--server", url,
                         "--retries", "2", "--backoff", "0.01", "--timeout", "5", "--json")
    assert result.exit_code == 1
    row = json.loads(result.stdout)["servers"][0]
    assert row["url"] == url and row["status"] == "failed" and row["attempts"] == 3
    assert result.stderr.strip().splitlines()[-1].startswith(f"glmpost: error: server {url} is not on weight version 0")
    assert CheckpointRoot(out).latest() == 0  # the version is published; only the server is behind
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "sync/server" in line]
    assert rows[0]["sync/status"] == "failed" and rows[0]["sync/attempts"] == 3


class _StaleServer(BaseHTTPRequestHandler):
    """An SGLang-API server whose weight update claims success but keeps serving version "0"."""

    def log_message(self, *args) -> None:
        pass

    def _send(self, payload) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send({"weight_version": "0"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send({"success": True, "message": "ok", "num_paused_requests": 0})


def test_a_server_still_on_the_old_version_after_the_update_is_an_error(glmpost_cli, tiny_checkpoint, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StaleServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        train = make_version(tiny_checkpoint, tmp_path / "train", 1)
        result = glmpost_cli("sync-weights", "--checkpoint", train, "--out", tmp_path / "rollout", "--server", url,
                             "--retries", "1", "--backoff", "0.01")
    finally:
        server.shutdown()
    assert result.exit_code == 1
    assert "still reports weight version '0' after update_weights_from_disk to '1'" in result.stderr
    assert "failed" in result.stdout and url in result.stdout  # the per-server table


# ---------------------------------------------------------------------------------------- real servers


class Served:
    def __init__(self, checkpoint: Path):
        self.proc, self.url = start_server(checkpoint)

    def client(self):
        from glmpost.kernel.sglang_client import SGLangClient

        return SGLangClient(self.url, timeout=60, retries=0)

    def greedy(self, ids: list[int]) -> list[int]:
        answer = self.client().generate(ids, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                                        return_logprob=False)
        return answer["output_ids"]

    def close(self) -> None:
        stop_server(self.proc)


@pytest.fixture
def served_rollout(glmpost_cli, tiny_checkpoint, tmp_path):
    """A rollout root at v0 (synced from the tiny model) and `glmpost serve` serving it."""
    out = tmp_path / "rollout"
    assert glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out).exit_code == 0
    served = Served(out)
    yield out, served
    served.close()


def test_sync_moves_a_real_server_to_the_new_version(glmpost_cli, tiny_checkpoint, tmp_path, served_rollout):
    out, served = served_rollout
    prompt = [5, 17, 42, 99, 7]
    assert served.client().get_weight_version() == "0"
    before = served.greedy(prompt)
    train = make_version(tiny_checkpoint, tmp_path / "train", 1, noise=0.5)
    result = glmpost_cli("sync-weights", "--checkpoint", train, "--out", out, "--server", served.url, "--json")
    assert result.exit_code == 0, result.stderr
    row = json.loads(result.stdout)["servers"][0]
    assert (row["status"], row["version_before"], row["version_after"]) == ("updated", "0", "1")
    assert served.client().get_weight_version() == "1"
    assert served.client().model_info()["model_path"].endswith("v000001")
    assert served.greedy(prompt) != before
    # rerun: nothing written, the server is confirmed as already current
    again = glmpost_cli("sync-weights", "--checkpoint", train, "--out", out, "--server", served.url, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["servers"][0]["status"] == "current"


def test_a_sync_killed_before_publishing_leaves_latest_and_servers_on_the_old_version(glmpost_cli, tiny_checkpoint, tmp_path,
                                                                                     served_rollout):
    out, served = served_rollout
    train = make_version(tiny_checkpoint, tmp_path / "train", 1)
    cmd = [GLMPOST, "sync-weights", "--checkpoint", str(train), "--out", str(out), "--server", served.url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "GLMPOST_SYNC_PAUSE_BEFORE_PUBLISH": "120"})
    for line in proc.stderr:  # every file is written and fsynced when the hook pauses
        if "pausing" in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    staging = out / ".staging-v000001"
    assert (staging / "glmpost.json").is_file()  # complete but never published
    assert (out / "LATEST").read_text().strip() == "v000000" and CheckpointRoot(out).versions() == [0]
    assert served.client().get_weight_version() == "0"
    done = glmpost_cli(*cmd[1:])  # the same command again, in this process
    assert done.exit_code == 0, done.stderr
    assert "removed staging left by an interrupted sync: .staging-v000001" in done.stderr
    assert not staging.exists() and CheckpointRoot(out).latest() == 1
    assert served.client().get_weight_version() == "1"


def test_a_server_refusing_the_update_is_reported(glmpost_cli, tiny_checkpoint, tmp_path, served_rollout):
    """A real refusal: the new version's tokenizer differs from the one the server serves."""
    out, served = served_rollout
    train = make_version(tiny_checkpoint, tmp_path / "train", 1)
    config = json.loads((train / "v000001" / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345
    (train / "v000001" / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = read_manifest(train / "v000001")
    from glmpost.checkpoints import tokenizer_revision

    manifest.tokenizer_revision = tokenizer_revision(train / "v000001")
    write_manifest(train / "v000001", manifest)
    result = glmpost_cli("sync-weights", "--checkpoint", train, "--out", out, "--server", served.url,
                         "--retries", "1", "--backoff", "0.01")
    assert result.exit_code == 1
    assert f"server {served.url}" in result.stderr and "tokenizer revision" in result.stderr
    assert served.client().get_weight_version() == "0"


def test_deepspeed_zero_checkpoint_is_consolidated(glmpost_cli, tiny_checkpoint, tmp_path):
    """A ZeRO-2 engine checkpoint (written as glmpost's DeepSpeedBackend writes it) syncs to exactly
    the weights the backend's own save_model writes."""
    script = tmp_path / "ds_train.py"
    script.write_text(f"""
import torch
from pathlib import Path
from glmpost.kernel.loading import load_model
from glmpost.rl.distributed import TrainingSession
from glmpost.rl.configs import GRPOConfig
session = TrainingSession.start(device="cpu", deterministic=False, zero_stage=2, deepspeed_config=None)
model = load_model({str(tiny_checkpoint)!r}).train()
backend = session.backend(model, GRPOConfig(lr=1e-2))
loss = model(torch.tensor([[5, 17, 42, 99, 7]]), labels=torch.tensor([[5, 17, 42, 99, 7]])).loss
backend.backward(loss)
backend.step()
out = Path({str(tmp_path)!r})
backend.save_model(out / "reference")
backend.save_optimizer(out / "ds" / "trainer_state" / "optimizer.pt")
session.close()
""")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ds_dir = tmp_path / "ds" / "trainer_state" / "deepspeed"
    assert (ds_dir / "latest").is_file()
    no_base = glmpost_cli("sync-weights", "--checkpoint", ds_dir, "--out", tmp_path / "r0")
    assert no_base.exit_code == 2 and "pass --base CKPT" in no_base.stderr
    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", ds_dir, "--base", tiny_checkpoint, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["source_kind"] == "deepspeed"
    ours, reference = _tensors(out / "v000000"), _tensors(tmp_path / "reference")
    assert ours.keys() == reference.keys() == _tensors(tiny_checkpoint).keys()
    assert all(ours[k].equal(reference[k]) for k in ours)
    assert not all(ours[k].equal(v) for k, v in _tensors(tiny_checkpoint).items())  # the step moved weights
    # inside a glmpost version directory (train-grpo's vN/trainer_state/deepspeed) --base defaults to it
    for item in tiny_checkpoint.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, tmp_path / "ds" / item.name)
    result = glmpost_cli("sync-weights", "--checkpoint", ds_dir / "optimizer", "--out", tmp_path / "r1", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["source"] == str(ds_dir / "optimizer")
    assert all(v.equal(ours[k]) for k, v in _tensors(tmp_path / "r1" / "v000000").items())


def test_one_sync_at_a_time_per_rollout_root(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.locks import output_lock

    out = tmp_path / "rollout"
    with output_lock(out, stage="sync-weights"):
        result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out)
    assert result.exit_code == 1 and f"{out} is being written by pid {os.getpid()}" in result.stderr
    assert CheckpointRoot(out).versions() == []


def test_recipe_section_sets_dtype_for_rollout(glmpost_cli, tiny_checkpoint, tmp_path):
    import torch

    from glmpost.kernel.loading import load_model

    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[sync-weights]\ndtype = "bfloat16"\nkeep = 1\n')
    out = tmp_path / "rollout"
    result = glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", out, "--config", recipe)
    assert result.exit_code == 0, result.stderr
    src, dst = _tensors(tiny_checkpoint), _tensors(out / "v000000")
    assert all(dst[k].dtype == torch.bfloat16 and dst[k].equal(src[k].to(torch.bfloat16)) for k in src)
    assert json.loads((out / "v000000" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "v000000" / "stage.json").read_text())["options"]["dtype"] == "bfloat16"
    assert load_model(out).dtype == torch.bfloat16


def test_a_server_runs_the_dequantized_weights_of_a_quantized_rollout_version(glmpost_cli, tiny_checkpoint, tmp_path,
                                                                              served_rollout):
    """sync-weights --quantize w4a16: the server loads v1 through the one quantizer's dequant, so its
    greedy tokens are those of the dequantized model in this process."""
    import torch

    from glmpost.kernel.loading import load_model

    out, served = served_rollout
    train = make_version(tiny_checkpoint, tmp_path / "train", 1, noise=0.5)
    result = glmpost_cli("sync-weights", "--checkpoint", train, "--out", out, "--quantize", "w4a16", "--group-size", "16",
                         "--server", served.url, "--json")
    assert result.exit_code == 0, result.stderr
    assert served.client().get_weight_version() == "1"
    prompt = [5, 17, 42, 99, 7]
    model = load_model(out / "v000001")
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=-1)
    assert served.greedy(prompt) == ids[0, len(prompt):].tolist()
