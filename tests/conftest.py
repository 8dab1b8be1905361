"""Shared fixtures: a tiny GLM-5 checkpoint built once per session, and an in-process CLI runner."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: the slow tier (learning tests of many minutes); bin/test leaves it out, "
                            "bin/test -m slow runs it")
    config.addinivalue_line("markers", "soak: the soak tier (the async pipeline over a real vLLM, its writers killed -9 "
                            "and restarted; many minutes); bin/test leaves it out, bin/test -m soak runs it")


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


def run_glmpost(*args: str) -> CliResult:
    """Run ``glmpost ARGS`` in this process exactly as the console script does."""
    from glmpost.commands.app import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def torch_one_thread():
    """One torch thread: two threads per process thrash on the shared 2-core machine (learning tests)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def glmpost_cli():
    return run_glmpost


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """``glmpost init-model --preset tiny-glm5 --seed 0`` written once for the whole session."""
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    result = run_glmpost("init-model", "--out", out, "--seed", "0")
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory) -> Path:
    """The tiny model with ``index_topk`` 64: on short sequences the DSA indexer selects every key,
    so no top-k ties make logits depend on batch layout (shared/notes/tiny-glm5-rl-facts.md)."""
    out = tmp_path_factory.mktemp("wide") / "ckpt"
    result = run_glmpost("init-model", "--out", out, "--seed", "0", "--index-topk", "64")
    assert result.exit_code == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    """A real ``glmpost serve`` of the tiny checkpoint (batch size 8) for one test module; its URL."""
    from serve_process import start_server, stop_server

    proc, url = start_server(tiny_checkpoint, "--batch-size", "8")
    yield url
    stop_server(proc)
    assert proc.returncode == 0  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """The in-process engine the ``server`` fixture serves (batch size 8)."""
    from glmpost.kernel.engine import LocalEngine
    from glmpost.kernel.loading import load_model

    return LocalEngine(load_model(tiny_checkpoint), batch_size=8, pad_token_id=0)


@pytest.fixture(scope="session")
def qwen3(tiny_checkpoint, tmp_path_factory) -> Path:
    """A tiny random-init Qwen3 (head_dim 32: real vLLM's CPU attention has no kernel for 16) with the
    tiny checkpoint's tokenizer; skips (fails under CI) where no real vLLM can serve it."""
    from vllm_server import QWEN3, require_vllm, tiny_folder

    require_vllm()
    return tiny_folder(tiny_checkpoint, tmp_path_factory.mktemp("vllm-qwen3") / "model", QWEN3)


@pytest.fixture(scope="session")
def real_vllm(qwen3):
    """A real vLLM (tests/vllm_server.py) serving ``qwen3`` with --logprobs-mode processed_logprobs
    (glmpost's ``sampled`` kind) and every log-prob allowed, once per session; dev mode on."""
    from vllm_server import VLLMServer

    server = VLLMServer(qwen3, qwen3.parent / "vllm.log", "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")
    yield server
    server.stop()


LORA_ARGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2")


@pytest.fixture(scope="session")
def real_vllm_lora(qwen3):
    """A real vLLM serving ``qwen3`` as ``real_vllm`` does, with LoRA on (rank up to 16, two adapters
    in a batch) and adapters loaded and unloaded at run time (``/v1/load_lora_adapter``,
    ``/v1/unload_lora_adapter``), once per session."""
    from vllm_server import VLLMServer

    server = VLLMServer(qwen3, qwen3.parent / "vllm-lora.log", "--logprobs-mode", "processed_logprobs",
                        "--max-logprobs", "-1", *LORA_ARGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield server
    server.stop()
