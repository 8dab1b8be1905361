"""Supervised fine-tuning on exact token ids: the loss of the QAT stage (GLM-5 puts INT4 QAT in SFT).

    L = - sum_{t in M} log p_theta(y_t | s_t) / |M|

over the response tokens ``M`` marked as actions (prompt and observation tokens never enter the
loss), with ``|M|`` counted over the whole optimizer batch on every rank, so the gradient does not
depend on the micro-batch or data-parallel split. Weights may carry a fake-quant parametrization
(``glmpost.quant``): the forward then sees the quantized weight and the optimizer updates the float
master weight through the straight-through estimator.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from glmpost.config import setting, shared
from glmpost.kernel.logprobs import DEFAULT_CHUNK_SIZE, sequence_log_probs
from glmpost.rl.batches import TrainExample, train_examples
from glmpost.rl.distributed import OptimizerConfig, TorchBackend
from glmpost.rl.micro_batches import collate, micro_batch_plan, micro_batch_tokens_setting, pack, pack_sequences_setting


@dataclass
class SFTConfig(OptimizerConfig):
    lr: float = setting(1e-5, "AdamW learning rate.")
    epochs: int = setting(1, "Passes over the data.", min=1)
    batch_size: int = setting(32, "Trajectories per optimizer step (over all ranks).", min=1)
    micro_batch_size: int = setting(8, "Trajectories per forward/backward on each rank.", min=1)
    micro_batch_tokens: int = micro_batch_tokens_setting()
    pack_sequences: bool = pack_sequences_setting()
    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, "Positions per chunk of the log-prob computation.", min=1)
    seed: int = setting(0, "Seed of the data shuffling.")
    chat_template_kwargs: str = shared("chat_template_kwargs")


def sft_examples(records: Sequence[dict[str, Any]]) -> list[TrainExample]:
    """Records with at least one action token, as trainer examples (the loss tokens are the actions);
    a compacted record (rollout --compaction) is one example per context window, each on its
    recorded context (:func:`~glmpost.rl.batches.train_examples`)."""
    examples = []
    for record in records:
        actions = record["action_mask"] & ~record["observation_mask"]
        if not actions.any():
            continue
        zeros = {**record, "rollout_log_probs": np.zeros(len(actions), dtype=np.float32), "group_id": record["id"]}
        examples.extend(train_examples(zeros, 0.0))
    return examples


class SFTTrainer:
    """Token-mean negative log-likelihood over response actions, split-invariant across ranks."""

    def __init__(self, model: torch.nn.Module, config: SFTConfig, *, pad_token_id: int, backend: Any = None):
        config.validate()
        self.model = model
        self.config = config
        self.pad_token_id = pad_token_id
        self.backend = backend or TorchBackend(model, config)
        self.device = next(model.parameters()).device

    def total_steps(self, count: int) -> int:
        return self.config.epochs * math.ceil(count / self.config.batch_size)

    def prepare(self, examples: Sequence[TrainExample], distribution: Any = None) -> list[TrainExample]:
        """SFT needs nothing from the weights before training (:class:`glmpost.rl.jobs.Trainer`); its
        loss is of the model's own distribution, whatever ``distribution`` the update names."""
        return list(examples)

    def steps(self, examples: Sequence[TrainExample]) -> int:
        return self.total_steps(len(examples))

    def plan(self, examples: Sequence[TrainExample], indices: Sequence[int]) -> list[list[int]]:
        """``indices`` as micro-batches (:func:`~glmpost.rl.micro_batches.micro_batch_plan`), as the policy trainer's."""
        return micro_batch_plan([len(e.input_ids) for e in examples], indices, size=self.config.micro_batch_size,
                                tokens=self.config.micro_batch_tokens, pack=self.config.pack_sequences)

    def _nll_sum(self, examples: Sequence[TrainExample]) -> tuple[torch.Tensor, int]:
        lay_out = pack if self.config.pack_sequences else collate
        batch = lay_out(examples, pad_token_id=self.pad_token_id, device=self.device)
        with self.backend.compute():
            result = sequence_log_probs(self.model, batch.input_ids, batch.attention_mask, position_ids=batch.position_ids,
                                        score_mask=batch.action_mask, chunk_size=self.config.chunk_size)
        return -result.log_probs.sum(), int(batch.action_mask.sum())

    @torch.no_grad()
    def evaluate(self, examples: Sequence[TrainExample]) -> float:
        """Mean negative log-likelihood per loss token (this rank's examples, summed over ranks)."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        for chunk in self.plan(examples, range(len(examples))):
            nll, tokens = self._nll_sum([examples[i] for i in chunk])
            sums += torch.tensor([float(nll), tokens], dtype=torch.float64)
        total = self.backend.all_reduce_sum(sums).tolist()
        return total[0] / max(total[1], 1.0)

    def train(self, examples: Sequence[TrainExample], *, start_step: int = 0,
              on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        config = self.config
        rank, world = self.backend.rank, self.backend.world_size
        order = list(range(len(examples)))
        rng = random.Random(config.seed)
        history, step = [], 0
        for epoch in range(config.epochs):
            rng.shuffle(order)
            for start in range(0, len(order), config.batch_size):
                part = order[start : start + config.batch_size]
                if step < start_step:
                    step += 1
                    continue
                metrics = self._step(examples, part, rank, world)
                metrics.update({"sft/epoch": epoch, "sft/step": step})
                history.append(metrics)
                if on_step is not None:
                    on_step(step, metrics)
                step += 1
        return history

    def _step(self, examples, part: list[int], rank: int, world: int) -> dict[str, float]:
        self.model.train()
        started = time.perf_counter()
        shares = [[i for i in part if i % world == r] for r in range(world)]
        mine = shares[rank]
        local_tokens = sum(int(examples[i].action_mask.sum()) for i in mine)
        total_tokens = float(self.backend.all_reduce_sum(torch.tensor([float(local_tokens)], dtype=torch.float64))[0])
        chunks = self.plan(examples, mine)
        micro_steps = max(1, *(len(self.plan(examples, s)) for s in shares))
        loss_sum = 0.0
        for micro in range(micro_steps):
            chunk = chunks[micro] if micro < len(chunks) else []
            if not chunk:  # keep every rank's backward count equal (see PolicyTrainer)
                nll, _ = self._nll_sum([examples[part[0]]])
                self.backend.backward(nll * 0.0)
                continue
            nll, _ = self._nll_sum([examples[i] for i in chunk])
            loss = nll / max(total_tokens, 1.0)
            self.backend.backward(loss)
            loss_sum += float(loss.detach())
        grad_norm = self.backend.step()
        loss_total = float(self.backend.all_reduce_sum(torch.tensor([loss_sum], dtype=torch.float64))[0])
        seconds = time.perf_counter() - started
        return {"sft/loss": loss_total, "sft/tokens": total_tokens, "sft/grad_norm": grad_norm, "sft/lr": self.backend.learning_rate,
                "sft/tokens_per_s": total_tokens / max(seconds, 1e-9)}
