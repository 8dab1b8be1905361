"""The environment protocol of multi-turn (agentic) rollouts, and how a rollout calls an environment.

Brief, "TITO：token ID 是动作事实": the model's exact token ids are the action; the text decoded from
them exists for the environment only. An environment is any class with

* ``reset(task: dict) -> str``: the first observation of a trajectory for the record's ``task``
  (may be ``""``: the prompt already says everything);
* ``step(action: Action) -> Step``: the next observation (text, rendered by the rollout with the chat
  template's observation turn and appended as exact ids), a reward, whether the trajectory is done,
  and free-form ``info`` kept in the record;
* optionally ``tools``: a list of JSON schemas (OpenAI function format) of the tools it answers in
  GLM's own tool-call format (:mod:`glmpost.envs.glm_tool_calls`): the rollout renders the first prompt
  with the checkpoint's chat template and these tools, and parses each action's exact ids into
  :attr:`Action.tool_calls` for the environment (``calculator-glm``).

One instance serves one trajectory (it may keep state between steps); the rollout builds it from a
name registered in :data:`ENVIRONMENTS` (``calculator``, ``kv-lookup``, ``latency``) or from a
``package.module:Class`` spec, with the recipe's ``[rollout.env_options]`` as keyword arguments.

What goes wrong in an environment never stops a run (:func:`call_environment`): an exception, a
step slower than the timeout, or an answer that is not a :class:`Step` becomes
:class:`EnvironmentFailure`, and the rollout records the trajectory as ``env_error`` with the reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from glmpost.envs.glm_tool_calls import ToolCalls, tool_names
from glmpost.errors import UsageError
from glmpost.registry import Registry, load_hook


@dataclass(frozen=True)
class Action:
    """One model turn: its exact token ids (what is trained, reasoning included) and the decoded text
    the environment reads: the turn's content, after its reasoning block when the rollout splits
    reasoning off (``--reasoning-parser glm45``: :mod:`glmpost.envs.reasoning`, as vLLM and SGLang do)."""

    token_ids: tuple[int, ...]
    text: str
    tool_calls: ToolCalls | None = None  # for an environment with ``tools``: GLM tool calls parsed from the content's ids
    reasoning: str = ""  # the decoded reasoning block ("" without one): never acted on


@dataclass
class Step:
    """An environment's answer to one action."""

    observation: str = ""  # appended as an observation turn unless done (then it may be empty)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, task: dict[str, Any]) -> str: ...

    def step(self, action: Action) -> Step: ...


class EnvironmentFailure(Exception):
    """An environment raised, timed out or answered malformed: the trajectory ends ``env_error``."""


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment")


@dataclass(frozen=True)
class EnvironmentFactory:
    """Builds fresh environments of ``cls`` with ``options``; ``tools``: the schemas they declare (None: none)."""

    cls: Callable[..., Environment]
    options: dict[str, Any]
    tools: list[dict[str, Any]] | None = None

    def __call__(self) -> Environment:
        return self.cls(**self.options)


def declared_tools(env: Any, *, where: str = "--env") -> list[dict[str, Any]] | None:
    """``env``'s ``tools`` (None when it declares none), checked: a non-empty list of JSON-serializable
    function schemas, each with a distinct name; anything else is one :class:`UsageError` naming ``where``."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return None
    try:
        json.dumps(tools)
        names = tool_names(tools)
    except (TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{where}: tools must be a list of JSON function schemas ({type(exc).__name__}: {exc})") from None
    if not isinstance(tools, list) or not tools or not all(names) or len(set(names)) != len(names):
        raise UsageError(f"{where}: tools must be a non-empty list of function schemas with distinct names, got {names}")
    return tools


def resolve_environment(spec: str, options: dict[str, Any] | None = None, *, where: str = "--env") -> EnvironmentFactory:
    """A factory of fresh environments for ``spec`` (a registered name or ``package.module:Class``)
    built with ``options``; one instance is made and checked here, so a spec that does not exist,
    does not build with these options, lacks ``reset`` / ``step`` or declares malformed ``tools`` is
    one :class:`UsageError` naming ``where``."""

    options = dict(options or {})
    if spec in ENVIRONMENTS:
        cls = ENVIRONMENTS[spec]
    elif ":" in spec:
        cls = load_hook(spec, where=where)
    else:
        raise UsageError(f"{where}: unknown environment {spec!r} (built in: {', '.join(ENVIRONMENTS)}; "
                         "or name a package.module:Class)")
    try:
        probe = cls(**options)
    except Exception as exc:  # the user's class or options: theirs to fix, in one line
        raise UsageError(f"{where}: {spec} cannot be built with options {options} ({type(exc).__name__}: {exc})") from None
    missing = [name for name in ("reset", "step") if not callable(getattr(probe, name, None))]
    if missing:
        raise UsageError(f"{where}: {spec} is not an environment: it lacks {' and '.join(m + '()' for m in missing)}")
    return EnvironmentFactory(cls, options, declared_tools(probe, where=f"{where} {spec}"))


def call_environment(fn: Callable[..., Any], *args: Any, timeout: float | None, what: str) -> Any:
    """``fn(*args)``, with any exception, or a call longer than ``timeout`` seconds, raised as
    :class:`EnvironmentFailure` naming ``what``. A timed-out call's thread is left to finish on its
    own (Python cannot stop it); its result is discarded."""
    if timeout is None:
        try:
            return fn(*args)
        except Exception as exc:
            raise EnvironmentFailure(f"{what} raised {type(exc).__name__}: {exc}") from None
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="glmpost-env")
    try:
        return pool.submit(fn, *args).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise EnvironmentFailure(f"{what} took longer than --env-timeout {timeout:g} s") from None
    except Exception as exc:
        raise EnvironmentFailure(f"{what} raised {type(exc).__name__}: {exc}") from None
    finally:
        pool.shutdown(wait=False)


def checked_step(answer: Any) -> Step:
    """``answer`` if it is a well-formed :class:`Step` (a str observation, a finite float reward, a
    bool done, a dict info), else :class:`EnvironmentFailure` saying what is wrong."""
    if not isinstance(answer, Step):
        raise EnvironmentFailure(f"step() returned {type(answer).__name__}, not a Step")
    if not isinstance(answer.observation, str):
        raise EnvironmentFailure(f"step() observation is {type(answer.observation).__name__}, not str")
    if isinstance(answer.reward, bool) or not isinstance(answer.reward, (int, float)) or not math.isfinite(answer.reward):
        raise EnvironmentFailure(f"step() reward {answer.reward!r} is not a finite number")
    if not isinstance(answer.done, bool):
        raise EnvironmentFailure(f"step() done {answer.done!r} is not a bool")
    if not isinstance(answer.info, dict):
        raise EnvironmentFailure(f"step() info is {type(answer.info).__name__}, not a dict")
    return answer


def checked_reset(answer: Any) -> str:
    """``answer`` if it is a str observation, else :class:`EnvironmentFailure`."""
    if not isinstance(answer, str):
        raise EnvironmentFailure(f"reset() returned {type(answer).__name__}, not a str observation")
    return answer
