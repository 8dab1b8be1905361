"""Environments of multi-turn (agentic) rollouts: the protocol (:mod:`glmpost.envs.protocol`) and the
built-in ones (:mod:`glmpost.envs.builtin`: ``calculator``, ``kv-lookup``, ``latency``)."""

from glmpost.envs.protocol import (
    ENVIRONMENTS,
    Action,
    Environment,
    EnvironmentFailure,
    Step,
    call_environment,
    checked_reset,
    checked_step,
    resolve_environment,
)
from glmpost.envs.builtin import calculator_tasks, kv_lookup_demos, kv_lookup_tasks  # also registers the built-in environments

__all__ = ["calculator_tasks", "kv_lookup_demos", "kv_lookup_tasks", "ENVIRONMENTS", "Action", "Environment", "EnvironmentFailure", "Step", "call_environment", "checked_reset",
           "checked_step", "resolve_environment"]
