"""Device and backend selection (npu / cuda / cpu; hccl / nccl / gloo) and determinism switches.

Importing this package never imports torch_npu; :func:`import_torch_npu` does, on demand.
"""

from glmpost.npu.device import (
    DEVICE_CHOICES,
    DeviceConfig,
    distributed_backend,
    import_torch_npu,
    resolve_device,
    set_deterministic,
)

__all__ = [
    "DEVICE_CHOICES",
    "DeviceConfig",
    "distributed_backend",
    "import_torch_npu",
    "resolve_device",
    "set_deterministic",
]
