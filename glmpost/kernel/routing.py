"""MoE routing as a discrete control object: one deterministic top-k rule, recording and replay (R3).

The brief asks training to optimise the policy the rollout executed ("四层一致性：从状态到梯度", "DSA Indexer 的
确定性为什么是 RL 问题": top-k is "a discrete control object"). An MoE layer's router picks ``k``
experts per token by a top-k just as the DSA indexer picks keys, so glmpost gives routers the same
treatment (issue 33):

* **one rule**: every router selects by :func:`glmpost.npu.topk.deterministic_topk`'s rule (larger
  score first, ties to the lower expert id; :func:`router_topk`), on the rollout engine and in the
  trainer alike;
* **record**: inside :func:`routing_session` a router reports the experts it chose for every
  position (``[N, k]`` per MoE layer, ``N`` the forward's flattened positions);
* **replay**: a session may carry forced expert ids for some positions; the router then uses them
  instead of its own choice, and recomputes the gate weights over that set from its current scores
  with the model's own normalisation (:func:`gate_weights`), so the router still gets a gradient.

Router families (transformers 5 modules, patched per instance as ``install_deterministic_topk``
patches the DSA indexer):

* ``sigmoid`` — ``GlmMoeDsaTopkRouter`` (GLM-5), ``Glm4MoeTopkRouter`` (GLM-4.5/4.7),
  ``DeepseekV3TopkRouter``: ``s = sigmoid(W h)`` in float32, choice ``c = s + bias`` limited to the
  ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two best ``c``), ids =
  top-k of ``c``; weights ``w = s[ids] / (sum s[ids] + 1e-20)`` (with ``norm_topk_prob``) times
  ``routed_scaling_factor``;
* ``softmax`` — ``Qwen3MoeTopKRouter``: ``p = softmax(W h)`` (float32), ids = top-k of ``p``,
  ``w = p[ids] / sum p[ids]`` (with ``norm_topk_prob``) in the logits' dtype.

Without ties the patched routers compute the transformers forward's values bit for bit (the same
operations in the same order; ``tests/test_routing.py`` checks it), so a run without replay trains
as before.

The record's arrays and the servers' routing payloads (:class:`RoutingLayout`, :func:`compact_ids`,
:func:`routed_from_sglang`, ...) are :mod:`glmpost.kernel.routing_payloads`'s, re-exported here.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from glmpost.kernel.routing_payloads import (NOT_RECORDED, RoutingLayout, all_layer_rows, compact_ids, config_field,
                                           moe_layer_indices, recorded_rows, routed_from_sglang, routing_dtype,
                                           select_moe_rows)
from glmpost.npu.topk import composite_topk, deterministic_topk

ROUTER_SUFFIXES = ("TopkRouter", "TopKRouter")

__all__ = ["NOT_RECORDED", "ROUTER_SUFFIXES", "RoutingLayout", "RoutingSession", "StepRouting", "all_layer_rows",
           "check_routing_fits", "compact_ids", "config_routing_layout", "gate_weights", "group_limited_choice",
           "install_routing", "model_routing_layout", "moe_layer_indices", "moe_shape", "prompt_routing",
           "recorded_rows", "routed_from_sglang", "router_family", "router_scores", "router_topk", "routers",
           "routing_dtype", "routing_session", "same_expert_sets", "select_moe_rows"]


def routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every MoE router of ``model``, in layer order (the record's layer axis)."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith(ROUTER_SUFFIXES)]


def router_family(router: torch.nn.Module) -> str:
    """``sigmoid`` (GLM-5, GLM-4.5, DeepSeek-V3: a correction bias and expert groups) or ``softmax`` (Qwen3-MoE)."""
    return "sigmoid" if hasattr(router, "e_score_correction_bias") else "softmax"


def group_limited_choice(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``choice`` ``[N, E]`` with every expert outside the ``topk_group`` best of ``n_group`` equal
    groups set to ``-inf``; a group's score is the sum of its two largest entries (DeepSeek-V3's
    group-limited routing), groups tied on score go to the lower group index."""
    if n_group <= 1:  # the one group is always kept
        return choice
    grouped = choice.view(-1, n_group, choice.shape[-1] // n_group)
    group_scores = torch.topk(grouped, 2, dim=-1)[0].sum(dim=-1)
    kept = router_topk(group_scores, topk_group)
    group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)
    score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, choice.shape[-1])
    return choice.masked_fill(~score_mask.bool(), float("-inf"))


def router_topk(choice: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`~glmpost.npu.topk.deterministic_topk`'s rule (larger first, ties to the lower index,
    NaN last) as int64 ``[N, k]``, for a router's few columns: one ``torch.topk`` of ``k + 1``; a row
    whose ``k + 1`` largest values are not all distinct (a tie that could change the set, a NaN, or
    a group-limited ``-inf`` boundary) takes the composite-key top-k."""
    # brief, "稀疏与版本契约": a top-k fixes its tie, order and NaN rules; routers get the DSA one.
    if k >= choice.shape[-1]:
        return deterministic_topk(choice, k).long()
    top = torch.topk(choice, k + 1, dim=-1)
    distinct = (top.values[..., :-1] > top.values[..., 1:]).all(-1)
    indices = top.indices[..., :k]
    if not bool(distinct.all()):
        indices = indices.clone()
        indices[~distinct] = composite_topk(choice[~distinct], k).long()
    return indices


def gate_weights(scores: torch.Tensor, ids: torch.Tensor, *, family: str, norm_topk_prob: bool,
                 scaling: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gate weights ``[N, k]`` of the experts ``ids`` from the router's scores ``[N, E]``:
    ``w = s[ids]``; with ``norm_topk_prob`` ``w / (sum w + 1e-20)`` (sigmoid) or ``w / sum w``
    (softmax); sigmoid routers then multiply by ``routed_scaling_factor``, softmax ones cast to
    ``dtype`` (the logits'). The same formula serves the router's own choice and replayed ids."""
    weights = scores.gather(1, ids)
    if family == "sigmoid":
        if norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * scaling
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype or weights.dtype)


def router_scores(router: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits, scores, choice)`` ``[N, E]`` of a router over flattened ``hidden``: the gate's
    scores and the selection scores its top-k runs on (see the module docstring)."""
    hidden = hidden.reshape(-1, router.hidden_dim)
    if router_family(router) == "sigmoid":
        logits = F.linear(hidden.type(torch.float32), router.weight.type(torch.float32))
        scores = logits.sigmoid()
        choice = group_limited_choice(scores + router.e_score_correction_bias, router.num_group, router.topk_group)
        return logits, scores, choice
    logits = F.linear(hidden, router.weight)
    scores = F.softmax(logits, dtype=torch.float, dim=-1)
    return logits, scores, scores


@dataclass
class RoutingSession:
    """What the routers of one model do while :func:`routing_session` is open.

    ``forced`` ``[N, L, k]`` (int64) with ``replay`` ``[N]`` (bool): the positions whose experts are
    replayed in every MoE layer ``0 .. L-1``. Every router call stores its own choice (``chosen``,
    by layer, ``[N, k]``) and, with ``keep_scores``, its selection scores (``scores``, ``[N, E]``);
    ``differing`` / ``compared`` count the replayed (position, layer) pairs whose own expert set
    differs from the forced one (a recompute of the same forward under activation checkpointing
    counts again)."""

    forced: torch.Tensor | None = None
    replay: torch.Tensor | None = None
    keep_scores: bool = False
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    differing_positions: torch.Tensor | None = None  # [N] bool: some layer's own set differs from the forced one
    differing: int = 0
    compared: int = 0

    def route(self, layer: int, chosen: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """The ids a router uses at ``layer``: its ``chosen`` ``[N, k]``, or the forced ones where replayed."""
        self.chosen[layer] = chosen.detach()
        if self.keep_scores:
            self.scores[layer] = choice.detach()
        if self.forced is None:
            return chosen
        if self.forced.shape[0] != chosen.shape[0] or layer >= self.forced.shape[1]:
            raise ValueError(f"routing replay: forced ids {tuple(self.forced.shape)} do not fit MoE layer {layer} "
                             f"of a forward over {chosen.shape[0]} positions")
        forced = self.forced[:, layer].to(chosen.device)
        replay = self.replay.to(chosen.device)
        differs = replay & ~same_expert_sets(chosen, forced)
        self.differing += int(differs.sum())
        self.compared += int(replay.sum())
        self.differing_positions = differs if self.differing_positions is None else self.differing_positions | differs
        return torch.where(replay.unsqueeze(-1), forced, chosen)

    def experts(self) -> torch.Tensor:
        """The routers' own choices ``[N, L, k]`` by layer (the layers that ran)."""
        return torch.stack([self.chosen[layer] for layer in sorted(self.chosen)], dim=1)


def same_expert_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[...]`` bool: whether rows ``a[..., :]`` and ``b[..., :]`` hold the same experts in any order."""
    return (a.sort(dim=-1).values == b.to(a.dtype).sort(dim=-1).values).all(dim=-1)


def _routed_forward(router: torch.nn.Module, hidden_states: torch.Tensor):
    """A router's forward under the deterministic rule: ``(logits, weights [N, k], ids [N, k])``,
    the ids replaced by a session's forced ones where it replays."""
    logits, scores, choice = router_scores(router, hidden_states)
    ids = router_topk(choice, router.top_k)
    session = router._glmpost_routing
    if session is not None:
        ids = session.route(router._glmpost_routing_layer, ids, choice)
    family = router_family(router)
    weights = gate_weights(scores, ids, family=family, norm_topk_prob=router.norm_topk_prob,
                           scaling=getattr(router, "routed_scaling_factor", 1.0), dtype=logits.dtype)
    return logits, weights, ids


def install_routing(model: torch.nn.Module) -> int:
    """Make every MoE router of ``model`` select by :func:`router_topk` and answer to
    :func:`routing_session`. Returns the number of routers (0 for a dense model); installing twice
    changes nothing."""
    found = routers(model)
    for layer, (_, router) in enumerate(found):
        if getattr(router, "_glmpost_routing_layer", None) is None:
            router.forward = _routed_forward.__get__(router)
            router._glmpost_routing = None
        router._glmpost_routing_layer = layer
    model._glmpost_routers = [router for _, router in found]  # routing_session's list, without a walk per forward
    return len(found)


@contextlib.contextmanager
def routing_session(model: torch.nn.Module, session: RoutingSession) -> Iterator[RoutingSession]:
    """Open ``session`` on every router of ``model`` (installing the rule first); the previous one
    comes back on exit. Keep it open over a backward that recomputes checkpointed activations."""
    found = getattr(model, "_glmpost_routers", None)
    if found is None:
        install_routing(model)
        found = model._glmpost_routers
    previous = [router._glmpost_routing for router in found]
    for router in found:
        router._glmpost_routing = session
    try:
        yield session
    finally:
        for router, before in zip(found, previous):
            router._glmpost_routing = before


def check_routing_fits(model: torch.nn.Module, layers: int, k: int) -> None:
    """ValueError unless ``model`` routes ``k`` experts in each of ``layers`` MoE layers (what a
    record's ``routed_experts`` ``[T, layers, k]`` says), naming both shapes."""
    if getattr(model, "_glmpost_routers", None) is None:
        install_routing(model)
    found = model._glmpost_routers
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE router to route the records' experts")
    if (len(found), int(found[0].top_k)) != (layers, k):
        raise ValueError(f"the records route {k} experts in {layers} MoE layers; {type(model).__name__} routes "
                         f"{int(found[0].top_k)} in {len(found)}")


def moe_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """``(moe_layers, k, experts)`` of ``model``'s routers, or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    first = found[0][1]
    return len(found), int(first.top_k), int(first.num_experts)


class StepRouting(RoutingSession):
    """The rollout engine's routing record: per decode step, the experts of each row's last position
    (the forward whose logits sampled the row's next token), attached to the completions as
    ``routed_experts`` ``[n, L, k]`` (:func:`compact_ids`)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.experts_count = moe_shape(model)[2]
        self.rows = 0
        self.steps: dict[int, list[torch.Tensor]] = {}

    def route(self, layer: int, chosen: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        self.steps.setdefault(layer, []).append(chosen.view(self.rows, -1, chosen.shape[-1])[:, -1])
        return chosen

    def step(self, rows: int):
        """Record the routers of the forward run inside (a batch of ``rows`` rows)."""
        self.rows = rows
        return routing_session(self.model, self)

    def attach(self, completions: list) -> None:
        """Give each completion (a batch's rows, in order) the experts of its sampled tokens."""
        layers = [torch.stack(self.steps[layer], dim=1) for layer in sorted(self.steps)]  # [B, steps, k] each
        steps = compact_ids(torch.stack(layers, dim=2), self.experts_count)  # [B, steps, L, k]
        for row, completion in enumerate(completions):
            completion.routed_experts = steps[row, : len(completion.token_ids)].copy()


def prompt_routing(model: torch.nn.Module, prompt_ids: list[int]) -> np.ndarray:
    """The experts of a prompt's positions ``0 .. P-2`` ``[P-1, L, k]`` (one forward of its first
    ``P - 1`` tokens, each row a position's routers' own choice): what SGLang's
    ``return_routed_experts`` gives for a prompt, before the rows of the generated tokens."""
    layers, k, _ = moe_shape(model)
    if len(prompt_ids) < 2:
        return np.zeros((0, layers, k), dtype=np.int64)
    device = next(model.parameters()).device
    with torch.no_grad(), routing_session(model, RoutingSession()) as session:
        model(input_ids=torch.tensor([prompt_ids[:-1]], device=device))
        return session.experts().cpu().numpy()



def model_routing_layout(model: torch.nn.Module) -> RoutingLayout | None:
    """The :class:`RoutingLayout` of a loaded ``model`` (its config's MoE layers, checked against
    its routers: :func:`config_routing_layout`), or None for a dense model."""
    return _layout(model.config, model)


def config_routing_layout(config) -> RoutingLayout | None:
    """The :class:`RoutingLayout` of the model ``config`` describes, from a skeleton on the meta
    device (no weights: a rollout on servers holds none); None for a dense model. The config's
    MoE layers (:func:`moe_layer_indices`) must be the skeleton's router layers, else ValueError."""
    from transformers import AutoModelForCausalLM  # the server engines only; transformers is heavy

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return _layout(config, model)


def _layout(config, model: torch.nn.Module) -> RoutingLayout | None:
    """``model``'s layout: :func:`moe_layer_indices` of ``config``, which must name the layers its
    routers sit in (``...layers.N...`` in their module names; their count where names say nothing)."""
    found = routers(model)
    if not found:
        return None
    layers, k, experts = moe_shape(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    indices = moe_layer_indices(config)
    named = [re.search(r"(?:^|\.)layers\.(\d+)\.", name) for name, _ in found]
    routed = tuple(int(m.group(1)) for m in named) if all(named) else None
    if indices is None or len(indices) != layers or (routed is not None and routed != indices):
        raise ValueError(f"the model config's MoE layers {list(indices or [])} are not its routers' "
                         f"{list(routed) if routed is not None else f'{layers} layers'}")
    return RoutingLayout(int(config_field(text, "num_hidden_layers")), indices, k, experts)
