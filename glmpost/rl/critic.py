"""SAO's critic ``V_phi`` (brief, "SAO：一条轨迹完成就训练"): the policy architecture with a value
head, initialised from a policy checkpoint, its attention frozen by default.

A critic directory is the policy's Hugging Face checkpoint (config, weights, tokenizer; the
language-model head is kept, unused, so every glmpost loader reads it) plus ``value_head.safetensors``
(``weight [1, hidden]``, ``bias [1]``) and ``glmpost.json`` whose ``extra.critic`` names the
checkpoint it was initialised from. ``V(t)`` is the head on the backbone's last hidden state at
position ``t``: the value of the state after token ``t``.

Freezing (brief: the critic's attention is frozen, only the MoE projections train): by default only
the value head and the ``mlp`` parameters (experts, shared experts, router, dense MLPs) train;
``train=("mlp", "attention")`` also trains every ``self_attn`` parameter (the DSA indexer among
them). Embeddings, norms and the unused language-model head stay frozen.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from glmpost.config import setting
from glmpost.checkpoints import (TOKENIZER_FILES, CheckpointError, CheckpointManifest, load_model, read_manifest, resolve_checkpoint,
                                 tokenizer_revision, write_manifest)

VALUE_HEAD = "value_head.safetensors"
CRITIC_GROUPS = {"mlp": ".mlp.", "attention": ".self_attn."}  # trainable groups: a parameter-name part each
DEFAULT_TRAINED = ("mlp",)


class ValueModel(nn.Module):
    """``values = head(backbone(input_ids).last_hidden_state)``, float32 ``[B, L]``."""

    def __init__(self, language_model: nn.Module, head: nn.Linear):
        super().__init__()
        self.language_model = language_model
        self.value_head = head

    @property
    def config(self):
        return self.language_model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.language_model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


def new_value_head(hidden_size: int, *, seed: int = 0) -> nn.Linear:
    """A float32 head with a zero bias and N(0, 0.02^2) weights from ``seed`` (small initial values)."""
    head = nn.Linear(hidden_size, 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.02)
        head.bias.zero_()
    return head


@dataclass
class InitCriticConfig:
    """``init-critic``'s settings."""

    seed: int = setting(0, "Seed of the value head's initial weights (N(0, 0.02^2); its bias is 0).")


def init_critic_root(policy: Path | str, out: Path | str, config: InitCriticConfig, *, options: dict[str, Any]) -> dict[str, Any]:
    """``init-critic``: a critic made from ``policy`` published as ``out``'s version 0 (``LATEST``),
    with ``stage.json`` (the tensors frozen by default) and ``metrics.jsonl``; a root that holds a
    version already is left as it is. Returns the summary."""
    import shutil

    from glmpost.checkpoints import CheckpointRoot
    from glmpost.stage import MetricsWriter, write_stage_json

    root = CheckpointRoot(out)
    if root.versions():
        return {"out": str(out), "skipped": True, "policy_version": root.latest()}
    staging = root.path / ".staging-init-critic"
    if staging.exists():  # an interrupted earlier run
        shutil.rmtree(staging)
    facts = init_critic(policy, staging, seed=config.seed)
    with MetricsWriter(staging / "metrics.jsonl") as metrics:
        metrics.write(**{f"critic/{key}": value for key, value in facts.items() if key != "frozen"})
    write_stage_json(staging, "init-critic", options, policy=str(resolve_checkpoint(policy)), frozen_by_default=facts["frozen"])
    root.publish(staging, 0)
    return {"out": str(out), "skipped": False, "policy_version": 0, "from": str(resolve_checkpoint(policy)),
            **{key: value for key, value in facts.items() if key != "frozen"}, "frozen_tensors": len(facts["frozen"])}


def init_critic(policy: Path | str, out: Path | str, *, seed: int = 0) -> dict[str, Any]:
    """Write a critic initialised from ``policy`` (a root or version directory) into the directory
    ``out`` (created); returns its parameter counts and the tensors frozen by default."""
    from safetensors.torch import save_file

    source = resolve_checkpoint(policy)
    out = Path(out)
    model = load_model(source, dtype="float32")
    model.save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):  # not the policy's stage.json, metrics or manifest
        if (source / name).is_file() and not (out / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    head = new_value_head(model.config.hidden_size, seed=seed)
    save_file({"weight": head.weight.detach().contiguous(), "bias": head.bias.detach().contiguous()}, str(out / VALUE_HEAD))
    write_manifest(out, CheckpointManifest(policy_version=0, tokenizer_revision=tokenizer_revision(out), stage="init-critic",
                                           parent=str(source), extra={"critic": {"from": str(source), "seed": seed}}))
    critic = ValueModel(model, head)
    frozen = freeze_critic(critic)
    return {"parameters": sum(p.numel() for p in critic.parameters()),
            "trainable_parameters": sum(p.numel() for p in critic.parameters() if p.requires_grad), "frozen": frozen}


def load_critic(critic: Path | str, *, policy: Path | str | None = None, device: Any = "cpu", **load: Any) -> ValueModel:
    """The critic at ``critic`` (a root or version directory). With ``policy``, a critic of another
    architecture or tokenizer is refused (one :class:`~glmpost.checkpoints.CheckpointError` line)."""
    from safetensors.torch import load_file

    directory = resolve_checkpoint(critic)
    if not (directory / VALUE_HEAD).is_file():
        raise CheckpointError(f"{directory}: not a critic (no {VALUE_HEAD}); make one with init-critic")
    if policy is not None:
        check_critic(directory, resolve_checkpoint(policy))
    model = load_model(directory, device=device, **load)
    state = load_file(str(directory / VALUE_HEAD))
    head = nn.Linear(model.config.hidden_size, 1)
    try:
        head.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{directory / VALUE_HEAD}: does not fit hidden size {model.config.hidden_size} "
                              f"({str(exc).splitlines()[0]})") from None
    return ValueModel(model, head.to(device))


def check_critic(critic: Path, policy: Path) -> None:
    """Refuse a critic whose tokenizer revision or architecture differs from the policy's."""
    critic_revision, policy_revision = read_manifest(critic).tokenizer_revision, tokenizer_revision(policy)
    if critic_revision != policy_revision:
        raise CheckpointError(f"{critic}: critic of tokenizer revision {critic_revision}, the policy {policy} has "
                              f"{policy_revision}; its values are of other token ids")
    keys = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (critic, policy))
    differ = [k for k in keys if mine.get(k) != theirs.get(k)]
    if differ:
        raise CheckpointError(f"{critic}: critic of another architecture than {policy} "
                              f"({', '.join(f'{k} {mine.get(k)!r} vs {theirs.get(k)!r}' for k in differ)})")


def freeze_critic(model: ValueModel, train: Sequence[str] = DEFAULT_TRAINED) -> list[str]:
    """Leave trainable only the value head and the parameters of the ``train`` groups
    (:data:`CRITIC_GROUPS`); returns the frozen parameter names (for stage.json)."""
    unknown = sorted(set(train) - set(CRITIC_GROUPS))
    if unknown:
        raise ValueError(f"unknown critic parameter group(s) {unknown}; known: {sorted(CRITIC_GROUPS)}")
    parts = [CRITIC_GROUPS[group] for group in train]
    frozen = []
    for name, parameter in model.named_parameters():
        trained = name.startswith("value_head.") or any(part in name for part in parts)
        parameter.requires_grad_(trained)
        if not trained:
            frozen.append(name)
    return frozen


def critic_values(critic: ValueModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]`` values aligned with the trainer's log-probs: entry ``t`` is the value of the state
    that predicts token ``t + 1`` (the backbone's hidden state at position ``t``), so the action
    mask and the GAE of a :class:`~glmpost.rl.batches.MicroBatch` index it directly."""
    return critic(input_ids, attention_mask)[:, :-1]
