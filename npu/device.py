"""Device, distributed backend and determinism switches for npu / cuda / cpu.

torch_npu is imported in exactly one place, :func:`import_torch_npu`, and only when a stage asks for
an NPU (``--device npu``, or ``--device auto`` on a machine where torch_npu is installed). Importing
glmpost never imports it. (torch itself auto-loads installed out-of-tree backends such as torch_npu
through the ``torch.backends`` entry points on ``import torch``; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
turns that off, which is outside glmpost's control.)

The availability probes (``_torch_npu_installed``, ``_npu_available``, ``_cuda_available``,
``_device_count``) are small module-level functions so tests can replace them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from glmpost.config import ConfigError
from glmpost.errors import UsageError

__all__ = [
    "DEVICE_CHOICES",
    "DeviceConfig",
    "distributed_backend",
    "import_torch_npu",
    "resolve_device",
    "set_deterministic",
]

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")

_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|npu)(?::(\d+))?$")

# cuBLAS is only deterministic with a fixed workspace; ":16:8" is the other documented value.
_CUBLAS_DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")


def _torch_version() -> str:
    return torch.__version__.split("+")[0]


def _npu_hint() -> str:
    version = _torch_version()
    return (
        f"torch_npu is not installed or CANN's set_env.sh was not sourced: install the torch_npu "
        f'matching torch {version} (pip install "torch-npu=={version}.*") and run '
        f"'source /usr/local/Ascend/ascend-toolkit/set_env.sh' (your CANN install path) first"
    )


def import_torch_npu() -> ModuleType:
    """Import and return torch_npu: the only place glmpost imports it.

    Raises:
        UsageError: torch_npu is missing or cannot load (no CANN libraries, torch mismatch); the
            message is one line saying how to install it and source CANN's ``set_env.sh``.
    """
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the "npu" device type)
    except (ImportError, OSError, RuntimeError) as err:
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise ConfigError("{device} npu: {hint} ({reason})", hint=_npu_hint(), reason=reason) from err
    return torch_npu


def _torch_npu_installed() -> bool:
    """torch_npu can be found on the import path (it is not imported)."""
    return importlib.util.find_spec("torch_npu") is not None


def _npu_available() -> bool:
    """An NPU is usable; imports torch_npu (raises UsageError when it cannot load)."""
    import_torch_npu()
    return bool(torch.npu.is_available())


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return int(torch.npu.device_count())
    return 1


def resolve_device(name: str = "auto") -> torch.device:
    """The ``torch.device`` for ``--device NAME``.

    ``NAME`` is ``auto``, ``cpu``, ``cuda``, ``npu``, or ``cuda:I`` / ``npu:I``. ``auto`` picks npu
    (torch_npu installed, loadable, and an NPU visible), else cuda (if available), else cpu; a
    torch_npu that is installed but fails to load is logged and skipped. Bare names return an
    index-less device (the current device, which a distributed launcher sets per local rank).

    Raises:
        UsageError: an unknown name, or a device that is not available here (one line).
    """
    match = _DEVICE_PATTERN.match(name.strip().lower())
    if match is None:
        raise ConfigError("{device} must be one of {choices} (or cuda:I / npu:I); got {name!r}",
                          choices=", ".join(DEVICE_CHOICES), name=name)
    kind, index_text = match.group(1), match.group(2)
    index = None if index_text is None else int(index_text)
    if kind == "auto":
        if index is not None:
            raise ConfigError("{device} auto takes no index; got {name!r}", name=name)
        return torch.device(_auto_kind())
    if kind == "cpu":
        if index not in (None, 0):
            raise ConfigError("{device} cpu takes no index; got {name!r}", name=name)
        return torch.device("cpu")
    if kind == "cuda" and not _cuda_available():
        why = (
            f"torch {torch.__version__} is a CPU-only build"
            if torch.version.cuda is None
            else "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        )
        raise ConfigError("{device} {name}: CUDA is not available: {why}; use {device} cpu or auto", name=name, why=why)
    if kind == "npu":
        if not _torch_npu_installed():
            raise ConfigError("{device} {name}: {hint}", name=name, hint=_npu_hint())
        if not _npu_available():
            raise ConfigError("{device} {name}: torch_npu loaded but no NPU is visible "
                              "(check 'npu-smi info' and ASCEND_RT_VISIBLE_DEVICES)", name=name)
    if index is None:
        return torch.device(kind)
    count = _device_count(kind)
    if index >= count:
        raise ConfigError("{device} {name}: only {count} {kind} device(s) visible", name=name, count=count, kind=kind)
    return torch.device(kind, index)


def _auto_kind() -> str:
    if _torch_npu_installed():
        try:
            if _npu_available():
                return "npu"
        except UsageError as err:
            log.warning("--device auto: skipping npu: %s", err)
    if _cuda_available():
        return "cuda"
    return "cpu"


def _device_type(device: torch.device | str) -> str:
    # Not torch.device(str): "npu" is only a known device type once torch_npu is imported.
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def distributed_backend(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for a device: npu -> hccl, cuda -> nccl, cpu -> gloo."""
    kind = _device_type(device)
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise ValueError(f"no distributed backend for device type {kind!r}") from None


def set_deterministic(enabled: bool, device: torch.device | str) -> dict[str, Any]:
    """Switch deterministic algorithms on or off for ``device``; return what was set.

    Enabled:

    - every device: ``torch.use_deterministic_algorithms(True)`` (ops without a deterministic
      implementation then raise). Ascend's torch_npu honours this same switch; Ascend documents
      that the first setting that reaches an operator in a thread wins, so call this before any
      NPU work.
    - cuda: ``cudnn.deterministic = True``, ``cudnn.benchmark = False`` and, unless already set to
      a deterministic value, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (read by cuBLAS when its handle
      is created: call before the first CUDA op).
    - npu: ``HCCL_DETERMINISTIC=true`` (deterministic AllReduce / ReduceScatter / Reduce; read when
      the HCCL communicator is created: call before ``init_process_group``).
      ``ASCEND_LAUNCH_BLOCKING`` is not set: Ascend documents it as synchronous launch for
      debugging stack traces, not as a determinism switch, and it costs speed.

    Disabled: the torch (and cudnn) flags are switched off; environment variables are left as they
    are (they only cost speed) and are not reported.

    Returns:
        A flat, JSON-ready dict of the settings now in force, e.g.
        ``{"torch.use_deterministic_algorithms": True, "env.HCCL_DETERMINISTIC": "true"}``, for
        stages to record in their ``stage.json`` / metrics.
    """
    kind = _device_type(device)
    enabled = bool(enabled)
    torch.use_deterministic_algorithms(enabled)
    settings: dict[str, Any] = {
        "torch.use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled()
    }
    if kind == "cuda":
        torch.backends.cudnn.deterministic = enabled
        if enabled:
            torch.backends.cudnn.benchmark = False
        settings["torch.backends.cudnn.deterministic"] = torch.backends.cudnn.deterministic
        settings["torch.backends.cudnn.benchmark"] = torch.backends.cudnn.benchmark
        if enabled:
            if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _CUBLAS_DETERMINISTIC_CONFIGS:
                os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
            settings["env.CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    elif kind == "npu" and enabled:
        os.environ["HCCL_DETERMINISTIC"] = "true"
        settings["env.HCCL_DETERMINISTIC"] = "true"
    return settings


@dataclass(frozen=True)
class DeviceConfig:
    """A stage's resolved device: ``DeviceConfig.create("auto", deterministic=True)``.

    Attributes:
        device: the resolved ``torch.device``.
        backend: its ``torch.distributed`` backend.
        deterministic: what :func:`set_deterministic` set (empty when determinism was not asked).
    """

    device: torch.device
    backend: str
    deterministic: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, name: str = "auto", *, deterministic: bool = False) -> DeviceConfig:
        """Resolve ``name`` and, if asked, switch determinism on for it."""
        device = resolve_device(name)
        settings = set_deterministic(True, device) if deterministic else {}
        return cls(device=device, backend=distributed_backend(device), deterministic=settings)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready record for a stage's header or ``stage.json``."""
        return {
            "device": str(self.device),
            "backend": self.backend,
            "deterministic": dict(self.deterministic),
        }
