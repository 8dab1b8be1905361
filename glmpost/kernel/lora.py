"""LoRA: the settings, the layers an adapter adapts, and applying one to a loaded model.

**Settings** (:class:`LoraSettings`): ``rank`` (0: none, full fine-tuning), ``alpha`` (the update is
``alpha / rank · B @ A``), ``targets`` (None: :func:`default_targets`) and ``dropout``, which must be 0:
a dropout on the adapter's input is applied by the trainer's forward and by no rollout engine, so the
trainer would score tokens with another function than the one that sampled them (closure breaks).

**Targets** are names of linear layers (a module's last name or a dotted tail of it, as PEFT matches
``target_modules``) plus ``experts``: the routed experts' fused 3-D weights. By default, every linear
layer of attention and MLP the model has, found by name per architecture:

* GLM-5 (``glm_moe_dsa``, the tiny preset ``glmpost init-model`` builds) and other MLA models:
  ``q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj`` (``q_proj`` where a model has no query
  compression), ``gate_proj up_proj down_proj`` of the dense layers and of the shared experts, and
  ``experts``: ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (every routed expert its own
  rank-``r`` pair; ``gate_up_proj`` is one rank-``r`` adapter over the fused gate and up outputs).
  Never the DSA indexer (``wq_b wk weights_proj``: it runs without gradient and picks keys by a
  top-k, so an adapter there would never learn) nor the MoE router (``gate``: its choice is a
  top-k that routing replay records; keeping it frozen keeps recorded routes valid).
* Qwen3, Llama: ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``; GLM-4.5/4.6/4.7 the
  same and ``experts`` (dense first layers, a shared expert beside the routed ones); Qwen3-MoE
  ``q_proj k_proj v_proj o_proj`` and ``experts`` (it has no dense MLP).
  GLM-4 (``glm4``) computes gate and up with one linear layer: ``gate_up_proj down_proj``.

PEFT wraps fused experts (a 3-D ``nn.Parameter``, transformers 5's MoE layout: GLM-5, GLM-4.5/4.6/4.7,
Qwen3-MoE, DeepSeek-V3, Mixtral) with its ``ParamWrapper``, which adds ``scale · B @ A`` to the whole
stack at each forward (in training that stack and its gradient are materialised per layer: a LoRA on
experts costs activation memory of the experts' size, still far less than full fine-tuning's
gradients and optimizer states; leave ``experts`` out of the targets to avoid it).

On transformers 5, PEFT rewrites the ``target_modules`` ``gate_proj up_proj down_proj`` of those MoE
families into the experts' parameters (its v4-compatibility conversion), dropping the dense layers and
shared experts. :func:`peft_config` therefore names such layers as ``target_parameters``
``gate_proj.weight`` ...: the same ``W + scale · B @ A``, saved under the same tensor names
(``...mlp.gate_proj.lora_A.weight``), and an ``adapter_config.json`` that PEFT reloads unchanged.

**Applying** (:func:`apply_adapter`): ``PeftModel.from_pretrained`` injects the adapter into the loaded
base, unmerged, and the injected model itself is returned (its class, config, forward and module
names as the base's; the adapted layers compute ``W x + scale · B (A x)``). Unmerged, not merged
(``W + scale · B A`` once, a little faster), because the rollout engine then computes with the very
modules and operations of the trainer's PEFT model, so closure holds in any dtype: merging agrees in
float32 only to rounding (9.5e-7 on the tiny GLM-5), and in bfloat16 the merged weight rounds the small
update away (5e-3 from the unmerged bfloat16 forward); a new adapter also replaces only the adapter.
Code that reads a layer's ``weight`` directly sees the frozen part alone: GLM-5's native attention
reads ``kv_b_proj`` through the module for that reason. The directory format:
:mod:`glmpost.kernel.lora_versions`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmpost.checkpoints import CheckpointError
from glmpost.config import ConfigError
from glmpost.errors import first_line
from glmpost.kernel.lora_versions import is_lora_version, read_lora_base, write_lora_version

# The version directory format lives in glmpost.kernel.lora_versions; its three entry points are here too.

EXPERTS = "experts"
# The default targets a model has, in this order: attention (GQA: q k v o; MLA: q or q_a q_b, kv_a kv_b,
# o), then MLP.
DEFAULT_CANDIDATES = ("q_proj", "q_a_proj", "q_b_proj", "k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                      "gate_proj", "up_proj", "gate_up_proj", "down_proj")
ADAPTER = "default"  # PEFT's name for a model's one adapter

__all__ = ["DEFAULT_CANDIDATES", "EXPERTS", "LoraSettings", "adapter_state_names", "apply_adapter", "default_targets",
           "expert_parameters", "is_lora_version", "load_adapter", "peft_config", "read_lora_base", "resolve_targets", "write_lora_version"]


@dataclass(frozen=True)
class LoraSettings:
    """What a LoRA adapter is: ``rank`` (0: none), ``alpha``, ``targets`` (None: the architecture's
    :func:`default_targets`), ``dropout`` (only 0: see the module docstring)."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> LoraSettings:
        """Self, or a ConfigError naming the field at fault."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("{lora_rank} {value!r}: expected an integer >= 0 (0: full fine-tuning)", value=self.rank)
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ConfigError("{lora_alpha} {value!r}: expected a number > 0", value=self.alpha)
        if self.dropout != 0:
            raise ConfigError("{lora_dropout} {value!r}: only 0; a dropout the rollout engine does not apply would make "
                              "the trainer score tokens with another function than the one that sampled them", value=self.dropout)
        if self.targets is not None and (not self.targets or not all(isinstance(t, str) and t.strip() for t in self.targets)):
            raise ConfigError("{lora_targets} {value!r}: expected layer names (q_proj, ..., experts)", value=self.targets)
        return self


def _architecture(model: Any) -> str:
    return getattr(model.config, "model_type", None) or type(model).__name__


def _linear_names(model: Any) -> list[str]:
    import torch  # the model's layer types; this module is imported by light ones

    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def expert_parameters(model: Any) -> list[str]:
    """PEFT ``target_parameters`` for the model's fused routed experts: ``mlp.experts.gate_up_proj``
    ... (a 3-D parameter of a module named ``experts``), in order; empty for a dense model."""
    found: list[str] = []
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        if parameter.dim() == 3 and len(parts) >= 3 and parts[-2] == EXPERTS:
            tail = ".".join(parts[-3:])
            if tail not in found:
                found.append(tail)
    return found


def default_targets(model: Any) -> tuple[str, ...]:
    """Every linear layer of attention and MLP ``model`` has (module docstring), and ``experts``
    where it has fused routed experts."""
    leaves = {name.rsplit(".", 1)[-1] for name in _linear_names(model)}
    names = [n for n in DEFAULT_CANDIDATES if n in leaves]
    return (*names, *((EXPERTS,) if expert_parameters(model) else ()))


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def resolve_targets(settings: LoraSettings, model: Any) -> tuple[list[str], list[str]]:
    """``(target_modules, target_parameters)`` for PEFT: each target checked against ``model`` (a
    ConfigError naming an unknown one and the layers there are), then made immune to PEFT's MoE
    rewrite (module docstring)."""
    linear = _linear_names(model)
    modules: list[str] = []
    parameters: list[str] = []
    for target in settings.targets or default_targets(model):
        target = target.strip()
        if target == EXPERTS:
            experts = expert_parameters(model)
            if not experts:
                raise ConfigError("{lora_targets} experts: {arch} has no fused MoE experts", arch=_architecture(model))
            parameters += [p for p in experts if p not in parameters]
        elif any(_matches(name, target) for name in linear):
            modules += [target] if target not in modules else []
        else:
            known = " ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linear))
            raise ConfigError("{lora_targets} {target!r}: no linear layer of {arch} is named so (its linear layers: "
                              "{known}; and experts for fused MoE experts)", target=target, arch=_architecture(model), known=known)
    rewritten = _rewritten_by_peft(modules, model)
    return [m for m in modules if m not in rewritten], parameters + [f"{m}.weight" for m in modules if m in rewritten]


def _rewritten_by_peft(modules: list[str], model: Any) -> set[str]:
    """The ``target_modules`` that PEFT's transformers-5 conversion would move onto MoE experts
    (each tried alone; the conversion refusing one alone means it would move it too)."""
    from peft import LoraConfig  # optional heavy dependency (LoRA only): ~0.7 s on top of transformers

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # transformers 4: no conversion
        return set()
    moved = set()
    for name in modules:
        trial = LoraConfig(r=1, target_modules=[name])
        try:
            convert_peft_config_for_transformers(trial, model=model, conversions=None)
        except ValueError:
            moved.add(name)
            continue
        if name not in set(trial.target_modules or ()):
            moved.add(name)
    return moved


def peft_config(settings: LoraSettings, model: Any, *, task_type: str | None = "CAUSAL_LM"):
    """PEFT's ``LoraConfig`` for ``settings`` on ``model``: rank, alpha, no dropout, no bias, the
    targets of :func:`resolve_targets`."""
    from peft import LoraConfig  # optional heavy dependency (LoRA only)

    settings.check()
    if not settings.enabled:
        raise ConfigError("{lora_rank} 0: no adapter (full fine-tuning)")
    modules, parameters = resolve_targets(settings, model)
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, bias="none", task_type=task_type,
                      target_modules=modules, target_parameters=parameters or None)


def adapter_state_names(model: Any) -> set[str]:
    """The tensor names a PEFT model's adapter saves as (``base_model.model....lora_A.weight``)."""
    from peft import get_peft_model_state_dict  # optional heavy dependency (LoRA only)

    return set(get_peft_model_state_dict(model))


def _saved_names(adapter_dir: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
        return set(f.keys())


def apply_adapter(model: Any, adapter_dir: Path | str, *, where: Path | str | None = None) -> Any:
    """``model`` with the PEFT adapter of ``adapter_dir`` injected, unmerged, as
    ``PeftModel.from_pretrained`` applies it (its adapter weights as PEFT loads them: float32 unless
    saved wider). Refused in one line (CheckpointError naming ``where``, default ``adapter_dir``): an
    adapter that does not fit the model, one with a dropout, one whose file lacks a tensor the
    config asks for or holds one no layer takes."""
    inner = load_adapter(model, adapter_dir, where=where).base_model.model
    inner.glmpost_adapter = str(adapter_dir)  # what was applied: readers can tell a LoRA model
    return inner


def load_adapter(model: Any, adapter_dir: Path | str, *, where: Path | str | None = None, trainable: bool = False) -> Any:
    """The ``PeftModel`` of :func:`apply_adapter` (checked as it says); ``trainable``: its adapter's
    parameters require grad (a trainer continuing it), the base's never."""
    from peft import PeftModel  # optional heavy dependency (LoRA only)

    adapter_dir = Path(adapter_dir)
    where = where or adapter_dir
    try:
        with warnings.catch_warnings():  # PEFT asks transformers 5 a deprecated question (is_gradient_checkpointing)
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=ADAPTER, is_trainable=trainable)
    except Exception as exc:  # PEFT raises many types for an adapter that does not fit (ValueError, KeyError, RuntimeError, ...)
        raise CheckpointError(f"{where}: the adapter does not apply to its base ({first_line(exc)})") from None
    config = wrapped.peft_config[ADAPTER]
    if getattr(config, "lora_dropout", 0) or type(config).__name__ != "LoraConfig":
        raise CheckpointError(f"{where}: not a dropout-free LoRA adapter ({type(config).__name__}, dropout "
                              f"{getattr(config, 'lora_dropout', None)}); glmpost applies LoRA with dropout 0 only")
    expected, saved = adapter_state_names(wrapped), _saved_names(adapter_dir)
    for problem, names in (("lacks", expected - saved), ("holds unused", saved - expected)):
        if names:
            more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointError(f"{where}: adapter_model.safetensors {problem} tensor {sorted(names)[0]}{more}")
    return wrapped
