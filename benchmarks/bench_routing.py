"""MoE routing closure (issue 33): what recording and replaying routing cost, and what the field weighs.

Both sides of each comparison run in one process on the same model and inputs, in rounds (one
untimed warm-up, then ``--repeats`` rounds, every side once per round, the order alternating),
timed in CPU seconds of this process (``time.process_time``, one thread by default: the dev machine
is shared, and wall time there measures the neighbours); the figures are medians, the ratios the
median of the per-round ratios.

* **rollout**: ``LocalEngine.generate`` of ``--sequences`` x ``--new-tokens`` (no stop ids) with
  ``record_routing`` off vs on (the routers run glmpost's deterministic rule either way); also the
  transformers routers unpatched, as a reference for the rule itself. Goal: recording keeps >= 0.95
  of the tokens/s.
* **training**: the trainer's forward + backward (``sequence_log_probs`` over a right-padded
  micro-batch of the recorded trajectories, ``collate``) without and with the replayed forward
  (``glmpost.rl.routing_replay.replay_context``). Goal: replay keeps >= 0.90 of the tokens/s.
* **bytes**: the ``routed_experts`` field per token raw and inside a zstd shard (level 3): shards
  written with and without the field, the difference per token. On the benchmark model's own
  records, and on GLM-5-shaped synthetic records (``--glm5-records`` of ``formats.synthetic``, their
  observation rows not recorded; 75 MoE layers, 8 of 256 experts, uint8) whose expert ids are
  uniformly random: real routing repeats more, so the zstd figure is an upper bound. The shard growth
  is the field's bytes over the shard's bytes per token without it.

Models: the tiny GLM-5 preset (1 MoE layer, 2 of 4 experts) and ``--wide`` (4 layers, 3 MoE, 4 of 16
experts), both ``GlmMoeDsaForCausalLM`` at float32, ``torch.set_num_threads(--threads)``.

    .venv/bin/python benchmarks/bench_routing.py --out runs/bench_routing.json
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from reporting import emit

from glmpost.formats import ShardWriter, synthetic_record
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.kernel.routing import compact_ids, install_routing, moe_shape
from glmpost.models.tiny import build_model, tiny_glm5_config
from glmpost.rl.batches import train_example
from glmpost.rl.micro_batches import collate
from glmpost.rl.routing_replay import attach_routing, replay_context
from glmpost.rollout.records import RolloutPrompt, rollout_record

GOAL_RECORD, GOAL_REPLAY = 0.95, 0.90
GLM5_MOE_LAYERS, GLM5_EXPERTS, GLM5_TOPK = 75, 256, 8  # GlmMoeDsaConfig defaults: 78 layers, 3 dense


def paired(sides: dict, repeats: int, baseline: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each side's CPU seconds per ``run()`` (``time.process_time``: what other processes on the
    machine take does not count) as the median of ``repeats`` rounds, every side once per round
    (one untimed warm-up first; the order alternating), and each side's speed relative to
    ``baseline`` as the median of the per-round ratios (a round's sides ran under the same load)."""
    for run in sides.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for repeat in range(repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            started = time.process_time()
            sides[name]()
            times[name].append(time.process_time() - started)
    ratios = {name: float(np.median([b / t for b, t in zip(times[baseline], times[name])])) for name in sides}
    return {name: float(np.median(t)) for name, t in times.items()}, ratios


def rollout_side(model, prompts, keys, params, *, record: bool):
    engine = LocalEngine(model, batch_size=len(prompts), record_routing=record)
    return lambda: engine.generate(prompts, keys, params)


def records_of(model, prompts, keys, params) -> list[dict]:
    completions = LocalEngine(model, batch_size=len(prompts), record_routing=True).generate(prompts, keys, params)
    return [rollout_record(RolloutPrompt(f"p{i}", p), c, sample_index=0, params=params, policy_version=0,
                           tokenizer_revision="bench", engine={"engine": LocalEngine.name})
            for i, (p, c) in enumerate(zip(prompts, completions))]


def training_side(model, batch, *, replay: bool):
    def run():
        model.zero_grad(set_to_none=True)
        with replay_context(model, batch, replay):
            sequence_log_probs(model, batch.input_ids, batch.attention_mask, score_mask=batch.action_mask).log_probs.sum().backward()
    return run


def shard_bytes(records: list[dict], path: Path) -> int:
    with ShardWriter(path, stage="rollout", tokenizer_revision=records[0]["tokenizer_revision"]) as writer:
        for record in records:
            writer.write(record)
    return path.stat().st_size


def field_bytes(records: list[dict], directory: Path) -> dict[str, float]:
    """Per response token: the field raw, the shard without it, and the growth the field adds."""
    tokens = sum(len(r["response_token_ids"]) for r in records)
    raw = sum(r["routed_experts"].nbytes for r in records)
    with_field = shard_bytes(records, directory / "with.msgpack.zst")
    without = shard_bytes([{k: v for k, v in r.items() if k != "routed_experts"} for r in records],
                          directory / "without.msgpack.zst")
    return {"tokens": tokens, "raw_bytes_per_token": raw / tokens, "zstd_bytes_per_token": (with_field - without) / tokens,
            "shard_bytes_per_token_without": without / tokens, "shard_growth": (with_field - without) / without}


def glm5_records(count: int, response_len: int, seed: int) -> list[dict]:
    """Synthetic GLM-5 records with uniformly random routing of 8 distinct experts of 256 per MoE
    layer, stored as the engine stores them (:func:`compact_ids`: ascending, uint8); observation
    rows not recorded."""
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        record = synthetic_record(rng, index=index, response_len=response_len, tokenizer_revision="bench")
        T = len(record["response_token_ids"])
        ids = np.argsort(rng.random((T, GLM5_MOE_LAYERS, GLM5_EXPERTS)), axis=-1)[..., :GLM5_TOPK]
        ids[~record["action_mask"]] = -1
        record["routed_experts"] = compact_ids(ids, GLM5_EXPERTS)
        out.append(record)
    return out


def measure_model(name: str, config, args) -> dict:
    model = build_model(config, seed=0).eval()
    reference = copy.deepcopy(model)  # transformers' own routers
    install_routing(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (int(n),), generator=generator).tolist()
               for n in torch.randint(8, 24, (args.sequences,), generator=generator)]
    keys = [f"s{i}" for i in range(len(prompts))]
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    tokens = len(prompts) * args.new_tokens
    rollout, rollout_ratios = paired({"transformers_router": rollout_side(reference, prompts, keys, params, record=False),
                                      "plain": rollout_side(model, prompts, keys, params, record=False),
                                      "recording": rollout_side(model, prompts, keys, params, record=True)},
                                     args.repeats, "plain")
    records = records_of(model, prompts, keys, params)
    examples = [train_example(r, 0.0) for r in records]
    attach_routing(examples, records)
    batch = collate(examples, pad_token_id=0, device=torch.device("cpu"))
    model.train()
    training, training_ratios = paired({"plain": training_side(model, batch, replay=False),
                                        "replay": training_side(model, batch, replay=True)}, args.repeats, "plain")
    trained = int(batch.attention_mask.sum())
    with tempfile.TemporaryDirectory() as tmp:
        sizes = field_bytes(records, Path(tmp))
    layers, k, experts = moe_shape(model)
    return {
        "model": name, "moe_layers": layers, "experts": experts, "experts_per_token": k,
        "rollout_tokens_per_s": {side: tokens / s for side, s in rollout.items()},
        "recording_speed_ratio": rollout_ratios["recording"],
        "rule_speed_ratio": 1.0 / rollout_ratios["transformers_router"],  # plain vs transformers' routers
        "training_tokens_per_s": {side: trained / s for side, s in training.items()},
        "replay_speed_ratio": training_ratios["replay"],
        "field": sizes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--glm5-records", type=int, default=16)
    parser.add_argument("--glm5-response", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"tiny-glm5": tiny_glm5_config(),
              "wide": tiny_glm5_config(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4)}
    report = {"machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__},
              "settings": vars(args) | {"out": str(args.out) if args.out else None},
              "models": [measure_model(name, config, args) for name, config in models.items()]}
    with tempfile.TemporaryDirectory() as tmp:
        glm5 = field_bytes(glm5_records(args.glm5_records, args.glm5_response, seed=0), Path(tmp))
    report["glm5_shaped"] = {"moe_layers": GLM5_MOE_LAYERS, "experts": GLM5_EXPERTS, "experts_per_token": GLM5_TOPK, **glm5}
    worst_record = min(m["recording_speed_ratio"] for m in report["models"])
    worst_replay = min(m["replay_speed_ratio"] for m in report["models"])
    report["goals"] = {"recording_speed_ratio": {"goal": GOAL_RECORD, "worst": worst_record, "met": worst_record >= GOAL_RECORD},
                       "replay_speed_ratio": {"goal": GOAL_REPLAY, "worst": worst_replay, "met": worst_replay >= GOAL_REPLAY}}
    emit(report, args.out)


if __name__ == "__main__":
    main()
