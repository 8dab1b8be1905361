"""Multi-turn rollouts: KV caches kept between turns vs re-prefilling every turn vs HF ``generate``.

One process, one tiny GLM-5 model (``build_model(tiny_glm5_config(max_position_embeddings=4096),
seed=0)``, the ``tiny-glm5-agentic`` preset's shape, float32, deterministic DSA top-k) shared by every
side. ``--batch`` trajectories of ``--turns`` turns: a ``--prompt-tokens`` prompt, then per turn
``--action-tokens`` greedy tokens from the model (no stop ids, so every turn has exactly that many)
and an observation of ``--observation-tokens`` fixed random ids appended, the next turn's prompt
being the exact concatenation (TITO). Greedy decoding, so the sides can be checked to produce the
same tokens; the observations do not depend on the actions.

Sides (timed: the whole ``turns``-turn batch, best of ``--repeats``, interleaved):

* ``glmpost``: ``LocalEngine.generate(..., sessions=, caches=TurnCaches())`` each turn: every batch
  keeps its KV cache and a turn prefills only the observation (and the action's last token).
* ``re-prefill``: the same engine without caches: each turn prefills the whole history.
* ``hf``: ``model.generate(input_ids, attention_mask, do_sample=False, max_new_tokens=N,
  min_new_tokens=N, eos_token_id=None)`` each turn on the left-padded whole history (tokens only; no
  log-probs).

Reported: time per side, the speed ratios ``re-prefill / glmpost`` (goal >= 3) and ``hf / glmpost``,
the prompt tokens the cache spared, and the share of action tokens equal to ``glmpost``'s per side.

    .venv/bin/python benchmarks/bench_multiturn.py --out runs/bench_multiturn.json
    .venv/bin/python benchmarks/bench_multiturn.py --observation-tokens 64 --action-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import random
import time
import warnings
from pathlib import Path

import torch

from glmpost.kernel.continuation import TurnCaches
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.models.tiny import build_model, tiny_glm5_config

GOAL_RE_PREFILL_RATIO = 3.0
PAD = 0


class Script:
    """The fixed part of every trajectory: its prompt and one observation per turn."""

    def __init__(self, *, batch: int, turns: int, prompt_tokens: int, observation_tokens: int, vocab: int, seed: int):
        rng = random.Random(seed)
        self.prompts = [[rng.randrange(8, vocab) for _ in range(prompt_tokens)] for _ in range(batch)]
        self.observations = [[[rng.randrange(8, vocab) for _ in range(observation_tokens)] for _ in range(batch)]
                             for _ in range(turns)]


class EngineSide:
    def __init__(self, name: str, model, script: Script, *, action_tokens: int, keep_caches: bool):
        self.name, self.script, self.keep_caches = name, script, keep_caches
        self.engine = LocalEngine(model, batch_size=len(script.prompts), pad_token_id=PAD)
        self.params = SamplingParams(temperature=0.0, max_new_tokens=action_tokens, stop_token_ids=[])
        self.caches = None

    def run(self) -> list[list[int]]:
        self.caches = TurnCaches() if self.keep_caches else None
        histories = [list(p) for p in self.script.prompts]
        sessions = [f"t{i}" for i in range(len(histories))]
        actions = []
        for turn, observations in enumerate(self.script.observations):
            keys = [f"{s}#turn{turn}" for s in sessions]
            out = self.engine.generate(histories, keys, self.params, sessions=sessions if self.caches else None,
                                       caches=self.caches)
            for history, completion, observation in zip(histories, out, observations):
                actions.append(completion.token_ids)
                history += completion.token_ids + observation
        return actions


class HfSide:
    name = "hf"

    def __init__(self, model, script: Script, *, action_tokens: int):
        self.model, self.script = model, script
        self.kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=action_tokens,
                           min_new_tokens=action_tokens, eos_token_id=None, pad_token_id=PAD)

    @torch.no_grad()
    def run(self) -> list[list[int]]:
        histories = [list(p) for p in self.script.prompts]
        actions = []
        for observations in self.script.observations:
            width = max(len(h) for h in histories)
            ids = torch.full((len(histories), width), PAD, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, history in enumerate(histories):
                ids[row, width - len(history):] = torch.tensor(history)
                mask[row, width - len(history):] = 1
            new = self.model.generate(input_ids=ids, attention_mask=mask, **self.kwargs)[:, width:].tolist()
            for history, action, observation in zip(histories, new, observations):
                actions.append(action)
                history += action + observation
        return actions


def time_sides(sides, repeats: int) -> dict[str, list[float]]:
    times = {s.name: [] for s in sides}
    for r in range(repeats):
        for side in sides if r % 2 == 0 else sides[::-1]:
            gc.collect()
            start = time.perf_counter()
            side.run()
            times[side.name].append(time.perf_counter() - start)
    return times


def agreement(actions: list[list[int]], reference: list[list[int]]) -> float:
    pairs = [(a, b) for x, y in zip(actions, reference) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="trajectories decoded together")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--action-tokens", type=int, default=16, help="tokens the model writes per turn (a tool call)")
    parser.add_argument("--observation-tokens", type=int, default=384, help="tokens each tool answer appends")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (best wins)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 keeps torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    from glmpost.npu.topk import set_indexer_topk

    model = build_model(tiny_glm5_config(max_position_embeddings=4096), seed=0).float().eval()
    set_indexer_topk(model, deterministic=True)
    context = args.prompt_tokens + args.turns * (args.action_tokens + args.observation_tokens)
    if context > model.config.max_position_embeddings:
        raise SystemExit(f"--turns x (--action-tokens + --observation-tokens) + --prompt-tokens = {context} "
                         f"exceeds the model's {model.config.max_position_embeddings} positions")
    script = Script(batch=args.batch, turns=args.turns, prompt_tokens=args.prompt_tokens,
                    observation_tokens=args.observation_tokens, vocab=model.config.vocab_size, seed=args.seed)
    sides = [EngineSide("glmpost", model, script, action_tokens=args.action_tokens, keep_caches=True),
             EngineSide("re-prefill", model, script, action_tokens=args.action_tokens, keep_caches=False),
             HfSide(model, script, action_tokens=args.action_tokens)]
    actions = {side.name: side.run() for side in sides}  # warm-up and the token check
    times = time_sides(sides, args.repeats)
    best = {name: min(values) for name, values in times.items()}
    caches = sides[0].caches
    result = {
        "benchmark": "bench_multiturn",
        "setting": {**{k: v for k, v in vars(args).items() if k != "out"}, "context_tokens": context,
                    "threads": torch.get_num_threads()},
        "best_s": best,
        "times_s": times,
        "ratios": {"re-prefill/glmpost": best["re-prefill"] / best["glmpost"], "hf/glmpost": best["hf"] / best["glmpost"]},
        "goal_re_prefill_ratio": GOAL_RE_PREFILL_RATIO,
        "prompt_tokens": {"reused_from_cache": caches.reused_tokens, "prefilled": caches.prefilled_tokens},
        "action_token_agreement_with_glmpost": {name: agreement(a, actions["glmpost"]) for name, a in actions.items()},
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
