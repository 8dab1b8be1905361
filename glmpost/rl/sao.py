"""SAO: single-rollout asynchronous optimisation with a critic (brief, "SAO：一条轨迹完成就训练").

Group size 1: every finished trajectory trains as it is, and the critic ``V_phi`` restores the
baseline a group gave GRPO. One update on a batch, after the brief's pseudo-code:

1. **prepare**, on the weights as they are: the critic's value of every position, the trajectory's
   reward at its last action token, skip-observation GAE
   (:func:`~glmpost.rl.advantages.skip_observation_gae`) giving each action token's advantage (the
   ``gae`` estimator reads it as the ``gae_advantages`` token field) and return (the critic's
   target); then the policy's old log-probs and DIS mask (:meth:`PolicyTrainer.prepare`).
2. **before each policy optimizer step**, ``critic_steps`` (K; the paper's 2) critic optimizer steps on
   the same mini-batch: :func:`~glmpost.rl.losses.value_loss` (PPO value clipping optional), summed
   over the mini-batch's action tokens and divided by their number on every rank, with the critic's
   attention frozen (:func:`~glmpost.rl.critic.freeze_critic`);
3. **the policy step**: the DIS mask, ``-r A`` on the kept tokens, token-level normalisation over
   the whole mini-batch (:class:`~glmpost.rl.trainer.PolicyTrainer` with ``gae`` + ``dis`` + ``dis_policy``).

A trajectory that CompactionRL compacted trains as one example per context window: GAE runs within
each window (the reward at its last action token: a summary's window ends with the summary), and
the ``cross_segment`` scaling multiplies each window's advantages by ``(gamma * lambda)^{N_{>s}}``
(brief, "CompactionRL"); the critic learns the windows' local returns.

Advantages and returns come from the critic before its K steps (the pseudo-code computes ``adv``
first); its faster updates serve the next trajectories.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from glmpost.config import SettingError, setting
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.rl.advantages import skip_observation_gae
from glmpost.rl.batches import TrainExample
from glmpost.rl.configs import PolicyGradientConfig
from glmpost.rl.critic import DEFAULT_TRAINED, ValueModel, critic_values
from glmpost.rl.distributed import OptimizerConfig
from glmpost.rl.losses import masked_sum_over, value_loss
from glmpost.rl.micro_batches import collate, fit, micro_batch_plan
from glmpost.rl.trainer import PolicyTrainer, PreparedUpdate

OPTIONAL_CRITIC_GROUPS = ("attention",)


@dataclass
class SAOConfig(PolicyGradientConfig):
    """An SAO update: the policy's settings (DIS by default) and the critic's."""

    trust_mask: list[str] = setting(
        ["dis"], "Trust masks ANDed into the action mask, by name (repeat for several): dis (brief, SAO's first "
        "stability mechanism: r = pi_theta / pi_rollout, a token is kept iff 1 - dis-low < r < 1 + dis-high on the "
        "weights of each optimizer step, the policy term -m r A) and, as well, icepop (train vs rollout engine on "
        "the weights before the update).", flag="--trust-mask")
    gamma: float = setting(1.0, "Discount of skip-observation GAE (ours: 1.0, verl's PPO default; the brief gives none).",
                           min=0.0, max=1.0)
    gae_lambda: float = setting(1.0, "lambda of skip-observation GAE (ours: 1.0, verl's PPO default; the brief gives none).",
                                flag="--lambda", min=0.0, max=1.0)
    critic_steps: int = setting(2, "Critic optimizer steps before each policy optimizer step (brief, SAO: K > 1; the "
                                "paper's K = 2).", min=1)
    critic_lr: float = setting(1e-5, "The critic's AdamW learning rate.")
    critic_weight_decay: float = setting(0.0, "The critic's AdamW weight decay.", min=0.0)
    critic_grad_clip: float = setting(1.0, "Clip the critic's global gradient norm to this; 0 disables.", min=0.0)
    value_clip: Optional[float] = setting(
        None, "PPO value clipping: a value's loss is the larger of the plain one and the one of the value kept within "
        "this distance of the value before the update (unset: no clipping).", min=0.0)
    critic_train: list[str] = setting(
        [], "Critic parameters frozen by default to train as well (repeat for several): attention (every self_attn "
        "parameter, the DSA indexer among them; the brief freezes them: the value model's full-attention gradients "
        "are the unstable ones). The value head and the MLP / MoE projections always train.", flag="--critic-train")

    def validate(self) -> None:
        super().validate()
        self._require({"critic_lr": self.critic_lr > 0}, critic_lr="> 0")
        unknown = [group for group in self.critic_train if group not in OPTIONAL_CRITIC_GROUPS]
        if unknown:
            raise SettingError("critic_train", unknown[0], f"is not one of {', '.join(OPTIONAL_CRITIC_GROUPS)}")

    def advantage_estimator(self) -> str:
        return "gae"

    def advantage_scalings(self) -> tuple[str, ...]:
        return ("cross_segment",)

    def segment_decay_base(self) -> float:
        """CompactionRL (brief): a compacted trajectory's segments run GAE locally (each window's last
        action token bootstraps from the final reward), then scale it by ``(gamma * lambda)^{N_{>s}}``."""
        return self.gamma * self.gae_lambda

    def critic_groups(self) -> tuple[str, ...]:
        """The critic parameter groups that train (:data:`~glmpost.rl.critic.CRITIC_GROUPS`)."""
        return tuple(dict.fromkeys(DEFAULT_TRAINED + tuple(self.critic_train)))

    def critic_optimizer(self) -> OptimizerConfig:
        """What the critic's optimisation backend reads."""
        return OptimizerConfig(lr=self.critic_lr, weight_decay=self.critic_weight_decay, adam_beta1=self.adam_beta1,
                               adam_beta2=self.adam_beta2, grad_clip=self.critic_grad_clip, lr_schedule=self.lr_schedule,
                               min_lr_ratio=self.min_lr_ratio,  # the policy's schedule in policy steps (K critic steps each)
                               lr_warmup_steps=self.lr_warmup_steps * self.critic_steps,
                               lr_decay_steps=self.lr_decay_steps * self.critic_steps)


@dataclass
class CriticTargets:
    """Per owned example (by global index), float32 ``[L_i - 1]``: the returns the critic learns and
    its values before the update (value clipping's anchor); ``metrics``: the batch's statistics."""

    returns: dict[int, torch.Tensor]
    old_values: dict[int, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


def _mean_std(count: float, total: float, squares: float) -> tuple[float, float]:
    if count <= 0:
        return 0.0, 0.0
    mean = total / count
    return mean, math.sqrt(max(squares / count - mean * mean, 0.0))


def explained_variance(count: float, returns: float, returns_sq: float, errors: float, errors_sq: float) -> float | None:
    """``1 - Var(R - V) / Var(R)`` over action tokens, from the token count and the sums of ``R``,
    ``R^2``, ``R - V`` and ``(R - V)^2`` (so ranks reduce sums); None when the returns do not vary."""
    _, returns_std = _mean_std(count, returns, returns_sq)
    _, errors_std = _mean_std(count, errors, errors_sq)
    return 1.0 - errors_std**2 / returns_std**2 if returns_std > 0 else None


class CriticTrainer:
    """The critic's half of an SAO update (the module doc): targets on the weights before the
    update, then K optimizer steps on each of the policy's mini-batches (this rank's share)."""

    def __init__(self, critic: ValueModel, backend: Any, config: SAOConfig, *, pad_token_id: int):
        self.critic, self.backend, self.config, self.pad_token_id = critic, backend, config, pad_token_id
        self.device = next(critic.parameters()).device

    def _batches(self, examples: Sequence[TrainExample], indices: Sequence[int], passes: int):
        """``(chunk, micro-batch)`` of ``indices``, then ``(None, examples[0])`` filler passes up to
        ``passes`` (ZeRO-3 gathers parameters in every forward: ranks run as many)."""
        done = 0
        for chunk in self.plan(examples, indices):
            yield chunk, collate([examples[i] for i in chunk], pad_token_id=self.pad_token_id, device=self.device)
            done += 1
        for _ in range(done, passes):
            yield None, collate([examples[0]], pad_token_id=self.pad_token_id, device=self.device)

    def plan(self, examples: Sequence[TrainExample], indices: Sequence[int]) -> list[list[int]]:
        """``indices`` as padded micro-batches (:func:`~glmpost.rl.micro_batches.micro_batch_plan`; the
        critic's GAE runs along each row, so its rows are never packed, even when the policy's are)."""
        return micro_batch_plan([len(e.input_ids) for e in examples], indices, size=self.config.micro_batch_size,
                                tokens=self.config.micro_batch_tokens)

    def _values(self, batch) -> torch.Tensor:
        """The critic's values of ``batch`` (:func:`~glmpost.rl.critic.critic_values`), computed in the run's precision."""
        with self.backend.compute():
            return critic_values(self.critic, batch.input_ids, batch.attention_mask)

    @torch.no_grad()
    def prepare(self, examples: Sequence[TrainExample], mine: Sequence[int]) -> CriticTargets:
        """Values, skip-observation GAE advantages (into each owned example's ``gae_advantages``
        token field) and returns of this rank's examples ``mine``; statistics over every rank."""
        config, world = self.config, self.backend.world_size
        passes = max(len(self.plan(examples, range(rank, len(examples), world))) for rank in range(world))
        self.critic.eval()
        returns, old_values = {}, {}
        # tokens, sum A, sum A^2, sum R, sum R^2, sum V, sum (R - V), sum (R - V)^2
        sums = torch.zeros(8, dtype=torch.float64)
        for chunk, batch in self._batches(examples, mine, passes):
            values = self._values(batch)
            if chunk is None:
                continue
            mask = batch.action_mask
            rewards = torch.zeros_like(values)
            last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)  # each row's last action token
            rewards[torch.arange(len(chunk)), last] = torch.tensor([examples[i].reward for i in chunk], dtype=values.dtype)
            advantages, targets = skip_observation_gae(rewards, values, mask, gamma=config.gamma, lam=config.gae_lambda)
            for row, index in enumerate(chunk):
                example, width = examples[index], len(examples[index].input_ids) - 1
                example.token_fields["gae_advantages"] = advantages[row, example.prompt_length - 1 : width].cpu().numpy()
                returns[index], old_values[index] = targets[row, :width].cpu(), values[row, :width].cpu()
            on = mask.double()
            a, r, v = (x.double() * on for x in (advantages, targets, values))
            sums += torch.stack([on.sum(), a.sum(), (a * a).sum(), r.sum(), (r * r).sum(), v.sum(), (r - v).sum(),
                                 ((r - v) ** 2).sum()]).cpu()
        n, a, a2, r, r2, v, e, e2 = self.backend.all_reduce_sum(sums).tolist()
        advantage_mean, advantage_std = _mean_std(n, a, a2)
        return_mean, return_std = _mean_std(n, r, r2)
        metrics = {"sao/advantage_mean": advantage_mean, "sao/advantage_std": advantage_std, "sao/return_mean": return_mean,
                   "sao/return_std": return_std, "sao/value_mean": v / n if n else 0.0,
                   "sao/explained_variance_before": explained_variance(n, r, r2, e, e2)}
        return CriticTargets(returns, old_values, metrics)

    def train_steps(self, examples: Sequence[TrainExample], targets: CriticTargets, shares: list[list[int]],
                    filler: int) -> dict[str, float]:
        """The K critic optimizer steps before a policy step, on this rank's share of its mini-batch
        (``shares``: every rank's; each rank runs as many micro-batches as the busiest)."""
        started = time.perf_counter()
        share = shares[self.backend.rank]
        micro_steps = max(1, *(len(self.plan(examples, s)) for s in shares))
        losses = [self._step(examples, targets, share, micro_steps, filler) for _ in range(self.config.critic_steps)]
        last = losses[-1]
        return {**last, "sao/value_loss_first": losses[0]["sao/value_loss"],
                "sao/critic_optimizer_steps": self.backend.optimizer_steps(), "sao/critic_lr": self.backend.learning_rate,
                "sao/critic_s": time.perf_counter() - started}

    def _step(self, examples: Sequence[TrainExample], targets: CriticTargets, indices: list[int], micro_steps: int,
              filler: int) -> dict[str, float]:
        config = self.config
        self.critic.train()
        local = torch.tensor([sum(int(examples[i].action_mask.sum()) for i in indices)], dtype=torch.float64)
        denominator = float(self.backend.all_reduce_sum(local)[0])
        # value loss, clipped tokens, sum R, sum R^2, sum (R - V), sum (R - V)^2
        sums = torch.zeros(6, dtype=torch.float64)
        chunks = self.plan(examples, indices)
        for micro in range(micro_steps):
            chunk = chunks[micro] if micro < len(chunks) else []
            if not chunk:  # this rank's share ran out: a zero-weighted pass keeps the reductions in step
                batch = collate([examples[filler]], pad_token_id=self.pad_token_id, device=self.device)
                self.backend.backward(self._values(batch).sum() * 0.0)
                continue
            batch = collate([examples[i] for i in chunk], pad_token_id=self.pad_token_id, device=self.device)
            width, mask = batch.action_mask.shape[1], batch.action_mask
            returns = torch.stack([fit(targets.returns[i], width) for i in chunk]).to(self.device)
            old = torch.stack([fit(targets.old_values[i], width) for i in chunk]).to(self.device)
            values = self._values(batch)
            per_token, clipped = value_loss(values, returns, old, clip=config.value_clip)
            loss = masked_sum_over(per_token, mask, denominator)
            self.backend.backward(loss)
            on = mask.double()
            r, err = returns.double() * on, (returns - values.detach()).double() * on
            sums += torch.stack([loss.detach().double(), (clipped & mask).double().sum(), r.sum(), (r * r).sum(), err.sum(),
                                 (err * err).sum()]).cpu()
        grad_norm = self.backend.step()
        loss, clipped, r, r2, e, e2 = self.backend.all_reduce_sum(sums).tolist()
        return {"sao/value_loss": loss, "sao/value_clip_fraction": clipped / denominator if denominator else 0.0,
                "sao/explained_variance": explained_variance(denominator, r, r2, e, e2), "sao/critic_grad_norm": grad_norm}


@dataclass
class SAOPrepared:
    update: PreparedUpdate
    targets: CriticTargets


class SAOTrainer:
    """The :class:`~glmpost.rl.jobs.Trainer` of ``train-sao``: a :class:`CriticTrainer` and a
    :class:`PolicyTrainer` whose every optimizer step follows K critic steps (the module doc)."""

    def __init__(self, actor: PolicyTrainer, critic: CriticTrainer):
        self.actor, self.critic, self.backend = actor, critic, actor.backend

    def prepare(self, examples: Sequence[TrainExample],
                distribution: ScoredDistribution = ScoredDistribution()) -> SAOPrepared:
        mine = list(range(self.backend.rank, len(examples), self.backend.world_size))
        targets = self.critic.prepare(examples, mine)  # first: the policy's estimator reads its advantages
        update = self.actor.prepare(examples, distribution)
        update.diagnostics.update(targets.metrics)
        return SAOPrepared(update, targets)

    def steps(self, prepared: SAOPrepared) -> int:
        return self.actor.steps(prepared.update)

    def train(self, prepared: SAOPrepared, *, start_step: int = 0,
              on_step: Callable[[int, dict], None] | None = None) -> list[dict[str, float]]:
        examples = prepared.update.examples

        def counted(step: int, metrics: dict) -> None:
            metrics["sao/actor_optimizer_steps"] = self.backend.optimizer_steps()
            if on_step is not None:
                on_step(step, metrics)

        return self.actor.train(prepared.update, start_step=start_step, on_step=counted,
                                before_step=lambda shares, filler: self.critic.train_steps(
                                    examples, prepared.targets, shares, filler))
