"""Built-in environments, verifiable and fast on a CPU: ``calculator``, ``kv-lookup``, ``kv-recall`` and
``latency``.

Tool calls are tags in the model's text: ``<calc>EXPRESSION</calc>`` (calculator), ``<get>KEY</get>``
(kv-lookup), a bare ``<next>`` (kv-recall) and, in all, ``<answer>X</answer>`` to finish. A turn with
neither is a malformed tool call: the observation says so and ``info["malformed"]`` counts it; the
trajectory goes on.

* ``calculator``: arithmetic the tiny model cannot do in its head (``task = {"expression", "answer"}``);
  the tool returns the exact value; reward 1 for the right answer.
* ``kv-lookup``: a chain of look-ups in a small key-value store (``task = {"store", "start",
  "answer"}``): the value of ``start`` is the next key, and so on for ``hops`` look-ups, so the
  answer depends on earlier observations; reward 1 for the last value.
* ``kv-recall``: a long horizon for CompactionRL (``task = {"store", "query", "answer", "steps"}``):
  the store is shown once, by ``reset``; ``steps`` filler ``<next>`` calls later the question asks
  the value of ``query``, so a fact seen first must survive every compaction of the context (in the
  summary); reward 1 for that value.
* ``latency``: any environment (``inner``) behind a long-tailed step latency, log-normal with median
  ``median_s`` and shape ``sigma``: what the asynchronous issue measures overlap against.

:func:`calculator_tasks`, :func:`kv_lookup_tasks` and :func:`kv_recall_tasks` write prompt lines for them
(``glmpost rollout``'s prompt format: ``id``, ``prompt``, ``domain``, ``task``); :func:`kv_lookup_demos` and
:func:`kv_recall_demos` their SFT demonstrations.
"""

from __future__ import annotations

import abc
import ast
import itertools
import math
import operator
import random
import re
import threading
import time
from typing import Any

from glmpost.envs.protocol import ENVIRONMENTS, Action, Step, resolve_environment

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def answer_step(text: str, expected: Any) -> Step | None:
    """The final step when ``text`` gives an ``<answer>``: reward 1 iff it equals ``expected``."""
    found = _ANSWER.search(text)
    if found is None:
        return None
    answer = found.group(1).strip()
    correct = answer == str(expected)
    return Step("", 1.0 if correct else 0.0, True, {"answer": answer, "correct": correct})


def _malformed(hint: str) -> Step:
    return Step(f"no tool call found: write {hint}", 0.0, False, {"malformed": True})


# --------------------------------------------------------------------------------------------
# calculator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.Mod: operator.mod}


def evaluate(expression: str, *, limit: int = 10**12) -> int:
    """The integer value of ``expression`` (integers, ``+ - * // %``, unary minus, parentheses);
    ValueError for anything else, a division by zero or a value beyond ``limit``."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            result = -value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            result = _OPERATORS[type(node.op)](left, right)
        else:
            raise ValueError(f"unsupported expression {ast.unparse(node)!r}")
        if abs(result) > limit:
            raise ValueError(f"value beyond {limit}")
        return result

    return value(tree.body)


class ToolTask(abc.ABC):
    """An environment with one tool called as ``<TOOL>ARGUMENT</TOOL>`` (or the bare tag ``<TOOL>``
    when ``bare``: no argument) and a final ``<answer>``: subclasses name the tool, the task keys
    they need and what a call returns (:meth:`call`). ``tool_reward`` (default 0) is added for each
    well-formed tool call that succeeds."""

    tool = ""
    hint = ""
    bare = False
    required: tuple[str, ...] = ("answer",)

    def __init__(self, tool_reward: float = 0.0):
        self.tool_reward = float(tool_reward)
        self.task: dict[str, Any] = {}
        self.pattern = re.compile(rf"<{self.tool}>()" if self.bare else rf"<{self.tool}>(.*?)</{self.tool}>", re.S)

    def reset(self, task: dict[str, Any]) -> str:
        missing = [key for key in self.required if key not in task]
        if missing:
            raise ValueError(f"{type(self).__name__} task has no {', '.join(map(repr, missing))}")
        self.task = task
        return ""

    def step(self, action: Action) -> Step:
        final = answer_step(action.text, self.task["answer"])
        if final is not None:
            return final
        found = self.pattern.search(action.text)
        if found is None:
            return _malformed(self.hint)
        observation, ok = self.call(found.group(1))
        return Step(observation, self.tool_reward if ok else 0.0, False, {"tool": self.tool, "ok": ok})

    @abc.abstractmethod
    def call(self, argument: str) -> tuple[str, bool]:
        """The tool's answer to ``argument`` and whether the call succeeded."""


@ENVIRONMENTS.register("calculator")
class Calculator(ToolTask):
    """``<calc>EXPR</calc>`` returns the value; ``<answer>N</answer>`` ends with reward 1 iff N is
    the task's ``answer``."""

    tool, hint = "calc", "<calc>EXPRESSION</calc> or <answer>NUMBER</answer>"

    def call(self, argument: str) -> tuple[str, bool]:
        try:
            return str(evaluate(argument)), True
        except ValueError as exc:
            return f"error: {exc}", False


def calculator_tasks(count: int, *, seed: int = 0, digits: int = 2) -> list[dict[str, Any]]:
    """``count`` prompt lines of two-operand products and sums of ``digits``-digit numbers."""
    rng = random.Random(seed)
    lines = []
    for index in range(count):
        a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        op = rng.choice("*+")
        expression = f"{a}{op}{b}"
        lines.append({"id": f"calc-{seed}-{index}", "domain": "calculator",
                      "prompt": f"What is {expression}? Call <calc>{expression}</calc>, then reply <answer>VALUE</answer>.",
                      "task": {"expression": expression, "answer": str(evaluate(expression))}})
    return lines


# --------------------------------------------------------------------------------------------
# kv-lookup


@ENVIRONMENTS.register("kv-lookup")
class KeyValueLookup(ToolTask):
    """``<get>KEY</get>`` returns the store's value (or says the key is missing);
    ``<answer>X</answer>`` ends with reward 1 iff X is the task's ``answer``."""

    tool, hint, required = "get", "<get>KEY</get> or <answer>VALUE</answer>", ("store", "answer")

    def reset(self, task: dict[str, Any]) -> str:
        if not isinstance(task.get("store"), dict):
            raise ValueError("kv-lookup task needs a 'store' map")
        return super().reset(task)

    def call(self, argument: str) -> tuple[str, bool]:
        key = argument.strip()
        store = self.task["store"]
        return (str(store[key]), True) if key in store else (f"no key {key}", False)


def kv_lookup_tasks(count: int, *, seed: int = 0, hops: int = 2, keys: int = 6) -> list[dict[str, Any]]:
    """``count`` prompt lines: a store of ``keys`` two-letter keys in which ``hops`` look-ups lead from
    the start key to the answer (each looked-up value but the last is the next key)."""
    if hops < 1:
        raise ValueError(f"hops must be >= 1, got {hops}")
    rng = random.Random(seed)
    names = ["".join(p) for p in itertools.product("abcdefgh", repeat=2)]
    lines = []
    for index in range(count):
        picked = rng.sample(names, max(keys, hops))
        chain = picked[:hops]
        store = {k: rng.choice(names) for k in picked}
        for key, value in zip(chain, chain[1:]):
            store[key] = value
        answer = store[chain[-1]] = str(rng.randrange(100, 1000))
        lines.append({"id": f"kv-{seed}-{index}", "domain": "kv-lookup",
                      "prompt": f"Look up {chain[0]} with <get>KEY</get>, then look up each value you get, {hops} "
                                "look-ups in all; reply <answer>VALUE</answer> with the last value.",
                      "task": {"store": store, "start": chain[0], "hops": hops, "answer": answer}})
    return lines


def kv_lookup_demos(lines: list[dict[str, Any]], *, marker: str = "<|observation|>") -> list[dict[str, Any]]:
    """SFT demonstrations of :func:`kv_lookup_tasks` lines: per task one conversation per model turn
    (each look-up along the chain, then the answer), the turn trained being the last; a look-up turn
    ends with the turn ``marker`` that calls the environment (``shards import`` trains on it)."""
    demos = []
    for line in lines:
        task = line["task"]
        keys = [task["start"]]
        for _ in range(task["hops"]):
            keys.append(task["store"][keys[-1]])
        history: list[dict[str, str]] = [{"role": "user", "content": line["prompt"]}]
        for turn, key in enumerate(keys[:-1]):
            call = f"<get>{key}</get>"
            demos.append({"id": f"{line['id']}-get{turn + 1}", "messages": [*history, {"role": "assistant", "content": call + marker}],
                          "domain": line["domain"], "task": task})
            history += [{"role": "assistant", "content": call}, {"role": "observation", "content": keys[turn + 1]}]
        demos.append({"id": f"{line['id']}-answer", "messages": [*history, {"role": "assistant", "content": f"<answer>{keys[-1]}</answer>"}],
                      "domain": line["domain"], "task": task})
    return demos


# --------------------------------------------------------------------------------------------
# kv-recall


def store_text(store: dict[str, Any]) -> str:
    """A store as kv-recall shows it (its reset observation, and the summary that keeps it): ``ab=417 cd=902``."""
    return " ".join(f"{key}={value}" for key, value in store.items())


def _recall_observation(task: dict[str, Any], calls: int) -> str:
    """What the ``calls``-th ``<next>`` observes: ``step i of N`` before the ``steps``-th, then the question."""
    steps = task["steps"]
    return f"step {calls} of {steps}" if calls < steps else f"value of {task['query']}?"


@ENVIRONMENTS.register("kv-recall")
class KeyValueRecall(ToolTask):
    """The store is shown once, as the reset observation; each ``<next>`` (no argument, no closing tag)
    observes ``step i of N``, the ``N``-th the question ``value of KEY?`` (asked again by any later
    ``<next>``, which earns no ``tool_reward``); ``<answer>X</answer>`` ends with reward 1 iff X is
    the task's ``answer``."""

    tool, hint, bare, required = "next", "<next> or <answer>VALUE</answer>", True, ("store", "query", "answer", "steps")

    def __init__(self, tool_reward: float = 0.0):
        super().__init__(tool_reward)
        self.calls = 0  # <next> calls so far

    def reset(self, task: dict[str, Any]) -> str:
        super().reset(task)
        store, steps = task["store"], task["steps"]
        if not isinstance(store, dict) or task["query"] not in store:
            raise ValueError("kv-recall task needs a 'store' map holding its 'query' key")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"kv-recall task needs 'steps' >= 1, got {steps!r}")
        self.calls = 0
        return store_text(store)

    def call(self, argument: str) -> tuple[str, bool]:
        self.calls += 1
        return _recall_observation(self.task, self.calls), self.calls <= self.task["steps"]


RECALL_PROMPT = "Remember it. Call <next> until asked, then <answer>VALUE</answer>."


def kv_recall_tasks(count: int, *, seed: int = 0, steps: int = 4, keys: int = 1, digits: int = 3,
                    letters: str = "abcdefgh") -> list[dict[str, Any]]:
    """``count`` prompt lines: a store of ``keys`` two-letter keys of ``letters`` with ``digits``-digit
    values (shown by the environment's reset only), ``steps`` ``<next>`` calls to the question, which
    asks one of its keys. The prompt is short and the same for every task: a rebuilt context repeats
    it. With one key of one letter (``letters="a"``) tasks differ in the value alone, so a model can
    only succeed by carrying the value itself (nothing else predicts it)."""
    names = ["".join(p) for p in itertools.product(letters, repeat=2)]
    if steps < 1 or not 1 <= keys <= len(names) or digits < 1:
        raise ValueError(f"steps and digits must be >= 1 and keys in 1..{len(names)}, got {steps}, {digits} and {keys}")
    rng = random.Random(seed)
    low = 10 ** (digits - 1) if digits > 1 else 0
    lines = []
    for index in range(count):
        store = {key: str(rng.randrange(low, 10**digits)) for key in rng.sample(names, keys)}
        query = rng.choice(sorted(store))
        lines.append({"id": f"recall-{seed}-{index}", "domain": "kv-recall", "prompt": RECALL_PROMPT,
                      "task": {"store": store, "query": query, "answer": store[query], "steps": steps}})
    return lines


def _flat(pairs: list[list[dict[str, str]]]) -> list[dict[str, str]]:
    return [message for pair in pairs for message in pair]


def _turn_demo(line: dict[str, Any], name: str, history: list[dict[str, str]], turn: str, marker: str) -> dict[str, Any]:
    """One demonstration of ``line``: ``history`` then the trained assistant ``turn`` (a ``<next>``
    call ends with ``marker``)."""
    content = turn + marker if turn == "<next>" else turn
    return {"id": f"{line['id']}-{name}", "messages": [*history, {"role": "assistant", "content": content}],
            "domain": line["domain"], "task": line["task"]}


def kv_recall_demos(lines: list[dict[str, Any]], *, summary_prompt: str, resume_template: str, keep_last: int = 1,
                    marker: str = "<|observation|>") -> list[dict[str, Any]]:
    """SFT demonstrations of :func:`kv_recall_tasks` lines, one conversation per trained turn (the
    last), per task:

    * ``ID-stepI`` / ``ID-answer``: each turn of the uncompacted trajectory (the prompt, the store as
      the reset observation, then ``<next>`` / observation pairs; a ``<next>`` turn ends with ``marker``);
    * ``ID-summary``: the summary turn after observation ``j`` (round robin over ``1..steps-1`` by the
      line's position): the ``summary_prompt`` user turn answered by the store text, no marker;
    * ``ID-resumed-stepI`` / ``ID-resumed-answer``: every later turn in the context rebuilt there once
      (the prompt, ``resume_template.format(summary=...)``, the last ``keep_last`` pairs up to ``j``,
      then the pairs since).
    """
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    demos = []
    for position, line in enumerate(lines):
        task, summary = line["task"], store_text(line["task"]["store"])
        steps = task["steps"]
        turns = ["<next>"] * steps + [f"<answer>{task['answer']}</answer>"]  # turn i comes after pairs[:i]
        names = [f"step{i}" for i in range(1, steps + 1)] + ["answer"]
        pairs = [[{"role": "assistant", "content": "<next>"}, {"role": "observation", "content": _recall_observation(task, i)}]
                 for i in range(1, steps + 1)]

        prompt = {"role": "user", "content": line["prompt"]}
        opening = [prompt, {"role": "observation", "content": summary}]
        demos += [_turn_demo(line, name, opening + _flat(pairs[:i]), turn, marker)
                  for i, (name, turn) in enumerate(zip(names, turns))]
        j = 1 + position % max(steps - 1, 1)
        asked = opening + _flat(pairs[:j]) + [{"role": "user", "content": summary_prompt}]
        demos.append(_turn_demo(line, "summary", asked, summary, marker))
        resumed = [prompt, {"role": "user", "content": resume_template.format(summary=summary)}]
        demos += [_turn_demo(line, f"resumed-{names[i]}", resumed + _flat(pairs[max(j - keep_last, 0):i]), turns[i], marker)
                  for i in range(j, steps + 1)]
    return demos


# --------------------------------------------------------------------------------------------
# latency


@ENVIRONMENTS.register("latency")
class Latency:
    """``inner`` (a name or ``package.module:Class``, built with ``inner_options``) with each step
    delayed by a log-normal time: median ``median_s``, shape ``sigma`` (a long tail), drawn from a
    generator seeded with ``seed`` and the instance's number. ``info["latency_s"]`` records it."""

    _instances = itertools.count()
    _lock = threading.Lock()

    def __init__(self, inner: str = "calculator", inner_options: dict[str, Any] | None = None, median_s: float = 0.05,
                 sigma: float = 1.0, seed: int = 0):
        if not median_s >= 0 or not sigma >= 0:
            raise ValueError(f"median_s and sigma must be >= 0, got {median_s} and {sigma}")
        self.inner = resolve_environment(inner, inner_options, where="latency inner")()
        self.tools = getattr(self.inner, "tools", None)  # the inner environment's, rendered and parsed for it
        with self._lock:
            number = next(self._instances)
        self.rng = random.Random(seed * 1_000_003 + number)
        self.median_s, self.sigma = float(median_s), float(sigma)

    def reset(self, task: dict[str, Any]) -> str:
        return self.inner.reset(task)

    def step(self, action: Action) -> Step:
        delay = self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0)) if self.median_s > 0 else 0.0
        time.sleep(delay)
        answer = self.inner.step(action)
        answer.info = {**answer.info, "latency_s": round(delay, 6)}
        return answer
