"""Device choice, backend mapping, determinism switches, and torch_npu staying unimported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from glmpost.errors import UsageError
from glmpost.npu import device as dev


def probes(monkeypatch, *, npu_installed=False, npu=False, cuda=False, count=2):
    def npu_available():
        if not npu_installed:
            raise AssertionError("probed the NPU without torch_npu installed")
        return npu

    monkeypatch.setattr(dev, "_torch_npu_installed", lambda: npu_installed)
    monkeypatch.setattr(dev, "_npu_available", npu_available)
    monkeypatch.setattr(dev, "_cuda_available", lambda: cuda)
    monkeypatch.setattr(dev, "_device_count", lambda kind: count)


@pytest.mark.parametrize(
    ("npu_installed", "npu", "cuda", "expected"),
    [
        (False, False, False, "cpu"),
        (False, False, True, "cuda"),
        (True, False, True, "cuda"),  # torch_npu present but no NPU visible
        (True, False, False, "cpu"),
    ],
)
def test_auto_prefers_npu_then_cuda_then_cpu(monkeypatch, npu_installed, npu, cuda, expected):
    probes(monkeypatch, npu_installed=npu_installed, npu=npu, cuda=cuda)
    assert dev.resolve_device("auto") == torch.device(expected)


def test_auto_skips_a_broken_torch_npu(monkeypatch, caplog):
    probes(monkeypatch, cuda=True)
    monkeypatch.setattr(dev, "_torch_npu_installed", lambda: True)

    def broken():
        raise UsageError("--device npu: torch_npu is not installed or ...")

    monkeypatch.setattr(dev, "_npu_available", broken)
    assert dev.resolve_device("auto") == torch.device("cuda")
    assert "skipping npu" in caplog.text


def test_explicit_devices(monkeypatch):
    probes(monkeypatch, cuda=True, count=2)
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_device("CUDA") == torch.device("cuda")
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match=r"only 2 cuda device\(s\) visible"):
        dev.resolve_device("cuda:2")
    for bad in ("tpu", "cuda:x", "auto:0", "cpu:1", ""):
        with pytest.raises(UsageError, match="--device"):
            dev.resolve_device(bad)


def test_cuda_without_cuda_is_a_usage_error(monkeypatch):
    probes(monkeypatch, cuda=False)
    with pytest.raises(UsageError, match="CUDA is not available") as info:
        dev.resolve_device("cuda:0")
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


def test_npu_without_torch_npu_is_one_line_usage_error(monkeypatch):
    probes(monkeypatch, npu_installed=False)
    with pytest.raises(UsageError) as info:
        dev.resolve_device("npu")
    message = str(info.value)
    assert "\n" not in message
    assert "torch_npu is not installed" in message and "set_env.sh" in message
    assert f"torch-npu=={torch.__version__.split('+')[0]}" in message


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("raise OSError('libhccl.so: cannot open shared object file')", "OSError: libhccl.so"),
        ("raise ImportError('libascendcl.so:\\n undefined symbol')", "ImportError: libascendcl"),
        ("raise RuntimeError('torch version mismatch')", "RuntimeError: torch version"),
    ],
)
def test_import_torch_npu_turns_load_failures_into_usage_errors(
    tmp_path, monkeypatch, body, reason
):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(UsageError) as info:
        dev.import_torch_npu()
    message = str(info.value)
    assert "\n" not in message and reason in message and "set_env.sh" in message
    # resolve_device takes the real probes: the package is found, then fails to load.
    with pytest.raises(UsageError, match="torch_npu is not installed or CANN"):
        dev.resolve_device("npu:0")
    assert "torch_npu" not in sys.modules


def test_npu_loaded_but_no_device(monkeypatch):
    probes(monkeypatch, npu_installed=True, npu=False)
    with pytest.raises(UsageError, match="no NPU is visible"):
        dev.resolve_device("npu")


@pytest.mark.parametrize(
    ("device", "backend"),
    [
        ("npu", "hccl"),
        ("npu:3", "hccl"),
        ("cuda", "nccl"),
        (torch.device("cuda", 1), "nccl"),
        ("cpu", "gloo"),
    ],
)
def test_distributed_backend(device, backend):
    assert dev.distributed_backend(device) == backend


def test_distributed_backend_unknown():
    with pytest.raises(ValueError, match="no distributed backend"):
        dev.distributed_backend("mps")


@pytest.fixture
def restore_determinism(monkeypatch):
    """Restore the global torch / cudnn flags; monkeypatch restores the environment."""
    for name in ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def test_set_deterministic_cpu(restore_determinism):
    settings = dev.set_deterministic(True, "cpu")
    assert settings == {"torch.use_deterministic_algorithms": True}
    assert torch.are_deterministic_algorithms_enabled()
    assert "HCCL_DETERMINISTIC" not in os.environ and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert dev.set_deterministic(False, "cpu") == {"torch.use_deterministic_algorithms": False}
    assert not torch.are_deterministic_algorithms_enabled()


def test_set_deterministic_cuda(restore_determinism, monkeypatch):
    torch.backends.cudnn.benchmark = True
    settings = dev.set_deterministic(True, torch.device("cuda", 0))
    assert settings == {
        "torch.use_deterministic_algorithms": True,
        "torch.backends.cudnn.deterministic": True,
        "torch.backends.cudnn.benchmark": False,
        "env.CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    json.dumps(settings)
    # A user's other deterministic cuBLAS value is kept.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert dev.set_deterministic(True, "cuda")["env.CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_set_deterministic_npu(restore_determinism):
    settings = dev.set_deterministic(True, "npu:0")
    assert settings == {
        "torch.use_deterministic_algorithms": True,
        "env.HCCL_DETERMINISTIC": "true",
    }
    assert os.environ["HCCL_DETERMINISTIC"] == "true"
    assert "ASCEND_LAUNCH_BLOCKING" not in settings


def test_device_config(restore_determinism, monkeypatch):
    probes(monkeypatch)
    config = dev.DeviceConfig.create("auto", deterministic=True)
    assert config.device == torch.device("cpu") and config.backend == "gloo"
    assert config.as_dict() == {
        "device": "cpu",
        "backend": "gloo",
        "deterministic": {"torch.use_deterministic_algorithms": True},
    }


FAKE_TORCH_NPU = """
import types
import torch

torch.utils.rename_privateuse1_backend("npu")
_module = types.ModuleType("torch_npu.npu")
_module.is_available = lambda: True
_module.device_count = lambda: 2
torch._register_device_module("npu", _module)
"""

CHILD = """
import json, sys
import glmpost, glmpost.npu, glmpost.npu.device, glmpost.kernel.logprobs
result = {"imported_at_start": "torch_npu" in sys.modules}
from glmpost.npu import device as dev
dev._cuda_available = lambda: True  # npu must win over cuda
result["auto"] = str(dev.resolve_device("auto"))
result["imported_after_auto"] = "torch_npu" in sys.modules
result["npu1"] = str(dev.resolve_device("npu:1"))
try:
    dev.resolve_device("npu:2")
except Exception as err:
    result["npu2"] = str(err)
result["backend"] = dev.distributed_backend(dev.resolve_device("auto"))
print(json.dumps(result))
"""


def test_import_glmpost_does_not_import_torch_npu_but_auto_does(tmp_path):
    """In a fresh interpreter with a (fake) torch_npu importable and an NPU 'visible'."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_TORCH_NPU))
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "imported_at_start": False,
        "auto": "npu",
        "imported_after_auto": True,
        "npu1": "npu:1",
        "npu2": "--device npu:2: only 2 npu device(s) visible",
        "backend": "hccl",
    }
