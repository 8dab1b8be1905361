"""The embedded rollout engine: batched sampling with a KV cache over a Hugging Face causal LM.

For every sampled token it records the log-prob of the kind ``SamplingParams.log_prob_kind`` names
(:mod:`glmpost.kernel.distribution`): by default under the distribution it was actually sampled
from (temperature, then top-k, then top-p, renormalised) — the rollout ("infer") probability that
IcePop and DIS compare against (DESIGN.md §5). Greedy decoding (temperature 0) samples from a point
mass and records the model's own log-probs (kind ``raw``), as SGLang does.

Reproducibility: each sequence draws from its own ``torch.Generator`` seeded from
``(seed, sequence key)`` (:func:`sequence_seed`) or from an explicit per-sequence seed (what
``glmpost serve`` receives as SGLang's ``sampling_params.sampling_seed``), so a sequence's sample does
not depend on which other sequences share its batch or on ``--shard-index``; the same seed gives the
same tokens bit for bit on the same machine (log-probs bit for bit for the same batch composition).

:meth:`LocalEngine.score` is the prefill-only path (teacher scoring, SGLang's ``max_new_tokens`` 0):
log-probs of given tokens under the model's own distribution, by the trainer's formula
(:func:`glmpost.kernel.logprobs.sequence_log_probs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from glmpost.kernel.continuation import CachedBatch, TurnCaches
from glmpost.kernel.distribution import (
    DEFAULT_LOG_PROB_KIND,
    check_log_prob_kind,
    distribution_log_softmax,
    filter_logits,
    scored_distribution,
)
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.kernel.routing import StepRouting, moe_shape


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; stored verbatim in each record's ``sampling`` map. Immutable once built: a
    variant (a round's seed, the model's stop ids, the servers' log-prob kind) is a new one
    (``dataclasses.replace``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    max_new_tokens: int = 64
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    # What rollout_log_probs are log-probs of (glmpost.kernel.distribution.LOG_PROB_KINDS); greedy
    # decoding always records "raw" (see recorded_kind).
    log_prob_kind: str = DEFAULT_LOG_PROB_KIND

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_log_prob_kind(self.log_prob_kind)

    def recorded_kind(self) -> str:
        """The kind of the log-probs a completion carries: ``raw`` for greedy, else ``log_prob_kind``."""
        return "raw" if self.temperature == 0 else self.log_prob_kind

    def to_json(self) -> dict:
        return {**asdict(self), "log_prob_kind": self.recorded_kind()}

    @classmethod
    def from_record(cls, sampling: dict | None) -> "SamplingParams":
        """A record's ``sampling`` map read back (formats/SPEC.md): an absent field takes its default;
        ``top_k`` 0 or any negative value (SGLang and imported data write -1) is off, as ``top_p`` 1.0
        (or absent) is; an absent ``log_prob_kind`` is ``sampled`` (all glmpost wrote before it existed).

        Raises ValueError naming the field for an unknown ``log_prob_kind``."""
        s = sampling or {}
        top_k = int(s.get("top_k") or 0)
        top_p = s.get("top_p")
        return cls(temperature=float(s.get("temperature", 1.0)), top_p=1.0 if top_p is None else float(top_p),
                   top_k=max(top_k, 0), max_new_tokens=max(1, int(s.get("max_new_tokens", 1) or 1)),
                   seed=int(s.get("seed", 0) or 0), log_prob_kind=_record_kind(s))

    def scored(self):
        """The :class:`~glmpost.kernel.distribution.ScoredDistribution` the recorded log-probs are of
        (ValueError for a greedy record whose kind is not ``raw``: glmpost before log_prob_kind
        recorded 0, the log-prob of the point mass greedy decoding samples from, which nothing can check)."""
        return scored_distribution(self.log_prob_kind, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def _record_kind(sampling: dict) -> str:
    kind = sampling.get("log_prob_kind", DEFAULT_LOG_PROB_KIND)
    try:
        return check_log_prob_kind(kind)
    except ValueError as exc:
        raise ValueError(f"sampling.log_prob_kind: {exc}") from None


@dataclass
class Completion:
    """One sampled response: exact token ids, their sampling log-probs, and why it ended."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (a stop token, included), "length" (max_new_tokens) or "abort" (stopped early)
    # With ``top_logprobs_num`` k > 0: per sampled position, the k most likely token ids of the
    # sampling distribution and their log-probs (ties to the lower id).
    top_ids: list[list[int]] | None = None
    top_log_probs: list[list[float]] | None = None
    # Read from a trajectory's KV cache: the oldest policy version whose keys and values it attended
    # to (None: its prompt was prefilled by the weights that sampled it, or no version is known).
    cache_version: int | None = None
    # The policy version of each token's weights where they differ within the completion (a
    # server's aborted sequence continued after a weight switch); None: one version for all.
    token_versions: list[int] | None = None
    # With ``record_routing``: the MoE experts that chose each token, uint8/uint16 [n, moe_layers, k]
    # (glmpost.kernel.routing; formats/SPEC.md ``routed_experts``).
    routed_experts: object = None


@dataclass
class Scores:
    """Prefill-only scoring of one sequence from position ``start`` (see :meth:`LocalEngine.score`)."""

    log_probs: list[float]  # log p(ids[t] | ids[:t]) for t = start .. len(ids) - 1
    top_ids: list[list[int]] | None = None  # per scored position, the k most likely ids there
    top_log_probs: list[list[float]] | None = None


def sequence_seed(seed: int, key: str) -> int:
    """A 63-bit seed for one sequence, independent of batch layout."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def turn_key(key: str, turn: int) -> str:
    """The seed key of turn ``turn`` of sequence ``key`` (turn 0 keeps ``key``)."""
    return key if turn == 0 else f"{key}#turn{turn}"


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class LocalEngine:
    """In-process sampler over a Hugging Face causal LM (the embedded default rollout engine)."""

    name = "glmpost-local"

    def __init__(self, model, *, batch_size: int = 16, pad_token_id: int = 0, record_routing: bool = False):
        self.model = model.eval()
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        # Record each sampled token's MoE experts (a dense model has none to record).
        self.record_routing = record_routing and moe_shape(model) is not None
        self._cache_kwarg = _cache_kwarg(model)
        # Only the last position's logits are sampled from: skip the [B, L, V] prefill logits.
        accepts = inspect.signature(model.forward).parameters
        self._logits_to_keep = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[str] | None,
        params: SamplingParams,
        *,
        seeds: Sequence[int] | None = None,
        top_logprobs_num: int = 0,
        sessions: Sequence[str] | None = None,
        caches: TurnCaches | None = None,
        abort: Callable[[int], bool] | None = None,
    ) -> list[Completion]:
        """Sample one completion per prompt, in batches of ``batch_size``.

        ``abort(i)``, asked after every decode step, stops prompt ``i`` there: its completion keeps
        the tokens sampled so far, ``finish_reason`` ``abort`` (a server's ``/abort_request``).

        Each sequence's generator is seeded with ``seeds[i]`` when given, else with
        ``sequence_seed(params.seed, keys[i])`` (``keys`` unique per sequence).

        With ``caches``, each batch's KV cache is kept in ``caches`` after the call, and a prompt that
        extends the ids a cached row covers prefills only the new tokens: the row of its session (one
        ``sessions`` name per prompt: a trajectory's turns share it) or, without ``sessions``, the row
        with the longest such prefix (:mod:`glmpost.kernel.continuation`).
        """
        params.validate()
        if seeds is None:
            if keys is None or len(prompts) != len(keys):
                raise ValueError("one key per prompt")
            seeds = [sequence_seed(params.seed, k) for k in keys]
        elif len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        if caches is None:
            plan = [(None, list(range(start, min(start + self.batch_size, len(prompts)))), [])
                    for start in range(0, len(prompts), self.batch_size)]
        elif sessions is not None and len(sessions) != len(prompts):
            raise ValueError("one session per prompt")
        else:
            plan = caches.plan(prompts, sessions, self.batch_size)
        results: list[Completion | None] = [None] * len(prompts)
        for cached, indices, rows in plan:
            batch_prompts = [prompts[i] for i in indices]
            stop_rows = None if abort is None else (lambda indices=indices: [abort(i) for i in indices])
            completions, state = self._generate_batch(batch_prompts, [seeds[i] for i in indices], params,
                                                      top_logprobs_num, cached=cached, rows=rows,
                                                      keep_cache=caches is not None, abort=stop_rows)
            if caches is not None:
                caches.keep(CachedBatch([sessions[i] if sessions is not None else "" for i in indices], *state))
            for index, completion in zip(indices, completions):
                results[index] = completion
        return results

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], *, top_logprobs_num: int = 0) -> list[Scores]:
        """Log-probs of ``sequences[i][starts[i]:]``, each token under its own prefix (temperature 1).

        ``starts[i] >= 1`` (the first token has no prefix). Runs in batches of ``batch_size``, right
        padded, through :func:`glmpost.kernel.logprobs.sequence_log_probs`; the top-k lists come from the
        same forward's full logits.
        """

        if len(sequences) != len(starts):
            raise ValueError("one start per sequence")
        for seq, start in zip(sequences, starts):
            if not 1 <= start <= len(seq):
                raise ValueError(f"start must be in [1, {len(seq)}], got {start}")
        device = self.device
        results: list[Scores] = []
        for first in range(0, len(sequences), self.batch_size):
            chunk, chunk_starts = sequences[first : first + self.batch_size], starts[first : first + self.batch_size]
            width = max(2, max(len(s) for s in chunk))
            ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
                mask[row, : len(seq)] = 1
            ids, mask = ids.to(device), mask.to(device)
            scored = sequence_log_probs(self.model, ids, mask, response_start=torch.tensor(list(chunk_starts), device=device))
            values = scored.log_probs.cpu()
            top = None
            if top_logprobs_num > 0:
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
                top = torch.topk(torch.log_softmax(logits, dim=-1), top_logprobs_num, dim=-1)
                top_values, top_indices = top.values.cpu(), top.indices.cpu()
            for row, (seq, start) in enumerate(zip(chunk, chunk_starts)):
                span = slice(start - 1, len(seq) - 1)  # entry t predicts token t + 1
                results.append(Scores(
                    values[row, span].tolist(),
                    top_indices[row, span].tolist() if top is not None else None,
                    top_values[row, span].tolist() if top is not None else None,
                ))
        return results

    def _start(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh batch: the prompts left padded (every row's next token is at the end) and their mask."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention.to(self.device)

    def _resume(self, cached: CachedBatch, rows: list[int], prompts: Sequence[Sequence[int]]):
        """A batch continuing ``cached``'s ``rows``: their caches and masks, and what each prompt adds to
        the ids its cache covers, left padded as a fresh batch is."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        cached.cache.batch_select_indices(index)
        suffix_ids, suffix_mask = self._start([prompt[len(cached.ids[row]) :] for row, prompt in zip(rows, prompts)])
        return suffix_ids, torch.cat([cached.attention[index], suffix_mask], dim=-1), cached.cache

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], params: SamplingParams,
                        top_logprobs_num: int = 0, *, cached: CachedBatch | None = None, rows: Sequence[int] = (),
                        keep_cache: bool = False, abort: Callable[[], list[bool]] | None = None) -> tuple[list[Completion], tuple]:
        """Sample one batch; with ``keep_cache`` also returns ``(ids, cache, attention)``: what its
        cache covers per row (else ``()``); ``abort()``: the rows to stop after each step."""
        device = self.device
        batch = len(prompts)
        if cached is None:
            step_ids, attention = self._start(prompts)
            cache = None
        else:
            step_ids, attention, cache = self._resume(cached, list(rows), prompts)
        cache_attention = attention
        # One uniform number per sequence and step, drawn up front from the sequence's own generator:
        # a sequence's sample depends on its seed and key only, never on its batch neighbours.
        uniforms = torch.stack([
            torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
            for seed in seeds
        ]).to(device)
        stops = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=device)

        chosen_steps, log_prob_steps, top_steps = [], [], []
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        aborted = torch.zeros(batch, dtype=torch.bool, device=device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        routing = StepRouting(self.model) if self.record_routing else None
        for step in range(params.max_new_tokens):
            with routing.step(batch) if routing else contextlib.nullcontext():
                outputs = self.model(input_ids=step_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                                     **self._logits_to_keep, **({self._cache_kwarg: cache} if cache is not None else {}))
            cache = getattr(outputs, self._cache_kwarg, None) or outputs.past_key_values
            chosen, chosen_log_probs, top = sample_tokens(outputs.logits[:, -1, :].float(), uniforms[:, step], params, top_logprobs_num)
            top_steps.append(top)
            # Rows that already stopped keep decoding (a batch moves together) but record nothing.
            chosen_steps.append(torch.where(finished, -1, chosen))
            log_prob_steps.append(chosen_log_probs)
            finished |= torch.isin(chosen, stops)
            if abort is not None:
                stopped = torch.tensor(abort(), dtype=torch.bool, device=device) & ~finished
                aborted |= stopped
                finished |= stopped
            if bool(finished.all()) or step + 1 == params.max_new_tokens:
                break
            step_ids = chosen.unsqueeze(-1)
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=-1)
            positions = positions[:, -1:] + 1
        recorded = torch.stack(chosen_steps, dim=1)
        results = _completions(recorded, log_prob_steps, top_steps if top_logprobs_num > 0 else None, params)
        for row in aborted.nonzero().flatten().tolist():
            results[row].finish_reason = "abort"
        if routing:
            routing.attach(results)
        if not keep_cache:
            return results, ()
        # The cache holds every token fed after the first forward (all chosen ones but the last); a
        # row attends to those it chose before it stopped.
        fed = recorded[:, :-1]
        cache_attention = torch.cat([cache_attention, (fed >= 0).to(cache_attention.dtype)], dim=-1)
        ids = [list(prompt) + result.token_ids[: fed.shape[1]] for prompt, result in zip(prompts, results)]
        return results, (ids, cache, cache_attention)


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, top_logprobs_num: int = 0):
    """Inverse-CDF sampling of one token per row from the filtered distribution, and its log-prob:
    ``(chosen [N], log_probs [N], top)`` for ``logits [N, V]`` and one uniform number per row
    (:meth:`LocalEngine.generate` draws them from each sequence's generator; ``diff-logprobs`` resamples
    with the same ones).

    The log-probs (and, with ``top_logprobs_num`` k > 0, the k largest of them and their ids; else
    None) are of the recorded kind (``params.recorded_kind()``): by default the sampling
    distribution, for greedy decoding the temperature-1 one.
    """
    if params.temperature == 0:
        chosen = logits.argmax(dim=-1)
        recorded = torch.log_softmax(logits, dim=-1)  # kind "raw"
    else:
        filtered = filter_logits(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        sampling_log_probs = torch.log_softmax(filtered, dim=-1)
        cdf = torch.cumsum(sampling_log_probs.double().exp(), dim=-1)
        # The first token whose cumulative probability exceeds u * total; zero-probability tokens
        # have a flat CDF and are never chosen.
        chosen = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        chosen = chosen.clamp(max=logits.shape[-1] - 1)
        recorded = sampling_log_probs if params.log_prob_kind == "sampled" else distribution_log_softmax(logits, params.scored())
    return chosen, recorded.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), _top(recorded, top_logprobs_num)


def _top(log_probs: torch.Tensor, k: int):
    if k <= 0:
        return None
    top = torch.topk(log_probs, min(k, log_probs.shape[-1]), dim=-1)
    return top.values, top.indices


def _completions(recorded: torch.Tensor, log_prob_steps: list, top_steps: list | None, params: SamplingParams) -> list[Completion]:
    """Each row's :class:`Completion` from a batch's decode steps (``recorded [B, steps]``: -1 after
    the row stopped): its tokens up to and with its stop token, their log-probs and top-k lists."""
    tokens = recorded.cpu().tolist()
    log_probs = torch.stack(log_prob_steps, dim=1).cpu().tolist()
    top_ids = top_values = None
    if top_steps is not None:
        top_values = torch.stack([t[0] for t in top_steps], dim=1).cpu().tolist()
        top_ids = torch.stack([t[1] for t in top_steps], dim=1).cpu().tolist()
    stop_set = set(params.stop_token_ids)
    results = []
    for row, (row_tokens, row_log_probs) in enumerate(zip(tokens, log_probs)):
        length = row_tokens.index(-1) if -1 in row_tokens else len(row_tokens)
        kept = row_tokens[:length]
        reason = "stop" if kept and kept[-1] in stop_set else "length"
        results.append(Completion(
            kept, row_log_probs[:length], reason,
            top_ids[row][:length] if top_ids is not None else None,
            top_values[row][:length] if top_values is not None else None,
        ))
    return results
