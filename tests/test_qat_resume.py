"""``glmpost qat --resume``: a killed run continues from its last saved state, repeats no step and ends
with the same weights as an uninterrupted run; 2 DeepSpeed ZeRO-2 ranks match one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread here and in child processes: on the shared 2-core machine two threads per
    process thrash (a 50-step run takes 85 s instead of 14 s), and both sides of every comparison
    must use the same reduction order anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    torch.set_num_threads(before)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_resume_after_a_kill_repeats_no_step_and_matches_an_uninterrupted_run(glmpost_cli, tiny_checkpoint, tmp_path, one_thread):
    common = [str(DATA / "sft-train.jsonl"), "--checkpoint", str(tiny_checkpoint), "--scheme", "w4a16", "--group-size", "16",
              "--lr", "3e-3", "--epochs", "10", "--batch-size", "16", "--micro-batch-size", "16"]  # 50 steps
    straight = glmpost_cli("qat", *common, "--out", tmp_path / "straight", "--json")
    assert straight.exit_code == 0, straight.stderr

    root = tmp_path / "resumed"
    state = root / ".staging-v000001" / "trainer_state" / "resume.pt"
    env = one_thread
    process = subprocess.Popen(GLMPOST + ["qat", *common, "--out", str(root), "--save-every", "3"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 300
    while not state.exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.02)
    time.sleep(0.3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert state.exists() and not (root / "v000001").exists(), "the run finished before it could be interrupted"

    refused = glmpost_cli("qat", *common, "--out", root)
    assert refused.exit_code == 2 and "pass --resume to continue it" in refused.stderr
    resumed = glmpost_cli("qat", *common, "--out", root, "--resume", "--json")
    assert resumed.exit_code == 0, resumed.stderr
    assert "resuming at optimizer step" in resumed.stderr
    version = root / "v000001"
    steps = [m["sft/step"] for m in map(json.loads, (version / "metrics.jsonl").read_text().splitlines()) if "sft/step" in m]
    assert steps == list(range(50))
    assert not (version / "trainer_state").exists()
    assert json.loads(resumed.stdout)["loss_last"] == json.loads(straight.stdout)["loss_last"]
    one, two = load_file(tmp_path / "straight" / "v000001" / "model.safetensors"), load_file(version / "model.safetensors")
    for key in one:
        np.testing.assert_array_equal(two[key], one[key], err_msg=key)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_two_deepspeed_ranks_match_one_process(glmpost_cli, tiny_checkpoint, tmp_path, one_thread, stage):
    """Same QAT update on 1 process (torch AdamW) and on 2 gloo ranks under ZeRO-2 and ZeRO-3 (each
    rank holds half of every batch; the loss is normalised by the global token count, so the
    gradient is the same; ZeRO-3 also partitions the weights the fake quantizer reads)."""
    common = [str(DATA / "sft-train.jsonl"), "--checkpoint", str(tiny_checkpoint), "--scheme", "w4a16", "--group-size", "16",
              "--lr", "3e-3", "--epochs", "1", "--batch-size", "16", "--micro-batch-size", "4", "--json"]
    single = glmpost_cli("qat", *common, "--out", tmp_path / "single")
    assert single.exit_code == 0, single.stderr
    env = {**one_thread, "DS_ACCELERATOR": "cpu"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    result = subprocess.run(torchrun + ["-m", "glmpost.commands.app", "qat", *common, "--out", str(tmp_path / f"zero{stage}"),
                                        "--zero-stage", stage], check=False, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks, one_rank = json.loads(result.stdout.strip().splitlines()[-1]), json.loads(single.stdout)
    assert ranks["steps"] == one_rank["steps"] == 5
    # tolerance: the two runs sum the same float32 terms in a different order (per-rank partial sums,
    # gloo all-reduce); after 5 AdamW steps at lr 3e-3 weights agree to ~1e-6, far below one step (3e-3)
    assert ranks["loss_last"] == pytest.approx(one_rank["loss_last"], rel=1e-5, abs=1e-7)
    one = load_file(tmp_path / "single" / "v000001" / "model.safetensors")
    two = load_file(tmp_path / f"zero{stage}" / "v000001" / "model.safetensors")
    assert set(one) == set(two)
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-4, atol=1e-5, err_msg=key)
