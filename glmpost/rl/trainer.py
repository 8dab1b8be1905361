"""The policy trainer: one update of the policy from a batch of trajectories, composed by name.

One call of :meth:`PolicyTrainer.train` is one policy update (brief, "Reasoning RL：相对奖励与可信
token"; "OPD：把教师变成逐 token 优势"): recompute the old log-probs of the exact rollout tokens with
the training engine on the same weights, AND the trust masks into the action mask, then run
``epochs`` passes of ``mini_batches`` optimizer steps over the batch. What it optimises comes from
registries, chosen by the config: the advantage estimator (:mod:`glmpost.rl.advantages`), the trust
masks (:mod:`glmpost.kernel.trust_masks`), the loss terms (:mod:`glmpost.rl.losses`) and the batch
diagnostics (:mod:`glmpost.rl.diagnostics`). GRPO (:class:`GRPOConfig`) is ``grpo`` + ``icepop`` +
``policy`` (or ``gspo`` / ``cispo``); OPD / MOPD (:class:`OPDConfig`) is ``opd`` (or ``task`` with the
``topk_reverse_kl`` term) + ``icepop`` + ``policy``. An importance correction (``tis``, ``seq-tis``, ``mis``:
:data:`~glmpost.kernel.trust_masks.IMPORTANCE_CORRECTIONS`) is taken with the masks, before the update:
its weights multiply the advantages (so the policy term), its rejections join the mask.

The loss of a mini-batch is a sum over its trusted action tokens divided by their number (or, with
``loss_denominator = "action"``, by the number of all its action tokens) *in the
whole mini-batch across all data-parallel ranks*, so the gradient does not depend on how records
are split into micro-batches or ranks (a 2-process run matches a 1-process run). How the tokens are
weighed is the registered loss normalisation ``config.loss_normalization`` names
(:data:`~glmpost.rl.losses.LOSS_NORMALIZATIONS`: ``token``, CompactionRL's, or ``segment``, each
example's mean first); an example is a context window of a record (a compacted record has several),
and the estimator's advantages pass through the scalings ``config.advantage_scalings()`` names
(``cross_segment``: ``(gamma*lambda)^{N_{>s}}``). Step metrics are named sums, reduced over ranks
once per step.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.kernel.scoring import score_tokens
from glmpost.kernel.trust_masks import IMPORTANCE_CORRECTIONS, TRUST_MASKS, correction_counts, correction_metrics
from glmpost.rl.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALINGS
from glmpost.rl.batches import TrainExample
from glmpost.rl.configs import PER_STEP_MASKS, GRPOConfig
from glmpost.rl.diagnostics import BATCH_DIAGNOSTICS
from glmpost.rl.distributed import TorchBackend
from glmpost.rl.losses import LOSS_NORMALIZATIONS, LOSS_TERMS, LossInputs, masked_sum_over, trusted_sum
from glmpost.rl.micro_batches import MicroBatch, collate, micro_batch_plan, pack
from glmpost.rl.routing_replay import replay_context, replay_counts, replay_metrics


@dataclass
class OldPolicyStats:
    """Per owned example (by global index): old log-probs float32 [L-1] and the trust mask bool [L-1]."""

    old_log_probs: dict[int, torch.Tensor]
    trust: dict[int, torch.Tensor]  # the first optimizer step's final mask
    base_trust: dict[int, torch.Tensor] = None  # the update-start masks alone (before the per-step ones)
    importance: dict[int, torch.Tensor] | None = None  # the importance correction's weights float32 [L-1] (None: off)


@dataclass
class PreparedUpdate:
    """A batch with its old-policy log-probs, trust mask, reference log-probs and diagnostics, and the
    distribution every log-prob of the update is taken under (the records' rollout log-probs')."""

    examples: list[TrainExample]
    old: OldPolicyStats
    ref: dict[int, torch.Tensor] | None
    diagnostics: dict[str, float]
    distribution: ScoredDistribution = ScoredDistribution()


class PolicyTrainer:
    """Runs one policy update over prepared examples (this rank's share), composed from the
    registries by the config's names; it holds no algorithm of its own."""

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
        self.backend = backend or TorchBackend(model, config)
        self.reference = reference
        self.device = next(model.parameters()).device
        self.estimator = ADVANTAGE_ESTIMATORS[config.advantage_estimator()]
        self.scalings = [ADVANTAGE_SCALINGS[name] for name in config.advantage_scalings()]
        self.normalization = LOSS_NORMALIZATIONS[config.loss_normalization]
        correction = config.importance_correction_name()
        self.correction = None if correction is None else IMPORTANCE_CORRECTIONS[correction]
        # Masks of two engines on the same weights are taken once, before the update; DIS judges the
        # policy being optimised, so it is taken again on the weights of every later optimizer step.
        self.masks = [TRUST_MASKS[name] for name in config.trust_masks() if name not in PER_STEP_MASKS]
        self.step_masks = [TRUST_MASKS[name] for name in config.trust_masks() if name in PER_STEP_MASKS]
        self.terms = [LOSS_TERMS[name] for name in config.loss_terms()]
        self.diagnostics = [BATCH_DIAGNOSTICS[name] for name in config.diagnostics()]
        if "kl" in config.loss_terms() and reference is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        gathers = {term.gather for term in self.terms if term.gather}
        if len(gathers) > 1:
            raise ValueError(f"loss terms gather different ids: {sorted(gathers)}")
        self.gather = gathers.pop() if gathers else None
        # Every rank sums the same names in the same order, whatever its share of the batch.
        self.metric_names = sorted({"train/loss", "train/entropy", *(t.logged_as for t in self.terms if t.logged_as),
                                    *(name for t in self.terms for name in t.metrics)})

    def _log_probs(self, model: torch.nn.Module, batch: MicroBatch, distribution: ScoredDistribution, *,
                   entropy: bool = False):
        with self.backend.compute(), self._replay(batch, model) as session:
            self.routing_session = session
            return self._sequence_log_probs(model, batch, distribution, entropy=entropy)

    def _replay(self, batch: MicroBatch, model: torch.nn.Module | None = None):
        """The policy's forward of ``batch`` with the records' experts replayed (``routing_replay``;
        :mod:`glmpost.rl.routing_replay`): the old log-probs, the masks and the loss all see it."""
        return replay_context(self.model, batch, self.config.routing_replay and model in (None, self.model))

    def _sequence_log_probs(self, model: torch.nn.Module, batch: MicroBatch, distribution: ScoredDistribution, *,
                            entropy: bool):
        return sequence_log_probs(
            model,
            batch.input_ids,
            batch.attention_mask,
            position_ids=batch.position_ids,
            score_mask=batch.action_mask,
            temperature=distribution.temperature,
            top_k=distribution.top_k,
            top_p=distribution.top_p,
            chunk_size=self.config.chunk_size,
            return_entropy=entropy,
        )

    def _train_forward(self, batch: MicroBatch, distribution: ScoredDistribution):
        """The policy's forward with grad: per-token ``log_probs`` and ``entropy`` ``[B, L-1]``, and the
        log-probs of the ids a loss term gathers (``gathered`` ``[B, L-1, k]``)."""
        if self.gather is None:
            return self._log_probs(self.model, batch, distribution, entropy=True)
        with self.backend.compute():
            return score_tokens(
                self.model, batch.input_ids, batch.attention_mask, position_ids=batch.position_ids,
                score_mask=batch.action_mask, temperature=distribution.temperature, top_k=distribution.top_k,
                top_p=distribution.top_p,
                chunk_size=self.config.chunk_size, return_entropy=True,
                gather_ids=batch.token_fields[self.gather].long(),
            )

    def plan(self, examples: Sequence[TrainExample], indices: Sequence[int]) -> list[list[int]]:
        """``indices`` as micro-batches (:func:`~glmpost.rl.micro_batches.micro_batch_plan`: a count, or a
        token budget, padded or packed)."""
        return micro_batch_plan([len(e.input_ids) for e in examples], indices, size=self.config.micro_batch_size,
                                tokens=self.config.micro_batch_tokens, pack=self.config.pack_sequences)

    def micro_batch(self, examples: Sequence[TrainExample]) -> MicroBatch:
        """``examples`` laid out as the config says: packed into one row, or one right-padded row each."""
        lay_out = pack if self.config.pack_sequences else collate
        return lay_out(examples, pad_token_id=self.pad_token_id, device=self.device)

    def _micro_batches(self, examples: Sequence[TrainExample], indices: Sequence[int]):
        for chunk in self.plan(examples, indices):
            yield chunk, self.micro_batch([examples[i] for i in chunk])

    @torch.no_grad()
    def old_policy(self, examples: Sequence[TrainExample], indices: Sequence[int],
                   distribution: ScoredDistribution) -> OldPolicyStats:
        """Old log-probs of the rollout tokens with the training engine (under ``distribution``), and
        the trust mask (the per-step masks on these weights: the first step's)."""
        self.model.eval()
        old, trust, base, importance = {}, {}, {}, {}
        self.routing_totals = torch.zeros(5, dtype=torch.float64)
        self.correction_totals = torch.zeros(4, dtype=torch.float64)
        for chunk, batch in self._micro_batches(examples, indices):
            result = self._log_probs(self.model, batch, distribution)
            self.routing_totals += replay_counts(self.routing_session, batch)
            mask = batch.action_mask.clone()
            for trust_mask in self.masks:
                mask &= trust_mask(result.log_probs, batch.rollout_log_probs, self.config)[0]
            if self.correction is not None:  # a weight on the policy term, and MIS's sequence rejection in the mask
                weights, keep = self.correction(result.log_probs, batch.rollout_log_probs, batch.action_mask,
                                                batch.example_ids(), self.config)
                self.correction_totals += correction_counts(weights, keep, batch.action_mask)
                mask &= keep
                importance.update({index: w.cpu() for index, w in zip(chunk, batch.per_example(weights))})
            stepped = self._with_step_masks(mask, result.log_probs, batch)
            for index, log_probs, final, start in zip(chunk, batch.per_example(result.log_probs),
                                                      batch.per_example(stepped), batch.per_example(mask)):
                old[index], trust[index], base[index] = log_probs.cpu(), final.cpu(), start.cpu()
        return OldPolicyStats(old, trust, base, importance if self.correction is not None else None)

    def _with_step_masks(self, mask: torch.Tensor, log_probs: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        for trust_mask in self.step_masks:
            mask = mask & trust_mask(log_probs, batch.rollout_log_probs, self.config)[0]
        return mask

    @torch.no_grad()
    def step_trust(self, examples: Sequence[TrainExample], indices: Sequence[int], old: OldPolicyStats,
                   distribution: ScoredDistribution, *, passes: int = 0, filler: int = 0) -> dict[int, torch.Tensor]:
        """The final mask of an optimizer step after the first: the update-start masks AND the
        per-step masks (DIS) on the weights as they are now. Runs at least ``passes`` forwards (a
        rank whose share ran out scores ``examples[filler]`` and drops it), so ZeRO-3's gathers line
        up across ranks."""
        was_training = self.model.training
        self.model.eval()
        trust, done = {}, 0
        for chunk, batch in self._micro_batches(examples, indices):
            base = batch.lay([old.base_trust[i] for i in chunk], fill=False)
            stepped = self._with_step_masks(base, self._log_probs(self.model, batch, distribution).log_probs, batch)
            trust.update({index: values.cpu() for index, values in zip(chunk, batch.per_example(stepped))})
            done += 1
        for _ in range(done, passes):
            self._log_probs(self.model, collate([examples[filler]], pad_token_id=self.pad_token_id, device=self.device),
                            distribution)
        self.model.train(was_training)
        return trust

    @torch.no_grad()
    def reference_log_probs(self, examples: Sequence[TrainExample], indices: Sequence[int],
                            distribution: ScoredDistribution) -> dict[int, torch.Tensor]:
        out = {}
        for chunk, batch in self._micro_batches(examples, indices):
            result = self._log_probs(self.reference, batch, distribution)
            out.update({index: values.cpu() for index, values in zip(chunk, batch.per_example(result.log_probs))})
        return out

    def prepare(self, examples: Sequence[TrainExample],
                distribution: ScoredDistribution = ScoredDistribution()) -> PreparedUpdate:
        """What the update needs from the old policy, computed on the weights as they are now, every
        log-prob under ``distribution``: the one the records' rollout log-probs are of
        (:class:`~glmpost.rl.admission.Admission`; default: the model's own).

        Call before loading a resumed run's weights: the old log-probs (and the trust mask) belong
        to the policy that produced the rollouts, not to a half-trained one.
        """
        mine = list(range(self.backend.rank, len(examples), self.backend.world_size))
        old = self.old_policy(examples, mine, distribution)
        diagnostics: dict[str, float] = {}
        for diagnostic in self.diagnostics:
            diagnostics.update(diagnostic(examples, old, self.backend.all_reduce_sum))
        if self.config.routing_replay:
            diagnostics.update(replay_metrics(self.backend.all_reduce_sum(self.routing_totals)))
        if self.correction is not None:
            diagnostics.update(correction_metrics(self.backend.all_reduce_sum(self.correction_totals)))
        ref = self.reference_log_probs(examples, mine, distribution) if any(t is LOSS_TERMS["kl"] for t in self.terms) else None
        return PreparedUpdate(list(examples), old, ref, diagnostics, distribution)

    def train(
        self,
        examples: Sequence[TrainExample] | PreparedUpdate,
        *,
        start_step: int = 0,
        on_step: Callable[[int, dict[str, float]], None] | None = None,
        before_step: Callable[[list[list[int]], int], dict[str, float]] | None = None,
    ) -> list[dict[str, float]]:
        """Update the policy on the global batch; returns one metrics dict per optimizer step.

        Every rank holds the same global batch, shuffles it into the same mini-batches, and computes
        the examples it owns (global index ``i`` with ``i % world_size == rank``), so any number of
        ranks sees the same mini-batches. Steps before ``start_step`` (a resumed run) are skipped;
        pass the :meth:`prepare` result made before the resumed weights were loaded.
        ``before_step(shares, filler)`` runs before each policy step on its mini-batch, given every
        rank's share of it (SAO's critic steps); its metrics join the step's.
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
                micro_steps = max(1, *(len(self.plan(examples, s)) for s in shares))
                before = {} if before_step is None else before_step(shares, int(part[0]))
                trust = prepared.old.trust if step == 0 or not self.step_masks else self.step_trust(
                    examples, shares[rank], prepared.old, prepared.distribution, passes=micro_steps, filler=int(part[0]))
                metrics = before | self._optimizer_step(prepared, shares[rank], micro_steps, int(part[0]), trust)
                metrics.update(prepared.diagnostics)
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

    def steps(self, prepared: PreparedUpdate) -> int:
        """Optimizer steps of the update (:class:`glmpost.rl.jobs.Trainer`)."""
        return self.total_steps()

    def _micro_loss(self, batch: MicroBatch, distribution: ScoredDistribution, old_lp: torch.Tensor, trust: torch.Tensor,
                    ref_lp, denominator: float, sums: dict[str, torch.Tensor],
                    weights: torch.Tensor | None = None, importance: torch.Tensor | None = None) -> torch.Tensor:
        """The composed loss of one micro-batch; its named metric sums are added to ``sums``.
        ``weights`` ``[B, L-1]``: each example's weight under the loss normalisation over its entries (None: all 1).
        ``importance`` ``[B, L-1]``: the importance correction's weights ``w >= 0``, folded into the advantages, so
        they weigh the policy term alone (``-min(r w A, clip(r) w A) = w * -min(r A, clip(r) A)``)."""
        forward = self._train_forward(batch, distribution)
        advantages, _ = self.estimator(batch, old_lp, self.config)
        for scaling in self.scalings:
            advantages = scaling(batch, advantages, self.config)
        if importance is not None:
            advantages = advantages * importance
        inputs = LossInputs(forward, old_lp, advantages, trust, batch, ref_lp, self.config)
        loss = None
        for term in self.terms:
            values, metrics = term.fn(inputs)
            if weights is not None:
                values = values * weights.to(values.dtype)
            contribution = masked_sum_over(values, trust, denominator)
            coefficient = term.coefficient(self.config)
            if coefficient != 1.0:
                contribution = coefficient * contribution
            loss = contribution if loss is None else loss + contribution
            if term.logged_as:
                sums[term.logged_as] += contribution.detach().double().cpu()
            for name, value in metrics.items():
                sums[name] += torch.as_tensor(value, dtype=torch.float64).detach().cpu()
        sums["train/loss"] += loss.detach().double().cpu()
        sums["train/entropy"] += trusted_sum(forward.entropy, trust).detach().double().cpu()
        return loss

    def _optimizer_step(self, prepared: PreparedUpdate, indices, micro_steps: int, filler: int,
                        trust_of: dict[int, torch.Tensor]) -> dict[str, float]:
        config, examples, old, ref, distribution = self.config, prepared.examples, prepared.old, prepared.ref, prepared.distribution
        self.model.train()
        started = time.perf_counter()
        trusted = [int(trust_of[i].sum()) for i in indices]
        actions = [int(examples[i].action_mask.sum()) for i in indices]
        weights, local_denominator = self.normalization(
            torch.tensor(trusted if config.loss_denominator == "trusted" else actions, dtype=torch.float64), config)
        weight_of = None if bool((weights == 1.0).all()) else dict(zip(indices, weights.tolist()))
        counts = torch.tensor([sum(trusted), sum(actions), float(local_denominator)], dtype=torch.float64)
        local_trusted = sum(trusted)
        # Global over ranks and micro-batches: split-invariant gradients.
        trusted_total, action_total, denominator = self.backend.all_reduce_sum(counts).tolist()
        sums = {name: torch.zeros((), dtype=torch.float64) for name in self.metric_names}
        used = 0  # trusted tokens the numerators summed over
        chunks = self.plan(examples, indices)
        for micro in range(micro_steps):
            chunk_idx = chunks[micro] if micro < len(chunks) else []
            if not chunk_idx:
                # This rank's share ran out: a zero-weighted pass over a real example touches the same
                # parameters as the other ranks' passes, so the collective reductions line up.
                batch = collate([examples[filler]], pad_token_id=self.pad_token_id, device=self.device)
                with self._replay(batch):
                    self.backend.backward(self._log_probs(self.model, batch, distribution).log_probs.sum() * 0.0)
                continue
            batch = self.micro_batch([examples[i] for i in chunk_idx])
            old_lp = batch.lay([old.old_log_probs[i] for i in chunk_idx])
            trust = batch.lay([trust_of[i] for i in chunk_idx], fill=False)
            used += int(trust.sum())
            ref_lp = None if ref is None else batch.lay([ref[i] for i in chunk_idx])
            weights = None if weight_of is None else batch.spread([weight_of[i] for i in chunk_idx], dtype=torch.float64)
            importance = None if old.importance is None else batch.lay([old.importance[i] for i in chunk_idx], fill=1.0)
            with self._replay(batch):  # open over the backward too: a checkpointed layer recomputes under it
                self.backend.backward(self._micro_loss(batch, distribution, old_lp, trust, ref_lp, denominator, sums, weights,
                                                       importance))
        if used != local_trusted:  # numerator and denominator must count the same final mask (ROLL#444, verl#4852)
            raise RuntimeError(f"the loss summed {used} trusted tokens but its denominator counted {local_trusted}")
        grad_norm = self.backend.step()
        reduced = self.backend.all_reduce_sum(torch.stack([sums[name] for name in self.metric_names])).tolist()
        totals = dict(zip(self.metric_names, reduced))
        seconds = time.perf_counter() - started
        per_token = max(trusted_total, 1.0)
        # Contributions and the loss are totals; every other named sum is a mean per trusted token.
        whole = {"train/loss", *(t.logged_as for t in self.terms if t.logged_as)}
        return {
            **{name: value if name in whole else value / per_token for name, value in totals.items()},
            "train/trusted_tokens": trusted_total,
            "train/action_tokens": action_total,
            "train/trusted_fraction": trusted_total / action_total if action_total else 0.0,
            "train/grad_norm": grad_norm,
            "train/lr": self.backend.learning_rate,
            "train/action_tokens_per_s": action_total / max(seconds, 1e-9),
        }
