"""QAT step time vs plain SFT step time on the tiny GLM-5 (goal: QAT overhead <= 1.3x).

Both sides run the same SFT update (glmpost.rl.sft.SFTTrainer: forward, chunked log-probs, backward,
AdamW step) on the same weights and batch, in one process, interleaved, best of N; the QAT side has
every targeted weight parametrized with the quantizer's fake quant (glmpost.quant.qat), which is
what `glmpost qat --scheme w4a16` runs. The peer is plain SFT (`--scheme none`).

    .venv/bin/python benchmarks/bench_qat.py --out runs/bench_qat.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from glmpost.models.tiny import build_model, tiny_glm5_config
from glmpost.quant.qat import apply_fake_quant
from glmpost.quant.spec import make_spec
from glmpost.rl.sft import SFTConfig, SFTTrainer
from glmpost.rl.batches import TrainExample


def make_examples(count: int, prompt: int, response: int, vocab: int, seed: int) -> list[TrainExample]:
    rng = np.random.default_rng(seed)
    return [
        TrainExample(
            input_ids=rng.integers(8, vocab, prompt + response).tolist(),
            prompt_length=prompt,
            action_mask=np.ones(response, dtype=bool),
            rollout_log_probs=np.zeros(response, dtype=np.float32),
            advantage=0.0,
            group_id=str(i),
        )
        for i in range(count)
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=32, help="trajectories per optimizer step")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--scheme", default="w4a16", help="QAT scheme (w4a16, w8a16, w8a8-dynamic)")
    parser.add_argument("--group-size", type=int, default=16, help="w4a16 group size (must divide the tiny model's widths)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per side (best wins)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 keeps torch's default")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    base = build_model(tiny_glm5_config(), seed=0)
    examples = make_examples(args.records, args.prompt_tokens, args.response_tokens, base.config.vocab_size, seed=0)
    config = SFTConfig(lr=1e-4, batch_size=args.records, micro_batch_size=args.records)
    sides = {}
    for name in ("sft", "qat"):
        model = copy.deepcopy(base)
        if name == "qat":
            kwargs = {"group_size": args.group_size} if args.scheme == "w4a16" else {}
            apply_fake_quant(model, make_spec(args.scheme, **kwargs))
        sides[name] = SFTTrainer(model, config, pad_token_id=0)
    times = {name: [] for name in sides}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name in (("sft", "qat") if repeat % 2 else ("qat", "sft")):
            started = time.perf_counter()
            sides[name].train(examples)
            if repeat:
                times[name].append(time.perf_counter() - started)
    best = {name: min(values) for name, values in times.items()}
    tokens = args.records * args.response_tokens
    ratio = best["qat"] / best["sft"]
    print(f"{args.records} x ({args.prompt_tokens} + {args.response_tokens}) tokens, scheme {args.scheme}, {args.threads} thread(s)")
    print(f"{'side':6} {'best s':>8} {'median s':>9} {'tokens/s':>9}")
    for name, values in times.items():
        print(f"{name:6} {best[name]:8.4f} {float(np.median(values)):9.4f} {tokens / best[name]:9.0f}")
    print(f"QAT step time / SFT step time = {ratio:.2f}x (goal <= 1.3x: {'met' if ratio <= 1.3 else 'missed'})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "best_s": best,
                                        "times_s": times, "qat_over_sft": ratio}, indent=2))


if __name__ == "__main__":
    main()
