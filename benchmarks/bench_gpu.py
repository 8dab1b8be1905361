"""The accelerator check (issue 31): a ~1.5B-parameter random-init Qwen3 layout in bf16, glmpost's
training step and rollout against the peers users would otherwise run, in one process.

* **train**: one policy-gradient step on ``--batch`` sequences of ``--seq`` tokens (the last
  ``--response`` of each are actions): glmpost's path (float32 master weights, ``--precision bf16``
  autocast, the chunked float32 log-prob head, ``--activation-checkpointing``, torch AdamW) vs TRL
  GRPOTrainer's way (bf16 weights, ``model(...).logits`` over the whole sequence, then
  ``selective_log_softmax`` on the response: TRL's ``_get_per_token_logps``; its AdamW on the bf16
  weights): action tokens/s and peak memory (the allocator's) of each, and their ratios.
* **rollout**: ``--rollout-batch`` prompts of ``--prompt`` tokens, ``--new-tokens`` sampled tokens:
  glmpost's ``LocalEngine`` vs HF ``generate`` (both bf16, sampling at temperature 1): tokens/s.

Goals (issue 31): train speed >= 1x, memory <= 1x TRL's; rollout tokens/s vs HF generate. It prints
one JSON object and, with ``--out``, writes it (give ``$OUT/gpu.json`` on the device machine). On a
CPU, ``--size tiny`` runs the same code in seconds (the suite's smoke check).

    python3 benchmarks/bench_gpu.py --out $OUT/gpu.json                  # on the device machine
    .venv/bin/python benchmarks/bench_gpu.py --size tiny --device cpu    # here
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from reporting import emit

from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.rl.precision import checkpoint_layers, compute_context

SIZES = {  # Qwen3-1.7B's layout (1.5B without embeddings at vocab 32k), and a CPU-sized one
    "1.5b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=32768),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}


def build(size: str, dtype: torch.dtype, device: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SIZES[size], max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype)


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def loss_of(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO's token-mean policy term at ratio 1 with advantage 1 (what both sides differentiate)."""
    return -(log_probs * mask).sum() / mask.sum()


def train_sides(args, device: torch.device) -> dict:
    ids = torch.randint(3, SIZES[args.size]["vocab_size"] - 1, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    score = torch.zeros(args.batch, args.seq - 1, dtype=torch.bool, device=device)
    score[:, -args.response:] = True
    actions = int(score.sum())
    out = {}

    model = build(args.size, torch.float32, device).train()  # glmpost: float32 masters
    checkpoint_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def glmpost_step():
        with compute_context("bf16", device):
            result = sequence_log_probs(model, ids, score_mask=score, chunk_size=512)
        loss_of(result.log_probs, score).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    glmpost_step()  # warm-up: AdamW's states exist from here on, as in a run
    peak_reset(device)
    seconds = min(timed(device, glmpost_step) for _ in range(args.repeats))
    out["glmpost"] = {"step_s": seconds, "action_tokens_per_s": actions / seconds, "peak_gib": peak(device)}
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = build(args.size, torch.bfloat16, device).train()  # TRL: the checkpoint's bf16 weights
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def trl_step():
        logits = model(input_ids=ids).logits[:, -args.response - 1 : -1].float()
        targets = ids[:, -args.response:]
        log_probs = torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)  # selective_log_softmax
        loss_of(log_probs, torch.ones_like(log_probs, dtype=torch.bool)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    trl_step()
    peak_reset(device)
    seconds = min(timed(device, trl_step) for _ in range(args.repeats))
    out["trl_way"] = {"step_s": seconds, "action_tokens_per_s": actions / seconds, "peak_gib": peak(device)}
    out["speed_ratio"] = out["glmpost"]["action_tokens_per_s"] / out["trl_way"]["action_tokens_per_s"]
    if device.type == "cuda":
        out["memory_ratio"] = out["glmpost"]["peak_gib"] / out["trl_way"]["peak_gib"]
    return out


def rollout_sides(args, device: torch.device) -> dict:
    model = build(args.size, torch.bfloat16, device).eval()
    vocab = SIZES[args.size]["vocab_size"]
    prompts = torch.randint(3, vocab - 1, (args.rollout_batch, args.prompt), generator=torch.Generator().manual_seed(1))
    new = args.rollout_batch * args.new_tokens
    engine = LocalEngine(model, batch_size=args.rollout_batch)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, stop_token_ids=[])
    keys = [f"p{i}" for i in range(args.rollout_batch)]
    run_engine = lambda: engine.generate(prompts.tolist(), keys, params)  # noqa: E731
    run_engine()
    glmpost_s = timed(device, run_engine)
    with torch.no_grad():
        run_hf = lambda: model.generate(prompts.to(device), do_sample=True, temperature=1.0, top_k=0,  # noqa: E731
                                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        run_hf()
        hf_s = timed(device, run_hf)
    return {"glmpost_tokens_per_s": new / glmpost_s, "hf_generate_tokens_per_s": new / hf_s, "speed_ratio": hf_s / glmpost_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rollout-batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"size": args.size, "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "parameters": sum(p.numel() for p in build(args.size, torch.bfloat16, torch.device("meta")).parameters()),
              "train": train_sides(args, device), "rollout": rollout_sides(args, device)}
    emit(report, args.out)


if __name__ == "__main__":
    main()
