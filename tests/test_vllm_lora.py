"""A real vLLM with LoRA (``real_vllm_lora``: ``--enable-lora``, adapters loaded at run time) against
PEFT in this process: the prompt log-probs vLLM gives under an adapter's name are PEFT's base+adapter
forward (fp32, every position, the whole vocabulary, <= 1e-5), the base model's name gives the base
forward, an unloaded adapter is refused, and two adapters loaded together each score as their own.

The adapters are PEFT's own ``save_pretrained`` folders (rank 8, alpha 16, every attention and MLP
projection) with ``lora_B`` drawn from a fixed seed instead of PEFT's zeros, so that they change the
output. Prompt log-probs are the model's own ``log_softmax`` in vLLM's processed_logprobs mode too
(``glmpost.kernel.vllm_client``: prompt tokens skip the sampling processors).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

CLOSE = 1e-5  # fp32 on both sides, another kernel (vLLM's CPU LoRA and attention): float-rounding close
APART = 1e-2  # an adapter moves the log-probs by far more than rounding
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B_STD = 0.02  # lora_B's draw: the size of the tiny model's own weights (initializer_range)
LENGTHS = (7, 33, 64)


def make_adapter(model: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for ``model`` saved to ``out``: rank 8, alpha 16, every attention and MLP
    linear layer, ``lora_A`` as PEFT initialises it and ``lora_B`` ~ N(0, B_STD), both from ``seed``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, bias="none",
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * B_STD)
    peft_model.save_pretrained(out)
    return out


def peft_log_probs(model: Path, adapter: Path | None, prompts: list[list[int]]) -> list[np.ndarray]:
    """``log_softmax`` of the next-token logits at every prompt position after the first, float32:
    the base model's (``adapter`` None) or PEFT's base+adapter forward of the saved ``adapter``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    network = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter is not None:
        network = PeftModel.from_pretrained(network, adapter)
    network.eval()
    rows = []
    with torch.no_grad():
        for ids in prompts:
            logits = network(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            rows.append(torch.log_softmax(logits, dim=-1).numpy())
    return rows


@pytest.fixture(scope="module")
def adapters(qwen3, tmp_path_factory):
    """Two adapters (seeds 1 and 2), the prompts, and PEFT's log-probs for the base and each adapter."""
    folder = tmp_path_factory.mktemp("lora")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in LENGTHS]
    paths = {"a": make_adapter(qwen3, folder / "adapter-a", 1), "b": make_adapter(qwen3, folder / "adapter-b", 2)}
    expected = {name: peft_log_probs(qwen3, path, prompts) for name, path in paths.items()}
    expected["base"] = peft_log_probs(qwen3, None, prompts)
    return paths, prompts, expected


def _post(url: str, body: dict) -> tuple[int, str]:
    """``(status, body text)`` of a JSON POST, error statuses included."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _models(server) -> dict[str, dict]:
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as response:
        return {card["id"]: card for card in json.loads(response.read())["data"]}


def load(server, name: str, path: Path) -> None:
    status, text = _post(server.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert (status, text) == (200, f"Success: LoRA adapter '{name}' added successfully."), (status, text)


def score(server, model: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """vLLM's prompt log-probs of every prompt under ``model`` (a served name): the whole vocabulary
    at every position after the first (``prompt_logprobs`` -1, ``max_tokens`` 1, the token dropped)."""
    rows = []
    for ids in prompts:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": -1}
        status, text = _post(server.url + "/v1/completions", body)
        assert status == 200, text
        entries = json.loads(text)["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        table = np.full((len(ids) - 1, 512), np.nan)
        for position, entry in enumerate(entries[1:]):
            for token, value in entry.items():
                table[position, int(token)] = value["logprob"]
        assert not np.isnan(table).any(), "a prompt log-prob row without the whole vocabulary"
        rows.append(table)
    return rows


def max_abs(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_a_runtime_loaded_adapter_scores_as_peft_and_the_base_name_as_the_base(real_vllm_lora, adapters):
    """(a) the adapter's name gives PEFT's base+adapter forward, (b) the base model's name the base forward."""
    paths, prompts, expected = adapters
    base_name = str(real_vllm_lora.model)
    load(real_vllm_lora, "lora-a", paths["a"])
    card = _models(real_vllm_lora)["lora-a"]
    assert card["root"] == str(paths["a"]) and card["parent"] == base_name
    with_adapter, base = score(real_vllm_lora, "lora-a", prompts), score(real_vllm_lora, base_name, prompts)
    figures = {"adapter": max_abs(with_adapter, expected["a"]), "base": max_abs(base, expected["base"]),
               "adapter_vs_base": max_abs(expected["a"], expected["base"]),
               "served_adapter_vs_base": max_abs(with_adapter, base)}
    print(f"\nvLLM LoRA vs PEFT, max |dlogprob| over {sum(LENGTHS) - len(LENGTHS)} positions x 512: {figures}")
    assert figures["adapter"] <= CLOSE and figures["base"] <= CLOSE, figures
    assert figures["adapter_vs_base"] > APART and figures["served_adapter_vs_base"] > APART, figures


def test_two_adapters_loaded_together_each_score_with_their_own(real_vllm_lora, adapters):
    """(d) a second adapter under another name while the first is loaded: requests for both, sent
    at once (one batch can hold two, ``--max-loras 2``), each close to PEFT with its own adapter."""
    paths, prompts, expected = adapters
    load(real_vllm_lora, "pair-a", paths["a"])
    load(real_vllm_lora, "pair-b", paths["b"])
    assert {"pair-a", "pair-b"} <= set(_models(real_vllm_lora))
    with ThreadPoolExecutor(2) as pool:
        got_a, got_b = pool.map(lambda name: score(real_vllm_lora, name, prompts), ["pair-a", "pair-b"])
    figures = {"a": max_abs(got_a, expected["a"]), "b": max_abs(got_b, expected["b"]),
               "a_vs_b": max_abs(expected["a"], expected["b"]), "served_a_vs_b": max_abs(got_a, got_b)}
    print(f"\ntwo adapters at once, max |dlogprob| against PEFT: {figures}")
    assert figures["a"] <= CLOSE and figures["b"] <= CLOSE, figures
    assert figures["a_vs_b"] > APART and figures["served_a_vs_b"] > APART, figures


def test_an_unloaded_adapter_is_refused(real_vllm_lora, adapters):
    """(c) after ``/v1/unload_lora_adapter`` a request naming the adapter is a 404 NotFoundError, as is
    unloading it again; the base model and the other adapters serve on."""
    paths, prompts, expected = adapters
    base_name = str(real_vllm_lora.model)
    load(real_vllm_lora, "gone", paths["b"])
    assert max_abs(score(real_vllm_lora, "gone", prompts[:1]), expected["b"][:1]) <= CLOSE
    status, text = _post(real_vllm_lora.url + "/v1/unload_lora_adapter", {"lora_name": "gone"})
    assert (status, text) == (200, "Success: LoRA adapter 'gone' removed successfully."), (status, text)
    assert "gone" not in _models(real_vllm_lora)
    status, text = _post(real_vllm_lora.url + "/v1/completions",
                         {"model": "gone", "prompt": prompts[0], "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 404, text
    error = json.loads(text)["error"]  # the aliases: vLLM writes a path under /tmp, /home, ... as "<path>"
    assert error.pop("message").startswith("The model `gone` does not exist. Valid aliases: "), text
    assert error == {"type": "NotFoundError", "param": "model", "code": 404}
    status, text = _post(real_vllm_lora.url + "/v1/unload_lora_adapter", {"lora_name": "gone"})
    assert status == 404 and json.loads(text)["error"] == {
        "message": "The lora adapter 'gone' cannot be found.", "type": "NotFoundError", "param": None, "code": 404}
    assert max_abs(score(real_vllm_lora, base_name, prompts[:1]), expected["base"][:1]) <= CLOSE
