"""Learning-rate schedules (issue 31): values by hand, the rate every optimizer step took across
policy versions, and refusals of a schedule that cannot run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train_grpo import _judged

from glmpost.config import SettingError
from glmpost.rl.deepspeed_settings import deepspeed_config
from glmpost.rl.distributed import OptimizerConfig, TorchBackend
from glmpost.rl.schedules import scheduled_lr


def test_warmup_then_each_decay_by_hand():
    # lr 1e-3, warmup W = 2, decay ends at D = 6, min ratio m = 0.1.
    kw = dict(lr=1e-3, warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    for schedule in ("constant", "linear", "cosine"):
        assert scheduled_lr(0, schedule=schedule, **kw) == pytest.approx(0.5e-3)  # (0 + 1) / 2
        assert scheduled_lr(1, schedule=schedule, **kw) == pytest.approx(1e-3)
        assert scheduled_lr(2, schedule=schedule, **kw) == pytest.approx(1e-3)  # decay progress 0
    # Step 3: progress (3 - 2) / (6 - 2) = 0.25.
    assert scheduled_lr(3, schedule="constant", **kw) == pytest.approx(1e-3)
    assert scheduled_lr(3, schedule="linear", **kw) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.75))  # 7.75e-4
    assert scheduled_lr(3, schedule="cosine", **kw) == pytest.approx(1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2))
    assert scheduled_lr(4, schedule="cosine", **kw) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # halfway: 5.5e-4
    for schedule in ("linear", "cosine"):
        assert scheduled_lr(6, schedule=schedule, **kw) == pytest.approx(1e-4)
        assert scheduled_lr(100, schedule=schedule, **kw) == pytest.approx(1e-4)  # stays at the minimum
    assert scheduled_lr(0, lr=2e-3) == 2e-3  # no warmup, constant: the rate itself from step one


def test_the_torch_backend_steps_with_the_scheduled_rate():
    model = torch.nn.Linear(3, 1)
    config = OptimizerConfig(lr=1e-2, lr_schedule="linear", lr_warmup_steps=2, lr_decay_steps=4, min_lr_ratio=0.0)
    backend = TorchBackend(model, config)
    rates = []
    for _ in range(6):
        model(torch.ones(1, 3)).sum().backward()
        backend.step()
        rates.append(backend.learning_rate)
    assert rates == pytest.approx([5e-3, 1e-2, 1e-2, 5e-3, 0.0, 0.0])


@pytest.mark.parametrize("changes, field", [
    ({"lr_schedule": "cosine"}, "lr_decay_steps"),  # a decay needs its end
    ({"lr_schedule": "linear", "lr_warmup_steps": 5, "lr_decay_steps": 5}, "lr_decay_steps"),
    ({"lr_schedule": "step"}, "lr_schedule"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
])
def test_a_schedule_that_cannot_run_is_refused_naming_the_setting(changes, field):
    with pytest.raises(SettingError) as caught:
        OptimizerConfig(**changes).validate()
    assert caught.value.field == field


def test_a_deepspeed_file_with_its_own_scheduler_is_refused(tmp_path):
    from glmpost.config import ConfigError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupLR"}}))
    with pytest.raises(ConfigError, match="remove its scheduler section"):
        deepspeed_config(OptimizerConfig(), zero_stage=1, path=path)


def test_the_schedule_spans_policy_versions_and_the_metrics_name_each_rate(glmpost_cli, tiny_checkpoint, tmp_path):
    """Two train-grpo versions of 2 steps each: the second continues the first's optimizer steps (its
    state carries them), so its rates are steps 2 and 3 of the warmup-then-cosine schedule."""
    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    root = tmp_path / "root"
    schedule = ["--lr", "1e-3", "--lr-schedule", "cosine", "--lr-warmup-steps", "3", "--lr-decay-steps", "5",
                "--min-lr-ratio", "0.2", "--mini-batches", "2"]
    first = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root, *schedule)
    assert first.exit_code == 0, first.stderr
    second = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--max-version-lag", "1", *schedule)
    assert second.exit_code == 0, second.stderr
    rates = [json.loads(line)["train/lr"] for line in (root / "metrics.jsonl").read_text().splitlines()]
    expected = [scheduled_lr(s, lr=1e-3, schedule="cosine", warmup_steps=3, decay_steps=5, min_lr_ratio=0.2) for s in range(4)]
    assert rates == pytest.approx(expected) and expected[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    refused = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "x", "--lr-schedule", "linear")
    assert refused.exit_code == 2 and "--lr-decay-steps" in refused.stderr
