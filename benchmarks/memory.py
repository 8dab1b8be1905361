"""Peak-memory measurement for benchmarks: extra bytes above the level at the start of a block.

On CUDA / NPU the allocator's own peak counter is exact (``max_memory_allocated``). On CPU there
is no allocator counter, so :class:`PeakMemory` samples the process RSS from ``/proc/self/statm``
on a background thread (every ``interval_s``; torch kernels release the GIL, so the sampler runs
while they do) and, where the kernel allows it, also reads the exact high-water mark ``VmHWM``
after resetting it through ``/proc/self/clear_refs``.

RSS is a fair measure of tensor memory only if freeing a large tensor returns its pages to the
OS. glibc serves allocations above its mmap threshold (at most 32 MiB on 64-bit) with ``mmap`` and
``munmap``s them on free, so RSS falls when a large tensor dies. :func:`check_rss_tracks_tensors`
verifies this on the running machine; benchmarks report its result next to their numbers. The
threshold is dynamic: after a large mmapped block is freed glibc raises it (up to 32 MiB), so blocks
below 32 MiB may then come from the heap and linger in RSS after they are freed. RSS therefore
overstates, never understates, the peak of code whose temporaries are under 32 MiB.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process (second field of ``/proc/self/statm``, in pages)."""
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE_SIZE


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


@dataclass
class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.peak_bytes``.

    Attributes (after the block):
        peak_bytes: peak memory above the level at entry (sampled RSS on CPU, the allocator's
            ``max_memory_allocated`` on cuda / npu).
        hwm_bytes: CPU only: the kernel's exact peak RSS above the entry level, or None where
            ``/proc/self/clear_refs`` cannot be written.
        samples: CPU only: number of RSS samples taken.
    """

    device: torch.device | str = "cpu"
    interval_s: float = 0.001
    peak_bytes: int = 0
    hwm_bytes: int | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline = 0
        self._max_rss = 0
        self._hwm_ok = False

    def _accelerator(self):
        if self.device.type == "cuda":
            return torch.cuda
        if self.device.type == "npu":
            return torch.npu  # registered by torch_npu, which the caller has imported
        return None

    def __enter__(self) -> PeakMemory:
        accelerator = self._accelerator()
        if accelerator is not None:
            accelerator.synchronize()
            accelerator.reset_peak_memory_stats()
            self._baseline = accelerator.memory_allocated()
            return self
        self._baseline = rss_bytes()
        self._max_rss = self._baseline
        self._hwm_ok = _reset_hwm()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max_rss = max(self._max_rss, rss_bytes())
            self.samples += 1
            time.sleep(self.interval_s)

    def __exit__(self, *exc_info) -> None:
        accelerator = self._accelerator()
        if accelerator is not None:
            accelerator.synchronize()
            self.peak_bytes = accelerator.max_memory_allocated() - self._baseline
            return
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self._max_rss = max(self._max_rss, rss_bytes())
        self.peak_bytes = self._max_rss - self._baseline
        if self._hwm_ok:
            self.hwm_bytes = _hwm_bytes() - self._baseline


def check_rss_tracks_tensors(size_bytes: int = 256 * 2**20) -> dict[str, float | bool]:
    """Verify that a large CPU tensor raises RSS by its size and that freeing it lowers RSS again.

    Returns the measured fractions of ``size_bytes`` and ``ok`` (grew by >= 90 %, then fell back to
    within 10 % of the start). Without this, an RSS peak could count memory that was already freed.
    """
    before = rss_bytes()
    tensor = torch.ones(size_bytes // 4, dtype=torch.float32)  # ones: every page is touched
    during = rss_bytes()
    del tensor
    after = rss_bytes()
    grew, left = (during - before) / size_bytes, (after - before) / size_bytes
    return {
        "grew_fraction": round(grew, 3),
        "left_fraction": round(left, 3),
        "ok": grew >= 0.9 and left <= 0.1,
    }
