"""Micro-batches by a token budget, padded or packed, vs by a count of sequences (the peer: padded
count-based micro-batches, glmpost's ``--micro-batch-size`` before the budget), one process, same
examples.

``--examples`` trajectories with long-tailed lengths (lognormal, clipped to 32 .. ``--max-len``
tokens, like agentic trajectories; the last half of each is action tokens), in a shuffled order as
a mini-batch arrives; a random-init Qwen3 layout (hidden 256, 4 layers, vocab 512), float32. Each
side runs forward + backward of the trainer's log-prob path
(:func:`glmpost.kernel.logprobs.sequence_log_probs`) over every micro-batch of its plan
(:func:`glmpost.rl.micro_batches.micro_batch_plan`): ``--micro-batch-size`` rows, ``--tokens``
padded tokens, or ``--tokens`` tokens packed into one row (positions restarting per example,
attention within each: ``--pack-sequences``). Reported: action tokens/s, the padded share of the
tokens computed, and both as ratios; the summed gradients of the three sides agree (the split and
the layout do not change the update).

Goal (issue 31, with sequence packing): action tokens/s >= 2x the padded count-based micro-batches.

    .venv/bin/python benchmarks/bench_token_batches.py --out runs/bench_token_batches.json
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch
from reporting import emit

from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.models.packed_attention import use_packed_sdpa
from glmpost.rl.batches import TrainExample
from glmpost.rl.micro_batches import collate, micro_batch_plan, pack


def examples(count: int, max_len: int, seed: int) -> list[TrainExample]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=1.0, size=count), 32, max_len).astype(int)
    out = []
    for length in lengths:
        prompt = int(length) // 2
        out.append(TrainExample(input_ids=rng.integers(3, 500, size=int(length)).tolist(), prompt_length=prompt,
                                action_mask=np.ones(int(length) - prompt, dtype=bool),
                                rollout_log_probs=np.zeros(int(length) - prompt, dtype=np.float32), advantage=1.0, group_id="g"))
    return out


def run(model, batch: list[TrainExample], plan: list[list[int]], lay_out=collate) -> dict:
    model.zero_grad(set_to_none=True)
    computed = actions = 0
    started = time.perf_counter()
    for chunk in plan:
        micro = lay_out([batch[i] for i in chunk], pad_token_id=0, device=torch.device("cpu"))
        computed += micro.input_ids.numel()
        actions += int(micro.action_mask.sum())
        sequence_log_probs(model, micro.input_ids, micro.attention_mask, position_ids=micro.position_ids,
                           score_mask=micro.action_mask).log_probs.sum().backward()
    seconds = time.perf_counter() - started
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    real = sum(len(e.input_ids) for e in batch)
    return {"seconds": seconds, "action_tokens_per_s": actions / seconds, "micro_batches": len(plan),
            "padded_share": 1 - real / computed, "grad": grad}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         max_position_embeddings=args.max_len)).train()
    use_packed_sdpa(model)  # as load_model runs it: a packed row's sequences attended one at a time
    batch = examples(args.examples, args.max_len, seed=0)
    order = list(range(len(batch)))
    random.Random(0).shuffle(order)  # as a shuffled mini-batch arrives
    lengths = [len(e.input_ids) for e in batch]
    count = run(model, batch, micro_batch_plan(lengths, order, size=args.micro_batch_size))
    budget = run(model, batch, micro_batch_plan(lengths, order, size=args.micro_batch_size, tokens=args.tokens))
    packed = run(model, batch, micro_batch_plan(lengths, order, size=args.micro_batch_size, tokens=args.tokens, pack=True),
                 pack)
    report = {
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "examples": args.examples,
        "tokens": sum(lengths), "lengths": {"min": min(lengths), "median": int(np.median(lengths)), "max": max(lengths)},
        **{f"{name}_{key}": round(value, 4) if isinstance(value, float) else value
           for name, side in (("count", count), ("budget", budget), ("packed", packed))
           for key, value in side.items() if key != "grad"},
        "speed_ratio": round(budget["action_tokens_per_s"] / count["action_tokens_per_s"], 3),
        "packed_speed_ratio": round(packed["action_tokens_per_s"] / count["action_tokens_per_s"], 3),
        "grad_rel_diff": float((budget["grad"] - count["grad"]).norm() / count["grad"].norm()),
        "packed_grad_rel_diff": float((packed["grad"] - count["grad"]).norm() / count["grad"].norm()),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
