"""``glmpost sync-weights``: a training checkpoint converted (and optionally quantized) into the
rollout checkpoint's tensors (:mod:`~glmpost.weight_sync.convert`), published into the rollout root
and switched to atomically by every server (:mod:`~glmpost.weight_sync.sync`); the stage run is
:mod:`~glmpost.weight_sync.run`."""
