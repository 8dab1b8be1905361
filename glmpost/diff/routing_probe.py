"""``diff-logprobs --routing``: the MoE experts a record's tokens were routed to against path A's
(issue 33; brief, "DSA Indexer 的确定性为什么是 RL 问题": routing is a discrete control object like the DSA top-k).

A record's ``routed_experts[t]`` (formats/SPEC.md) are the experts, per MoE layer, of the forward
position whose logits gave token ``t`` (prompt length ``P``: input position ``P + t - 1``). Path A
is the trainer's forward over prompt + response (:func:`glmpost.diff.mismatch.local_path`); a
:class:`PathRouting` session keeps, for each of its forwards, every router's own choice and
selection scores, and with ``replay`` forces the record's experts (R3) while it still notes what
the router would have chosen.

Per action token with a recorded row and MoE layer ``l``: ``differs[t, l] = set(record) !=
set(A)``; a token differs when any layer does. The router-score margin of A at the k-th expert is
``m = c_(k) - c_(k+1)`` (``c`` A's selection scores sorted descending): how far the boundary
expert was from the next one. The report sets the log-prob delta (A - B) of differing tokens
beside the rest's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from glmpost.errors import GlmpostError
from glmpost.kernel.routing import RoutingSession, check_routing_fits, recorded_rows, routing_session, same_expert_sets

ROUTING = "routed_experts"


def kth_margin(choice: torch.Tensor, k: int) -> torch.Tensor:
    """``c_(k) - c_(k+1)`` per row of selection scores ``[..., E]`` (sorted descending; ``inf`` when
    ``k == E`` or the (k+1)-th is ``-inf``: nothing competes)."""
    if k >= choice.shape[-1]:
        return torch.full(choice.shape[:-1], float("inf"), dtype=choice.dtype, device=choice.device)
    top = torch.topk(choice.float(), k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


class PathRouting(RoutingSession):
    """A session over many forwards of path A (each starts with MoE layer 0): per forward, every
    layer's own choice ``[N, k]`` and k-th margin ``[N]``; ``forced`` holds per forward ``(ids
    [N, L, k], replay [N])`` to replay, in order, or is empty."""

    def __init__(self, forced: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()):
        super().__init__()
        self.pending = list(forced)
        self.forwards: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []

    def route(self, layer: int, chosen: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            self.forwards.append({})
            self.forced, self.replay = self.pending.pop(0) if self.pending else (None, None)
            self.differing_positions = None
        self.forwards[-1][layer] = (chosen.detach().cpu(), kth_margin(choice.detach(), chosen.shape[-1]).cpu())
        return super().route(layer, chosen, choice)


def batch_forced(records: Sequence[dict[str, Any]], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per forward of :func:`~glmpost.diff.mismatch.local_path` (``batch_size`` records, right padded
    to the longest), the records' experts laid at the positions that produced their tokens, and
    which positions replay (recorded rows)."""
    out = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        width = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in chunk)
        layers, k = chunk[0][ROUTING].shape[1:]
        forced = torch.zeros((len(chunk), width, layers, k), dtype=torch.long)
        replay = torch.zeros((len(chunk), width), dtype=torch.bool)
        for row, r in enumerate(chunk):
            routed, at = r[ROUTING], len(r["prompt_token_ids"]) - 1
            rows = recorded_rows(routed)
            forced[row, at : at + len(routed)] = torch.from_numpy(routed.astype(np.int64))
            replay[row, at : at + len(routed)] = torch.from_numpy(rows)
        out.append((forced.view(-1, layers, k), replay.view(-1)))
    return out


def record_routing(capture: PathRouting, records: Sequence[dict[str, Any]], batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per record, path A's own experts ``[T, L, k]`` and k-th margins ``[T, L]`` at the positions
    that produced its tokens (the forwards in :func:`batch_forced`'s order)."""
    out = []
    for number, start in enumerate(range(0, len(records), batch_size)):
        chunk = records[start : start + batch_size]
        forward = capture.forwards[number]
        width = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in chunk)
        ids = torch.stack([forward[layer][0] for layer in sorted(forward)], dim=1).view(len(chunk), width, len(forward), -1)
        margins = torch.stack([forward[layer][1] for layer in sorted(forward)], dim=1).view(len(chunk), width, len(forward))
        for row, r in enumerate(chunk):
            at, n = len(r["prompt_token_ids"]) - 1, len(r["response_token_ids"])
            out.append((ids[row, at : at + n].numpy(), margins[row, at : at + n].double().numpy()))
    return out


def _stats(values: np.ndarray) -> dict[str, float] | None:
    finite = values[np.isfinite(values)]
    if not finite.size:
        return None
    return {"mean": float(finite.mean()), "median": float(np.median(finite)), "min": float(finite.min()),
            "max": float(finite.max())}


def _delta_stats(delta: np.ndarray) -> dict[str, float]:
    if not delta.size:
        return {"tokens": 0}
    return {"tokens": int(delta.size), "mean_abs": float(np.abs(delta).mean()), "max_abs": float(np.abs(delta).max()),
            "mean": float(delta.mean())}


def compare_routing(records: Sequence[dict[str, Any]], path_a: Sequence[tuple[np.ndarray, np.ndarray]],
                    deltas: Any) -> dict[str, Any]:
    """Record vs path A at every action token with a recorded row: per MoE layer and overall the
    fraction whose expert set differs, A's k-th margin where they differ and where they agree, and
    the log-prob delta (``deltas``: :class:`~glmpost.diff.mismatch.TokenDeltas`) of differing tokens
    beside the rest's."""
    differs, margins, keys = [], [], []
    for index, (record, (ids, margin)) in enumerate(zip(records, path_a)):
        rows = recorded_rows(record[ROUTING]) & record["action_mask"] & ~record["observation_mask"]
        positions = np.flatnonzero(rows)
        same = same_expert_sets(torch.from_numpy(ids[positions]), torch.from_numpy(record[ROUTING][positions].astype(np.int64)))
        differs.append(~same.numpy())
        margins.append(margin[positions])
        keys += [(index, int(p)) for p in positions]
    layers = records[0][ROUTING].shape[1]
    differs = np.concatenate(differs) if differs else np.zeros((0, layers), dtype=bool)
    margins = np.concatenate(margins) if margins else np.zeros((0, layers))
    token_differs = differs.any(axis=1)
    where = {key: i for i, key in enumerate(zip(deltas.record_index.tolist(), deltas.position.tolist()))}
    delta = deltas.delta[[where[key] for key in keys]] if keys else np.zeros(0)
    overall = {
        "tokens": int(len(keys)), "layers": int(layers),
        "differing_tokens": float(token_differs.mean()) if len(keys) else 0.0,
        "differing_token_layers": float(differs.mean()) if differs.size else 0.0,
        "margin_where_differing": _stats(margins[differs]), "margin_where_same": _stats(margins[~differs]),
        "delta_differing": _delta_stats(delta[token_differs]), "delta_same": _delta_stats(delta[~token_differs]),
    }
    by_layer = {str(layer): {"differing_tokens": float(differs[:, layer].mean()) if len(keys) else 0.0,
                             "margin_where_differing": _stats(margins[differs[:, layer], layer])} for layer in range(layers)}
    return {"overall": overall, "by_layer": by_layer}


def check_routing_records(records: Sequence[dict[str, Any]], where: str) -> None:
    """Refuse (GlmpostError, one line naming the record) a record without ``routed_experts``, or
    records whose MoE layers or top-k differ."""
    shapes = set()
    for r in records:
        if ROUTING not in r:
            raise GlmpostError(f"{where}: record {r['id']!r} has no {ROUTING} (rollout --record-routing records them)")
        shapes.add(r[ROUTING].shape[1:])
    if len(shapes) > 1:
        raise GlmpostError(f"{where}: records differ in routing shape [moe_layers, k]: {sorted(shapes)}")


def path_routing(model: torch.nn.Module, records: Sequence[dict[str, Any]], *, batch_size: int, replay: bool,
                 where: str) -> tuple[PathRouting, Any]:
    """Path A's :class:`PathRouting` (replaying the records' experts with ``replay``) and the context
    that opens it on ``model``'s routers; the records are checked first."""
    check_routing_records(records, where)
    try:
        check_routing_fits(model, *records[0][ROUTING].shape[1:])
    except ValueError as exc:
        raise GlmpostError(f"{where}: --routing: {exc}") from None
    capture = PathRouting(batch_forced(records, batch_size) if replay else ())
    return capture, routing_session(model, capture)


def routing_report(capture: PathRouting, records: Sequence[dict[str, Any]], batch_size: int, deltas: Any,
                   *, replayed: bool) -> dict[str, Any]:
    """:func:`compare_routing` of path A's capture, noting whether path A replayed the record's experts
    (then its forward used them and ``differing_*`` say where its router would have chosen otherwise)."""
    report = compare_routing(records, record_routing(capture, records, batch_size), deltas)
    report["overall"]["replayed"] = replayed
    return report
