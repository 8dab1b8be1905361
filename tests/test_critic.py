"""SAO's critic (brief, "SAO：一条轨迹完成就训练"): initialised from a policy checkpoint with a value head,
saved and loaded back unchanged, refused for another tokenizer or architecture, and frozen as the
brief says (only the MoE projections and the head train) under K = 2 critic steps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from glmpost.checkpoints import CheckpointError
from glmpost.rl.critic import CRITIC_GROUPS, VALUE_HEAD, critic_values, freeze_critic, init_critic, load_critic


@pytest.fixture(scope="module")
def critic_dir(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("critic") / "critic"
    facts = init_critic(tiny_checkpoint, out, seed=3)
    assert facts["frozen"] and 0 < facts["trainable_parameters"] < facts["parameters"]
    return out


def _ids(model, length=12):
    return torch.randint(3, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


def test_a_critic_round_trips_and_gives_a_value_per_position(tiny_checkpoint, critic_dir):
    critic = load_critic(critic_dir, policy=tiny_checkpoint, dtype="float32")
    ids = _ids(critic)
    with torch.no_grad():
        values = critic(ids, torch.ones_like(ids))
    assert values.shape == ids.shape and values.dtype == torch.float32 and torch.isfinite(values).all()
    again = load_critic(critic_dir, dtype="float32")
    with torch.no_grad():
        assert torch.equal(again(ids, torch.ones_like(ids)), values)  # same files, same shapes, same kernels
    assert (critic_dir / VALUE_HEAD).is_file() and json.loads((critic_dir / "glmpost.json").read_text())["stage"] == "init-critic"
    # critic_values' entry t is the value of the prefix ids[: t + 1] (the state predicting token t + 1),
    # as the trainer's log-prob entry t is; the prefix runs in another shape, so compared within float noise.
    with torch.no_grad():
        aligned = critic_values(critic, ids, torch.ones_like(ids))
        prefix = critic(ids[:, :5], torch.ones_like(ids[:, :5]))
    assert aligned.shape == (2, ids.shape[1] - 1)
    assert torch.allclose(aligned[:, 4], prefix[:, -1], atol=1e-5)


def test_k_critic_steps_move_only_the_unfrozen_parameters(critic_dir):
    critic = load_critic(critic_dir, dtype="float32")
    frozen = set(freeze_critic(critic))
    assert frozen and all(CRITIC_GROUPS["attention"] in n or CRITIC_GROUPS["mlp"] not in n for n in frozen)
    assert any("indexer" in n for n in frozen) and not any(n.startswith("value_head.") for n in frozen)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    trainable = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = _ids(critic)
    targets = torch.linspace(-1, 1, ids.shape[1]).expand(ids.shape)
    for _ in range(2):  # the paper's K = 2 critic updates
        loss = ((critic(ids, torch.ones_like(ids)) - targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    steps = {int(state["step"]) for state in optimizer.state.values()}
    assert steps == {2}  # counted by the optimizer, for every trained tensor
    for name, parameter in critic.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, before[name]), name  # bitwise unchanged
        else:
            assert not torch.equal(parameter, before[name]), name  # every unfrozen one moved
    opted_out = set(freeze_critic(critic, train=("mlp", "attention")))
    assert opted_out < frozen and not any(CRITIC_GROUPS["attention"] in n for n in opted_out)
    with pytest.raises(ValueError, match="unknown critic parameter group"):
        freeze_critic(critic, train=("everything",))


def test_a_critic_of_another_tokenizer_or_architecture_is_refused(tiny_checkpoint, critic_dir, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(critic_dir, other)
    manifest = json.loads((other / "glmpost.json").read_text())
    manifest["tokenizer_revision"] = "0" * len(manifest["tokenizer_revision"])
    (other / "glmpost.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="critic of tokenizer revision"):
        load_critic(other, policy=tiny_checkpoint)
    config = json.loads((critic_dir / "config.json").read_text())
    bigger = tmp_path / "other-architecture"
    shutil.copytree(critic_dir, bigger)
    (bigger / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    with pytest.raises(CheckpointError, match="critic of another architecture"):
        load_critic(bigger, policy=tiny_checkpoint)
    with pytest.raises(CheckpointError, match="not a critic"):
        load_critic(tiny_checkpoint)


def test_init_critic_publishes_version_0_and_refuses_a_missing_policy(glmpost_cli, tiny_checkpoint, tmp_path):
    root = tmp_path / "critic"
    result = glmpost_cli("init-critic", "--from", tiny_checkpoint, "--out", root, "--seed", "1", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    version = root / "v000000"
    assert (root / "LATEST").read_text().strip() == "v000000" and (version / VALUE_HEAD).is_file()
    assert 0 < summary["trainable_parameters"] < summary["parameters"]
    stage = json.loads((version / "stage.json").read_text())
    frozen = stage["frozen_by_default"]
    assert len(frozen) == summary["frozen_tensors"] and any("self_attn" in n for n in frozen)
    assert not any(".mlp." in n or n.startswith("value_head.") for n in frozen)
    metrics = [json.loads(line) for line in (version / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["critic/parameters"] == summary["parameters"]
    load_critic(root, policy=tiny_checkpoint)  # the root's LATEST loads as a critic of this policy
    again = glmpost_cli("init-critic", "--from", tiny_checkpoint, "--out", root, "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["skipped"] is True
    missing = glmpost_cli("init-critic", "--from", tmp_path / "nowhere", "--out", tmp_path / "c2")
    assert missing.exit_code != 0 and len(missing.stderr.strip().splitlines()) == 1 and "nowhere" in missing.stderr
    assert not (tmp_path / "c2" / "LATEST").exists()
