"""``calculator-glm``: the built-in calculator speaking GLM's own tool-call format.

The environment declares its tool as a JSON schema (:data:`CALCULATOR_TOOL`, OpenAI function format)
in ``tools``; the rollout renders the first prompt with the checkpoint's chat template and those tools
(``apply_chat_template(messages, tools=...)``) and hands each step the calls it parsed from the
action's exact ids (:attr:`~glmpost.envs.protocol.Action.tool_calls`,
:func:`glmpost.envs.glm_tool_calls.parse_tool_calls`). A turn with calls gets one ``<tool_response>``
per call, in order (the exact value, or ``error: ...``); a turn without calls ends the trajectory
when it gives ``<answer>N</answer>`` (reward 1 iff N is the task's ``answer``), else it is malformed
(``info["malformed"]``) and the trajectory goes on, as a turn whose calls do not parse is.
"""

from __future__ import annotations

import random
from typing import Any

from glmpost.envs.builtin import answer_step, evaluate
from glmpost.envs.glm_tool_calls import ToolCall, tool_responses
from glmpost.envs.protocol import ENVIRONMENTS, Action, Step

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "The exact value of an integer arithmetic expression (+, -, *, //, % and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. 37*91"}},
            "required": ["expression"],
        },
    },
}
HINT = "call calculator(expression) or write <answer>NUMBER</answer>"


@ENVIRONMENTS.register("calculator-glm")
class CalculatorGLM:
    """The calculator as a GLM tool; ``tool_reward`` (default 0) is added for each call that succeeds."""

    tools = [CALCULATOR_TOOL]

    def __init__(self, tool_reward: float = 0.0):
        self.tool_reward = float(tool_reward)
        self.task: dict[str, Any] = {}

    def reset(self, task: dict[str, Any]) -> str:
        if "answer" not in task:
            raise ValueError("CalculatorGLM task has no 'answer'")
        self.task = task
        return ""

    def step(self, action: Action) -> Step:
        parsed = action.tool_calls
        if parsed is None:
            raise ValueError("calculator-glm reads the tool calls the rollout parses from the action's ids (Action.tool_calls)")
        if parsed.malformed:
            return Step(tool_responses([f"error: malformed tool call: {parsed.error}"]), 0.0, False,
                        {"malformed": True, "error": parsed.error})
        if not parsed.calls:
            final = answer_step(action.text, self.task["answer"])
            if final is not None:
                return final
            return Step(tool_responses([f"error: no tool call found: {HINT}"]), 0.0, False, {"malformed": True})
        results = [self.call(call) for call in parsed.calls]
        ok = [success for _, success in results]
        return Step(tool_responses([text for text, _ in results]), self.tool_reward * sum(ok), False,
                    {"tool": "calculator", "calls": len(ok), "ok": all(ok)})

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """One call's result and whether it succeeded."""
        if set(call.arguments) != {"expression"}:
            return f"error: calculator takes one argument, expression (got {', '.join(call.arguments) or 'none'})", False
        expression = call.arguments["expression"]
        if isinstance(expression, bool) or not isinstance(expression, (str, int)):
            return f"error: expression {expression!r} is not text", False
        try:
            return str(evaluate(str(expression))), True
        except ValueError as exc:
            return f"error: {exc}", False


def calculator_glm_tasks(count: int, *, seed: int = 0, digits: int = 2) -> list[dict[str, Any]]:
    """``count`` prompt lines of two-operand products and sums of ``digits``-digit numbers, asking for
    the calculator tool (the prompt renders its schema)."""
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        expression = f"{a}{rng.choice('*+')}{b}"
        lines.append({"id": f"calc-glm-{seed}-{index}", "domain": "calculator",
                      "prompt": f"What is {expression}? Call the calculator tool, then reply <answer>VALUE</answer>.",
                      "task": {"expression": expression, "answer": str(evaluate(expression))}})
    return lines
