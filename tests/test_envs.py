"""Environments of agentic rollouts (glmpost.envs): the protocol's checks and the built-in ones on
hand-computed cases."""

from __future__ import annotations

import sys
import time
import types

import pytest

from glmpost.envs import (
    ENVIRONMENTS,
    Action,
    EnvironmentFailure,
    Step,
    calculator_tasks,
    call_environment,
    checked_reset,
    checked_step,
    kv_lookup_demos,
    kv_lookup_tasks,
    kv_recall_demos,
    kv_recall_tasks,
    resolve_environment,
)
from glmpost.envs.builtin import evaluate
from glmpost.errors import UsageError


def act(text: str) -> Action:
    return Action((1, 2, 3), text)


@pytest.mark.parametrize("expression, value", [("37*91", 3367), ("-(2+3)*4", -20), ("17//5", 3), ("17 % 5", 2),
                                               (" 12 + 30 ", 42)])
def test_evaluate_hand_computed(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, message", [("7//0", "division by zero"), ("2**3", "unsupported"),
                                                 ("__import__('os')", "unsupported"), ("1.5*2", "unsupported"),
                                                 ("3 +", "cannot parse"), ("10**6*10**7", "unsupported")])
def test_evaluate_refuses_everything_else(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


def test_calculator_tool_call_answer_and_malformed_turns():
    env = resolve_environment("calculator", {"tool_reward": 0.25})()
    assert env.reset({"expression": "37*91", "answer": "3367"}) == ""
    tool = env.step(act("let me compute <calc>37*91</calc>"))
    assert (tool.observation, tool.reward, tool.done, tool.info) == ("3367", 0.25, False, {"tool": "calc", "ok": True})
    broken = env.step(act("<calc>37/0</calc>"))
    assert broken.observation.startswith("error: unsupported") and broken.info["ok"] is False and broken.reward == 0.0
    lost = env.step(act("I think it is big"))
    assert lost.info == {"malformed": True} and not lost.done and "<calc>EXPRESSION</calc>" in lost.observation
    wrong = resolve_environment("calculator")()
    wrong.reset({"answer": "3367"})
    assert wrong.step(act("<answer>3366</answer>")) == Step("", 0.0, True, {"answer": "3366", "correct": False})
    assert env.step(act("<answer> 3367 </answer>")) == Step("", 1.0, True, {"answer": "3367", "correct": True})


def test_calculator_tasks_are_answered_by_their_own_tool():
    for line in calculator_tasks(20, seed=3):
        env = ENVIRONMENTS["calculator"]()
        env.reset(line["task"])
        value = env.step(act(f"<calc>{line['task']['expression']}</calc>")).observation
        assert value == line["task"]["answer"] and line["task"]["expression"] in line["prompt"]
        assert env.step(act(f"<answer>{value}</answer>")).reward == 1.0


@pytest.mark.parametrize("hops", [1, 2, 4])
def test_kv_lookup_chains_lead_to_the_answer_in_exactly_hops_look_ups(hops):
    for line in kv_lookup_tasks(25, seed=hops, hops=hops, keys=6):
        task = line["task"]
        env = ENVIRONMENTS["kv-lookup"]()
        env.reset(task)
        key = task["start"]
        for _ in range(hops):
            step = env.step(act(f"<get>{key}</get>"))
            assert step.info == {"tool": "get", "ok": True} and not step.done
            key = step.observation
        assert key == task["answer"] and key not in task["store"]  # the last value is no key: the chain ends
        assert env.step(act(f"<answer>{key}</answer>")).reward == 1.0
    missing = ENVIRONMENTS["kv-lookup"]()
    missing.reset({"store": {"ab": "1"}, "answer": "1"})
    assert missing.step(act("<get>zz</get>")) == Step("no key zz", 0.0, False, {"tool": "get", "ok": False})


def test_kv_lookup_demos_replay_to_the_full_reward_one_conversation_per_turn():
    lines = kv_lookup_tasks(6, seed=3, hops=2, keys=64)
    demos = kv_lookup_demos(lines)
    assert [d["id"] for d in demos[:3]] == ["kv-3-0-get1", "kv-3-0-get2", "kv-3-0-answer"] and len(demos) == 18
    for line, (first, second, last) in zip(lines, zip(demos[0::3], demos[1::3], demos[2::3])):
        assert first["messages"][-1]["content"].endswith("<|observation|>") and second["messages"][:-1] == last["messages"][:3]
        env = ENVIRONMENTS["kv-lookup"](tool_reward=1.0)
        env.reset(line["task"])
        turns = [m["content"] for m in last["messages"] if m["role"] == "assistant"]
        observations = [m["content"] for m in last["messages"] if m["role"] == "observation"]
        steps = [env.step(act(text)) for text in turns]
        assert [s.reward for s in steps] == [1.0, 1.0, 1.0] and steps[-1].done
        assert [s.observation for s in steps[:-1]] == observations


def test_kv_recall_asks_after_the_steps_and_rewards_the_value_shown_at_reset():
    env = resolve_environment("kv-recall", {"tool_reward": 0.5})()
    assert env.reset({"store": {"ab": "417", "cd": "902"}, "query": "cd", "answer": "902", "steps": 3}) == "ab=417 cd=902"
    assert env.step(act("<next>")) == Step("step 1 of 3", 0.5, False, {"tool": "next", "ok": True})
    lost = env.step(act("I remember cd"))
    assert lost.info == {"malformed": True} and not lost.done and "<next> or <answer>VALUE</answer>" in lost.observation
    assert env.step(act("going on <next></next>")).observation == "step 2 of 3"  # the malformed turn counted no step
    assert env.step(act("<next>")) == Step("value of cd?", 0.5, False, {"tool": "next", "ok": True})
    assert env.step(act("<next>")) == Step("value of cd?", 0.0, False, {"tool": "next", "ok": False})  # asked again
    assert env.step(act("<answer> 902 </answer>")) == Step("", 1.0, True, {"answer": "902", "correct": True})
    wrong = ENVIRONMENTS["kv-recall"]()
    wrong.reset({"store": {"ab": "417"}, "query": "ab", "answer": "417", "steps": 1})
    assert wrong.step(act("<next>")).observation == "value of ab?"
    assert wrong.step(act("<answer>471</answer>")) == Step("", 0.0, True, {"answer": "471", "correct": False})
    for task, message in [({"store": {"ab": "417"}, "answer": "417", "steps": 2}, "no 'query'"),
                          ({"store": {"ab": "417"}, "query": "cd", "answer": "417", "steps": 2}, "holding its 'query'"),
                          ({"store": {"ab": "417"}, "query": "ab", "answer": "417", "steps": 0}, "'steps' >= 1")]:
        with pytest.raises(ValueError, match=message):
            ENVIRONMENTS["kv-recall"]().reset(task)


def test_kv_recall_tasks_of_one_key_differ_in_the_value_alone():
    """The tiny recipe's tasks: one key of the letter a, one-digit values; only the value varies, so
    nothing but the value itself predicts the answer."""
    lines = kv_recall_tasks(200, seed=1, digits=1, letters="a")
    assert {line["task"]["query"] for line in lines} == {"aa"} and {line["prompt"] for line in lines} == {lines[0]["prompt"]}
    assert {line["task"]["answer"] for line in lines} == set("0123456789")
    assert all(line["task"]["store"] == {"aa": line["task"]["answer"]} for line in lines)
    with pytest.raises(ValueError):
        kv_recall_tasks(1, digits=0)


def test_kv_recall_tasks_are_deterministic_and_answer_the_queried_key():
    lines = kv_recall_tasks(30, seed=5, steps=3, keys=3)
    assert lines == kv_recall_tasks(30, seed=5, steps=3, keys=3) != kv_recall_tasks(30, seed=6, steps=3, keys=3)
    assert [line["id"] for line in lines[:2]] == ["recall-5-0", "recall-5-1"] and {line["domain"] for line in lines} == {"kv-recall"}
    for line in lines:
        task = line["task"]
        assert task["answer"] == task["store"][task["query"]] and task["steps"] == 3 and len(task["store"]) == 3
        assert all(len(key) == 2 and len(value) == 3 and value.isdigit() for key, value in task["store"].items())
        assert task["answer"] not in line["prompt"] and "<next>" in line["prompt"] and "<answer>VALUE</answer>" in line["prompt"]
        env = ENVIRONMENTS["kv-recall"]()
        assert f"{task['query']}={task['answer']}" in env.reset(task).split(" ")
        steps = [env.step(act("<next>")) for _ in range(3)]
        assert [s.observation for s in steps] == ["step 1 of 3", "step 2 of 3", f"value of {task['query']}?"]
        assert env.step(act(f"<answer>{task['answer']}</answer>")).reward == 1.0


@pytest.mark.parametrize("keep_last", [0, 1, 2])
def test_kv_recall_demos_replay_to_the_full_reward_and_resume_from_the_summary(keep_last):
    lines = kv_recall_tasks(6, seed=3, steps=4, keys=1)
    demos = kv_recall_demos(lines, summary_prompt="Summarize.", resume_template="Summary: {summary}", keep_last=keep_last)
    assert len({d["id"] for d in demos}) == len(demos)
    for position, line in enumerate(lines):
        mine = {d["id"].removeprefix(line["id"] + "-"): d for d in demos if d["id"].startswith(line["id"] + "-")}
        j = 1 + position % 3  # the compaction point: round robin over observations 1..3
        assert set(mine) == {"step1", "step2", "step3", "step4", "answer", "summary"} | {
            f"resumed-{name}" for name in ["step1", "step2", "step3", "step4", "answer"][j:]}
        env = ENVIRONMENTS["kv-recall"]()
        shown = env.reset(line["task"])
        full = mine["answer"]["messages"]  # (a): the uncompacted trajectory
        assert full[:2] == [{"role": "user", "content": line["prompt"]}, {"role": "observation", "content": shown}]
        steps = [env.step(act(m["content"])) for m in full if m["role"] == "assistant"]
        assert steps[-1] == Step("", 1.0, True, {"answer": line["task"]["answer"], "correct": True})
        assert [s.observation for s in steps[:-1]] == [m["content"] for m in full[2:] if m["role"] == "observation"]
        for i in range(1, 5):
            step = mine[f"step{i}"]["messages"]
            assert step[:-1] == full[: 2 * i] and step[-1] == {"role": "assistant", "content": "<next><|observation|>"}
        summary = mine["summary"]["messages"]  # (b): the store text exactly as reset shows it
        assert summary[:-1] == full[: 2 + 2 * j] + [{"role": "user", "content": "Summarize."}]
        assert summary[-1] == {"role": "assistant", "content": shown}
        for i in range(j, 5):  # (c): the prompt, the resume turn, the kept pairs, then the pairs since
            name = f"step{i + 1}" if i < 4 else "answer"
            resumed = mine[f"resumed-{name}"]["messages"]
            assert resumed[:2] == [full[0], {"role": "user", "content": f"Summary: {summary[-1]['content']}"}]
            kept = max(j - keep_last, 0)  # the first pair the rebuilt context keeps
            assert resumed[2:-1] == full[2 + 2 * kept : 2 + 2 * i] and resumed[-1] == mine[name]["messages"][-1]


def test_latency_delays_each_step_and_passes_the_inner_answer_through():
    env = resolve_environment("latency", {"inner": "calculator", "median_s": 0.02, "sigma": 0.0})()
    env.reset({"answer": "5"})
    started = time.perf_counter()
    step = env.step(act("<calc>2+3</calc>"))
    assert time.perf_counter() - started >= 0.02
    assert step.observation == "5" and step.info == {"tool": "calc", "ok": True, "latency_s": 0.02}
    tailed = [resolve_environment("latency", {"median_s": 0.001, "sigma": 1.0, "seed": 7})() for _ in range(6)]
    for env in tailed:
        env.reset({"answer": "1"})
    delays = {env.step(act("<answer>1</answer>")).info["latency_s"] for env in tailed}
    assert len(delays) == 6  # every instance draws its own delay


class NoStep:
    def reset(self, task):
        return ""


class NeedsOption:
    def __init__(self, size):
        self.size = size

    def reset(self, task):
        return ""

    def step(self, action):
        return Step()


@pytest.fixture
def user_module():
    module = types.ModuleType("glmpost_test_user_envs")
    module.NoStep, module.NeedsOption = NoStep, NeedsOption
    sys.modules[module.__name__] = module
    yield module.__name__
    del sys.modules[module.__name__]


def test_specs_that_are_no_environment_are_one_line_errors(user_module):
    cases = {
        "calculater": "--env: unknown environment 'calculater' (built in: calculator, calculator-glm, kv-lookup, kv-recall, latency;",
        f"{user_module}:Missing": f"--env: {user_module} has no attribute 'Missing'",
        f"{user_module}:NoStep": f"--env: {user_module}:NoStep is not an environment: it lacks step()",
        f"{user_module}:NeedsOption": f"--env: {user_module}:NeedsOption cannot be built with options {{}}",
        "no_such_package.envs:Env": "--env: cannot import no_such_package.envs",
    }
    for spec, message in cases.items():
        with pytest.raises(UsageError) as raised:
            resolve_environment(spec)
        assert str(raised.value).startswith(message) and "\n" not in str(raised.value), spec
    made = resolve_environment(f"{user_module}:NeedsOption", {"size": 3})
    assert made().size == 3 and made() is not made()  # a fresh instance per trajectory


def test_failures_of_an_environment_become_reasons_not_crashes():
    def boom(_):
        raise KeyError("store")

    with pytest.raises(EnvironmentFailure, match=r"step\(\) raised KeyError: 'store'"):
        call_environment(boom, act("x"), timeout=None, what="step()")
    with pytest.raises(EnvironmentFailure, match=r"step\(\) took longer than --env-timeout 0.05 s"):
        call_environment(time.sleep, 1.0, timeout=0.05, what="step()")
    assert call_environment(lambda a: a.text, act("ok"), timeout=5.0, what="step()") == "ok"
    for answer, message in [(None, "returned NoneType, not a Step"), (Step(observation=3), "observation is int"),
                            (Step(reward=float("nan")), "reward nan is not a finite number"),
                            (Step(done=1), "done 1 is not a bool"), (Step(info=[]), "info is list")]:
        with pytest.raises(EnvironmentFailure, match=message):
            checked_step(answer)
    assert checked_step(Step("obs", 1, True)).reward == 1
    with pytest.raises(EnvironmentFailure, match="reset\\(\\) returned dict"):
        checked_reset({})
