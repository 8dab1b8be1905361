"""Environments of multi-turn (agentic) rollouts: the protocol (:mod:`glmpost.envs.protocol`) and the
built-in ones (:mod:`glmpost.envs.builtin`: ``calculator``, ``kv-lookup``, ``kv-recall``, ``latency``)."""

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
from glmpost.envs.builtin import (  # also registers the built-in environments
    calculator_tasks, kv_lookup_demos, kv_lookup_tasks, kv_recall_demos, kv_recall_tasks)

__all__ = ["calculator_tasks", "kv_lookup_demos", "kv_lookup_tasks", "kv_recall_demos", "kv_recall_tasks",
           "ENVIRONMENTS", "Action", "Environment", "EnvironmentFailure", "Step", "call_environment", "checked_reset",
           "checked_step", "resolve_environment"]
