"""Rollout: the embedded sampling engine, prompts, trajectory records and the rollout runner."""
