"""Routing replay (R3) in training: every recorded token is routed to the experts the rollout chose.

The brief's thesis ("四层一致性：从状态到梯度") is that training optimises the policy the rollout executed;
MoE routing is a discrete part of that policy (issue 33), so with ``--routing-replay`` the trainer's
forward takes, at each position that produced a recorded token, the record's ``routed_experts`` in
every MoE layer (:mod:`glmpost.kernel.routing`), with the gate weights recomputed from the current
router over that set (the router still learns). The same replayed forward serves the old-log-prob
recompute, the trust masks (IcePop, DIS) and the loss: :func:`replay_context` opens it around each
of them, the backward included (a checkpointed layer recomputes under it).

Layout: response token ``j`` of an example is scored by entry ``prompt_length - 1 + j``
(:mod:`glmpost.rl.micro_batches`), and that entry is the forward position whose router chose the
token's experts, so the record's rows ride along as two per-token fields (:data:`EXPERTS`,
:data:`REPLAYED`) laid out like the rollout log-probs; the last input position of a row has no
entry and routes freely (it scores nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from glmpost.config import setting
from glmpost.errors import GlmpostError
from glmpost.formats.windows import context_windows
from glmpost.kernel.routing import RoutingSession, check_routing_fits, recorded_rows, routing_session
from glmpost.rl.batches import TrainExample

ROUTING = "routed_experts"
EXPERTS, REPLAYED = "routed_experts", "routing_replayed"
METRICS = ("routing/replayed_fraction", "routing/would_differ_fraction", "routing/would_differ_token_layers")


def routing_replay_setting():
    """The ``routing_replay`` setting of every policy-gradient stage (train-grpo, opd-merge, train-sao)."""
    return setting(False, "Routing replay (R3): route every recorded action token to the MoE experts the rollout "
                   "chose (the records' routed_experts: rollout --record-routing), gate weights recomputed from the "
                   "current router over that set; the old log-probs, IcePop / DIS and the loss all see that forward. "
                   "Records without routed_experts are refused. Metrics: routing/replayed_fraction and "
                   "routing/would_differ_fraction.", flag="--routing-replay/--no-routing-replay")


def check_routing_records(records: Sequence[dict[str, Any]], stage: str) -> None:
    """Refuse, in one line naming the record, a record without ``routed_experts``."""
    for record in records:
        if ROUTING not in record:
            raise GlmpostError(f"{stage}: --routing-replay: record {record['id']!r} has no {ROUTING} "
                               "(sample it with rollout --record-routing)")


def attach_routing(examples: Sequence[TrainExample], records: Sequence[dict[str, Any]]) -> None:
    """Give each example its record's experts (``[n, L, k]``, 0 where not recorded; :func:`_held`)
    and which rows replay (bool ``[n]``), cut to its context window."""
    by_id = {record["id"]: record for record in records}
    for example in examples:
        record = by_id[example.trajectory]
        window = context_windows(record)[example.window]
        routed = record[ROUTING][window.start : window.end]
        rows = recorded_rows(routed)
        example.token_fields[EXPERTS] = _held(routed, rows)
        example.token_fields[REPLAYED] = rows


def _held(routed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A record's experts as a trainer holds them, in the record's width: 0 where not recorded;
    uint8 as it is, uint16 viewed as int16 (torch has no full uint16; :func:`replay_session` masks
    the bits back to 0..65535 when it widens one micro-batch)."""
    held = np.where(rows[:, None, None], routed, 0).astype(routed.dtype)
    return held.view(np.int16) if held.dtype == np.uint16 else held


def replay_session(batch: Any) -> RoutingSession:
    """The :class:`RoutingSession` of a micro-batch: its entries' experts at their input positions,
    the last position of each row free."""
    forced, replay = batch.token_fields[EXPERTS], batch.token_fields[REPLAYED]
    rows, entries = replay.shape
    forced = torch.cat([forced, forced.new_zeros((rows, 1, *forced.shape[2:]))], dim=1)
    replay = torch.cat([replay, replay.new_zeros((rows, 1))], dim=1)
    forced = forced.reshape(rows * (entries + 1), *forced.shape[2:]).long() & 0xFFFF  # uint16 held as int16
    return RoutingSession(forced, replay.reshape(-1))


def replay_context(model: torch.nn.Module, batch: Any, enabled: bool):
    """The replayed forward of ``batch`` on ``model`` (a :class:`RoutingSession` opened on its
    routers), or nothing when ``enabled`` is false. Yields the session (None when off)."""
    if not enabled:
        return contextlib.nullcontext()
    try:
        check_routing_fits(model, *batch.token_fields[EXPERTS].shape[2:])
    except ValueError as exc:
        raise GlmpostError(f"--routing-replay: {exc}") from None
    return routing_session(model, replay_session(batch))


def replay_counts(session: RoutingSession | None, batch: Any) -> torch.Tensor:
    """float64 ``[action tokens, replayed, would differ, (token, layer) pairs compared, pairs differing]``
    of one forward (action tokens only: the first two of ``session.compared`` / ``differing``)."""
    actions = batch.action_mask
    if session is None or session.differing_positions is None:
        return torch.tensor([float(actions.sum()), 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    rows, entries = actions.shape
    differs = session.differing_positions.view(rows, entries + 1)[:, :-1]
    replayed = batch.token_fields[REPLAYED] & actions
    return torch.tensor([float(actions.sum()), float(replayed.sum()), float((differs & actions).sum()),
                         float(session.compared), float(session.differing)], dtype=torch.float64)


def replay_metrics(totals: torch.Tensor) -> dict[str, float]:
    """:data:`METRICS` from summed :func:`replay_counts`: replayed action tokens / action tokens,
    replayed action tokens whose router would have chosen another set in some MoE layer / replayed
    ones, and replayed (position, layer) pairs differing / compared."""
    actions, replayed, differ, compared, differing = totals.tolist()
    return dict(zip(METRICS, (replayed / actions if actions else 0.0, differ / replayed if replayed else 0.0,
                              differing / compared if compared else 0.0)))


def prepare_replay(config: Any, records: Sequence[dict[str, Any]], examples: Sequence[TrainExample], stage: str) -> None:
    """With ``config.routing_replay``: refuse records without routing (:func:`check_routing_records`)
    and attach it to ``examples`` (:func:`attach_routing`); nothing otherwise."""
    if getattr(config, "routing_replay", False):
        check_routing_records(records, stage)
        attach_routing(examples, records)
