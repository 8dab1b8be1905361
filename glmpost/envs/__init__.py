"""Environments of multi-turn (agentic) rollouts: the protocol (:mod:`glmpost.envs.protocol`), GLM's own
tool calls (:mod:`glmpost.envs.glm_tool_calls`) and the built-in environments (:mod:`glmpost.envs.builtin`:
``calculator``, ``kv-lookup``, ``kv-recall``, ``latency``; :mod:`glmpost.envs.calculator_glm`:
``calculator-glm``)."""

from glmpost.envs.builtin import (  # also registers the built-in environments
    calculator_tasks,
    kv_lookup_demos,
    kv_lookup_tasks,
    kv_recall_demos,
    kv_recall_tasks,
)
from glmpost.envs.calculator_glm import calculator_glm_tasks  # also registers calculator-glm
from glmpost.envs.glm_tool_calls import TOOL_CALL_PARSERS, ToolCall, ToolCalls, parse_tool_calls, tool_responses
from glmpost.envs.protocol import (
    ENVIRONMENTS,
    Action,
    Environment,
    EnvironmentFactory,
    EnvironmentFailure,
    Step,
    call_environment,
    checked_reset,
    checked_step,
    declared_tools,
    resolve_environment,
)

__all__ = ["calculator_glm_tasks", "calculator_tasks", "kv_lookup_demos", "kv_lookup_tasks", "kv_recall_demos",
           "kv_recall_tasks", "ENVIRONMENTS", "Action", "Environment", "EnvironmentFactory", "EnvironmentFailure", "Step",
           "TOOL_CALL_PARSERS", "ToolCall", "ToolCalls", "call_environment", "checked_reset", "checked_step", "declared_tools",
           "parse_tool_calls", "resolve_environment", "tool_responses"]
