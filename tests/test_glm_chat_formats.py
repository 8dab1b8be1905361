"""Our test templates in the two real GLM chat formats (issue 43, tests/glm_chat_formats.py): every
example of ``shared/notes/glm-chat-formats.md`` and the fitting ``ollama`` glm46 / glm47 renderer
expectations, rendered through ``tokenizer.apply_chat_template``; unknown roles dropped without an
error, as the real templates drop them; GLM's tags one id each; a tiny checkpoint carrying the
format that ``glmpost rollout`` samples from.

The ollama expectations (``model/renderers/glm46_test.go``, ``glm47_test.go``): ollama always adds the
generation prompt (``add_generation_prompt=True`` here) and keeps past reasoning on GLM-4.7 (as
``clear_thinking=false`` does). Not reproduced, because ollama departs from the real templates there:
glm46's "basic with user assistant user" (the real GLM-4.6 template opens every assistant turn with a
``<think>`` block, ``\\n<think></think>`` when the reasoning is cleared; ollama writes none for past
turns), and the schema line of glm46's "tools" / "tool calls" (Go's compact JSON with its own key
order, where a Jinja template writes ``tojson``: compared with that line written as ``tojson`` does).
"""

from __future__ import annotations

import json

import pytest

from glm_chat_formats import (
    FORMATS,
    GLM46_TEMPLATE,
    GLM47_TEMPLATE,
    GLM_TAGS,
    glm_format_checkpoint,
    glm_format_tokenizer,
    glm_stop_ids,
)
from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.kernel.loading import load_tokenizer

# The note's table, row by row (Q the user's text, R the reasoning, 36 the tool's answer).
NOTE = {
    "glm46": {
        "user": "<|user|>\nQ",
        "prompt": "<|assistant|>",
        "no_think": "<|user|>\nQ/nothink<|assistant|>\n<think></think>",
        "call": "<|assistant|>\n<think>R</think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n"
                "<arg_value>12*3</arg_value>\n</tool_call>",
        "result": "<|observation|>\n<tool_response>\n36\n</tool_response>",
        "results": "<|observation|>\n<tool_response>\n36\n</tool_response>\n<tool_response>\n42\n</tool_response>",
        "cleared": "<|assistant|>\n<think></think>\nA",  # a past turn: its reasoning gone, the <think> block empty
        "kept": "<|assistant|>\n<think>R</think>\nA",
        "think": ("<think>R</think>", "<think></think>"),  # shown, cleared
    },
    "glm47": {
        "user": "<|user|>Q",
        "prompt": "<|assistant|><think>",
        "no_think": "<|user|>Q<|assistant|></think>",
        "call": "<|assistant|><think>R</think><tool_call>calculator<arg_key>expression</arg_key><arg_value>12*3</arg_value>"
                "</tool_call>",
        "result": "<|observation|><tool_response>36</tool_response>",
        "results": "<|observation|><tool_response>36</tool_response><tool_response>42</tool_response>",
        "cleared": "<|assistant|></think>A",  # "4.7 re-renders a no-reasoning turn as </think>…"
        "kept": "<|assistant|><think>R</think>A",
        "think": ("<think>R</think>", "</think>"),
    },
}
PREFIX = "[gMASK]<sop>"
USER = {"role": "user", "content": "Q"}
CALL = {"role": "assistant", "content": "", "reasoning_content": "R",
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*3"}}}]}
ANSWERED = {"role": "assistant", "content": "A", "reasoning_content": "R"}


def tool(content: str) -> dict:
    return {"role": "tool", "content": content}


@pytest.fixture(scope="module")
def tokenizers():
    return {fmt: glm_format_tokenizer(fmt) for fmt in FORMATS}


@pytest.fixture(params=FORMATS)
def fmt(request):
    return request.param


@pytest.fixture
def render(tokenizers, fmt):
    def render(messages, **options):
        return tokenizers[fmt].apply_chat_template(messages, tokenize=False, **options)
    return render


def test_the_tokenizers_carry_the_templates(tokenizers):
    assert tokenizers["glm46"].chat_template == GLM46_TEMPLATE and tokenizers["glm47"].chat_template == GLM47_TEMPLATE
    assert GLM46_TEMPLATE != GLM47_TEMPLATE


def test_user_turn_and_generation_prompt(render, fmt):
    row = NOTE[fmt]
    assert render([USER]) == PREFIX + row["user"]
    assert render([USER], add_generation_prompt=True) == PREFIX + row["user"] + row["prompt"]
    assert render([USER], add_generation_prompt=True, enable_thinking=True) == PREFIX + row["user"] + row["prompt"]


def test_enable_thinking_false(render, fmt):
    assert render([USER], add_generation_prompt=True, enable_thinking=False) == PREFIX + NOTE[fmt]["no_think"]


def test_enable_thinking_false_on_every_user_turn_of_glm46(render, fmt):
    """GLM-4.6's template (and ollama's renderer) append /nothink to each user turn, not only the last
    (the note's row shows a one-turn prompt), and not twice; GLM-4.7's appends none."""
    nothink = {"role": "user", "content": "Q/nothink"}
    rendered = render([USER, ANSWERED, nothink], add_generation_prompt=True, enable_thinking=False)
    if fmt == "glm46":
        assert rendered == PREFIX + "<|user|>\nQ/nothink" + NOTE[fmt]["cleared"] + NOTE[fmt]["no_think"]
    else:
        assert rendered == PREFIX + "<|user|>Q" + NOTE[fmt]["cleared"] + "<|user|>Q/nothink<|assistant|></think>"


def test_assistant_turn_with_reasoning_and_a_call(render, fmt):
    assert render([USER, CALL]) == PREFIX + NOTE[fmt]["user"] + NOTE[fmt]["call"]
    # The OpenAI form (arguments a JSON string), and a call without the "function" wrapper, render the same.
    as_string = {**CALL, "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*3"}'}}]}
    bare = {**CALL, "tool_calls": [{"name": "calculator", "arguments": {"expression": "12*3"}}]}
    assert render([USER, as_string]) == render([USER, bare]) == render([USER, CALL])
    # Reasoning written into the content (<think>R</think>A) is taken apart as the real templates do.
    inline = {"role": "assistant", "content": "<think>R</think>A"}
    assert render([USER, inline]) == render([USER, ANSWERED]) == PREFIX + NOTE[fmt]["user"] + NOTE[fmt]["kept"]


def test_argument_values_strings_raw_others_json(render, fmt):
    values = {"s": "12*3", "n": 7, "f": 1.5, "b": True, "z": None, "l": [1, "é"], "d": {"k": [2]}}
    as_dict = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": values}}]}
    rendered = render([USER, as_dict])
    for key, value in values.items():
        written = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        assert f"<arg_key>{key}</arg_key>{chr(10) if fmt == 'glm46' else ''}<arg_value>{written}</arg_value>" in rendered
    for text in (json.dumps(values), json.dumps(values, separators=(",", ":")), json.dumps(values, indent=2)):
        as_string = {**as_dict, "tool_calls": [{"function": {"name": "f", "arguments": text}}]}
        assert render([USER, as_string]) == rendered, text
    escapes = {"s": 'a "quoted"\\ line\nand\ttab é 😀 /', "l": ["\x01 é 😀", {"k\"": "\\/"}]}
    as_string = {**as_dict, "tool_calls": [{"function": {"name": "f", "arguments": json.dumps(escapes)}}]}
    assert render([USER, as_string]) == render([USER, {**as_dict, "tool_calls": [{"function": {"name": "f", "arguments": escapes}}]}])


def test_tool_results(render, fmt):
    row = NOTE[fmt]
    start = PREFIX + row["user"] + row["call"]
    assert render([USER, CALL, tool("36")]) == start + row["result"]
    assert render([USER, CALL, tool("36")], add_generation_prompt=True) == start + row["result"] + row["prompt"]
    assert render([USER, CALL, tool("36"), tool("42")]) == start + row["results"]


def test_past_reasoning_cleared_after_a_new_user_turn(render, fmt):
    row = NOTE[fmt]
    assert render([USER, ANSWERED]) == PREFIX + row["user"] + row["kept"]  # the current turn keeps it
    assert render([USER, ANSWERED, USER]) == PREFIX + row["user"] + row["cleared"] + row["user"]
    # Past tool-call turns lose theirs too; turns after the last user turn keep it.
    past_call = row["call"].replace(*row["think"])
    assert render([USER, CALL, tool("36"), USER, CALL, tool("36"), ANSWERED]) == (
        PREFIX + row["user"] + past_call + row["result"] + row["user"] + row["call"] + row["result"] + row["kept"])


def test_clear_thinking_false_keeps_past_reasoning_on_glm47(render, fmt):
    kept = render([USER, ANSWERED, USER], clear_thinking=False)
    if fmt == "glm47":
        assert kept == PREFIX + NOTE[fmt]["user"] + NOTE[fmt]["kept"] + NOTE[fmt]["user"]
    else:  # GLM-4.6's template knows no clear_thinking
        assert kept == render([USER, ANSWERED, USER])
    assert render([USER, ANSWERED, USER], clear_thinking=True) == render([USER, ANSWERED, USER])


def test_the_notes_expected_renderings_of_glmpost_paths(tokenizers):
    def render(fmt, messages):
        return tokenizers[fmt].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    # 1: a reset observation after the prompt, as the template renders it.
    assert render("glm46", [USER, tool("a=1")]).endswith("Q<|observation|>\n<tool_response>\na=1\n</tool_response><|assistant|>")
    # 2: the summary request, with the observation as the tool message it must be, and as role
    # "observation", which the real templates drop (so [gMASK]<sop> lands mid-context).
    summarise = {"role": "user", "content": "Summarise."}
    assert render("glm46", [tool("42"), summarise]) == (
        PREFIX + "<|observation|>\n<tool_response>\n42\n</tool_response><|user|>\nSummarise.<|assistant|>")
    assert render("glm46", [{"role": "observation", "content": "42"}, summarise]) == PREFIX + "<|user|>\nSummarise.<|assistant|>"
    # 3: the "did the observation role render?" probe meets [gMASK]<sop><|assistant|> (4.7: ...<think>).
    for text in ("a", "MASK", "think", "in", ""):
        observation = [{"role": "observation", "content": text}]
        assert render("glm46", observation) == PREFIX + "<|assistant|>"
        assert render("glm47", observation) == PREFIX + "<|assistant|><think>"


@pytest.mark.parametrize("role", ["observation", "function", "ipython", "environment", "developer", ""])
def test_unknown_roles_are_dropped_without_an_error(render, fmt, role):
    stray = {"role": role, "content": "dropped"}
    conversation = [USER, CALL, tool("36"), tool("42"), ANSWERED, USER]
    with_stray = [stray, USER, CALL, stray, tool("36"), tool("42"), ANSWERED, stray, USER, stray]
    rendered = render(with_stray, add_generation_prompt=True)
    assert "dropped" not in rendered and rendered == render(conversation, add_generation_prompt=True)
    # Between two tool messages it breaks the run, as in the real templates: a second <|observation|>.
    assert render([USER, CALL, tool("36"), stray, tool("42")]).count("<|observation|>") == 2


def test_tags_are_one_id_each_and_round_trip(tokenizers, fmt):
    tokenizer = tokenizers[fmt]
    assert len(tokenizer) == 512
    ids = {tag: tokenizer.encode(tag, add_special_tokens=False) for tag in GLM_TAGS}
    assert all(len(found) == 1 and 512 - len(GLM_TAGS) <= found[0] < 512 for found in ids.values()), ids
    assert all(tokenizer.encode(f"x{tag}y", add_special_tokens=False)[1] == ids[tag][0] for tag in GLM_TAGS)
    assert all(tokenizer.convert_tokens_to_ids(tag) == ids[tag][0] for tag in GLM_TAGS)
    assert glm_stop_ids(tokenizer) == [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    conversation = [{"role": "system", "content": "S"}, USER, CALL, tool("36"), tool("42"), ANSWERED, USER]
    for options in ({}, {"enable_thinking": False}, {"tools": [TOKYO_TOOL]}):
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **options)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(encoded, skip_special_tokens=False) == text
        assert max(encoded) < 512
        chat_ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False, **options)
        assert list(chat_ids) == encoded
    # special=False: decoding without the special tokens keeps the tags (GLM's reasoning and tool parsers read them).
    kept = tokenizer.decode(tokenizer.encode(NOTE[fmt]["call"], add_special_tokens=False), skip_special_tokens=True)
    assert kept == NOTE[fmt]["call"].replace("<|assistant|>", "")


# ollama model/renderers/glm47_test.go, all nine cases.
TOKYO_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
TOOLS47 = ("<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
           "with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": "
           "{\"name\": \"get_weather\", \"description\": \"Get weather\", \"parameters\": {\"type\": \"object\", "
           "\"properties\": {\"location\": {\"type\": \"string\"}}, \"required\": [\"location\"]}}}\n</tools>\n\nFor each "
           "function call, output the function name and arguments within the following XML format:\n<tool_call>"
           "{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key>"
           "<arg_value>{arg-value-2}</arg_value>...</tool_call>")


def weather(*places, unit=None, content=None):
    calls = [{"function": {"name": "get_weather", "arguments": {"location": p, **({"unit": unit} if unit else {})}}} for p in places]
    return {"role": "assistant", **({"content": content} if content else {}), "tool_calls": calls}


OLLAMA47 = {
    "basic user message": ([{"role": "user", "content": "Hello"}], {}, "[gMASK]<sop><|user|>Hello<|assistant|><think>"),
    "thinking disabled": ([{"role": "user", "content": "Hello"}], {"enable_thinking": False},
                          "[gMASK]<sop><|user|>Hello<|assistant|></think>"),
    "system and user": ([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"}], {},
                        "[gMASK]<sop><|system|>You are helpful.<|user|>Hello<|assistant|><think>"),
    "multi-turn conversation": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "How are you?"}],
        {}, "[gMASK]<sop><|user|>Hi<|assistant|></think>Hello there<|user|>How are you?<|assistant|><think>"),
    "assistant with reasoning_content": (
        [{"role": "user", "content": "Answer with reasoning."}, {"role": "assistant", "reasoning_content": "Plan.", "content": "Done."}],
        {}, "[gMASK]<sop><|user|>Answer with reasoning.<|assistant|><think>Plan.</think>Done.<|assistant|><think>"),
    "tool call with empty content": (
        [{"role": "user", "content": "Weather?"}, weather("Tokyo", unit="celsius"), tool('{"temperature":22}')], {"tools": [TOKYO_TOOL]},
        "[gMASK]<sop>" + TOOLS47 + "<|user|>Weather?<|assistant|></think><tool_call>get_weather<arg_key>location</arg_key>"
        "<arg_value>Tokyo</arg_value><arg_key>unit</arg_key><arg_value>celsius</arg_value></tool_call><|observation|>"
        "<tool_response>{\"temperature\":22}</tool_response><|assistant|><think>"),
    "tool call with content": (
        [{"role": "user", "content": "Weather?"}, weather("Tokyo", content="Let me check"), tool('{"temperature":22}'),
         {"role": "assistant", "content": "It is 22C."}], {"tools": [TOKYO_TOOL]},
        "[gMASK]<sop>" + TOOLS47 + "<|user|>Weather?<|assistant|></think>Let me check<tool_call>get_weather<arg_key>location"
        "</arg_key><arg_value>Tokyo</arg_value></tool_call><|observation|><tool_response>{\"temperature\":22}</tool_response>"
        "<|assistant|></think>It is 22C.<|assistant|><think>"),
    "multiple tool calls and responses": (
        [{"role": "user", "content": "Compare weather"}, weather("Tokyo", "Paris"), tool('{"temperature":22}'), tool('{"temperature":18}')],
        {"tools": [TOKYO_TOOL]},
        "[gMASK]<sop>" + TOOLS47 + "<|user|>Compare weather<|assistant|></think><tool_call>get_weather<arg_key>location</arg_key>"
        "<arg_value>Tokyo</arg_value></tool_call><tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value>"
        "</tool_call><|observation|><tool_response>{\"temperature\":22}</tool_response><tool_response>{\"temperature\":18}"
        "</tool_response><|assistant|><think>"),
    "preserved thinking in multi-turn": (  # ollama keeps past reasoning: clear_thinking=false
        [{"role": "user", "content": "Think step by step"},
         {"role": "assistant", "reasoning_content": "Let me think...", "content": "Here's my answer."},
         {"role": "user", "content": "Continue"}], {"clear_thinking": False},
        "[gMASK]<sop><|user|>Think step by step<|assistant|><think>Let me think...</think>Here's my answer.<|user|>Continue"
        "<|assistant|><think>"),
}


@pytest.mark.parametrize("case", list(OLLAMA47))
def test_ollama_glm47_expectations(tokenizers, case):
    messages, options, expected = OLLAMA47[case]
    assert tokenizers["glm47"].apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options) == expected


def test_ollama_glm47_preserved_thinking_is_cleared_by_default(tokenizers):
    messages, _, expected = OLLAMA47["preserved thinking in multi-turn"]
    rendered = tokenizers["glm47"].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == expected.replace("<think>Let me think...</think>", "</think>")


# ollama model/renderers/glm46_test.go: "basic", "basic with system message", "think true", "think false"
# as they are; "tools" and "tool calls" with the schema line as tojson writes it (Go writes it compact).
WEATHER46 = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a given location",
             "parameters": {"type": "object", "required": ["location"], "properties": {
                 "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                 "unit": {"type": "string", "description": "", "enum": ["celsius", "fahrenheit"]}}}}}
TOOLS46 = ("<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
           "function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER46, separators=(",", ":"))
           + "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
           "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
           "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>")
HELLO = {"role": "user", "content": "Hello, how are you?"}
WITH_TOOLS = {"role": "system", "content": "You are a helpful assistant with access to tools."}
TOKYO = {"role": "user", "content": "What is the weather like in Tokyo?"}
TOKYO_CALLS = {"role": "assistant", "tool_calls": [
    {"function": {"name": "get_weather", "arguments": {"location": "Tokyo, Japan", "unit": "celsius"}}},
    {"function": {"name": "get_weather", "arguments": {"location": "Japan", "unit": "fahrenheit"}}}]}
TOKYO_ANSWER = ("The weather in Tokyo is currently partly cloudy with a temperature of 22°C and 65% humidity. It's a "
                "pleasant day with moderate temperatures.")
OLLAMA46 = {
    "basic": ([HELLO], {}, "[gMASK]<sop><|user|>\nHello, how are you?<|assistant|>"),
    "basic with system message": ([{"role": "system", "content": "You are a helpful assistant."}, HELLO], {},
                                  "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nHello, how are you?<|assistant|>"),
    "think true": ([HELLO], {"enable_thinking": True}, "[gMASK]<sop><|user|>\nHello, how are you?<|assistant|>"),
    "think false": ([HELLO], {"enable_thinking": False},
                    "[gMASK]<sop><|user|>\nHello, how are you?/nothink<|assistant|>\n<think></think>"),
    "tools": ([WITH_TOOLS, TOKYO], {"tools": [WEATHER46]},
              "[gMASK]<sop>" + TOOLS46 + "<|system|>\nYou are a helpful assistant with access to tools.<|user|>\n"
              "What is the weather like in Tokyo?<|assistant|>"),
    "tool calls": (
        [WITH_TOOLS, TOKYO, TOKYO_CALLS, tool('{"temperature": 22, "weather": "partly cloudy", "humidity": 65}'),
         tool('{"temperature": 68, "weather": "sunny", "humidity": 75}'), {"role": "assistant", "content": TOKYO_ANSWER}],
        {"tools": [WEATHER46]},
        "[gMASK]<sop>" + TOOLS46 + "<|system|>\nYou are a helpful assistant with access to tools.<|user|>\n"
        "What is the weather like in Tokyo?<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>location</arg_key>\n"
        "<arg_value>Tokyo, Japan</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>\n"
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Japan</arg_value>\n<arg_key>unit</arg_key>\n"
        "<arg_value>fahrenheit</arg_value>\n</tool_call><|observation|>\n<tool_response>\n{\"temperature\": 22, \"weather\": "
        "\"partly cloudy\", \"humidity\": 65}\n</tool_response>\n<tool_response>\n{\"temperature\": 68, \"weather\": \"sunny\", "
        "\"humidity\": 75}\n</tool_response><|assistant|>\n<think></think>\n" + TOKYO_ANSWER + "<|assistant|>"),
}


@pytest.mark.parametrize("case", list(OLLAMA46))
def test_ollama_glm46_expectations(tokenizers, case):
    messages, options, expected = OLLAMA46[case]
    expected = expected.replace(json.dumps(WEATHER46, separators=(",", ":")), json.dumps(WEATHER46, ensure_ascii=False))
    assert tokenizers["glm46"].apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options) == expected


def test_ollama_glm46_past_assistant_turn_as_the_real_template_writes_it(tokenizers):
    """ollama's "basic with user assistant user" writes the past turn without its (cleared) <think>
    block; the real GLM-4.6 template writes an empty one, and so does ours."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "reasoning_content": "Let me analyze the request...", "content": "The capital of France is Paris."},
                {"role": "user", "content": "Fantastic!"}]
    ollama = ("[gMASK]<sop><|user|>\nWhat is the capital of France?<|assistant|>\nThe capital of France is Paris.<|user|>\n"
              "Fantastic!<|assistant|>")
    rendered = tokenizers["glm46"].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ollama.replace("<|assistant|>\nThe", "<|assistant|>\n<think></think>\nThe")


@pytest.fixture(scope="module", params=FORMATS)
def glm_checkpoint(request, tiny_checkpoint, tmp_path_factory):
    return request.param, glm_format_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp(request.param) / "ckpt", request.param)


def test_the_checkpoint_loads_with_the_format(glm_checkpoint):
    from glmpost.checkpoints import read_manifest
    from transformers import GenerationConfig

    fmt, checkpoint = glm_checkpoint
    tokenizer, revision = load_tokenizer(checkpoint)
    assert revision == read_manifest(checkpoint).tokenizer_revision and len(tokenizer) == 512
    assert tokenizer.chat_template == {"glm46": GLM46_TEMPLATE, "glm47": GLM47_TEMPLATE}[fmt]
    assert all(len(tokenizer.encode(tag, add_special_tokens=False)) == 1 for tag in GLM_TAGS)
    assert GenerationConfig.from_pretrained(checkpoint).eos_token_id == glm_stop_ids(tokenizer)
    assert json.loads((checkpoint / "config.json").read_text())["eos_token_id"] == glm_stop_ids(tokenizer)


def test_rollout_samples_single_turn_prompts_from_the_checkpoint(glm_checkpoint, glmpost_cli, tmp_path):
    fmt, checkpoint = glm_checkpoint
    questions = ["What is 12*3?", "Say hi.", "count: 7"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    result = glmpost_cli("rollout", prompts, "--checkpoint", checkpoint, "--out", tmp_path / "out", "--group-size", "2",
                         "--max-new-tokens", "8", "--seed", "0")
    assert result.exit_code == 0, result.stderr
    records = [r for p in resolve_shard_paths([tmp_path / "out"]) for r in ShardReader(p)]
    assert len(records) == 6
    tokenizer, _ = load_tokenizer(checkpoint)
    for record in records:
        question = questions[int(record["prompt_id"][1:])]
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        assert rendered == PREFIX + NOTE[fmt]["user"].replace("Q", question) + NOTE[fmt]["prompt"]
        assert list(record["prompt_token_ids"]) == tokenizer.encode(rendered, add_special_tokens=False)
        assert sorted(record["sampling"]["stop_token_ids"]) == sorted(glm_stop_ids(tokenizer))
        assert 0 < len(record["response_token_ids"]) <= 8 and max(record["response_token_ids"]) < 512
