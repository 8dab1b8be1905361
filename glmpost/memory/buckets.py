"""The sizes of glmpost's DeepSpeed buffers: what the trainer configures and the plan counts."""

from __future__ import annotations

# glmpost's DeepSpeed buckets (glmpost.rl.deepspeed_settings.ZERO_BUFFERS; DeepSpeed's own are 5e8): elements.
DEFAULT_REDUCE_BUCKET = 20_000_000
DEFAULT_ALLGATHER_BUCKET = 20_000_000
MODEL_SHARE_OF_BUCKETS = 50  # a bucket holds at most 1/50 of the model (2 %)
MIN_BUCKET = 1_000_000


def zero_bucket_elements(parameters: int | None, cap: int = DEFAULT_REDUCE_BUCKET) -> int:
    """The elements of each of glmpost's DeepSpeed buffers for a model of ``parameters``: 2 % of the
    model, at least :data:`MIN_BUCKET`, at most ``cap`` (a model of a billion parameters and more
    gets the cap; a smaller model would otherwise keep a sizeable share of itself in buffers:
    252.7M parameters, 2 ZeRO-3 ranks: 2e7-element buffers held 290 MiB more per rank than 5e6)."""
    if parameters is None:
        return cap
    return int(min(cap, max(MIN_BUCKET, parameters // MODEL_SHARE_OF_BUCKETS)))
