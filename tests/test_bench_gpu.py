"""The accelerator check (benchmarks/bench_gpu.py) runs end to end on a CPU at its tiny size, so the
script a lent GPU runs is known to work before device time is spent on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_at_tiny_size_on_a_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--size", "tiny", "--device", "cpu",
                    "--batch", "2", "--seq", "48", "--response", "16", "--rollout-batch", "2", "--prompt", "8",
                    "--new-tokens", "4", "--repeats", "1", "--out", str(out)], check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["parameters"] == 139648  # the tiny Qwen3 layout, counted on the meta device
    for side in ("glmpost", "trl_way"):
        assert report["train"][side]["action_tokens_per_s"] > 0 and report["train"][side]["peak_gib"] is None  # no CUDA here
    assert report["train"]["speed_ratio"] > 0 and report["rollout"]["speed_ratio"] > 0
