"""GLM's own tool calls (issue 34): environments declare tools as JSON schemas, the chat template
renders them into the prompt, the calls are parsed from the exact ids the policy sampled (the tags as
plain text, the tiny tokenizer, or as added tokens, GLM's), and ``calculator-glm`` answers them with
``<tool_response>`` observations appended as exact ids (TITO, the drift ledger unchanged)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from glmpost.checkpoints import tokenizer_revision
from glmpost.envs import (
    TOOL_CALL_PARSERS,
    Action,
    ToolCall,
    calculator_glm_tasks,
    parse_tool_calls,
    resolve_environment,
    tool_responses,
)
from glmpost.envs.calculator_glm import CALCULATOR_TOOL
from glmpost.envs.glm_tool_calls import REPAIRS, TAGS, ToolCalls, tag_ids
from glmpost.errors import UsageError
from glmpost.formats import ShardReader, ShardWriter, resolve_shard_paths
from glmpost.formats.prompts import encode_prompt, renders_tools
from glmpost.kernel.engine import Completion, SamplingParams
from glmpost.kernel.loading import load_tokenizer
from glmpost.models.tokenizer import train_tokenizer
from glmpost.rollout.agentic import MultiTurnSettings, ObservationRenderer, retokenize_drift, run_trajectories
from glmpost.rollout.records import RolloutPrompt, trajectory_record

TOOLS = [CALCULATOR_TOOL, {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}, "count": {"type": "integer"}}}}}]
CALL = "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>37*91</arg_value>\n</tool_call>"
# A third of the ids end a turn (short turns with observations), the model's eos ids among them.
STOPS = ",".join(str(i) for i in sorted(set(range(0, 512, 3)) | {0, 4, 6}))
PLAIN_TEMPLATE = ("[gMASK]<sop>{%- for message in messages -%}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                  "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{{ '\\n' }}{%- endif -%}")


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny built-in tokenizer: the tags are plain text (several byte-level pieces each)."""
    return train_tokenizer(512)


@pytest.fixture(scope="module")
def glm_tokenizer():
    """The tiny tokenizer with GLM's tags as added special tokens (one id each, as GLM's tokenizers have them)."""
    tok = train_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": list(TAGS)})
    return tok


def ids_of(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def spans_text(tok, ids, parsed):
    return [tok.decode(ids[start:end]) for start, end in (call.span for call in parsed.calls)]


@pytest.mark.parametrize("which", ["tokenizer", "glm_tokenizer"])
def test_one_and_two_calls_with_json_and_string_values(which, request):
    tok = request.getfixturevalue(which)
    assert (tag_ids(tok) is None) == (which == "tokenizer")
    one = ids_of(tok, "Let me compute. " + CALL + "<|observation|>")
    parsed = parse_tool_calls(one, tok, TOOLS)
    assert parsed.calls == (ToolCall("calculator", {"expression": "37*91"}, parsed.calls[0].span),) and not parsed.malformed
    assert parsed.content == "Let me compute. " and spans_text(tok, one, parsed) == [CALL]
    second = ("<tool_call>lookup<arg_key>key</arg_key><arg_value>12</arg_value><arg_key>count</arg_key>"
              "<arg_value>12</arg_value><arg_key>extra</arg_key><arg_value>{\"a\": [1, true]}</arg_value>"
              "<arg_key>note</arg_key><arg_value>not json</arg_value></tool_call>")
    two = ids_of(tok, CALL + "\n" + second + "<|observation|>")
    parsed = parse_tool_calls(two, tok, TOOLS)
    assert [c.name for c in parsed.calls] == ["calculator", "lookup"] and parsed.content == ""
    # a string parameter keeps its text ("12"); otherwise JSON when it parses, else the raw text
    assert parsed.calls[1].arguments == {"key": "12", "count": 12, "extra": {"a": [1, True]}, "note": "not json"}
    assert spans_text(tok, two, parsed) == [CALL, second]
    assert parse_tool_calls(two, tok).calls[1].arguments["key"] == 12  # no schemas: JSON whenever it parses


@pytest.mark.parametrize("which", ["tokenizer", "glm_tokenizer"])
@pytest.mark.parametrize("text, error", [
    ("<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>37*91\n</tool_call>",
     "argument 'expression''s <arg_value> without </arg_value> (found </tool_call>)"),
    ("<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>37*91</arg_value>",
     "tool call 'calculator' without <arg_key> (found the end of the turn)"),
    ("<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>\n</tool_call>",
     "unknown tool 'search' (tools: calculator, lookup)"),
    ("<tool_call>\n<arg_key>q</arg_key><arg_value>x</arg_value></tool_call>", "a <tool_call> without a function name"),
    ("<arg_key>q</arg_key>", "<arg_key> outside a <tool_call>"),
    ("<tool_call>lookup<arg_key>key</arg_key><arg_value>a</arg_value><arg_key>key</arg_key><arg_value>b</arg_value>"
     "</tool_call>", "a repeated argument key 'key'"),
])
def test_malformed_calls_say_why_and_have_no_calls(which, text, error, request):
    tok = request.getfixturevalue(which)
    parsed = parse_tool_calls(ids_of(tok, CALL + text + "<|observation|>"), tok, TOOLS)
    assert parsed.malformed and parsed.calls == () and error in parsed.error


SEARCH = "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>\n</tool_call>"
LITERALS = ("<tool_call>lookup<arg_key>a</arg_key><arg_value>'abc'</arg_value><arg_key>b</arg_key><arg_value>True</arg_value>"
            "<arg_key>c</arg_key><arg_value>None</arg_value><arg_key>d</arg_key><arg_value>[1, 2]</arg_value>"
            "<arg_key>e</arg_key><arg_value>{'a': 1}</arg_value><arg_key>f</arg_key><arg_value>(1, 2)</arg_value>"
            "<arg_key>key</arg_key><arg_value>'abc'</arg_value><arg_key>count</arg_key><arg_value> 12 </arg_value></tool_call>")
CALCULATED = ("calculator", {"expression": "37*91"})
# The engine mode's expected calls are what vLLM's GLM tool parser returns on the same text (read from
# vllm/tool_parsers/glm4_moe_tool_parser.py, Glm4MoeModelToolParser.extract_tool_calls / _deserialize /
# _is_string_type at commit 081866a6, with the two regexes of glm47_moe_tool_parser.py at commit b91ee1b4;
# the unknown tool dropped as vllm/parser/glm47_moe.py's validate_tool_names=True drops it), worked out by
# hand from those regexes. Each row: text, the engine's calls, its `repaired`, strict's error or calls.
ENGINE_CASES = {
    "unknown tool beside a known one": (CALL + SEARCH, [CALCULATED], ("unknown-tool",), "unknown tool 'search'"),
    "repeated key: the last value": (
        "<tool_call>lookup<arg_key>key</arg_key><arg_value>a</arg_value><arg_key>key</arg_key><arg_value>b</arg_value>"
        "</tool_call>", [("lookup", {"key": "b"})], ("repeated-key",), "a repeated argument key 'key'"),
    "missing </arg_value>: the argument lost": (
        "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>37*91\n</tool_call>", [("calculator", {})],
        ("ignored-text",), "argument 'expression''s <arg_value> without </arg_value> (found </tool_call>)"),
    "missing </arg_value> before a pair: the value runs to the next </arg_value>": (
        "<tool_call>lookup<arg_key>key</arg_key><arg_value>a<arg_key>count</arg_key><arg_value>2</arg_value></tool_call>",
        [("lookup", {"key": "a<arg_key>count</arg_key><arg_value>2"})], ("tag-in-argument",),
        "argument 'key''s <arg_value> without </arg_value> (found <arg_key>)"),
    "unclosed <tool_call>: no call": (
        CALL + "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>1+1</arg_value>", [CALCULATED],
        ("unclosed-call",), "tool call 'calculator' without <arg_key> (found the end of the turn)"),
    "junk between key and value: the argument lost": (
        "<tool_call>lookup<arg_key>key</arg_key>junk<arg_value>a</arg_value></tool_call>", [("lookup", {})],
        ("ignored-text",), "text between </arg_key> and <arg_value>"),
    "junk between key and value before a pair: the key runs to the next </arg_key>": (
        "<tool_call>lookup<arg_key>key</arg_key>junk<arg_value>a</arg_value><arg_key>count</arg_key><arg_value>2</arg_value>"
        "</tool_call>", [("lookup", {"key</arg_key>junk<arg_value>a</arg_value><arg_key>count": 2})], ("tag-in-argument",),
        "text between </arg_key> and <arg_value>"),
    "untyped values: JSON, else a Python literal, else text": (
        LITERALS, [("lookup", {"a": "abc", "b": True, "c": None, "d": [1, 2], "e": {"a": 1}, "f": [1, 2], "key": "'abc'",
                               "count": 12})], ("python-literal",) * 5,
        [("lookup", {"a": "'abc'", "b": "True", "c": "None", "d": [1, 2], "e": "{'a': 1}", "f": "(1, 2)", "key": "'abc'",
                     "count": 12})]),
    "tags outside calls ignored": ("hi </arg_key>" + CALL + " x <arg_value>", [CALCULATED], ("stray-tag", "stray-tag"),
                                   "</arg_key> outside a <tool_call>"),
    "a call without a name dropped": ("<tool_call>\n<arg_key>q</arg_key><arg_value>x</arg_value></tool_call>", [],
                                      ("no-name",), "a <tool_call> without a function name"),
}


@pytest.mark.parametrize("which", ["tokenizer", "glm_tokenizer"])
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_the_engine_mode_reads_malformed_calls_as_vllm_does(which, case, request):
    tok = request.getfixturevalue(which)
    text, expected, repaired, strict = ENGINE_CASES[case]
    ids = ids_of(tok, text + "<|observation|>")
    parsed = parse_tool_calls(ids, tok, TOOLS, mode="engine")
    assert [(call.name, call.arguments) for call in parsed.calls] == expected and not parsed.malformed
    assert parsed.repaired == repaired and set(repaired) <= set(REPAIRS)
    for call in parsed.calls:  # a kept call's span is its <tool_call> to its </tool_call>
        spanned = tok.decode(ids[call.span[0] : call.span[1]])
        assert spanned.startswith("<tool_call>" + call.name) and spanned.endswith("</tool_call>")
    # content: the text before the first <tool_call>, the whole turn when no call is kept (vLLM's)
    assert parsed.content == (text[: text.index("<tool_call>")] if expected else text)
    before = parse_tool_calls(ids, tok, TOOLS)  # the strict mode: as it was
    assert before.repaired == ()
    if isinstance(strict, str):
        assert before.malformed and before.calls == () and strict in before.error
    else:
        assert [(call.name, call.arguments) for call in before.calls] == strict and not before.malformed


@pytest.mark.parametrize("which", ["tokenizer", "glm_tokenizer"])
def test_the_engine_mode_on_clean_turns_without_tools_and_on_unserializable_values(which, request):
    tok = request.getfixturevalue(which)
    second = ("<tool_call>lookup<arg_key>key</arg_key><arg_value>12</arg_value><arg_key>count</arg_key>"
              "<arg_value>12</arg_value><arg_key>extra</arg_key><arg_value>{\"a\": [1, true]}</arg_value></tool_call>")
    clean = ids_of(tok, "Let me compute. " + CALL + "\n" + second + "<|observation|>")
    engine, strict = parse_tool_calls(clean, tok, TOOLS, mode="engine"), parse_tool_calls(clean, tok, TOOLS)
    assert engine == strict and engine.repaired == () and len(engine.calls) == 2  # a clean turn: the same calls
    # No tools (or none declared): no name is checked, as vLLM checks none; the strict mode refuses [] tools' names.
    unknown = ids_of(tok, CALL + SEARCH)
    for tools in (None, []):
        assert [c.name for c in parse_tool_calls(unknown, tok, tools, mode="engine").calls] == ["calculator", "search"]
    assert "unknown tool 'calculator' (tools: none)" in parse_tool_calls(unknown, tok, []).error
    # vLLM's parser fails on arguments JSON cannot hold (a set): no calls for the whole turn.
    text = CALL + "<tool_call>lookup<arg_key>a</arg_key><arg_value>{1, 2}</arg_value></tool_call>"
    failed = parse_tool_calls(ids_of(tok, text), tok, TOOLS, mode="engine")
    assert failed.calls == () and "no JSON" in failed.error and failed.content == text
    assert failed.repaired == ("python-literal",)
    assert parse_tool_calls(ids_of(tok, text), tok, TOOLS).calls[1].arguments == {"a": "{1, 2}"}
    with pytest.raises(ValueError, match="the tool-call parsers are strict, engine"):
        parse_tool_calls(clean, tok, TOOLS, mode="lenient")
    assert TOOL_CALL_PARSERS == ("strict", "engine")


@pytest.mark.parametrize("which", ["tokenizer", "glm_tokenizer"])
@pytest.mark.parametrize("mode", TOOL_CALL_PARSERS)
def test_start_parses_after_the_reasoning_with_spans_in_the_whole_action(which, mode, request):
    tok = request.getfixturevalue(which)
    reasoning = ids_of(tok, "<think>maybe " + CALL + " or <tool_call>calculator</think>")
    action = reasoning + ids_of(tok, "Let me compute. " + CALL + "<|observation|>")
    whole = parse_tool_calls(action, tok, TOOLS, mode=mode)  # the reasoning's call and open tag in the way
    if mode == "strict":
        assert whole.malformed
    else:  # the reasoning's call kept; its open <tool_call> runs to the answer's </tool_call>: one unknown name
        assert len(whole.calls) == 1 and whole.calls[0].span[1] <= len(reasoning) and whole.repaired == ("unknown-tool",)
    parsed = parse_tool_calls(action, tok, TOOLS, mode=mode, start=len(reasoning))
    assert parsed.calls == (ToolCall("calculator", {"expression": "37*91"}, parsed.calls[0].span),)
    assert parsed.content == "Let me compute. " and parsed.repaired == () and not parsed.malformed
    assert parsed.calls[0].span[0] >= len(reasoning) and spans_text(tok, action, parsed) == [CALL]  # whole-action positions
    assert parse_tool_calls(action, tok, TOOLS, mode=mode, start=len(action)) == ToolCalls()
    for bad in (-1, len(action) + 1):
        with pytest.raises(ValueError, match="is not a position"):
            parse_tool_calls(action, tok, TOOLS, mode=mode, start=bad)


@pytest.mark.parametrize("mode", TOOL_CALL_PARSERS)
def test_a_spelled_out_tag_is_text_in_either_mode(glm_tokenizer, mode):
    tok = glm_tokenizer
    spelled = [i for piece in ("<tool", "_call>calculator\n<arg", "_key>expression</arg", "_key>") for i in ids_of(tok, piece)]
    parsed = parse_tool_calls(spelled, tok, mode=mode)
    assert parsed == ToolCalls((), tok.decode(spelled))


def test_the_turn_ends_at_its_marker_and_text_between_calls_is_ignored(tokenizer):
    ids = ids_of(tokenizer, CALL + " and then " + CALL + "<|observation|><tool_call>nothing")
    parsed = parse_tool_calls(ids, tokenizer, TOOLS)
    assert len(parsed.calls) == 2 and not parsed.malformed
    assert parse_tool_calls(ids_of(tokenizer, "<answer>3367</answer><|endoftext|>"), tokenizer, TOOLS).calls == ()


def test_with_tag_tokens_only_the_tag_ids_are_tags(glm_tokenizer):
    """GLM's tags are single ids: a tag the model spelled out of ordinary pieces is text, not a call."""
    tok = glm_tokenizer
    real = ids_of(tok, CALL)
    assert real[0] == tok.convert_tokens_to_ids("<tool_call>") and len(parse_tool_calls(real, tok).calls) == 1
    spelled = [i for piece in ("<tool", "_call>calculator\n<arg", "_key>expression</arg", "_key>") for i in ids_of(tok, piece)]
    assert tok.decode(spelled) == "<tool_call>calculator\n<arg_key>expression</arg_key>"
    parsed = parse_tool_calls(spelled, tok)
    assert parsed.calls == () and not parsed.malformed and parsed.content == tok.decode(spelled)


def test_calculator_glm_answers_each_call_with_a_tool_response(tokenizer):
    env = resolve_environment("calculator-glm", {"tool_reward": 0.25})()
    assert env.tools == [CALCULATOR_TOOL] and resolve_environment("calculator-glm").tools == [CALCULATOR_TOOL]
    env.reset({"expression": "37*91", "answer": "3367"})

    def act(text):
        ids = ids_of(tokenizer, text)
        return Action(tuple(ids), tokenizer.decode(ids, skip_special_tokens=True), parse_tool_calls(ids, tokenizer, env.tools))

    two = env.step(act(CALL + CALL.replace("37*91", "7//0") + "<|observation|>"))
    assert two.observation == "<tool_response>\n3367\n</tool_response>\n<tool_response>\nerror: division by zero\n</tool_response>"
    assert (two.reward, two.done, two.info) == (0.25, False, {"tool": "calculator", "calls": 2, "ok": False})
    broken = env.step(act(CALL.replace("</arg_value>", "") + "<|observation|>"))
    assert broken.info["malformed"] and broken.observation.startswith("<tool_response>\nerror: malformed tool call: ")
    lost = env.step(act("I think it is big<|endoftext|>"))
    assert lost.info == {"malformed": True} and "no tool call found" in lost.observation
    final = env.step(act("<answer>3367</answer><|endoftext|>"))
    assert (final.reward, final.done, final.info) == (1.0, True, {"answer": "3367", "correct": True})
    with pytest.raises(ValueError, match="Action.tool_calls"):
        env.step(Action((1,), "no parse"))


class BadTools:
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]

    def reset(self, task):
        return ""

    def step(self, action):
        raise NotImplementedError


def test_declared_tools_are_checked_and_pass_through_latency():
    with pytest.raises(UsageError, match=r"--env test_glm_tool_calls:BadTools: tools must be .* distinct names"):
        resolve_environment("test_glm_tool_calls:BadTools")
    assert resolve_environment("calculator").tools is None
    assert resolve_environment("latency", {"inner": "calculator-glm", "median_s": 0}).tools == [CALCULATOR_TOOL]


def test_the_chat_template_renders_the_tools_into_the_prompt_ids(tokenizer):
    messages = [{"role": "user", "content": calculator_glm_tasks(1)[0]["prompt"]}]
    plain, with_tools = encode_prompt(tokenizer, messages), encode_prompt(tokenizer, messages, [CALCULATOR_TOOL])
    assert renders_tools(tokenizer, [CALCULATOR_TOOL]) and with_tools[-len(plain) + 2 :] == plain[2:]  # after [gMASK]<sop>
    schema = json.dumps(CALCULATOR_TOOL, ensure_ascii=False)
    text = tokenizer.decode(with_tools)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n") and f"<tools>\n{schema}\n</tools>" in text
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=[CALCULATOR_TOOL])
    assert with_tools == ids_of(tokenizer, rendered) and text == rendered
    bare = train_tokenizer(512)
    bare.chat_template = PLAIN_TEMPLATE
    assert not renders_tools(bare, [CALCULATOR_TOOL])


def _scripted(actions):
    """A ``generate`` that answers turn ``t`` with the teacher-forced ids ``actions[t]``, recording each prompt."""
    prompts = []

    def generate(seqs, turn_keys, sessions, max_new_tokens=None):
        prompts.extend(seqs)
        return [(Completion(list(actions[len(prompts) - 1]), [-0.5] * len(actions[len(prompts) - 1]), "stop"), 0, None)
                for _ in seqs]

    return generate, prompts


def test_a_calculator_glm_trajectory_is_exact_ids_turn_after_turn(tokenizer, tmp_path):
    line = calculator_glm_tasks(1, seed=4)[0]
    expression, answer = line["task"]["expression"], line["task"]["answer"]
    factory = resolve_environment("calculator-glm")
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": line["prompt"]}], factory.tools)
    call = CALL.replace("37*91", expression) + "<|observation|>"
    # Teacher-forced, one id per character: not what encoding the text gives, so the drift ledger sees it.
    first = [i for ch in call.replace("<|observation|>", "") for i in ids_of(tokenizer, ch)] + ids_of(tokenizer, "<|observation|>")
    last = ids_of(tokenizer, f"<answer>{answer}</answer><|endoftext|>")
    generate, prompts = _scripted([first, last])
    settings = MultiTurnSettings(max_turns=4, max_new_tokens=64, context=4096, env_timeout=None)
    (trajectory,) = run_trajectories(generate, [prompt], ["q/0"], [line["task"]], factory, ObservationRenderer(tokenizer),
                                     settings, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    assert trajectory.status == "completed" and trajectory.reward == 1.0
    observation = trajectory.turns[0].observation_ids
    assert trajectory.turns[0].observation == f"<tool_response>\n{answer}\n</tool_response>"
    # the model's <|observation|> opened the turn: the rendering without it, exactly
    assert observation == ids_of(tokenizer, f"\n<tool_response>\n{answer}\n</tool_response><|assistant|>\n")
    assert prompts == [prompt, prompt + first + observation]  # each turn's prompt is exactly everything before it
    assert trajectory.response_ids() == first + observation + last
    assert tokenizer.decode(prompt + trajectory.response_ids()).endswith(
        f"{call}\n<tool_response>\n{answer}\n</tool_response><|assistant|>\n<answer>{answer}</answer><|endoftext|>")

    drift = retokenize_drift(tokenizer, trajectory.response_ids(), trajectory.action_flags())
    assert drift > 0  # re-encoding the text would merge the per-character ids: counted, never done
    record = trajectory_record(RolloutPrompt("q", prompt, "calculator", line["task"]), trajectory, sample_index=0,
                               params=SamplingParams(), policy_version=0, tokenizer_revision="rev", engine={},
                               env_name="calculator-glm", drift=drift)
    with ShardWriter(tmp_path / "r.shard", stage="rollout", tokenizer_revision="rev") as writer:
        writer.write(record)
    (record,) = [r for p in resolve_shard_paths([tmp_path / "r.shard"]) for r in ShardReader(p)]
    ids = record["response_token_ids"].tolist()
    assert record["prompt_token_ids"].tolist() == prompt and ids == first + observation + last
    assert [(s["kind"], s["start"], s["end"]) for s in record["segments"]] == [
        ("action", 0, len(first)), ("observation", len(first), len(first) + len(observation)),
        ("action", len(first) + len(observation), len(ids))]
    assert record["action_mask"].tolist() == [True] * len(first) + [False] * len(observation) + [True] * len(last)
    assert np.isnan(record["rollout_log_probs"][record["observation_mask"]]).all()
    assert record["extra"]["env"]["retokenize_drift"] == drift and record["extra"]["env"]["reward"] == 1.0
    assert record["extra"]["env"]["steps"][0] == {"tool": "calculator", "calls": 1, "ok": True}


@pytest.fixture(scope="module")
def agentic_checkpoint(tmp_path_factory):
    """A tiny checkpoint with the long context of the agentic preset (the tools section alone is ~600 ids)."""
    from conftest import run_glmpost  # the session's in-process CLI runner

    out = tmp_path_factory.mktemp("agentic") / "ckpt"
    result = run_glmpost("init-model", "--out", out, "--preset", "tiny-glm5-agentic", "--seed", "0")
    assert result.exit_code == 0, result.stderr
    return out


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in calculator_glm_tasks(2, seed=1)))
    return path


def test_rollout_renders_the_tools_and_answers_in_tool_responses(glmpost_cli, agentic_checkpoint, tmp_path):
    out = tmp_path / "ro"
    result = glmpost_cli("rollout", _prompt_file(tmp_path), "--checkpoint", agentic_checkpoint, "--out", out, "--env",
                         "calculator-glm", "--group-size", "2", "--max-new-tokens", "12", "--max-turns", "3",
                         "--stop-token-ids", STOPS, "--temperature", "0.8")
    assert result.exit_code == 0, result.stderr
    tokenizer, _ = load_tokenizer(agentic_checkpoint)
    records = [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]
    assert len(records) == 4
    schema, observations = json.dumps(CALCULATOR_TOOL, ensure_ascii=False), 0
    for record, line in zip(records, [x for x in calculator_glm_tasks(2, seed=1) for _ in range(2)]):
        expected = encode_prompt(tokenizer, [{"role": "user", "content": line["prompt"]}], [CALCULATOR_TOOL])
        assert record["prompt_token_ids"].tolist() == expected and schema in tokenizer.decode(expected)
        ids = record["response_token_ids"].tolist()
        for segment in record["segments"]:
            if segment["kind"] == "observation":
                text = tokenizer.decode(ids[segment["start"] : segment["end"]])
                assert text.removeprefix("<|observation|>").startswith("\n<tool_response>\n") and text.endswith(
                    "</tool_response><|assistant|>\n")
                observations += 1
    assert observations >= 1


def test_a_template_that_does_not_render_tools_is_a_one_line_error(glmpost_cli, agentic_checkpoint, tmp_path):
    copy = tmp_path / "plain"
    shutil.copytree(agentic_checkpoint, copy)
    (copy / "chat_template.jinja").write_text(PLAIN_TEMPLATE)
    manifest = json.loads((copy / "glmpost.json").read_text())
    (copy / "glmpost.json").write_text(json.dumps({**manifest, "tokenizer_revision": tokenizer_revision(copy)}))
    result = glmpost_cli("rollout", _prompt_file(tmp_path), "--checkpoint", copy, "--out", tmp_path / "ro", "--env",
                         "calculator-glm", "--group-size", "1")
    assert result.exit_code == 2
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and "--env calculator-glm declares tools, but the checkpoint's chat template" in message[0]
    assert tool_responses(["1", "2"]).count("<tool_response>") == 2


# GLM-4.5+'s way of writing tool results: OpenAI's `tool` role, one message per result, the run of
# them under one <|observation|>, each in its <tool_response> block (no `observation` role).
TOOL_ROLE_TEMPLATE = (
    "[gMASK]<sop>{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}{{ '\\n</tool_response>' }}"
    "{%- elif m.role in ('system', 'user', 'assistant') -%}<|{{ m.role }}|>\n{{ m.content }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m.role) }}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")


def test_observations_render_as_tool_messages_where_the_template_has_no_observation_role():
    tok = train_tokenizer(512)
    tok.chat_template = TOOL_ROLE_TEMPLATE
    text = tool_responses(["3367", "error: division by zero"])
    ids = ObservationRenderer(tok).ids(text, after=())
    # The template writes each block itself: the results once, not wrapped twice.
    assert tok.decode(ids) == f"<|observation|>\n{text}<|assistant|>"
    assert tok.decode(ids).count("<tool_response>") == 2
    tok.chat_template = "{%- for m in messages -%}{{ raise_exception('no') }}{%- endfor -%}"
    with pytest.raises(Exception, match="the chat template cannot render the generation prompt"):
        ObservationRenderer(tok)
    # a template that renders turns, but neither an observation nor a tool message: refused before any sampling
    tok.chat_template = ("{%- for m in messages -%}{%- if m.role in ('user', 'assistant') -%}<|{{ m.role }}|>{{ m.content }}"
                         "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
    with pytest.raises(Exception, match="renders neither an observation nor a tool turn"):
        ObservationRenderer(tok)
