"""Train-vs-rollout log-prob mismatch: the numbers IcePop acts on, measured and reported.

For every action token the rollout engine sampled, ``delta_t = log pi_train(y_t|s_t) - log
pi_rollout(y_t|s_t)`` on the same weights (brief, "IcePop 为什么有两层 ratio": the implementation
mismatch, not the update). With ``r_t = exp(delta_t)`` and tokens sampled by the rollout engine:

    k1 = mean(-delta)                 # KL(pi_rollout || pi_train), unbiased, can be < 0 per batch
    k3 = mean(r - 1 - delta)          # the same KL, low-variance, >= 0
    icepop_kept = mean(1/beta <= r <= beta)
    dis_kept    = mean(1 - eps_low < r < 1 + eps_high)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from glmpost.algorithms import dis_mask, icepop_mask
from glmpost.logprobs import sequence_log_probs

POSITION_BUCKETS = (0, 64, 256, 1024, 4096)


@dataclass
class TokenDeltas:
    """One entry per action token: ``delta`` (train - rollout), its position in the response, the record."""

    delta: np.ndarray  # float64
    position: np.ndarray  # int64
    status: list[str]
    record_id: list[str]


@torch.no_grad()
def token_deltas(model, records: Sequence[dict[str, Any]], *, temperature: float = 1.0, batch_size: int = 8,
                 chunk_size: int = 512) -> TokenDeltas:
    """Recompute the action tokens' log-probs with ``model`` and subtract the rollout's."""
    device = next(model.parameters()).device
    deltas, positions, statuses, ids = [], [], [], []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        width = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in chunk)
        input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):
            sequence = np.concatenate([r["prompt_token_ids"], r["response_token_ids"]])
            input_ids[row, : len(sequence)] = torch.from_numpy(sequence.astype(np.int64))
            attention[row, : len(sequence)] = 1
        result = sequence_log_probs(model, input_ids.to(device), attention.to(device), temperature=temperature,
                                    chunk_size=chunk_size)
        train = result.log_probs.double().cpu().numpy()
        for row, r in enumerate(chunk):
            prompt, response = len(r["prompt_token_ids"]), len(r["response_token_ids"])
            actions = r["action_mask"] & ~r["observation_mask"]
            recomputed = train[row, prompt - 1 : prompt - 1 + response][actions]
            deltas.append(recomputed - r["rollout_log_probs"][actions].astype(np.float64))
            positions.append(np.flatnonzero(actions))
            statuses += [r["status"]] * int(actions.sum())
            ids += [r["id"]] * int(actions.sum())
    empty = np.zeros(0)
    return TokenDeltas(np.concatenate(deltas) if deltas else empty,
                       np.concatenate(positions).astype(np.int64) if positions else empty.astype(np.int64), statuses, ids)


def summarize(delta: np.ndarray, *, beta: float = 2.0, eps_low: float = 0.2, eps_high: float = 0.28) -> dict[str, float]:
    """The module docstring's statistics of one set of token deltas."""
    if delta.size == 0:
        return {"tokens": 0}
    d = torch.from_numpy(delta)
    zeros = torch.zeros_like(d)
    absolute = np.abs(delta)
    return {
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


def mismatch_report(deltas: TokenDeltas, *, worst: int = 10, **thresholds: float) -> dict[str, Any]:
    """Overall statistics, by response-position bucket and by status, and the worst tokens."""
    report: dict[str, Any] = {"overall": summarize(deltas.delta, **thresholds)}
    buckets = {}
    edges = list(POSITION_BUCKETS) + [np.iinfo(np.int64).max]
    for low, high in zip(edges[:-1], edges[1:]):
        chosen = (deltas.position >= low) & (deltas.position < high)
        if chosen.any():
            label = f"{low}-{high - 1}" if high != edges[-1] else f"{low}+"
            buckets[label] = summarize(deltas.delta[chosen], **thresholds)
    report["by_position"] = buckets
    statuses = np.array(deltas.status)
    report["by_status"] = {s: summarize(deltas.delta[statuses == s], **thresholds) for s in sorted(set(deltas.status))}
    order = np.argsort(-np.abs(deltas.delta))[:worst]
    report["worst"] = [{"record": deltas.record_id[i], "position": int(deltas.position[i]), "delta": float(deltas.delta[i])}
                       for i in order]
    return report


def parse_gates(items: Iterable[str]) -> dict[str, float]:
    """``METRIC=VALUE`` pairs of ``--fail-above`` (metrics of the overall summary)."""
    known = ("mean_abs", "p50_abs", "p99_abs", "max_abs", "k1", "k3")
    gates = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise ValueError(f"--fail-above {item!r}: expected METRIC=VALUE with METRIC one of {', '.join(known)}")
        try:
            gates[name] = float(value)
        except ValueError:
            raise ValueError(f"--fail-above {item!r}: {value!r} is not a number") from None
    return gates
