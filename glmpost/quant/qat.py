"""Fake quantization inside a model for QAT: the forward sees ``dequant(quantize(w))``, the optimizer
updates the float master weight through the straight-through estimator (brief, "STE 的反向").

Each targeted weight gets a :mod:`torch.nn.utils.parametrize` parametrization calling
:func:`glmpost.quant.core.fake_quant` — the same function, codes and stored scale as the offline
quantizer, so the deployed weights equal the QAT forward bit for bit (DESIGN.md §5). Targets are the
``nn.Linear`` weights and the fused MoE expert tensors (``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]``; their rows are the on-disk per-expert ``gate/up/down_proj`` rows,
and integer group / channel scales never cross rows), minus the default skips of
:mod:`glmpost.quant.targets` (embeddings, ``lm_head``, the MoE router, the DSA indexer, and
``kv_b_proj``, which SGLang's DeepseekV2 loader needs unpacked), by the same rules as ``quantize``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize

from glmpost.config import ConfigError, setting
from glmpost.quant.core import check_shape, fake_quant
from glmpost.quant.spec import GroupSizeSetting, QuantSpec
from glmpost.quant.targets import DEFAULT_SKIP, TARGET_MODES, LayerSelection, check_patterns_match

QAT_SCHEMES = ("none", "w4a16", "w8a16", "w8a8-dynamic")
FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass
class QATQuantization(GroupSizeSetting, LayerSelection):
    """What ``qat`` fake-quantizes: the scheme, and the group size and layers as ``quantize`` takes
    them (so the deployed checkpoint is quantized exactly as trained)."""

    scheme: str = setting("w4a16", "Fake quantization: w4a16 (int4 groups), w8a16, w8a8-dynamic (weights), or none (plain SFT).")


class FakeQuantWeight(torch.nn.Module):
    """Parametrization: the weight as the quantized model will see it."""

    def __init__(self, spec: QuantSpec):
        super().__init__()
        self.spec = spec

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quant(weight, self.spec)


def qat_targets(
    model: torch.nn.Module, *, targets: str = "all", include: Iterable[str] = (), exclude: Iterable[str] = ()
) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name, module, parameter)`` of every weight QAT fake-quantizes (names as in ``named_modules``);
    a refusal names the config fields ``targets``, ``include`` and ``exclude``."""
    if targets not in TARGET_MODES:
        raise ConfigError("{targets} {value!r}: expected all or moe-only", value=targets)
    include = [re.compile(p) for p in include]
    exclude = [re.compile(p) for p in exclude]
    skip = [re.compile(p) for p in DEFAULT_SKIP]
    found: list[tuple[str, torch.nn.Module, str]] = []
    candidates: list[tuple[str, torch.nn.Module, str, bool]] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            candidates.append((name, module, "weight", False))
        for param in FUSED_EXPERT_PARAMS:
            value = getattr(module, param, None) if name.endswith(".experts") else None
            if isinstance(value, torch.nn.Parameter) and value.dim() == 3:
                candidates.append((f"{name}.{param}", module, param, True))
    check_patterns_match([c[0] for c in candidates], {"include": include, "exclude": exclude}, what="this model")
    for name, module, param, is_expert in candidates:
        chosen = (is_expert or targets == "all") and not any(p.search(name) for p in skip)
        chosen = (chosen or any(p.search(name) for p in include)) and not any(p.search(name) for p in exclude)
        if chosen:
            found.append((name, module, param))
    if not found:
        raise ConfigError("{targets} {value}: no layer of this model is selected for quantization", value=targets)
    return found


def apply_fake_quant(model: torch.nn.Module, spec: QuantSpec, **selection) -> list[str]:
    """Parametrize the targeted weights with fake quant; returns their names."""
    if spec.scheme not in QAT_SCHEMES:
        raise ConfigError("{scheme} {value}: QAT supports {known} (fp8-block is a rollout checkpoint format for `glmpost quantize`)",
                          value=spec.scheme, known=", ".join(QAT_SCHEMES))
    if spec.scheme == "none":
        return []
    chosen = qat_targets(model, **selection)
    for name, module, param in chosen:
        check_shape(tuple(getattr(module, param).shape), spec, name)
    for name, module, param in chosen:
        parametrize.register_parametrization(module, param, FakeQuantWeight(spec), unsafe=True)
    return [name for name, _, _ in chosen]


def remove_fake_quant(model: torch.nn.Module) -> None:
    """Drop the parametrizations, keeping the float master weights (what a checkpoint stores)."""
    for module in model.modules():
        if parametrize.is_parametrized(module):
            for param in list(module.parametrizations.keys()):
                parametrize.remove_parametrizations(module, param, leave_parametrized=False)
