"""Training: the brief's advantage estimators, trust masks and loss terms, batches, the policy
trainer, the versioned training run, the local / DeepSpeed backends and SFT."""
