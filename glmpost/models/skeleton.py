"""A model architecture without its weights."""

from __future__ import annotations

from pathlib import Path

from glmpost.checkpoints import CheckpointError
from glmpost.errors import first_line


def model_skeleton(config_dir: Path):
    """The architecture of ``config_dir/config.json`` on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(str(config_dir))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{config_dir}/config.json: model architecture does not load ({first_line(exc)})") from None
