"""The DeepSpeed config glmpost builds from its options and a user's file."""

from __future__ import annotations

import json

import pytest

from glmpost.errors import UsageError
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.deepspeed_settings import ZERO_BUFFERS, deepspeed_config


def test_defaults_follow_the_trainer_options():
    ds = deepspeed_config(GRPOConfig(lr=3e-4, grad_clip=0.5, weight_decay=0.1), zero_stage=None, path=None)
    assert ds["zero_optimization"] == {"stage": 1, **ZERO_BUFFERS}  # glmpost's bounded buffers
    assert ds["managed_gradient_accumulation"] is False  # glmpost calls step() once per mini-batch
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "weight_decay": 0.1, "torch_adam": True}


def test_user_file_wins_and_zero_stage_flag_overrides_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": True}, "gradient_clipping": 2.0,
                                "managed_gradient_accumulation": True}))
    ds = deepspeed_config(GRPOConfig(), zero_stage=2, path=path)
    assert ds["zero_optimization"] == {**ZERO_BUFFERS, "stage": 2, "overlap_comm": True}
    assert ds["gradient_clipping"] == 2.0 and ds["managed_gradient_accumulation"] is False


def test_a_second_models_own_optimizer_settings_win_over_the_file(tmp_path):
    from glmpost.rl.sao import SAOConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "eps": 1e-8}}, "gradient_clipping": 2.0}))
    critic = SAOConfig(critic_lr=3e-5, critic_grad_clip=0.5).critic_optimizer()
    ds = deepspeed_config(critic, zero_stage=3, path=path, own_optimizer=True)
    assert ds["optimizer"]["params"] == {"lr": 3e-5, "eps": 1e-8, "weight_decay": 0.0} and ds["gradient_clipping"] == 0.5
    assert deepspeed_config(critic, zero_stage=3, path=path)["optimizer"]["params"]["lr"] == 1e-6  # the policy's: the file's


def test_bad_configs_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        deepspeed_config(GRPOConfig(), zero_stage=None, path=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UsageError, match="invalid JSON"):
        deepspeed_config(GRPOConfig(), zero_stage=None, path=tmp_path / "bad.json")
    (tmp_path / "z4.json").write_text(json.dumps({"zero_optimization": {"stage": 4}}))
    # the library names the field (deepspeed_config); `train-grpo --deepspeed` says its flag (tests/test_config.py)
    with pytest.raises(UsageError, match=f"--deepspeed-config {tmp_path / 'z4.json'}: zero_optimization.stage 4: ZeRO stages are 0, 1, 2 and 3"):
        deepspeed_config(GRPOConfig(), zero_stage=None, path=tmp_path / "z4.json")
    (tmp_path / "zs.json").write_text(json.dumps({"zero_optimization": {"stage": "3"}}))
    with pytest.raises(UsageError, match="stage '3'"):
        deepspeed_config(GRPOConfig(), zero_stage=None, path=tmp_path / "zs.json")


def test_zero3_is_accepted_from_the_flag_or_a_file(tmp_path):
    assert deepspeed_config(GRPOConfig(), zero_stage=3, path=None)["zero_optimization"] == {"stage": 3, **ZERO_BUFFERS}
    (tmp_path / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}))
    ds = deepspeed_config(GRPOConfig(), zero_stage=None, path=tmp_path / "z3.json")
    assert ds["zero_optimization"] == {**ZERO_BUFFERS, "stage": 3, "stage3_prefetch_bucket_size": 0}  # the file's own wins


def test_buffers_are_two_percent_of_the_model_within_bounds():
    from glmpost.memory.buckets import zero_bucket_elements

    assert zero_bucket_elements(252_742_656) == 5_054_853  # the 252.7M scale benchmark: 2 %
    assert zero_bucket_elements(10_000_000) == 1_000_000  # at least 1e6
    assert zero_bucket_elements(30_000_000_000) == 20_000_000  # at most the cap
    assert zero_bucket_elements(None) == 20_000_000
    ds = deepspeed_config(GRPOConfig(), zero_stage=3, path=None, parameters=252_742_656)["zero_optimization"]
    assert ds == {"stage": 3, **{key: 5_054_853 for key in ZERO_BUFFERS}}
