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

from glmpost.checkpoints import (
    MANIFEST,
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointManifest,
    CheckpointRoot,
    model_folder_problem,
    read_manifest,
    resolve_checkpoint,
    tokenizer_revision,
    version_dir_name,
    write_manifest,
)
from glmpost.config import ConfigError, setting
from glmpost.kernel.loading import load_model, load_weights
from glmpost.kernel.lora import load_adapter
from glmpost.kernel.lora_versions import is_lora_version, model_dir, read_lora_base
from glmpost.stage import MetricsWriter, write_stage_json

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
        with torch.autocast(hidden.device.type, enabled=False):  # the value head in its weight's dtype
            return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def save_pretrained(self, directory: Path | str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The critic directory's weights (the module doc): the language model's Hugging Face files
        and :data:`VALUE_HEAD`; ``state_dict`` (a ZeRO-3 gathered one) instead of the module's own."""
        from safetensors.torch import save_file

        state = self.state_dict() if state_dict is None else state_dict
        model = {k.removeprefix("language_model."): v for k, v in state.items() if k.startswith("language_model.")}
        self.language_model.save_pretrained(directory, state_dict=model)
        head = {k.removeprefix("value_head."): v.detach().contiguous() for k, v in state.items() if k.startswith("value_head.")}
        save_file(head, str(Path(directory) / VALUE_HEAD))


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

    problem = model_folder_problem(out)
    if problem:
        raise ConfigError("{out} {path} {problem}", path=out, problem=problem)
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
    source = resolve_checkpoint(policy)
    out = Path(out)
    if is_lora_version(source):  # the policy's function as one full model: its adapter merged into its base
        model = load_adapter(load_weights(read_lora_base(source), "float32"), source).merge_and_unload()
    else:
        model = load_model(source, dtype="float32")
    critic = ValueModel(model, new_value_head(model.config.hidden_size, seed=seed))
    critic.save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):  # not the policy's stage.json, metrics or manifest
        if (source / name).is_file() and not (out / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    write_manifest(out, CheckpointManifest(policy_version=0, tokenizer_revision=tokenizer_revision(out), stage="init-critic",
                                           parent=str(source), extra={"critic": {"from": str(source), "seed": seed}}))
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
    mine, theirs = (json.loads((model_dir(d) / "config.json").read_text()) for d in (critic, policy))  # a LoRA policy: its base's
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


class CriticVersions:
    """The critic's versioned root beside the policy's (``train-sao --critic ROOT``): the critic
    trained with policy version ``N`` is published as the critic root's ``vN`` with its optimizer
    state, right after the policy's ``vN`` (the commit); a crash between the two leaves the complete
    critic in the root's staging, which the next run publishes (:meth:`finish_interrupted`). The
    parent is the root's ``LATEST``, made from the policy by :func:`init_critic_root` when the root
    holds no version and ``init`` is set. Methods are the :class:`~glmpost.rl.jobs.Companion`'s."""

    name = "critic"

    def __init__(self, root: Path | str, *, policy: Path, version: int, groups: Sequence[str], optimizer: Any, init: bool,
                 seed: int = 0):

        self.root, self.groups, self.optimizer_config = CheckpointRoot(root), tuple(groups), optimizer
        path = self.root.path
        if (path / "config.json").is_file() or (path / VALUE_HEAD).is_file():
            raise ConfigError("{critic} {path}: a critic version directory; pass the critic root (the directory "
                              "holding LATEST and its versions)", path=path)
        if not self.root.versions():
            if not init:
                raise ConfigError("{critic} {path}: no critic version there; pass {init_critic} to make one from the "
                                  "policy, or run `glmpost init-critic --from POLICY --out {path}`", path=path)
            init_critic_root(policy, path, InitCriticConfig(seed=seed), options={"from": str(policy), "seed": seed})
        latest = self.root.latest()
        if latest is None:
            raise CheckpointError(f"{path}: critic root without {'LATEST'}")
        if latest >= version:
            raise ConfigError("{critic} {path}: its LATEST critic v{latest} is not older than the policy version this "
                              "update makes (v{version}); it was trained with a later policy", path=path, latest=latest,
                              version=version)
        self.parent = self.root.version_dir(latest)
        check_critic(self.parent, resolve_checkpoint(policy))
        self.version = version
        self.model = self.backend = None
        self.frozen: list[str] = []

    @staticmethod
    def finish_interrupted(root: Path | str, policy_root: Path | str) -> list[int]:
        """Publish every complete critic staged in ``root`` whose policy version ``policy_root``
        published (a crash between the two publishes); returns their versions."""

        critics, policies, done = CheckpointRoot(root), CheckpointRoot(policy_root), []
        if not critics.path.is_dir():
            return done
        for staged in sorted(critics.path.glob(".staging-v*")):
            version = int(staged.name.removeprefix(".staging-v"))
            if (staged / MANIFEST).is_file() and version in policies.versions() and version not in critics.versions():
                _publish_critic(critics, staged, version)
                done.append(version)
        return done

    @property
    def staging(self) -> Path:
        return self.root.path / f".staging-{version_dir_name(self.version)}"

    def setup(self, session: Any, *, dtype: str | None, **load: Any) -> tuple[ValueModel, Any]:
        """The parent critic on this rank's device with its groups frozen, and its optimisation backend."""
        self.model = load_critic(self.parent, device=session.device, dtype=dtype, **load)
        self.frozen = freeze_critic(self.model, self.groups)
        self.backend = session.backend(self.model, self.optimizer_config, own_optimizer=True)
        return self.model, self.backend

    def load_optimizer(self) -> None:
        self.backend.load_optimizer(self.parent / "trainer_state" / "optimizer.pt")

    def reset_optimizer(self) -> None:
        self.backend.reset_optimizer()

    def save_resume_state(self, directory: Path, step: int) -> None:
        """Step ``step``'s state as ``directory/resume-<step>.pt``, written before the policy's resume
        state (the commit), so the two newest are kept: the one the policy's names survives a kill."""
        self.backend.save_resume_state(directory / f"resume-{step:08d}.pt", step, [])
        if self.backend.rank == 0:
            import shutil

            for old in sorted(directory.glob("resume-*.pt"))[:-2]:
                old.unlink()
                shutil.rmtree(directory / "resume-deepspeed" / old.stem.replace("resume-", "step-"), ignore_errors=True)

    def load_resume_state(self, directory: Path, step: int) -> None:
        path = directory / f"resume-{step:08d}.pt"
        if not path.is_file():
            raise ConfigError("{directory}: no critic state of step {step} to resume with; pass {overwrite} to start over",
                              directory=directory, step=step, exit_code=CheckpointError.exit_code)
        self.backend.load_resume_state(path)

    def save(self, *, tokenizer_revision: str, stage: str, stage_options: dict[str, Any], world_size: int,
             history: list[dict]) -> None:
        """Every rank (ZeRO-3 gathers the weights); rank 0 writes the critic version into the root's
        staging, its manifest last (a staged critic with a manifest is complete)."""
        import shutil

        staging = self.staging
        if self.backend.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        self.backend.save_model(staging)
        self.backend.save_optimizer(staging / "trainer_state" / "optimizer.pt")
        if self.backend.rank != 0:
            return
        for name in (*TOKENIZER_FILES, "generation_config.json"):
            if (self.parent / name).is_file() and not (staging / name).exists():
                shutil.copy2(self.parent / name, staging / name)
        lines = [{k: v for k, v in m.items() if k.startswith("sao/") or k in ("train/step", "train/update")} for m in history]
        (staging / "metrics.jsonl").write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
        write_stage_json(staging, stage, stage_options, parent=str(self.parent), world_size=world_size,
                         trained_groups=list(self.groups), frozen=self.frozen)
        write_manifest(staging, CheckpointManifest(policy_version=self.version, tokenizer_revision=tokenizer_revision,
                                                   stage=stage, step=len(history), parent=str(self.parent),
                                                   extra={"critic": {"groups": list(self.groups)}}))

    def publish(self) -> None:
        """Rank 0, after the policy's version: the staged critic into place and ``LATEST``; the next
        version (``--follow``) has it as its parent."""
        self.parent = _publish_critic(self.root, self.staging, self.version)


def _publish_critic(root, staged: Path, version: int) -> Path:
    """Move a staged critic into ``root`` (and ``LATEST``); its metrics join the root's history."""
    lines = (staged / "metrics.jsonl").read_text() if (staged / "metrics.jsonl").is_file() else ""
    target = root.publish(staged, version)
    with open(root.path / "metrics.jsonl", "a") as f:
        f.write(lines)
    return target
