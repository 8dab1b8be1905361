"""Log-prob mismatch between two numerical paths: the numbers IcePop acts on, measured and reported.

A *path* computes, for the same trajectory records, the log-prob of every action token under its
exact prefix: the rollout engine (the ``rollout_log_probs`` it recorded), a checkpoint through the
trainer's forward (:func:`glmpost.kernel.logprobs.sequence_log_probs`) in some dtype, on some device and
with some DSA top-k rule, or a server (``glmpost serve`` / SGLang). Path A is the trainer side
(``--checkpoint``), path B the one it is compared against (the shards, or ``--against*``). For every
action token ``t`` (brief, "IcePop 为什么有两层 ratio": the implementation mismatch, not the update):

    delta_t = log pi_A(y_t|s_t) - log pi_B(y_t|s_t),   r_t = exp(delta_t)
    k1 = mean(-delta)                 # KL(pi_B || pi_A) on tokens sampled from B, unbiased, can be < 0
    k3 = mean(r - 1 - delta)          # the same KL, low-variance, >= 0
    icepop_kept = mean(1/beta <= r <= beta)                # brief, IcePop: a mask, not a clamp
    dis_kept    = mean(1 - eps_low < r < 1 + eps_high)     # brief, DIS (SAO)

Sampled-token agreement under a fixed seed (:func:`sampled_token_agreement`): each path resamples
every action position from its own distribution at that prefix with the *same* uniform number
``u_t`` (the record's per-sequence generator, exactly as :class:`glmpost.kernel.engine.LocalEngine` draws
it), by inverse CDF: ``x_P(t) = min{v : F_P(v | s_t) > u_t}`` with ``F_P`` the cumulative
probability of path P's filtered (temperature, top-k, top-p) distribution in token-id order. The
agreement is ``mean_t [x_A(t) == x_B(t)]`` over action tokens: the fraction of positions where the
two paths would have sampled the same token from the same randomness. For the rollout path
``x_B(t) = y_t`` (the engine drew ``y_t`` with that ``u_t``), so identical numerics give exactly 1.

DSA indexer (:func:`glmpost.diff.indexer_probe.topk_set_overlap`, :func:`~glmpost.diff.indexer_probe.boundary_ties`): for every query position and layer,
the set of key positions the indexer selected (keys masked out by causality or padding do not
count), compared between the paths as sets (Jaccard, identical) and as orders (identical lists).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from glmpost.diff.indexer_probe import IndexerCapture, indexer_summary, pad_rows
from glmpost.kernel.distribution import ScoredDistribution, distribution_log_softmax
from glmpost.kernel.engine import SamplingParams, sample_tokens, sequence_seed, turn_key
from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.kernel.trust_masks import dis_mask, icepop_mask
from glmpost.npu.topk import set_indexer_topk

POSITION_BUCKETS = (0, 64, 256, 1024, 4096)
# Full next-token distributions are asked of a server only up to this vocabulary size.
SERVER_FULL_DISTRIBUTION_MAX_VOCAB = 8192


# --------------------------------------------------------------------------------------------
# Pure functions


def summarize(delta: np.ndarray, *, agree: np.ndarray | None = None, beta: float = 2.0, eps_low: float = 0.2,
              eps_high: float = 0.28) -> dict[str, float]:
    """The module docstring's statistics of one set of token deltas (and ``sample_agreement``,
    ``sample_disagreement = 1 - agreement`` when ``agree``, one bool per token, is given)."""
    if delta.size == 0:
        return {"tokens": 0}
    d = torch.from_numpy(np.ascontiguousarray(delta, dtype=np.float64))
    zeros = torch.zeros_like(d)
    absolute = np.abs(delta)
    stats = {
        "tokens": int(delta.size),
        "mean_abs": float(absolute.mean()),
        "p50_abs": float(np.quantile(absolute, 0.5)),
        "p99_abs": float(np.quantile(absolute, 0.99)),
        "max_abs": float(absolute.max()),
        "k1": float((-delta).mean()),
        "k3": float((np.exp(delta) - 1 - delta).mean()),
        "icepop_kept": float(icepop_mask(d, zeros, beta=beta).double().mean()),
        "dis_kept": float(dis_mask(d, zeros, eps_low=eps_low, eps_high=eps_high).double().mean()),
    }
    if agree is not None:
        stats["sample_agreement"] = sampled_token_agreement(agree)
        stats["sample_disagreement"] = 1.0 - stats["sample_agreement"]
    return stats


def sampled_token_agreement(agree: np.ndarray) -> float:
    """``mean_t [x_A(t) == x_B(t)]`` over the given action tokens (module docstring); 1.0 for none."""
    return float(np.mean(agree)) if np.size(agree) else 1.0


# --------------------------------------------------------------------------------------------
# Paths: what each side computes for the same records


def action_positions(record: dict[str, Any]) -> np.ndarray:
    """Bool ``[T]``: tokens sampled by the policy (action, not observation)."""
    return np.asarray(record["action_mask"], dtype=bool) & ~np.asarray(record["observation_mask"], dtype=bool)


def record_sampling(record: dict[str, Any]) -> SamplingParams:
    """The record's sampling settings (defaults where a field is absent, e.g. imported data)."""
    return SamplingParams.from_record(record.get("sampling"))


def record_uniforms(record: dict[str, Any]) -> torch.Tensor:
    """float64 ``[T]``: the uniform number the engine drew for each response position.

    ``glmpost rollout`` seeds sequence ``i`` of prompt ``p`` with ``sequence_seed(seed, "p/i")``
    and draws ``max_new_tokens`` numbers up front (:class:`glmpost.kernel.engine.LocalEngine`); record ids
    end in ``/i``. Positions past ``max_new_tokens`` continue the same stream. A multi-turn record's
    action segment of turn ``t`` draws from its turn's stream (:func:`glmpost.kernel.engine.turn_key`);
    observation positions read 0.
    """

    params = record_sampling(record)
    key = f"{record['prompt_id']}/{str(record['id']).rsplit('/', 1)[-1]}"
    length = len(record["response_token_ids"])

    def stream(turn: int, size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(sequence_seed(params.seed, turn_key(key, turn)))
        return torch.rand(max(params.max_new_tokens, size), generator=generator, dtype=torch.float64)[:size]

    turns = [s for s in record.get("segments") or [] if s.get("kind") in ("action", "summary")]
    if not any(int(s.get("turn", 0)) for s in turns):
        return stream(0, length)
    uniforms = torch.zeros(length, dtype=torch.float64)
    for segment in turns:
        start, end = int(segment["start"]), int(segment["end"])
        uniforms[start:end] = stream(int(segment["turn"]), end - start)
    return uniforms


@dataclass
class PathScores:
    """What one path computed, per record (lists in record order).

    ``log_probs``: float64 ``[T]``, NaN where not an action. ``samples``: int64 ``[T]`` inverse-CDF
    samples (module docstring), -1 where not an action; None when the path cannot resample.
    ``selections``: per record a list over indexer layers of int64 ``[L, k]`` selected key
    positions (-1 = empty) for every position of prompt + response; ``ties``: bool ``[L]`` per
    layer (:func:`boundary_ties`); both None without ``--indexer``.
    """

    label: str
    log_probs: list[np.ndarray]
    samples: list[np.ndarray] | None = None
    selections: list[list[np.ndarray]] | None = None
    ties: list[list[np.ndarray]] | None = None


def rollout_path(records: Sequence[dict[str, Any]], *, resample: bool) -> PathScores:
    """The rollout engine's side: its recorded log-probs, and (``resample``) its sampled tokens."""
    log_probs, samples = [], []
    for r in records:
        actions = action_positions(r)
        log_probs.append(np.where(actions, np.asarray(r["rollout_log_probs"], dtype=np.float64), np.nan))
        samples.append(np.where(actions, np.asarray(r["response_token_ids"], dtype=np.int64), -1))
    return PathScores("rollout", log_probs, samples if resample else None)


def inverse_cdf_samples(logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """int64 ``[N]``: for each row of ``logits [N, V]`` the token the engine samples with uniform
    ``uniforms[n]`` (:func:`glmpost.kernel.engine.sample_tokens`, the engine's own code: filter, then
    ``min{v : F(v) > u * F(V-1)}``; argmax at temperature 0)."""
    if logits.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    chosen = sample_tokens(logits.float(), uniforms.to(logits.device), params)[0]
    return chosen.cpu().numpy().astype(np.int64)


@torch.no_grad()
def local_path(model, records: Sequence[dict[str, Any]], *, distribution: ScoredDistribution, label: str = "local", batch_size: int = 8,
               resample: bool = True, indexer: bool = False, chunk_size: int = 512, progress: Callable | None = None) -> PathScores:
    """Score ``records`` with ``model`` through the trainer's forward (right-padded batches of
    ``batch_size``, :func:`glmpost.kernel.logprobs.sequence_log_probs` under ``distribution``: the
    records' log-prob kind at their temperature and filter); with ``resample``
    also draw the inverse-CDF samples from the same hidden states, with ``indexer`` capture the DSA
    indexers' selections (:mod:`glmpost.diff.indexer_probe`)."""
    device = next(model.parameters()).device
    body, head = model.get_decoder(), model.get_output_embeddings()
    hidden: list[torch.Tensor] = []
    hook = body.register_forward_hook(lambda _m, _i, output: hidden.append(output[0] if isinstance(output, tuple) else output.last_hidden_state))
    result = PathScores(label, [], [] if resample else None, [] if indexer else None, [] if indexer else None)
    capture = IndexerCapture(model) if indexer else None
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            lengths = [len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in chunk]
            width = max(lengths)
            input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, r in enumerate(chunk):
                sequence = np.concatenate([r["prompt_token_ids"], r["response_token_ids"]]).astype(np.int64)
                input_ids[row, : len(sequence)] = torch.from_numpy(sequence)
                attention[row, : len(sequence)] = 1
            hidden.clear()
            if capture is not None:
                capture.start()
            scored = sequence_log_probs(model, input_ids.to(device), attention.to(device), temperature=distribution.temperature,
                                        top_k=distribution.top_k, top_p=distribution.top_p, chunk_size=chunk_size)
            train = scored.log_probs.double().cpu().numpy()
            for row, r in enumerate(chunk):
                prompt, response = len(r["prompt_token_ids"]), len(r["response_token_ids"])
                actions = action_positions(r)
                result.log_probs.append(np.where(actions, train[row, prompt - 1 : prompt - 1 + response], np.nan))
                if resample:
                    positions = np.flatnonzero(actions)
                    rows = hidden[-1][row].index_select(0, torch.from_numpy(prompt - 1 + positions).to(device))
                    uniforms, params = record_uniforms(r), record_sampling(r)
                    samples = np.full(response, -1, dtype=np.int64)
                    for i in range(0, len(positions), chunk_size):
                        part = positions[i : i + chunk_size]
                        samples[part] = inverse_cdf_samples(head(rows[i : i + chunk_size]), uniforms[part], params)
                    result.samples.append(samples)
                if capture is not None:
                    selections, ties = capture.rows(row, lengths[row])
                    result.selections.append(selections)
                    result.ties.append(ties)
            if progress is not None:
                progress(len(chunk))
    finally:
        hook.remove()
        if capture is not None:
            capture.close()
    return result


def server_path(client, records: Sequence[dict[str, Any]], *, distribution: ScoredDistribution, vocab_size: int, label: str = "server",
                resample: bool = True, progress: Callable | None = None) -> PathScores:
    """Score ``records`` on a server (:meth:`glmpost.kernel.sglang_client.SGLangClient.score`, temperature 1).

    With a vocabulary of at most ``SERVER_FULL_DISTRIBUTION_MAX_VOCAB`` ids the server is asked for
    the whole next-token distribution at every position (``top_logprobs_num = V``), so the
    log-probs under ``distribution`` (``log p_tau(y) = lp(y)/tau - logsumexp(lp/tau)``, over the
    kept set when filtered) and the inverse-CDF samples come out; a larger vocabulary gives the
    sampled tokens' log-probs at temperature 1 only (``distribution`` must be the raw one; no samples).
    """
    full = vocab_size <= SERVER_FULL_DISTRIBUTION_MAX_VOCAB
    if not full and distribution != ScoredDistribution():
        raise ValueError(f"the server scores at temperature 1 without filtering and its vocabulary ({vocab_size}) is too large "
                         f"to rescale to {distribution}")
    result = PathScores(label, [], [] if resample and full else None)
    for r in records:
        prompt = [int(x) for x in r["prompt_token_ids"]]
        response = [int(x) for x in r["response_token_ids"]]
        actions = action_positions(r)
        answer = client.score(prompt + response, len(prompt), top_logprobs_num=vocab_size if full else 0)
        if not full:
            result.log_probs.append(np.where(actions, np.asarray(answer["token_log_probs"], dtype=np.float64), np.nan))
        else:
            logits = torch.full((len(response), vocab_size), float("-inf"), dtype=torch.float64)
            for t, (ids, lps) in enumerate(zip(answer["top_ids"], answer["top_log_probs"])):
                logits[t, torch.tensor(ids, dtype=torch.long)] = torch.tensor(lps, dtype=torch.float64)
            scaled = distribution_log_softmax(logits, distribution)
            picked = scaled.gather(-1, torch.tensor(response, dtype=torch.long)[:, None]).squeeze(-1).numpy()
            result.log_probs.append(np.where(actions, picked, np.nan))
            if result.samples is not None:
                samples = np.full(len(response), -1, dtype=np.int64)
                chosen = torch.from_numpy(actions)
                samples[actions] = inverse_cdf_samples(logits[chosen].float(), record_uniforms(r)[chosen], record_sampling(r))
                result.samples.append(samples)
        if progress is not None:
            progress(1)
    return result


# --------------------------------------------------------------------------------------------
# Comparing two paths


@dataclass
class TokenDeltas:
    """One entry per action token: ``delta`` (A - B), the two log-probs, its position in the
    response, the record (index and id), its status, and (when both paths resample) ``agree``."""

    delta: np.ndarray  # float64
    position: np.ndarray  # int64
    status: list[str]
    record_id: list[str]
    record_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    log_prob_a: np.ndarray = field(default_factory=lambda: np.zeros(0))
    log_prob_b: np.ndarray = field(default_factory=lambda: np.zeros(0))
    agree: np.ndarray | None = None


def compare_paths(a: PathScores, b: PathScores, records: Sequence[dict[str, Any]]) -> TokenDeltas:
    """Pair the two paths' values at every action token of ``records``."""
    parts: dict[str, list] = {k: [] for k in ("delta", "position", "index", "a", "b", "agree")}
    status, ids = [], []
    both_sample = a.samples is not None and b.samples is not None
    for i, r in enumerate(records):
        actions = action_positions(r)
        la, lb = a.log_probs[i][actions], b.log_probs[i][actions]
        parts["a"].append(la)
        parts["b"].append(lb)
        parts["delta"].append(la - lb)
        parts["position"].append(np.flatnonzero(actions))
        parts["index"].append(np.full(int(actions.sum()), i, dtype=np.int64))
        if both_sample:
            parts["agree"].append(a.samples[i][actions] == b.samples[i][actions])
        status += [r["status"]] * int(actions.sum())
        ids += [r["id"]] * int(actions.sum())

    def cat(name, dtype):
        return np.concatenate(parts[name]).astype(dtype) if parts[name] else np.zeros(0, dtype=dtype)

    return TokenDeltas(cat("delta", np.float64), cat("position", np.int64), status, ids, cat("index", np.int64),
                       cat("a", np.float64), cat("b", np.float64), cat("agree", bool) if both_sample else None)


def compare_indexers(a: PathScores, b: PathScores) -> dict[str, Any]:
    """:func:`indexer_summary` over every layer and position of every record, and per layer."""
    if a.selections is None or b.selections is None:
        raise ValueError("both paths need indexer selections")
    layers = min((len(s) for s in a.selections), default=0)
    if any(len(s) != layers for s in a.selections + b.selections):
        raise ValueError("the two paths have different numbers of indexer layers")
    per_layer, all_a, all_b, all_ta, all_tb = {}, [], [], [], []
    for layer in range(layers):
        width = max(max((s[layer].shape[1] for s in a.selections), default=0), max((s[layer].shape[1] for s in b.selections), default=0))
        sa = torch.cat([pad_rows(torch.from_numpy(s[layer]), width) for s in a.selections]) if a.selections else torch.zeros(0, width, dtype=torch.long)
        sb = torch.cat([pad_rows(torch.from_numpy(s[layer]), width) for s in b.selections]) if b.selections else torch.zeros(0, width, dtype=torch.long)
        ta = torch.from_numpy(np.concatenate([t[layer] for t in a.ties])) if a.ties else torch.zeros(0, dtype=torch.bool)
        tb = torch.from_numpy(np.concatenate([t[layer] for t in b.ties])) if b.ties else torch.zeros(0, dtype=torch.bool)
        per_layer[str(layer)] = indexer_summary(sa, sb, ta, tb)
        all_a.append(sa)
        all_b.append(sb)
        all_ta.append(ta)
        all_tb.append(tb)
    if not layers:
        return {"overall": {"rows": 0}, "by_layer": {}}
    width = max(x.shape[1] for x in all_a + all_b)
    overall = indexer_summary(torch.cat([pad_rows(x, width) for x in all_a]), torch.cat([pad_rows(x, width) for x in all_b]),
                              torch.cat(all_ta), torch.cat(all_tb))
    overall["layers"] = layers
    return {"overall": overall, "by_layer": per_layer}


def mismatch_report(deltas: TokenDeltas, *, worst: int = 10, context: Callable[[int, int], dict[str, Any]] | None = None,
                    **thresholds: float) -> dict[str, Any]:
    """Overall statistics, by response-position bucket and by status, and the worst tokens
    (``context(record_index, position)`` adds each worst token's decoded context)."""
    def stats(chosen: np.ndarray | None = None) -> dict[str, float]:
        if chosen is None:
            return summarize(deltas.delta, agree=deltas.agree, **thresholds)
        return summarize(deltas.delta[chosen], agree=None if deltas.agree is None else deltas.agree[chosen], **thresholds)

    report: dict[str, Any] = {"overall": stats()}
    buckets = {}
    edges = list(POSITION_BUCKETS) + [np.iinfo(np.int64).max]
    for low, high in itertools.pairwise(edges):
        chosen = (deltas.position >= low) & (deltas.position < high)
        if chosen.any():
            label = f"{low}-{high - 1}" if high != edges[-1] else f"{low}+"
            buckets[label] = stats(chosen)
    report["by_position"] = buckets
    statuses = np.array(deltas.status)
    report["by_status"] = {s: stats(statuses == s) for s in sorted(set(deltas.status))}
    order = np.argsort(-np.abs(deltas.delta), kind="stable")[:worst]
    rows = []
    for i in order:
        row = {"record": deltas.record_id[i], "position": int(deltas.position[i]), "delta": float(deltas.delta[i])}
        if deltas.log_prob_a.size:
            row.update(log_prob_a=float(deltas.log_prob_a[i]), log_prob_b=float(deltas.log_prob_b[i]))
        if deltas.agree is not None:
            row["same_sample"] = bool(deltas.agree[i])
        if context is not None and deltas.record_index.size:
            row.update(context(int(deltas.record_index[i]), int(deltas.position[i])))
        rows.append(row)
    report["worst"] = rows
    return report


# --------------------------------------------------------------------------------------------
# Loading a path's model

DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_path_model(version_dir, *, dtype: str = "auto", device: Any = "cpu", deterministic_topk: bool = True,
                    attention: str = "native"):
    """A checkpoint's model for one path, as :func:`glmpost.kernel.loading.load_model` loads it (a
    quantized checkpoint dequantized: the weights a rollout engine computes with), with the DSA
    indexer's top-k rule set either way and GLM-5 attention ``attention``. ``dtype`` is a key of ``DTYPES`` (``auto``: the checkpoint's)."""

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    model = load_model(version_dir, device=device, dtype=DTYPES[dtype], deterministic_topk=deterministic_topk,
                       attention=attention)
    set_indexer_topk(model, deterministic=deterministic_topk)
    return model
