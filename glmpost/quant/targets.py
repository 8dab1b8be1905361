"""Which weights a quantization run touches.

Names are the checkpoint's on-disk module names (what vLLM/SGLang see). Candidates are the weights
of every ``nn.Linear``, the routed experts (``GlmMoeDsaForCausalLM`` holds them in memory as fused
3-D parameters ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``; on
disk, and here, they are per expert ``mlp.experts.<e>.{gate,up,down}_proj``; rows are independent
under group/channel quantization, so both views give the same codes — not so for fp8 128x128
blocks when I is not a multiple of 128), the MoE router weight and the embeddings.

Selection, in order:

1. ``targets="all"``: every ``nn.Linear`` and routed expert; ``"moe-only"``: routed experts only;
2. minus the default skips: embeddings, ``lm_head``, the MoE router ``mlp.gate`` and the DSA
   indexer ``indexer.`` (they decide routing/sparsity, where a small error flips a choice), and
   the MLA up-projection ``self_attn.kv_b_proj`` (:data:`LOADER_SKIP`): SGLang's DeepseekV2/V3
   loader, which serves GLM-5, reads ``kv_b_proj.weight`` in ``post_load_weights`` to split it into
   ``w_kc`` / ``w_vc``; it copes with fp8 and plain int8 there, but a pack-quantized layer has no
   ``weight``, so SGLang cannot load it. The skip holds for every scheme: one rule, for ``quantize``,
   ``qat`` and ``sync-weights`` alike;
3. plus candidates matching any ``--include`` regex (this overrides 1 and 2: ``--include kv_b_proj``
   quantizes it anyway, ``--targets moe-only --include lm_head`` adds ``lm_head`` to the experts);
4. minus candidates matching any ``--exclude`` regex (this overrides 3).

Regexes are ``re.search``-ed against module names; one that matches no candidate is an error.
``qat`` applies the same rules to the model in memory (:func:`glmpost.quant.qat.qat_targets`), so
QAT trains exactly the layers ``quantize`` deploys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from glmpost.config import ConfigError, setting

TARGET_MODES = ("all", "moe-only")
ROUTING_SKIP = (r"embed_tokens", r"(^|\.)lm_head$", r"\.mlp\.gate$", r"\.indexer\.")
LOADER_SKIP = (r"(^|\.)kv_b_proj$",)  # SGLang's DeepseekV2 post_load_weights reads kv_b_proj.weight
DEFAULT_SKIP = ROUTING_SKIP + LOADER_SKIP
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")


@dataclass
class LayerSelection:
    """Which layers a stage quantizes: the same settings in ``quantize`` and ``qat`` (their configs
    inherit them)."""

    targets: str = setting("all", "all (every Linear and routed expert but the default skips) or moe-only "
                           "(routed experts only, everything else in float: the safe recipe for SGLang).")
    include: list[str] = setting([], "Regex of module names to quantize too, whatever --targets and the default "
                                 "skips say (e.g. kv_b_proj, lm_head; repeatable).")
    exclude: list[str] = setting([], "Regex of module names to keep in float, even if --include names them "
                                 "(repeatable).")


@dataclass(frozen=True)
class Candidate:
    module: str  # on-disk module name, e.g. model.layers.1.mlp.experts.0.up_proj
    kind: str  # "linear", "expert" or "embedding"


def candidates_from_model(model, disk_shapes: dict[str, tuple[int, ...]]) -> list[Candidate]:
    """Quantizable 2-D weights of ``disk_shapes`` (on-disk name -> shape), classified with ``model``
    (a skeleton, e.g. built on the meta device, whose modules name the classes)."""
    import torch

    linear, embedding, fused_expert_parents = set(), set(), set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            linear.add(name)
        elif isinstance(module, torch.nn.Embedding):
            embedding.add(name)
    for name, param in model.named_parameters():
        if param.dim() == 3 and re.search(r"\.experts\.(gate_up_proj|down_proj)$", name):
            fused_expert_parents.add(name.rsplit(".", 1)[0])
    out = []
    for key in sorted(disk_shapes):
        if not key.endswith(".weight") or len(disk_shapes[key]) != 2:
            continue
        module = key[: -len(".weight")]
        if module in linear:
            kind = "linear"
        elif module in embedding:
            kind = "embedding"
        elif EXPERT.search(module) and (module.rsplit(".", 2)[0] in fused_expert_parents or module in linear):
            kind = "expert"
        elif module.endswith(".mlp.gate"):
            kind = "router"  # GLM's router is its own module class holding a [E, H] weight
        else:
            continue
        out.append(Candidate(module, "expert" if EXPERT.search(module) else kind))
    return out


def _compile(patterns: Iterable[str], field: str) -> list[re.Pattern]:
    """The regexes of config field ``field`` (``include`` / ``exclude``), compiled."""
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as exc:
            raise ConfigError("{%s} {pattern!r}: not a valid regular expression ({reason})" % field, pattern=p, reason=exc) from None
    return compiled


def check_patterns_match(names: list[str], patterns: dict[str, list[re.Pattern]], *, what: str) -> None:
    """Refuse a regex (``{field: compiled}``, ``include`` / ``exclude``) that matches none of ``names``,
    the quantizable layers of ``what`` (``this checkpoint``, ``this model``)."""
    for field, compiled in patterns.items():
        for p in compiled:
            if not any(p.search(n) for n in names):
                raise ConfigError("{%s} {pattern!r} matches no quantizable layer of {what}" % field, pattern=p.pattern, what=what)


def select_targets(
    candidates: list[Candidate],
    *,
    targets: str = "all",
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
) -> list[str]:
    """Module names to quantize (sorted), by the rules in this module's docstring; a refusal names the
    config fields ``targets``, ``include`` and ``exclude``."""
    if targets not in TARGET_MODES:
        raise ConfigError("{targets} {value!r}: expected one of {known}", value=targets, known=", ".join(TARGET_MODES))
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
    check_patterns_match([c.module for c in candidates], {"include": inc, "exclude": exc}, what="this checkpoint")
    skip = [re.compile(p) for p in DEFAULT_SKIP]
    chosen = set()
    for c in candidates:
        base = c.kind == "expert" if targets == "moe-only" else c.kind in ("linear", "expert")
        if base and not any(p.search(c.module) for p in skip):
            chosen.add(c.module)
        if any(p.search(c.module) for p in inc):
            chosen.add(c.module)
    chosen = {n for n in chosen if not any(p.search(n) for p in exc)}
    return sorted(chosen)
