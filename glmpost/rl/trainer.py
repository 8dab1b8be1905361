"""The GRPO trainer: group advantages, IcePop-masked clipped policy loss, global token-mean.

One call of :meth:`GRPOTrainer.train` is one policy update of GLM-5's Reasoning RL (brief,
"Reasoning RL：相对奖励与可信 token"): recompute the old log-probs of the exact rollout tokens with
the training engine on the same weights, build the IcePop trust mask against the rollout
log-probs, then run ``epochs`` passes of ``mini_batches`` optimizer steps over the batch.

The loss of a mini-batch is a sum over its trusted action tokens divided by their number *in the
whole mini-batch across all data-parallel ranks*, so the gradient does not depend on how records
are split into micro-batches or ranks (a 2-process run matches a 1-process run).

:class:`OPDTrainer` is the same update with another advantage source (the hooks
``_token_advantages``, ``_train_forward`` and ``_extra_loss``): on-policy distillation's per-token
teacher advantage and MOPD's top-k loss (:mod:`glmpost.rl.opd`).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from glmpost.rl.algorithms import (
    clipped_policy_loss,
    group_advantages,
    icepop_mask,
    k3_kl,
    masked_sum_over,
)
from glmpost.rl.distributed import LocalBackend, OptimizerConfig
from glmpost.closure.logprobs import DEFAULT_CHUNK_SIZE, sequence_log_probs
from glmpost.rl.opd import opd_advantages, sampled_reverse_kl, score_tokens, topk_reverse_kl

TRAINABLE_STATUSES = ("completed", "truncated")


@dataclass
class GRPOConfig(OptimizerConfig):
    """Defaults are GLM-5's Reasoning RL values where the brief gives them."""

    epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 8
    eps_low: float = 0.2  # PPO clip, brief: eps_l = 0.2
    eps_high: float = 0.28  # brief: eps_h = 0.28
    icepop: bool = True
    icepop_beta: float = 2.0  # brief: beta = 2
    advantage_eps: float = 1e-6
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        self._require({
            "epochs": self.epochs >= 1,
            "mini_batches": self.mini_batches >= 1,
            "micro_batch_size": self.micro_batch_size >= 1,
            "eps_low": 0 <= self.eps_low < 1,
            "eps_high": self.eps_high >= 0,
            "icepop_beta": self.icepop_beta >= 1,
            "temperature": self.temperature > 0,
            "kl_coef": self.kl_coef >= 0,
        })


@dataclass
class TrainExample:
    """One trajectory as the trainer needs it."""

    input_ids: list[int]
    prompt_length: int
    action_mask: np.ndarray  # bool [T]
    rollout_log_probs: np.ndarray  # float32 [T]
    advantage: float
    group_id: str
    domain: str = ""
    teacher: str = ""
    # Further per-response-token arrays ([T] or [T, k]) that collate lays out like rollout_log_probs,
    # e.g. the teacher's log-probs for on-policy distillation.
    token_fields: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class PreparedBatch:
    """Records turned into examples, with what was left out and why."""

    examples: list[TrainExample]
    rewards: np.ndarray
    excluded: dict[str, int] = field(default_factory=dict)
    zero_advantage_groups: int = 0
    groups: int = 0


def usable_records(records: Sequence[dict[str, Any]], *, need_reward: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The records an update trains on, and how many of the rest were excluded and why: a failed
    rollout (status), a NaN reward (only when the update uses rewards), no action token."""
    excluded = {"nan_reward": 0, "status": 0, "no_actions": 0}
    usable = []
    for record in records:
        if record["status"] not in TRAINABLE_STATUSES:
            excluded["status"] += 1
        elif need_reward and not math.isfinite(record["reward"]):
            excluded["nan_reward"] += 1
        elif not (record["action_mask"] & ~record["observation_mask"]).any():
            excluded["no_actions"] += 1
        else:
            usable.append(record)
    return usable, excluded


def train_example(record: dict[str, Any], advantage: float, **extra: Any) -> TrainExample:
    """A record as the trainer sees it: prompt + response ids, the action tokens it optimises."""
    return TrainExample(
        input_ids=record["prompt_token_ids"].tolist() + record["response_token_ids"].tolist(),
        prompt_length=len(record["prompt_token_ids"]),
        action_mask=record["action_mask"] & ~record["observation_mask"],
        rollout_log_probs=record["rollout_log_probs"],
        advantage=float(advantage),
        group_id=record["group_id"],
        **extra,
    )


def prepare_batch(records: Sequence[dict[str, Any]], *, advantage_eps: float = 1e-6) -> PreparedBatch:
    """Group advantages over usable records; NaN rewards and failed rollouts are excluded and counted."""
    usable, excluded = usable_records(records, need_reward=True)
    rewards = np.array([r["reward"] for r in usable], dtype=np.float64)
    groups = [r["group_id"] for r in usable]
    if usable:
        advantages, zero_signal = group_advantages(torch.from_numpy(rewards), groups, eps=advantage_eps)
    else:
        advantages, zero_signal = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    examples = [train_example(r, a) for r, a in zip(usable, advantages.tolist())]
    zero_groups = {g for g, z in zip(groups, zero_signal.tolist()) if z}
    return PreparedBatch(examples, rewards, excluded, len(zero_groups), len(set(groups)))


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L] right-padded
    attention_mask: torch.Tensor  # [B, L]
    action_mask: torch.Tensor  # bool [B, L-1]: entry t scores input_ids[t+1], a response action
    rollout_log_probs: torch.Tensor  # float32 [B, L-1], NaN off actions
    advantages: torch.Tensor  # float32 [B, 1]
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, L-1, ...]: NaN / 0 off responses


def collate(examples: Sequence[TrainExample], *, pad_token_id: int, device: torch.device) -> MicroBatch:
    length = max(len(e.input_ids) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    actions = torch.zeros((batch, length - 1), dtype=torch.bool)
    rollout = torch.full((batch, length - 1), float("nan"), dtype=torch.float32)
    for row, e in enumerate(examples):
        n, p = len(e.input_ids), e.prompt_length
        input_ids[row, :n] = torch.tensor(e.input_ids)
        attention[row, :n] = 1
        # Response token j sits at input position p + j and is predicted by entry p + j - 1.
        actions[row, p - 1 : n - 1] = torch.from_numpy(e.action_mask)
        rollout[row, p - 1 : n - 1] = torch.from_numpy(e.rollout_log_probs.astype(np.float32))
    advantages = torch.tensor([[e.advantage] for e in examples], dtype=torch.float32)
    fields = {}
    for name in examples[0].token_fields:
        first = examples[0].token_fields[name]
        fill = float("nan") if first.dtype.kind == "f" else 0
        laid = torch.full((batch, length - 1, *first.shape[1:]), fill, dtype=torch.from_numpy(first[:0]).dtype)
        for row, e in enumerate(examples):
            p, n = e.prompt_length, len(e.input_ids)
            laid[row, p - 1 : n - 1] = torch.from_numpy(np.ascontiguousarray(e.token_fields[name]))
        fields[name] = laid.to(device)
    return MicroBatch(input_ids.to(device), attention.to(device), actions.to(device), rollout.to(device), advantages.to(device),
                      fields)


@dataclass
class OldPolicyStats:
    """Per owned example (by global index): old log-probs float32 [L-1] and the trust mask bool [L-1]."""

    old_log_probs: dict[int, torch.Tensor]
    trust: dict[int, torch.Tensor]


@dataclass
class PreparedUpdate:
    """A batch with its old-policy log-probs, IcePop mask, reference log-probs and mismatch metrics."""

    examples: list[TrainExample]
    old: OldPolicyStats
    ref: dict[int, torch.Tensor] | None
    mismatch: dict[str, float]


class GRPOTrainer:
    """Runs one GRPO policy update over prepared examples (this rank's share)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: GRPOConfig,
        *,
        pad_token_id: int,
        backend: Any = None,
        reference: torch.nn.Module | None = None,
    ):
        config.validate()
        self.model = model
        self.config = config
        self.pad_token_id = pad_token_id
        self.backend = backend or LocalBackend(model, config)
        self.reference = reference
        self.device = next(model.parameters()).device

    def _log_probs(self, model: torch.nn.Module, batch: MicroBatch, *, entropy: bool = False):
        return sequence_log_probs(
            model,
            batch.input_ids,
            batch.attention_mask,
            score_mask=batch.action_mask,
            temperature=self.config.temperature,
            chunk_size=self.config.chunk_size,
            return_entropy=entropy,
        )

    def _micro_batches(self, examples: Sequence[TrainExample], indices: Sequence[int]):
        size = self.config.micro_batch_size
        for start in range(0, len(indices), size):
            chunk = list(indices[start : start + size])
            yield chunk, collate([examples[i] for i in chunk], pad_token_id=self.pad_token_id, device=self.device)

    @torch.no_grad()
    def old_policy(self, examples: Sequence[TrainExample], indices: Sequence[int]) -> OldPolicyStats:
        """Old log-probs of the rollout tokens with the training engine, and the IcePop mask."""
        self.model.eval()
        old, trust = {}, {}
        for chunk, batch in self._micro_batches(examples, indices):
            result = self._log_probs(self.model, batch)
            mask = batch.action_mask.clone()
            if self.config.icepop:
                # brief: rho = pi_train_old / pi_infer; keep iff 1/beta <= rho <= beta (a mask, not a clamp)
                mask &= icepop_mask(result.log_probs, batch.rollout_log_probs, beta=self.config.icepop_beta)
            for row, index in enumerate(chunk):
                old[index] = result.log_probs[row].cpu()
                trust[index] = mask[row].cpu()
        return OldPolicyStats(old, trust)

    @torch.no_grad()
    def reference_log_probs(self, examples: Sequence[TrainExample], indices: Sequence[int]) -> dict[int, torch.Tensor]:
        out = {}
        for chunk, batch in self._micro_batches(examples, indices):
            result = self._log_probs(self.reference, batch)
            out.update({index: result.log_probs[row].cpu() for row, index in enumerate(chunk)})
        return out

    def prepare(self, examples: Sequence[TrainExample]) -> "PreparedUpdate":
        """What the update needs from the old policy, computed on the weights as they are now.

        Call before loading a resumed run's weights: the old log-probs (and the IcePop mask) belong
        to the policy that produced the rollouts, not to a half-trained one.
        """
        mine = list(range(self.backend.rank, len(examples), self.backend.world_size))
        old = self.old_policy(examples, mine)
        mismatch = self._update_metrics(examples, old)
        ref = self.reference_log_probs(examples, mine) if (self.reference is not None and self.config.kl_coef > 0) else None
        return PreparedUpdate(list(examples), old, ref, mismatch)

    def train(
        self,
        examples: Sequence[TrainExample] | "PreparedUpdate",
        *,
        start_step: int = 0,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Update the policy on the global batch; returns one metrics dict per optimizer step.

        Every rank holds the same global batch, shuffles it into the same mini-batches, and computes
        the examples it owns (global index ``i`` with ``i % world_size == rank``), so any number of
        ranks sees the same mini-batches. Steps before ``start_step`` (a resumed run) are skipped;
        pass the :meth:`prepare` result made before the resumed weights were loaded.
        """
        prepared = examples if isinstance(examples, PreparedUpdate) else self.prepare(examples)
        examples = prepared.examples
        config = self.config
        started = time.perf_counter()
        rank, world = self.backend.rank, self.backend.world_size
        order = list(range(len(examples)))
        history: list[dict[str, float]] = []
        step = 0
        rng = random.Random(config.seed)
        for epoch in range(config.epochs):
            rng.shuffle(order)
            for part in np.array_split(np.array(order, dtype=np.int64), config.mini_batches):
                if step < start_step:
                    step += 1
                    continue
                shares = [[i for i in part.tolist() if i % world == r] for r in range(world)]
                # Every rank runs the same number of backward passes (ZeRO-2/3 reduce in each one).
                micro_steps = max(1, math.ceil(max(len(s) for s in shares) / config.micro_batch_size))
                metrics = self._optimizer_step(examples, shares[rank], micro_steps, int(part[0]), prepared.old, prepared.ref)
                metrics.update(prepared.mismatch)
                metrics["train/epoch"] = epoch
                metrics["train/step"] = step
                metrics["train/elapsed_s"] = time.perf_counter() - started
                history.append(metrics)
                if on_step is not None:
                    on_step(step, metrics)
                step += 1
        return history

    def total_steps(self) -> int:
        return self.config.epochs * self.config.mini_batches

    def steps(self, prepared: "PreparedUpdate") -> int:
        """Optimizer steps of the update (:class:`glmpost.rl.run.Trainer`)."""
        return self.total_steps()

    def _optimizer_step(self, examples, indices, micro_steps: int, filler: int, old: OldPolicyStats, ref) -> dict[str, float]:
        config = self.config
        self.model.train()
        started = time.perf_counter()
        counts = torch.tensor(
            [
                sum(int(old.trust[i].sum()) for i in indices),
                sum(int(examples[i].action_mask.sum()) for i in indices),
            ],
            dtype=torch.float64,
        )
        trusted_total, action_total = self.backend.all_reduce_sum(counts).tolist()
        denominator = trusted_total  # global over ranks and micro-batches: split-invariant gradients
        sums = torch.zeros(7, dtype=torch.float64)  # loss, pg_loss, clipped, entropy, kl, ratio, extra
        for micro in range(micro_steps):
            chunk_idx = indices[micro * config.micro_batch_size : (micro + 1) * config.micro_batch_size]
            if not chunk_idx:
                # This rank's share ran out: a zero-weighted pass over a real example touches the same
                # parameters as the other ranks' passes, so the collective reductions line up.
                batch = collate([examples[filler]], pad_token_id=self.pad_token_id, device=self.device)
                self.backend.backward(self._log_probs(self.model, batch).log_probs.sum() * 0.0)
                continue
            chunk = [examples[i] for i in chunk_idx]
            batch = collate(chunk, pad_token_id=self.pad_token_id, device=self.device)
            width = batch.action_mask.shape[1]
            old_lp = torch.stack([_fit(old.old_log_probs[i], width) for i in chunk_idx]).to(self.device)
            trust = torch.stack([_fit(old.trust[i], width) for i in chunk_idx]).to(self.device)
            result = self._train_forward(batch)
            terms = clipped_policy_loss(
                result.log_probs, old_lp, self._token_advantages(batch, old_lp), eps_low=config.eps_low, eps_high=config.eps_high
            )
            pg = masked_sum_over(terms.losses, trust, denominator)
            loss = pg
            extra_loss, extra_sum = self._extra_loss(batch, result, trust, denominator)
            if extra_loss is not None:
                loss = loss + extra_loss
            kl_sum = torch.zeros((), dtype=torch.float64)
            if ref is not None:
                ref_lp = torch.stack([_fit(ref[i], width) for i in chunk_idx]).to(self.device)
                kl = k3_kl(result.log_probs, ref_lp)
                loss = loss + config.kl_coef * masked_sum_over(kl, trust, denominator)
                kl_sum = torch.where(trust, kl, torch.zeros_like(kl)).sum().detach().double()
            entropy_sum = torch.where(trust, result.entropy, torch.zeros_like(result.entropy)).sum()
            if config.entropy_coef > 0:
                loss = loss - config.entropy_coef * entropy_sum / max(denominator, 1.0)
            self.backend.backward(loss)
            sums += torch.stack([
                loss.detach().double(),
                pg.detach().double(),
                (terms.clipped & trust).sum().double(),
                entropy_sum.detach().double(),
                kl_sum,
                torch.where(trust, terms.ratio, torch.zeros_like(terms.ratio)).sum().double(),
                torch.as_tensor(extra_sum, dtype=torch.float64).detach(),
            ]).cpu()
        grad_norm = self.backend.step()
        totals = self.backend.all_reduce_sum(sums).tolist()
        seconds = time.perf_counter() - started
        per_token = max(trusted_total, 1.0)
        return {
            "train/loss": totals[0],
            "train/pg_loss": totals[1],
            "train/clip_fraction": totals[2] / per_token,
            "train/entropy": totals[3] / per_token,
            "train/kl_ref_k3": totals[4] / per_token,
            "train/ratio_mean": totals[5] / per_token,
            "train/trusted_tokens": trusted_total,
            "train/action_tokens": action_total,
            "train/trusted_fraction": trusted_total / action_total if action_total else 0.0,
            "train/grad_norm": grad_norm,
            "train/action_tokens_per_s": action_total / max(seconds, 1e-9),
            **self._extra_step_metrics(totals[6] / per_token),
        }

    # Hooks a trainer with another advantage source or an extra loss term overrides (OPDTrainer).

    def _train_forward(self, batch: MicroBatch):
        """The policy's forward with grad: per-token ``log_probs`` and ``entropy`` ``[B, L-1]``."""
        return self._log_probs(self.model, batch, entropy=True)

    def _token_advantages(self, batch: MicroBatch, old_log_probs: torch.Tensor) -> torch.Tensor:
        """Advantages broadcastable to ``[B, L-1]``; GRPO's are one per trajectory (``[B, 1]``)."""
        return batch.advantages

    def _extra_loss(self, batch: MicroBatch, result, trust: torch.Tensor, denominator: float):
        """``(loss term or None, its detached sum over trusted tokens)`` added to the policy loss."""
        return None, 0.0

    def _extra_step_metrics(self, extra_per_token: float) -> dict[str, float]:
        return {}

    def _update_metrics(self, examples, old: OldPolicyStats) -> dict[str, float]:
        """Metrics of the batch on the weights before the update (logged with every step)."""
        return self._mismatch_metrics(examples, old)

    def _mismatch_metrics(self, examples, old: OldPolicyStats) -> dict[str, float]:
        """Train-vs-rollout mismatch on the same weights (what IcePop sees)."""
        deltas = []
        for index, old_lp in old.old_log_probs.items():
            example = examples[index]
            start = example.prompt_length - 1
            actions = torch.from_numpy(example.action_mask)
            train = old_lp[start : start + len(actions)][actions]
            rollout = torch.from_numpy(example.rollout_log_probs.astype(np.float32))[actions]
            deltas.append((train - rollout).double())
        delta = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)
        # k3 estimate of KL(pi_infer || pi_train) from tokens sampled by the rollout engine:
        # r = pi_train / pi_infer, k3 = r - 1 - log r.
        sums = torch.tensor(
            [delta.abs().sum(), (torch.exp(delta) - delta - 1).sum(), float(delta.numel())], dtype=torch.float64
        )
        total = self.backend.all_reduce_sum(sums).tolist()
        count = max(total[2], 1.0)
        return {
            "train/mismatch_abs_logp_mean": total[0] / count,
            "train/mismatch_k3_kl": total[1] / count,
        }


# --------------------------------------------------------------------------------------------
# On-policy distillation: the same update with the teacher's per-token advantage (glmpost.rl.opd)

OPD_LOSSES = ("sampled", "topk")


@dataclass
class OPDConfig(GRPOConfig):
    """OPD / MOPD update (brief, "OPD：把教师变成逐 token 优势"): group size 1, advantages from the teacher.

    ``loss = "sampled"``: ``A_t = sg(log pi_T - log pi_theta) + w * A_task`` in the clipped
    policy-gradient loss; ``"topk"``: the reverse KL over the teacher's top-k set with the MOPD
    ``pi_T - pi_theta`` correction (plus ``w * A_task`` in the policy-gradient term).
    """

    loss: str = "sampled"
    task_advantage_weight: float = 0.0
    topk_correction: bool = True

    def validate(self) -> None:
        super().validate()
        if self.loss not in OPD_LOSSES:
            raise ValueError(f"loss = {self.loss!r} is not one of {', '.join(OPD_LOSSES)}")
        self._require({"task_advantage_weight": self.task_advantage_weight >= 0})


def prepare_opd_batch(
    records: Sequence[dict[str, Any]], *, loss: str = "sampled", task_advantage_weight: float = 0.0, advantage_eps: float = 1e-6
) -> PreparedBatch:
    """Scored records as OPD examples: the teacher payload rides along in ``token_fields``.

    Failed rollouts and records without action tokens are excluded and counted; with a task
    advantage weight, records with a NaN reward are too, and the task advantage is GRPO's group
    advantage over ``group_id`` (0 for a group of one).
    """
    usable, excluded = usable_records(records, need_reward=task_advantage_weight > 0)
    groups = [r["group_id"] for r in usable]
    rewards = np.array([r["reward"] for r in usable if "reward" in r], dtype=np.float64)
    advantages = [0.0] * len(usable)
    zero_groups: set[str] = set()
    if task_advantage_weight > 0 and usable:
        values, zero_signal = group_advantages(torch.from_numpy(rewards), groups, eps=advantage_eps)
        advantages = values.tolist()
        zero_groups = {g for g, z in zip(groups, zero_signal.tolist()) if z}
    fields = ("teacher_log_probs",) + (("teacher_topk_ids", "teacher_topk_log_probs") if loss == "topk" else ())
    examples = [
        train_example(r, a, domain=r.get("domain", ""), teacher=str(r["teacher"].get("id", "")),
                      token_fields={name: r[name] for name in fields})
        for r, a in zip(usable, advantages)
    ]
    return PreparedBatch(examples, rewards, excluded, len(zero_groups), len(set(groups)))


class OPDTrainer(GRPOTrainer):
    """GRPO's update machinery (old log-probs, IcePop, PPO ratio, split-invariant token mean,
    DeepSpeed backends, resume) with OPD advantages; per-domain teacher KL in every step's metrics.

    The advantage uses the old log-probs the trainer recomputes on the weights before the update:
    ``log pi_theta^train`` of the brief's formula, fixed (stop-gradient) for the whole update.
    """

    config: OPDConfig

    def _train_forward(self, batch: MicroBatch):
        if self.config.loss != "topk":
            return super()._train_forward(batch)
        return score_tokens(
            self.model, batch.input_ids, batch.attention_mask, score_mask=batch.action_mask,
            temperature=self.config.temperature, chunk_size=self.config.chunk_size, return_entropy=True,
            gather_ids=batch.token_fields["teacher_topk_ids"].long(),
        )

    def _token_advantages(self, batch: MicroBatch, old_log_probs: torch.Tensor) -> torch.Tensor:
        weight = self.config.task_advantage_weight
        if self.config.loss == "topk":
            return weight * batch.advantages
        return opd_advantages(batch.token_fields["teacher_log_probs"], old_log_probs, batch.action_mask,
                              task_advantages=batch.advantages, task_weight=weight)

    def _extra_loss(self, batch: MicroBatch, result, trust: torch.Tensor, denominator: float):
        if self.config.loss != "topk":
            return None, 0.0
        per_token = topk_reverse_kl(result.gathered, batch.token_fields["teacher_topk_log_probs"], trust,
                                    correction=self.config.topk_correction)
        return masked_sum_over(per_token, trust, denominator), per_token.detach().sum()

    def _extra_step_metrics(self, extra_per_token: float) -> dict[str, float]:
        return {"train/topk_kl": extra_per_token} if self.config.loss == "topk" else {}

    def _update_metrics(self, examples, old: OldPolicyStats) -> dict[str, float]:
        """Mismatch metrics plus ``teacher_kl/<domain>``: mean of log pi_theta - log pi_T over the
        domain's action tokens (sampled reverse KL to the routed teacher, before the update)."""
        metrics = super()._update_metrics(examples, old)
        domains = sorted({e.domain for e in examples})
        sums = torch.zeros(2 * len(domains), dtype=torch.float64)
        for index, old_lp in old.old_log_probs.items():
            example = examples[index]
            start = example.prompt_length - 1
            actions = torch.from_numpy(example.action_mask)
            student = old_lp[start : start + len(actions)]
            teacher = torch.from_numpy(example.token_fields["teacher_log_probs"].astype(np.float32))
            kl = sampled_reverse_kl(student, teacher, actions)
            d = domains.index(example.domain)
            sums[2 * d] += kl.sum()
            sums[2 * d + 1] += float(actions.sum())
        total = self.backend.all_reduce_sum(sums).tolist()
        for d, domain in enumerate(domains):
            name = domain or "none"
            metrics[f"teacher_kl/{name}"] = total[2 * d] / max(total[2 * d + 1], 1.0)
            metrics[f"teacher_tokens/{name}"] = total[2 * d + 1]
        metrics["train/teacher_kl"] = sum(total[0::2]) / max(sum(total[1::2]), 1.0)
        return metrics


def _fit(values: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad or cut a per-example ``[L_i - 1]`` tensor to the micro-batch width."""
    if values.shape[0] >= width:
        return values[:width]
    pad = torch.zeros(width - values.shape[0], dtype=values.dtype)
    return torch.cat([values, pad])
