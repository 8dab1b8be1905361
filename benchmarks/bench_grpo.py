"""One train-grpo step: glmpost's ``PolicyTrainer.train`` vs TRL's ``GRPOTrainer`` loss path.

Both sides run side by side in one process on the tiny GLM-5 model (``build_model(tiny_glm5_config(),
seed=0)``, two deep copies of the same weights) and on the same batch: ``--prompts`` chat-template
prompts of ~10 tokens ("add: a+b="), ``--group`` samples each drawn with glmpost's ``LocalEngine``
(``--response-tokens`` tokens, no stop token, so every response has exactly that length), random 0/1
rewards and glmpost's group advantages. The same advantages and tokens are fed to both sides.

One step on each side is: old log-prob recompute of the rollout tokens (no grad) + token-level
clipped policy loss (eps_low 0.2, eps_high 0.28, no KL, no entropy bonus) + backward + grad-norm
clip (1.0) + AdamW step.

glmpost side (timed): ``PolicyTrainer(model, GRPOConfig(epochs=1, mini_batches=1,
micro_batch_size=M, icepop=False, lr=...)).train(examples)`` - the real call of ``train-grpo``,
including its collation of ``TrainExample`` rows into tensors. IcePop is off because TRL has no
counterpart (with it on, every token is trusted here anyway: same weights on both engines).

TRL side (timed), ``trl.GRPOTrainer`` built for real (model instance, a dummy reward function, the
tokenizer, ``loss_type="dapo"`` - TRL's default, ``beta=0``, ``epsilon=0.2``,
``epsilon_high=0.28``, ``max_grad_norm=1.0``, ``weight_decay=0``, ``per_device_train_batch_size=M``,
``gradient_accumulation_steps=B/M``), then per step exactly what its training loop runs after
generation, minus generation and reward scoring:

  1. ``trainer._get_per_token_logps_and_entropies(model, prompt+completion ids, mask,
     logits_to_keep, batch_size=M)`` under ``torch.no_grad()`` - the old log-prob recompute TRL
     does in ``_generate_and_score_completions`` (it skips it when ``num_iterations == 1`` and uses
     ``per_token_logps.detach()`` instead; glmpost always recomputes, so TRL's recompute is timed
     too: forcing the same work on both sides is the fair comparison);
  2. per micro-batch: ``trainer.compute_loss(model, inputs)`` (-> ``_compute_loss``: the fused,
     chunked LM-head log-probs + entropy, the clipped loss, TRL's metric logging) and
     ``trainer.accelerator.backward(loss)``;
  3. ``trainer.accelerator.clip_grad_norm_(..., 1.0)``, ``optimizer.step()``, ``zero_grad()`` with
     the optimizer TRL's ``create_optimizer`` builds (``adamw_torch_fused`` by default).

``inputs`` is the dict ``_generate_and_score_completions`` returns (left-padded ``prompt_ids``,
``completion_ids``, masks, ``advantages``, ``old_per_token_logps``, ``num_items_in_batch``); building
it is untimed (TRL builds it during generation).

Same loss: TRL's ``dapo`` normaliser is ``num_items_in_batch`` (action tokens of the whole
generation batch) scaled to one accumulation window, so the summed gradient is
``sum over all action tokens / their number`` - exactly glmpost's global token mean. Before timing,
both sides run a 2-epoch check on fresh copies (``--check-lr``, default 1e-3, so the second step
has ratios != 1 and a non-trivial loss; on the first step the ratio is 1 and the loss is
``-mean(A)``, ~0 with equal-length responses) and the script reports the loss and grad norm of
each step and the max weight difference after both.

Prompts all have the same length by default (12 tokens), so neither side pads them. With
``--mixed-lengths`` the parity check fails, and not because of the loss code: TRL left-pads prompts
(glmpost's trainer right-pads), and on this tiny randomly initialised model left padding changes the
log-probs of the shorter rows by up to ~0.04. The cause is the DSA indexer: its top-k often has
exact ties at the cut-off (7 % of the query rows of a sample sequence at init), and ``topk`` breaks
them by absolute key index, which padding shifts. glmpost's right-padded batch matches the unpadded
sequence bit for bit; left padding with position ids that skip the pads still differs.

Measures: best-of-``--repeats`` wall time of one step, interleaved (the side that goes first
alternates), as action tokens / s; and peak memory of one step above the level at its start
(``benchmarks/memory.py``: the kernel's exact ``VmHWM`` after a reset where permitted, else sampled
RSS) in a separate interleaved phase run after ``mallopt(M_MMAP_THRESHOLD, 128 KiB)``, so that
freed tensors leave RSS and each run's peak is its own (glibc's default adaptive threshold keeps
freed tensors < 32 MiB in the heap, which would make RSS peaks order-dependent). Ratios: glmpost
throughput / TRL throughput (goal >= 1.0) and glmpost peak / TRL peak (goal <= 1.0).

    .venv/bin/pip install -c constraints.txt -e '.[bench]'
    .venv/bin/python benchmarks/bench_grpo.py --out runs/bench_grpo.json
    .venv/bin/python benchmarks/bench_grpo.py --response-tokens 64 --out runs/bench_grpo_long.json
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import PeakMemory, rss_bytes  # noqa: E402

from glmpost.formats.prompts import encode_prompt  # noqa: E402
from glmpost.kernel.distribution import ScoredDistribution  # noqa: E402
from glmpost.kernel.engine import LocalEngine, SamplingParams  # noqa: E402
from glmpost.models.tiny import build_model, tiny_glm5_config  # noqa: E402
from glmpost.models.tokenizer import train_tokenizer  # noqa: E402
from glmpost.rl.batches import prepare_batch  # noqa: E402
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.trainer import PolicyTrainer  # noqa: E402
from glmpost.rollout.records import RolloutPrompt, rollout_record  # noqa: E402

GOAL_SPEED_RATIO = 1.0
GOAL_MEMORY_RATIO = 1.0
EPS_LOW, EPS_HIGH, GRAD_CLIP = 0.2, 0.28, 1.0


# --------------------------------------------------------------------------------------- batch


def make_batch(tokenizer, model, *, prompts: int, group: int, response_tokens: int, seed: int,
               mixed_lengths: bool = False):
    """Rollout records of ``prompts x group`` samples (no early stop) and their prepared examples."""
    rng = random.Random(seed)
    rollout_prompts = []
    for i in range(prompts):
        high = (99, 999) if mixed_lengths else (9, 9)  # one digit each: every prompt is 12 tokens
        text = f"add: {rng.randint(0, high[0])}+{rng.randint(0, high[1])}="
        ids = encode_prompt(tokenizer, [{"role": "user", "content": text}])
        rollout_prompts.append(RolloutPrompt(f"p{i}", ids, domain="add", task={"text": text}))
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=response_tokens, seed=seed)
    flat = [p for p in rollout_prompts for _ in range(group)]
    keys = [f"{p.prompt_id}/{j}" for p in rollout_prompts for j in range(group)]
    engine = LocalEngine(model, batch_size=len(flat), pad_token_id=tokenizer.pad_token_id)
    completions = engine.generate([p.token_ids for p in flat], keys, params)
    records = []
    for index, (prompt, completion) in enumerate(zip(flat, completions)):
        record = rollout_record(
            prompt, completion, sample_index=index % group, params=params, policy_version=0,
            tokenizer_revision="bench", engine={"engine": engine.name},
        )
        record["reward"] = float(rng.random() < 0.5)
        records.append(record)
    prepared = prepare_batch(records)
    return records, prepared


def trl_inputs(records, examples, *, pad_token_id: int) -> dict:
    """The dict TRL's ``_generate_and_score_completions`` hands to ``compute_loss`` (sans old log-probs)."""
    prompt_width = max(len(r["prompt_token_ids"]) for r in records)
    completion_width = max(len(r["response_token_ids"]) for r in records)
    batch = len(records)
    prompt_ids = torch.full((batch, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((batch, prompt_width), dtype=torch.long)
    completion_ids = torch.full((batch, completion_width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((batch, completion_width), dtype=torch.long)
    for row, record in enumerate(records):
        p, c = record["prompt_token_ids"], record["response_token_ids"]
        prompt_ids[row, prompt_width - len(p):] = torch.from_numpy(p.astype("int64"))  # TRL left-pads prompts
        prompt_mask[row, prompt_width - len(p):] = 1
        completion_ids[row, : len(c)] = torch.from_numpy(c.astype("int64"))
        completion_mask[row, : len(c)] = 1
    advantages = torch.tensor([e.advantage for e in examples], dtype=torch.float32)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum().float(),
    }


# --------------------------------------------------------------------------------------- sides


class GlmpostSide:
    name = "glmpost"

    def __init__(self, model, examples, *, pad_token_id, lr, micro_batch_size, epochs=1):
        config = GRPOConfig(
            lr=lr, epochs=epochs, mini_batches=1, micro_batch_size=micro_batch_size, grad_clip=GRAD_CLIP,
            eps_low=EPS_LOW, eps_high=EPS_HIGH, icepop=False, kl_coef=0.0, entropy_coef=0.0, weight_decay=0.0,
        )
        self.model = model
        self.examples = examples
        self.trainer = PolicyTrainer(model, config, pad_token_id=pad_token_id)

    def step(self) -> list[dict]:
        """One ``train`` call: one optimizer step per epoch; (loss, grad norm) per step."""
        history = self.trainer.train(self.examples)
        return [{"loss": h["train/loss"], "grad_norm": h["train/grad_norm"]} for h in history]


class TrlSide:
    name = "trl"

    def __init__(self, model, tokenizer, inputs, *, lr, micro_batch_size, group):
        from datasets import Dataset
        from trl import GRPOConfig as TrlConfig
        from trl import GRPOTrainer as TrlTrainer

        batch = inputs["prompt_ids"].shape[0]
        if batch % micro_batch_size:
            raise SystemExit(f"--micro-batch-size {micro_batch_size} must divide the batch of {batch}")
        self.micro = micro_batch_size
        self.accumulation = batch // micro_batch_size
        args = TrlConfig(
            output_dir=tempfile.mkdtemp(prefix="bench-grpo-trl-"),
            per_device_train_batch_size=micro_batch_size,
            gradient_accumulation_steps=self.accumulation,
            num_generations=group,
            max_completion_length=inputs["completion_ids"].shape[1],
            loss_type="dapo",
            beta=0.0,
            epsilon=EPS_LOW,
            epsilon_high=EPS_HIGH,
            learning_rate=lr,
            weight_decay=0.0,
            max_grad_norm=GRAD_CLIP,
            temperature=1.0,
            use_cpu=True,
            report_to=[],
            bf16=False,
            logging_steps=10**9,
            save_strategy="no",
        )
        self.trainer = TrlTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["unused"] * group}),
            processing_class=tokenizer,
        )
        self.trainer.create_optimizer()
        # Set by Trainer's loop; _compute_loss reads it for its normaliser.
        self.trainer.current_gradient_accumulation_steps = self.accumulation
        self.model = self.trainer.model
        self.inputs = inputs
        self.optimizer_name = str(args.optim)

    def old_log_probs(self) -> torch.Tensor:
        """TRL's old log-prob recompute, as in ``_generate_and_score_completions``."""
        from trl.models.utils import disable_gradient_checkpointing

        trainer, inputs = self.trainer, self.inputs
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
            old, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, inputs["completion_ids"].shape[1], batch_size=self.micro
            )
        return old

    def step(self, iterations: int = 1) -> list[dict]:
        trainer, model = self.trainer, self.trainer.model
        model.train()  # TRL's training loop runs generation and the loss in train mode
        inputs = dict(self.inputs, old_per_token_logps=self.old_log_probs())
        out = []
        for _ in range(iterations):
            total = 0.0
            for start in range(0, inputs["prompt_ids"].shape[0], self.micro):
                micro = inputs if self.accumulation == 1 else {
                    k: (v[start : start + self.micro] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                    for k, v in inputs.items()
                }
                with trainer.compute_loss_context_manager():
                    loss = trainer.compute_loss(model, micro)
                trainer.accelerator.backward(loss)
                total += float(loss.detach())
            norm = trainer.accelerator.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            trainer.optimizer.step()
            model.zero_grad(set_to_none=True)
            for metrics in trainer._metrics.values():  # TRL's logger clears these at each log step
                metrics.clear()
            out.append({"loss": total, "grad_norm": float(norm)})
        return out


# --------------------------------------------------------------------------------------- checks


def parity_check(base, tokenizer, records, examples, inputs, *, pad_token_id, lr, micro_batch_size, group):
    """Two steps on the same old log-probs, fresh copies of the same weights on both sides."""
    glm = GlmpostSide(copy.deepcopy(base), examples, pad_token_id=pad_token_id, lr=lr,
                      micro_batch_size=micro_batch_size, epochs=2)
    trl = TrlSide(copy.deepcopy(base), tokenizer, inputs, lr=lr, micro_batch_size=micro_batch_size, group=group)
    glm_old = glm.trainer.old_policy(examples, list(range(len(examples))), ScoredDistribution()).old_log_probs
    trl_old = trl.old_log_probs()
    width = inputs["completion_ids"].shape[1]
    old_diff = 0.0
    for row, example in enumerate(examples):
        start = example.prompt_length - 1
        old_diff = max(old_diff, float((glm_old[row][start : start + width] - trl_old[row]).abs().max()))
    glm_steps = glm.step()
    trl_steps = trl.step(iterations=2)
    weight_diff = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(glm.model.parameters(), trl.model.parameters())
    )
    steps = []
    for i, (g, t) in enumerate(zip(glm_steps, trl_steps)):
        steps.append({
            "step": i,
            "glmpost_loss": g["loss"], "trl_loss": t["loss"], "abs_diff_loss": abs(g["loss"] - t["loss"]),
            "glmpost_grad_norm": g["grad_norm"], "trl_grad_norm": t["grad_norm"],
            "rel_diff_grad_norm": abs(g["grad_norm"] - t["grad_norm"]) / max(abs(t["grad_norm"]), 1e-30),
        })
    return {
        "lr": lr,
        "max_abs_diff_old_log_probs": old_diff,
        "steps": steps,
        "max_abs_diff_weights_after": weight_diff,
        "ok": old_diff < 1e-5 and all(s["abs_diff_loss"] < 1e-5 and s["rel_diff_grad_norm"] < 1e-4 for s in steps),
    }


# --------------------------------------------------------------------------------------- timing


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc ``mallopt(M_MMAP_THRESHOLD, n)``: allocations >= n are mmapped and unmapped on free."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD = -3


def release_free_memory() -> None:
    """Return freed heap pages to the OS, so the next run's RSS peak counts every page it touches."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def check_rss_method(size_bytes: int = 8 * 2**20) -> dict:
    """After ``release_free_memory``, does a fresh tensor raise RSS by its size, and freeing it drop it?"""
    release_free_memory()
    before = rss_bytes()
    tensor = torch.ones(size_bytes // 4, dtype=torch.float32)
    during = rss_bytes()
    del tensor
    release_free_memory()
    after = rss_bytes()
    grew, left = (during - before) / size_bytes, (after - before) / size_bytes
    return {"size_bytes": size_bytes, "grew_fraction": round(grew, 3), "left_fraction": round(left, 3),
            "ok": grew >= 0.9 and left <= 0.1}


def time_sides(sides, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall seconds, process CPU seconds) per side; the side that goes first alternates."""
    times = {s.name: [] for s in sides}
    cpu = {s.name: [] for s in sides}
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            gc.collect()
            start, start_cpu = time.perf_counter(), time.process_time()
            side.step()
            times[side.name].append(time.perf_counter() - start)
            cpu[side.name].append(time.process_time() - start_cpu)
    return times, cpu


def memory_sides(sides, repeats: int) -> dict[str, list[dict]]:
    peaks = {s.name: [] for s in sides}
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            release_free_memory()
            with PeakMemory("cpu") as peak:
                side.step()
            peaks[side.name].append({"sampled": peak.peak_bytes, "hwm": peak.hwm_bytes})
    return peaks


def median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--response-tokens", type=int, default=8)
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="prompts of different lengths (padding); see the docstring: parity then fails")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the whole batch")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per side (best wins)")
    parser.add_argument("--memory-repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate of the timed steps")
    parser.add_argument("--check-lr", type=float, default=1e-3, help="learning rate of the parity check")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine, 2 threads under load are "
                             "several times slower and far noisier); 0 keeps torch's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    import trl  # noqa: F401  (fail early with the install hint)

    tokenizer = train_tokenizer(512)
    pad = tokenizer.pad_token_id
    base = build_model(tiny_glm5_config(), seed=0)
    records, prepared = make_batch(
        tokenizer, base, prompts=args.prompts, group=args.group, response_tokens=args.response_tokens, seed=args.seed,
        mixed_lengths=args.mixed_lengths,
    )
    examples = prepared.examples
    if len(examples) != len(records):
        raise SystemExit(f"prepare_batch dropped records: {prepared.excluded}")
    inputs = trl_inputs(records, examples, pad_token_id=pad)
    batch = len(examples)
    micro = args.micro_batch_size or batch
    action_tokens = int(inputs["completion_mask"].sum())
    prompt_lengths = [len(r["prompt_token_ids"]) for r in records]

    parity = parity_check(base, tokenizer, records, examples, inputs, pad_token_id=pad, lr=args.check_lr,
                          micro_batch_size=micro, group=args.group)

    glm = GlmpostSide(copy.deepcopy(base), examples, pad_token_id=pad, lr=args.lr, micro_batch_size=micro)
    trl_side = TrlSide(copy.deepcopy(base), tokenizer, inputs, lr=args.lr, micro_batch_size=micro, group=args.group)
    sides = [glm, trl_side]
    time_sides(sides, 1)  # warm-up: kernels, thread pools, optimizer state
    times, cpu_times = time_sides(sides, args.repeats)

    mmap_fixed = set_mmap_threshold(128 * 1024)
    rss_check = check_rss_method()
    peaks = memory_sides(sides, args.memory_repeats)

    rows = {}
    for side in sides:
        best = min(times[side.name])
        hwm = [p["hwm"] for p in peaks[side.name]]
        peak = median(hwm) if all(h is not None for h in hwm) else median([p["sampled"] for p in peaks[side.name]])
        rows[side.name] = {
            "best_step_s": best,
            "median_step_s": median(times[side.name]),
            "best_cpu_s": min(cpu_times[side.name]),
            "action_tokens_per_s": action_tokens / best,
            "action_tokens_per_cpu_s": action_tokens / min(cpu_times[side.name]),
            "peak_bytes": peak,
            "peak_source": "VmHWM" if all(h is not None for h in hwm) else "sampled RSS",
            "times_s": times[side.name],
            "cpu_times_s": cpu_times[side.name],
            "peaks": peaks[side.name],
        }
    speed_ratio = rows["glmpost"]["action_tokens_per_s"] / rows["trl"]["action_tokens_per_s"]
    cpu_speed_ratio = rows["glmpost"]["action_tokens_per_cpu_s"] / rows["trl"]["action_tokens_per_cpu_s"]
    memory_ratio = rows["glmpost"]["peak_bytes"] / max(rows["trl"]["peak_bytes"], 1)

    import transformers
    import trl as trl_module

    result = {
        "benchmark": "bench_grpo",
        "setting": {
            "prompts": args.prompts, "group": args.group, "batch": batch, "response_tokens": args.response_tokens,
            "prompt_tokens_min": min(prompt_lengths), "prompt_tokens_max": max(prompt_lengths),
            "action_tokens": action_tokens, "micro_batch_size": micro, "lr": args.lr, "repeats": args.repeats,
            "memory_repeats": args.memory_repeats, "threads": torch.get_num_threads(),
            "mixed_lengths": args.mixed_lengths, "trl_loss_type": "dapo", "trl_optimizer": trl_side.optimizer_name, "glmpost_icepop": False,
        },
        "versions": {
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_module.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
        },
        "parity": parity,
        "memory_method": {
            "what": "peak RSS of one step above its start (VmHWM reset via /proc/self/clear_refs where permitted, "
                    "else RSS sampled every 1 ms); malloc_trim(0) before each run, M_MMAP_THRESHOLD fixed at 128 KiB",
            "mmap_threshold_fixed": mmap_fixed,
            "rss_check": rss_check,
        },
        "results": rows,
        "speed_ratio_glmpost_over_trl": speed_ratio,
        "cpu_speed_ratio_glmpost_over_trl": cpu_speed_ratio,
        "memory_ratio_glmpost_over_trl": memory_ratio,
        "goals": {
            "speed_ratio_min": GOAL_SPEED_RATIO, "memory_ratio_max": GOAL_MEMORY_RATIO,
            "speed_met": speed_ratio >= GOAL_SPEED_RATIO, "memory_met": memory_ratio <= GOAL_MEMORY_RATIO,
        },
    }

    mib = 2**20
    print(f"GRPO step: {args.prompts} prompts x G={args.group} = {batch} seqs, prompt {min(prompt_lengths)}-"
          f"{max(prompt_lengths)} tokens, {args.response_tokens} response tokens, micro-batch {micro}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, trl {trl_module.__version__}")
    print(f"parity (lr {args.check_lr}): max|old logp diff| {parity['max_abs_diff_old_log_probs']:.2e}, "
          f"max|weight diff| after 2 steps {parity['max_abs_diff_weights_after']:.2e}")
    for s in parity["steps"]:
        print(f"  step {s['step']}: loss glmpost {s['glmpost_loss']:+.8e} trl {s['trl_loss']:+.8e} "
              f"(|diff| {s['abs_diff_loss']:.1e}); grad norm glmpost {s['glmpost_grad_norm']:.6e} "
              f"trl {s['trl_grad_norm']:.6e} (rel {s['rel_diff_grad_norm']:.1e})")
    print(f"  parity {'ok' if parity['ok'] else 'MISMATCH'}"
          + ("" if parity["ok"] or not args.mixed_lengths else
             " (expected with --mixed-lengths: TRL left-pads prompts, see the docstring)"))
    header = f"{'side':<8} {'best s':>9} {'median s':>9} {'cpu s':>9} {'tokens/s':>10} {'peak MiB':>9}"
    print(header)
    for name, row in rows.items():
        print(f"{name:<8} {row['best_step_s']:>9.4f} {row['median_step_s']:>9.4f} {row['best_cpu_s']:>9.4f} "
              f"{row['action_tokens_per_s']:>10.0f} {row['peak_bytes'] / mib:>9.2f}")
    print(f"throughput glmpost/trl = {speed_ratio:.2f}x wall, {cpu_speed_ratio:.2f}x CPU time "
          f"(goal >= {GOAL_SPEED_RATIO}: "
          f"{'met' if speed_ratio >= GOAL_SPEED_RATIO else 'MISSED'}); peak glmpost/trl = {memory_ratio:.2f}x "
          f"(goal <= {GOAL_MEMORY_RATIO}: {'met' if memory_ratio <= GOAL_MEMORY_RATIO else 'MISSED'}); "
          f"peak from {rows['glmpost']['peak_source']}, RSS check {rss_check}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
