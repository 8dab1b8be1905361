"""LoRA training (issue 45): the training stages' policy trained as a PEFT adapter over frozen base
weights and published as a LoRA version (:mod:`glmpost.kernel.lora_versions`).

**Settings** (:class:`LoraOptions`, a section of :class:`~glmpost.rl.run.RunOptions`):
``--lora-rank`` (0, the default: every weight trains, full fine-tuning as before), ``--lora-alpha``,
``--lora-targets`` (default: :func:`glmpost.kernel.lora.default_targets`), ``--lora-dropout`` (only 0:
the rollout engine applies no dropout, so a trainer that did would score tokens with another
function than the one that sampled them). The critic of train-sao stays a full model.

**The trained model** (:meth:`LoraTraining.load_base`, then :meth:`LoraTraining.adapt` outside
ZeRO-3's partitioned creation: the adapter is made whole, the same on every rank), from the run's parent:

* a full version: its published weights frozen (never the float32 masters a bf16 version keeps in
  ``trainer_state``: no rollout engine computes with those), a fresh adapter injected by PEFT's
  ``get_peft_model`` (:func:`~glmpost.kernel.lora.peft_config`): ``lora_A`` drawn as PEFT draws it
  (Kaiming-uniform) from seed :data:`LORA_SEED` (every rank and every rerun the same), ``lora_B`` zero,
  so the first forward is the parent's;
* a LoRA version: its base frozen and the parent's adapter trainable (``PeftModel.from_pretrained``);
  a rank, alpha or targets other than the parent's ``adapter_config.json`` is refused in one line.

The base is float32 under ``precision`` fp32; under bf16 it stays in its saved dtype (what the
rollout engine computes with; autocast runs the matmuls in bfloat16 either way) but for the LM head,
float32 as in full fine-tuning. The adapter is float32 (PEFT upcasts a low-precision one): its
parameters are the fp32 masters, published as they are. Only they require grad, so AdamW (torch's,
or DeepSpeed ZeRO-1/2/3's) holds states of the adapter alone. ZeRO-3 trains linear-layer targets
only (:func:`prepare_zero3` says why).

**Published** by the LoRA backends' ``save_model`` (:class:`LoraTorchBackend`,
:class:`LoraDeepSpeedBackend`): :func:`~glmpost.kernel.lora.write_lora_version` into the run's staging,
naming as base the full version under the parent chain (the parent, or the parent's base); the run
then publishes it as any version (stage.json, the manifest keeping ``lora_base``, ``LATEST``). Where
the trained model is the version's float32 function, whole on rank 0 (fp32, not ZeRO-3), its
fingerprint is kept beside it (``glmpost-fingerprint.json``), so ``sync-weights`` does not load the
base and adapter again to compute it. The
optimizer state is the adapter's, carried from a LoRA parent like full training carries its own (a
full parent's is the full model's: a LoRA version starts AdamW afresh). Resume states hold the
adapter and its optimizer state, not the frozen base.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmpost.checkpoints import CheckpointManifest, tokenizer_revision
from glmpost.config import ConfigError, setting
from glmpost.kernel.fingerprint import keep_fingerprint
from glmpost.kernel.loading import load_weights, ready_model, saved_dtype
from glmpost.kernel.lora import LoraSettings, load_adapter, peft_config, resolve_targets
from glmpost.kernel.lora_versions import ADAPTER_CONFIG, is_lora_version, read_lora_base, write_lora_version
from glmpost.rl.distributed import DeepSpeedBackend, TorchBackend

LORA_SEED = 0  # lora_A of a fresh adapter: the same on every rank and in every rerun
LORA_STAGES = ("train-grpo", "opd-merge", "train-sao")  # the stages with --lora-* options (commands/options.py LORA_OPTIONS)


@dataclass
class LoraOptions:
    """The training stages' LoRA settings (module doc); :meth:`settings` checks them."""

    lora_rank: int = setting(0, "Train a LoRA adapter of this rank on the policy instead of every weight (0: full "
                             "fine-tuning). The base stays frozen; the new version is the adapter alone, naming its base "
                             "(a LoRA version). From a LoRA version: its adapter continues (give its rank, alpha and targets).",
                             min=0)
    lora_alpha: float = setting(16.0, "LoRA alpha: the adapter adds alpha / rank x B A to each target's weight.", above=0.0)
    lora_targets: list[str] = setting(
        [], "Layers the LoRA adapter adapts, by name (repeat, or separate with commas): linear layers of attention and "
        "MLP (q_proj k_proj v_proj o_proj; MLA: q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj; gate_proj up_proj "
        "down_proj) and experts (the routed experts' fused weights). Default: every linear layer of attention and MLP "
        "the model has, and experts where it has fused MoE experts (never the DSA indexer nor the MoE router).")
    lora_dropout: float = setting(0.0, "LoRA dropout: only 0. The rollout engine applies no dropout, so training with one "
                                  "would score tokens with another function than the one that sampled them.")

    def settings(self) -> LoraSettings:
        """The checked :class:`~glmpost.kernel.lora.LoraSettings` (a ConfigError naming the option at fault)."""
        targets = tuple(t.strip() for item in self.lora_targets for t in str(item).split(",") if t.strip())
        if self.lora_targets and not targets:
            raise ConfigError("{lora_targets} {value!r}: expected layer names (q_proj, ..., experts)", value=self.lora_targets)
        return LoraSettings(self.lora_rank, float(self.lora_alpha), targets or None, self.lora_dropout).check()


class LoraTraining:
    """The policy's adapter in a training run (module doc): how it loads, which backends train it,
    and how a version of it is written. Made by :func:`lora_training` (None for full fine-tuning)."""

    def __init__(self, settings: LoraSettings, parent: Path):
        self.settings = settings
        self.continues = is_lora_version(parent)  # the parent's adapter trains on
        self.base = read_lora_base(parent) if self.continues else Path(parent)
        self.peft: Any = None

    @property
    def model(self) -> torch.nn.Module:
        """The trained model: the base's own class with the adapter's layers injected."""
        return self.peft.base_model.model

    def load_base(self, session: Any) -> torch.nn.Module:
        """The frozen base's weights: float32, or under bf16 in their saved dtype (module doc); under
        ZeRO-3, inside the run's partitioned loading, created partitioned."""
        return load_weights(self.base, "float32" if session.precision == "fp32" else saved_dtype(self.base))

    def adapt(self, model: torch.nn.Module, parent: Path, session: Any, *, deterministic_topk: bool,
              attention: str) -> torch.nn.Module:
        """``model`` (:meth:`load_base`) with the adapter injected (module doc), ready on this rank's
        device; only the adapter's parameters require grad. Outside ZeRO-3's partitioned creation:
        the adapter is made (or read) whole, the same on every rank as in one process."""
        from peft import get_peft_model  # optional heavy dependency (LoRA only)

        if self.continues:
            check_same_adapter(parent, self.settings, model)
            self.peft = load_adapter(model, parent, trainable=True)
        else:
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # PEFT asks transformers 5 a deprecated question
                torch.manual_seed(LORA_SEED)
                self.peft = get_peft_model(model, peft_config(self.settings, model))
        head = self.model.get_output_embeddings()
        if head is not None and head.weight.dtype != torch.float32 and not hasattr(head.weight, "ds_id"):
            head.float()  # the LM head in float32, as full fine-tuning computes it
        return ready_model(self.model, parent, device=session.device, deterministic_topk=deterministic_topk,
                           attention=attention)

    def load(self, parent: Path, session: Any, *, deterministic_topk: bool, attention: str) -> torch.nn.Module:
        """:meth:`load_base` then :meth:`adapt` (one process)."""
        return self.adapt(self.load_base(session), parent, session, deterministic_topk=deterministic_topk, attention=attention)

    def backends(self) -> tuple[Any, Any]:
        """The optimisation backends (one process, DeepSpeed) that train and publish the adapter."""
        return functools.partial(LoraTorchBackend, lora=self), functools.partial(LoraDeepSpeedBackend, lora=self)

    def save(self, directory: Path) -> None:
        """Rank 0, the adapter's values whole: the LoRA version into ``directory`` (the run's staging);
        its manifest is the run's to write, keeping the ``lora_base`` written here."""
        staged = CheckpointManifest(policy_version=0, tokenizer_revision=tokenizer_revision(self.base), stage="staging")
        write_lora_version(directory, self.peft, base=self.base, manifest=staged)
        if self.scores_as_loaded():  # sync-weights then reads the version's fingerprint instead of loading it
            keep_fingerprint(directory, self.model)

    def scores_as_loaded(self) -> bool:
        """Whether the trained model computes what the published version loads as in float32 (a
        fingerprint, :mod:`glmpost.kernel.fingerprint`): every parameter float32 and whole on this
        rank (not under bf16's base in its saved dtype, nor ZeRO-3's partitioned base)."""
        return all(p.dtype == torch.float32 and not hasattr(p, "ds_id") for p in self.model.parameters())


def lora_training(options: LoraOptions, parent: Path, stage: str) -> LoraTraining | None:
    """The LoRA side of a ``stage`` run from ``parent`` (None: full fine-tuning); in a stage that
    trains LoRA (:data:`LORA_STAGES`) a LoRA parent with ``lora_rank`` 0 is refused (full fine-tuning
    would train the base, which the version does not hold; other stages, qat, refuse it themselves)."""
    settings = options.settings()
    if not settings.enabled:
        if stage in LORA_STAGES and is_lora_version(parent):
            config = _adapter_config(parent)
            raise ConfigError("{lora_rank} 0 trains every weight, but {parent} is a LoRA version: continue its adapter with "
                              "{lora_rank} {rank} {lora_alpha} {alpha} (and its {lora_targets})", parent=parent,
                              rank=config.get("r"), alpha=config.get("lora_alpha"))
        return None
    return LoraTraining(settings, parent)


def _adapter_config(directory: Path) -> dict:
    try:
        return json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("{parent}: unreadable {name} ({reason})", parent=directory, name=ADAPTER_CONFIG, reason=exc,
                          exit_code=1) from None


def check_same_adapter(parent: Path, settings: LoraSettings, model: Any) -> None:
    """Refuse, in one line naming the options, settings whose adapter is not the LoRA version
    ``parent``'s (its rank, alpha, target modules and parameters as resolved on ``model``)."""
    config = _adapter_config(parent)
    modules, parameters = resolve_targets(settings, model)
    theirs = config.get("target_modules") or []
    theirs = [theirs] if isinstance(theirs, str) else theirs
    differ = []
    if config.get("r") != settings.rank:
        differ.append(f"rank {settings.rank} vs {config.get('r')}")
    if float(config.get("lora_alpha", 0)) != settings.alpha:
        differ.append(f"alpha {settings.alpha:g} vs {config.get('lora_alpha')}")
    if set(modules) != set(theirs) or set(parameters) != set(config.get("target_parameters") or []):
        differ.append(f"targets {' '.join(sorted([*modules, *parameters]))} vs "
                      f"{' '.join(sorted([*theirs, *(config.get('target_parameters') or [])]))}")
    if differ:
        raise ConfigError("{lora_rank} / {lora_alpha} / {lora_targets}: the parent {parent} is a LoRA version whose adapter "
                          "this update continues, and its settings differ ({differ}); give the parent's", parent=parent,
                          differ="; ".join(differ))


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained (adapter) parameters of ``model`` by name, detached copies."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor], *, where: Path) -> None:
    """:func:`adapter_state` output back into ``model`` (every trained parameter, nothing else)."""
    own = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(own) != set(state):
        missing = sorted(set(own) ^ set(state))
        raise ConfigError("{resume} {where}: its adapter state does not fit this run's adapter (e.g. {name}); pass {overwrite}",
                          where=where, name=missing[0], exit_code=1)
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(state[name])


class LoraTorchBackend(TorchBackend):
    """:class:`~glmpost.rl.distributed.TorchBackend` over the adapter: it publishes a LoRA version,
    resumes the adapter alone, and takes a parent's optimizer state only from a LoRA parent."""

    def __init__(self, model: torch.nn.Module, config: Any, *, precision: str = "fp32", lora: LoraTraining):
        self.lora = lora
        super().__init__(model, config, precision=precision)

    def save_model(self, directory: Path, **_: Any) -> None:
        self.lora.save(directory)

    def load_optimizer(self, path: Path) -> bool:
        return self.lora.continues and super().load_optimizer(path)

    def save_resume_state(self, path: Path, step: int, history: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"adapter": adapter_state(self.model), "optimizer": self.optimizer.state_dict(), "step": step,
                    "history": history}, tmp)
        os.replace(tmp, path)

    def load_resume_state(self, path: Path) -> tuple[int, list[dict]]:
        saved = torch.load(path, map_location="cpu", weights_only=False)
        load_adapter_state(self.model, saved["adapter"], where=path)
        self.optimizer.load_state_dict(saved["optimizer"])
        return int(saved["step"]), list(saved["history"])


def prepare_zero3(model: torch.nn.Module) -> None:
    """What ZeRO-3 needs of a LoRA model, after DeepSpeed took it.

    Refused (a ConfigError naming ``lora_targets``): targets PEFT adapts as parameters (its
    ``ParamWrapper``: fused MoE experts, and the dense MLPs of MoE families, whose layers PEFT would
    otherwise move onto the experts). Such a wrapper reads the wrapped weight and its ``lora_A`` /
    ``lora_B`` weights directly (``W + s B A`` as a parametrization), not through the module forwards
    DeepSpeed hooks, and two ZeRO-3 ranks then train another adapter than one process (measured on
    the tiny GLM-5); linear-layer targets train the same (9e-7).

    The frozen LM head runs inside the chunked log-probs' checkpoints; DeepSpeed (0.19) releases a
    frozen parameter after its forward (before its trace is complete, persistent ones too) and does
    not gather it again for the recomputation in the backward pass. Marked as DeepSpeed marks a
    parameter one module hands to another, it is not released after a forward: the head stays whole
    from its first use to the end of the step (vocabulary x hidden on every rank)."""
    from peft.tuners.lora.layer import ParamWrapper  # optional heavy dependency (LoRA only)

    wrapped = sorted({"experts" if ".experts" in name else name.rsplit(".", 1)[-1]
                      for name, m in model.named_modules() if isinstance(m, ParamWrapper)})
    if wrapped:
        raise ConfigError("{lora_targets}: under {zero_stage} 3, PEFT's LoRA on fused MoE experts and on the MLPs of MoE "
                          "models ({wrapped}) does not train as in one process; name linear layers of attention "
                          "(q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj, or q_proj k_proj v_proj o_proj), or "
                          "train with ZeRO-1/2", wrapped=" ".join(wrapped))
    head = model.get_output_embeddings()
    for parameter in head.parameters() if head is not None else ():
        if not parameter.requires_grad:
            parameter.is_external_param = True


class LoraDeepSpeedBackend(DeepSpeedBackend):
    """:class:`~glmpost.rl.distributed.DeepSpeedBackend` over the adapter: its checkpoints (optimizer
    state, resume state) leave the frozen base out; rank 0 publishes the LoRA version (ZeRO-3: the
    adapter gathered whole first)."""

    saves_frozen = False

    def __init__(self, model: torch.nn.Module, config: Any, *, lora: LoraTraining, **kwargs: Any):
        self.lora = lora
        super().__init__(model, config, **kwargs)
        if self.zero_stage == 3:
            prepare_zero3(model)

    def save_model(self, directory: Path, **_: Any) -> None:
        gathered = contextlib.nullcontext()
        if self.zero_stage == 3:
            import deepspeed  # optional heavy dependency (DeepSpeed runs only)

            gathered = deepspeed.zero.GatheredParameters([p for p in self.model.parameters() if p.requires_grad])
        with gathered:
            if self.rank == 0:
                self.lora.save(directory)

    def load_optimizer(self, path: Path) -> bool:
        return self.lora.continues and super().load_optimizer(path)


__all__ = ["LORA_SEED", "LORA_STAGES", "LoraDeepSpeedBackend", "LoraOptions", "LoraTorchBackend", "LoraTraining",
           "adapter_state", "check_same_adapter", "load_adapter_state", "lora_training"]
