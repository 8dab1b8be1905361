"""Multi-turn rollouts under the real GLM chat formats (issue 43): GLM-4.5/4.6 and GLM-4.7/GLM-5
templates of our own (tests/glm_chat_formats.py) that render as the real checkpoints' do — tags as
added tokens, no ``observation`` role (unknown roles silently dropped), generation prompts
``<|assistant|>`` and ``<|assistant|><think>``.

Each defect of shared/notes/glm-chat-formats.md has a test here that fails on the code before the
issue: the reset observation's stray generation prompt (1), compaction's lost observation and stale
generation prompt (2), short observations replaced by the probe (3), tool calls and answers read
inside the reasoning (4). Then whole rollouts in both formats: exact ids against the template's own
rendering, and the trainer's log-probs against the rollout's on every window (closure <= 1e-5).
"""

from __future__ import annotations

import json

import pytest
from glm_chat_formats import FORMATS, glm_format_checkpoint, glm_format_tokenizer, glm_stop_ids

from glmpost.envs import calculator_glm_tasks, resolve_environment
from glmpost.formats import ShardReader, resolve_shard_paths
from glmpost.formats.chat_format import ChatFormat
from glmpost.formats.prompts import encode_prompt
from glmpost.kernel.engine import Completion
from glmpost.rollout.agentic import MultiTurnSettings, run_trajectories
from glmpost.rollout.compaction import CompactionSettings, ContextBuilder
from glmpost.rollout.observations import ObservationRenderer

QUESTION = [{"role": "user", "content": "What is stored under ab?"}]
# A third of the ids end a turn (short turns), GLM's stop ids (0, 4, 6) among them.
STOPS = ",".join(str(i) for i in sorted(set(range(0, 512, 3)) | {0, 4, 6}))


@pytest.fixture(scope="module", params=FORMATS)
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def tok(fmt):
    return glm_format_tokenizer(fmt)


def rendered(tok, messages, *, generation_prompt=True, **kwargs) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)


def rendered_ids(tok, messages, *, generation_prompt=True, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=False, **kwargs))


def after_conversation(tok, conversation, new, **kwargs) -> list[int]:
    """The ids the template gives ``new`` messages and the generation prompt after ``conversation``."""
    before = rendered_ids(tok, conversation, generation_prompt=False, **kwargs)
    full = rendered_ids(tok, conversation + new, **kwargs)
    assert full[: len(before)] == before  # the template is prefix-stable here
    return full[len(before):]


# --------------------------------------------------------------------------------------------
# the pieces, against the template's rendering of the whole conversation


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "no-thinking"])
def test_a_reset_observation_is_the_templates_tool_turn_after_the_prompt(tok, kwargs):
    """Defect 1: the prompt's generation prompt (taken from the template, not a literal) is replaced
    by the observation turn, which ends with it: exactly the template's rendering of the conversation."""
    renderer = ObservationRenderer(tok, ChatFormat(tok, kwargs))
    prompt = encode_prompt(tok, QUESTION, None, kwargs)
    ids = renderer.prompt_with(prompt, "ab=417 cd=902")
    assert ids == rendered_ids(tok, QUESTION + [{"role": "tool", "content": "ab=417 cd=902"}], **kwargs)
    assert tok.decode(ids).count("<|assistant|>") == 1


@pytest.mark.parametrize("text", ["a", "MASK", "think", "in", "sop", "", "tick 2"])
def test_every_observation_is_rendered_as_itself_however_short(tok, text):
    """Defect 3: an observation that is empty or a piece of the template's own text is rendered, never
    replaced by what the template writes around it."""
    conversation = QUESTION + [{"role": "assistant", "content": "Let me look."}]
    ids = ObservationRenderer(tok).ids(text, after=())
    assert ids == after_conversation(tok, conversation, [{"role": "tool", "content": text}])


def test_tool_results_are_one_tool_message_each_under_one_observation_turn(tok, fmt):
    conversation = QUESTION + [{"role": "assistant", "content": "Two calls."}]
    text = "<tool_response>\n36\n</tool_response>\n<tool_response>\nerror: x\n</tool_response>"
    ids = ObservationRenderer(tok).ids(text, after=())
    expected = after_conversation(tok, conversation, [{"role": "tool", "content": "36"}, {"role": "tool", "content": "error: x"}])
    assert ids == expected and tok.decode(ids).count("<|observation|>") == 1
    # the model's own <|observation|> (its stop token) is an action token: the observation starts after it
    marker = tok.convert_tokens_to_ids("<|observation|>")
    assert ObservationRenderer(tok).ids(text, after=[marker]) == expected[1:]


def _builder(tok, kwargs=None):
    settings = CompactionSettings("summary", 4096, 8, 1, "Summarise.", "Summary: {summary}", 16)
    return ContextBuilder(ChatFormat(tok, kwargs), settings, glm_stop_ids(tok), reasoning_parser="glm45")


def test_the_summary_request_keeps_the_observation_and_asks_in_a_user_turn(tok):
    """Defect 2: the environment's answer is a tool turn the template renders (not a dropped
    ``observation`` message), then the summary prompt as a user turn; no [gMASK]<sop> mid-context."""
    conversation = QUESTION + [{"role": "assistant", "content": "Next."}]
    request = _builder(tok).request("ab=417", after=tok.encode("Next.", add_special_tokens=False))
    text = tok.decode(request)
    new = [{"role": "tool", "content": "ab=417"}, {"role": "user", "content": "Summarise."}]
    assert text == rendered(tok, conversation + new)[len(rendered(tok, conversation, generation_prompt=False)):]
    assert "ab=417" in text and "[gMASK]" not in text and text.startswith("<|observation|>")


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "no-thinking"])
def test_a_rebuilt_window_is_the_prompt_then_the_resume_turn_with_no_stale_generation_prompt(tok, fmt, kwargs):
    """Defect 2: the rebuilt context is the prompt's turns without their generation prompt, the resume
    turn holding the summary's content (its reasoning block left out) and the generation prompt:
    the template's own rendering of that conversation."""
    builder = _builder(tok, kwargs)
    prompt = encode_prompt(tok, QUESTION, None, kwargs)
    opened = "" if fmt == "glm47" and not kwargs else "<think>"  # GLM-4.7's prompt opened the reasoning block
    summary = tok.encode(f"{opened}I should keep the store.</think>ab=417", add_special_tokens=False) + [glm_stop_ids(tok)[0]]
    context = builder.rebuild(builder.head(prompt), summary, [])
    expected = rendered(tok, QUESTION + [{"role": "user", "content": "Summary: ab=417"}], **kwargs)
    assert tok.decode(context) == expected


# --------------------------------------------------------------------------------------------
# the reasoning split: what a turn's reasoning says is never acted on


def _scripted(turns):
    """A generate function that answers turn i with ``turns[i]`` (exact ids), recording the prompts."""
    prompts = []

    def generate(seqs, keys, sessions, max_new_tokens=None):
        prompts.extend(seqs)
        ids = list(turns[len(prompts) - 1])
        return [(Completion(ids, [-0.5] * len(ids), "stop"), 0, None) for _ in seqs]

    return generate, prompts


@pytest.mark.parametrize("parser", ["glm45", "none"])
def test_a_call_or_an_answer_inside_the_reasoning_is_never_acted_on(tok, fmt, parser):
    """Defect 4: with the glm45 split (vLLM's and SGLang's), the call and the right answer inside
    <think> are ignored and the content's call runs; without it (``none``, the code before the issue)
    the reasoning's call is executed first."""
    line = calculator_glm_tasks(1, seed=3)[0]
    answer = line["task"]["answer"]
    factory = resolve_environment("calculator-glm")
    chat = ChatFormat(tok)
    prompt = encode_prompt(tok, [{"role": "user", "content": line["prompt"]}], factory.tools)
    opened = "" if chat.prompt_in_reasoning else "<think>"
    call = "<tool_call>calculator<arg_key>expression</arg_key><arg_value>{}</arg_value></tool_call>"
    stop, marker = glm_stop_ids(tok)[0], tok.convert_tokens_to_ids("<|observation|>")
    first = tok.encode(f"{opened}Maybe {call.format('1+1')} or <answer>{answer}</answer>.</think>"
                       f"I will check: {call.format(line['task']['expression'])}", add_special_tokens=False) + [marker]
    last = tok.encode(f"{opened}Done.</think><answer>{answer}</answer>", add_special_tokens=False) + [stop]
    generate, _ = _scripted([first, last])
    renderer = ObservationRenderer(tok, chat, reasoning_parser=parser)
    settings = MultiTurnSettings(max_turns=4, max_new_tokens=64, context=4096, env_timeout=None)
    (trajectory,) = run_trajectories(generate, [prompt], ["q/0"], [line["task"]], factory, renderer, settings,
                                     lambda ids: tok.decode(ids, skip_special_tokens=True))
    step = trajectory.turns[0]
    if parser == "none":  # both calls run, the reasoning's first
        assert step.observation.startswith("<tool_response>\n2\n</tool_response>") and step.info["calls"] == 2
        return
    assert step.observation == f"<tool_response>\n{answer}\n</tool_response>" and step.info["calls"] == 1
    assert trajectory.status == "completed" and trajectory.reward == 1.0
    closes = [ids.index(tok.convert_tokens_to_ids("</think>")) + 1 for ids in (first, last)]
    assert [t.reasoning_tokens for t in trajectory.turns] == closes
    # an answer only inside the reasoning is not an answer: the turn is malformed, the trajectory goes on
    wrong = tok.encode(f"{opened}It is <answer>{answer}</answer>.</think>No idea.", add_special_tokens=False) + [stop]
    generate, _ = _scripted([wrong, last])
    (trajectory,) = run_trajectories(generate, [prompt], ["q/0"], [line["task"]], factory, renderer, settings,
                                     lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert trajectory.turns[0].info["malformed"] and trajectory.reward == 1.0 and len(trajectory.turns) == 2


# --------------------------------------------------------------------------------------------
# whole rollouts in both formats


@pytest.fixture(scope="module")
def glm_checkpoint(fmt, tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint speaking ``fmt``, with the agentic preset's context (the tools' system turn
    alone is 500 tokens; rope positions are not parameters)."""
    out = glm_format_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp(f"ckpt-{fmt}") / "ckpt", fmt)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}, indent=2))
    return out


def _rollout(run, checkpoint, tmp_path, *extra, env="test_compaction:Ticks", name="ro"):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"t{d}", "prompt": f"count {d}", "task": {}}) + "\n" for d in range(4)))
    out = tmp_path / name
    result = run("rollout", prompts, "--checkpoint", checkpoint, "--out", out, "--env", env, "--group-size", "2",
                 "--max-new-tokens", "8", "--max-turns", "8", "--stop-token-ids", STOPS, "--temperature", "0.8", *extra)
    assert result.exit_code == 0, result.stderr
    return out, [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]


@pytest.fixture(scope="module")
def compacted(glm_checkpoint, tmp_path_factory):
    from conftest import run_glmpost

    tmp = tmp_path_factory.mktemp("glm-compaction")
    return _rollout(run_glmpost, glm_checkpoint, tmp, "--context-budget", "96", "--keep-last", "1",
                    "--max-summary-tokens", "8", "--compaction", "summary")


def test_records_are_the_templates_rendering_and_every_window_is_rebuilt_by_it(compacted, glm_checkpoint, fmt):
    """The reset observation ('fact 417') and every observation are the template's tool turns, the
    reasoning split is the format's (recorded in stage.json), and each rebuilt window is the prompt's
    turns then the template's resume turn holding the summary's content, as exact ids."""
    out, records = compacted
    tok = glm_format_tokenizer(fmt)
    chat = ChatFormat(tok)
    stage = json.loads((out / "stage.json").read_text())
    assert stage["chat_format"]["observation_role"] == "tool" and stage["chat_format"]["reasoning_parser"] == "glm45"
    assert stage["chat_format"]["generation_prompt"] == chat.generation_prompt
    builder = ContextBuilder(chat, CompactionSettings("summary", 96, 8, 1, "x", "Summary: {summary}", 8),
                             [int(i) for i in STOPS.split(",")], reasoning_parser="glm45")
    windows = 0
    for record in records:
        question = [{"role": "user", "content": f"count {record['prompt_id'][1:]}"}]
        assert record["prompt_token_ids"].tolist() == rendered_ids(tok, question + [{"role": "tool", "content": "fact 417"}])
        ids, segments = record["response_token_ids"].tolist(), record["segments"]
        for index, segment in enumerate(segments):
            if segment["kind"] == "observation" and segment.get("role") != "summary_request":
                text = tok.decode(ids[segment["start"] : segment["end"]])
                assert "<tool_response>" in text and text.endswith(chat.generation_prompt) and "[gMASK]" not in text
            if "context" not in segment:
                continue
            windows += 1
            summary = segments[index - 1]
            body = tok.decode(builder.summary_body(ids[summary["start"] : summary["end"]]))
            expected = rendered(tok, question + [{"role": "user", "content": f"Summary: {body}"}])
            assert tok.decode(segment["context"].tolist()).startswith(expected)
    assert windows >= 2


def test_the_trainer_scores_every_window_as_the_rollout_did(compacted, glm_checkpoint, glmpost_cli, tmp_path):
    """Closure under the GLM formats: diff-logprobs (the trainer's forward on each window's recorded
    context) equals the rollout's log-prob of every action and summary token to <= 1e-5."""
    out, records = compacted
    diff = glmpost_cli("diff-logprobs", out, "--checkpoint", glm_checkpoint, "--out", tmp_path / "diff", "--json", "--no-plots")
    assert diff.exit_code == 0, diff.stderr
    overall = json.loads(diff.stdout)["overall"]
    assert overall["tokens"] == sum(int(r["action_mask"].sum()) for r in records)
    assert overall["max_abs"] <= 1e-5 and overall["sample_agreement"] == 1.0


def test_enable_thinking_reaches_the_template_and_is_recorded(glm_checkpoint, fmt, glmpost_cli, tmp_path):
    out, records = _rollout(glmpost_cli, glm_checkpoint, tmp_path, "--chat-template-kwargs", '{"enable_thinking": false}',
                            env="test_agentic:Countdown")
    tok = glm_format_tokenizer(fmt)
    stage = json.loads((out / "stage.json").read_text())
    assert stage["options"]["chat_template_kwargs"] == '{"enable_thinking": false}'
    assert stage["chat_format"]["template_kwargs"] == {"enable_thinking": False}
    question = [{"role": "user", "content": "count 0"}]
    record = next(r for r in records if r["prompt_id"] == "t0")
    assert record["prompt_token_ids"].tolist() == rendered_ids(tok, question, enable_thinking=False)
    bad = glmpost_cli("rollout", tmp_path / "prompts.jsonl", "--checkpoint", glm_checkpoint, "--out", tmp_path / "bad",
                      "--chat-template-kwargs", "[1]")
    assert bad.exit_code == 2 and "--chat-template-kwargs" in bad.stderr and "Traceback" not in bad.stderr


def test_a_tool_loop_is_the_templates_rendering_of_the_whole_conversation(tok, fmt):
    """Where the template is prefix-stable (a tool loop: no new user turn clears past reasoning), the
    prompt and every turn of a trajectory are exactly the template's rendering of the conversation:
    the model's turns as assistant messages with their reasoning and calls, the results as tool
    messages. (Not prefix-stable, by the template's design: a GLM-4.7 turn without reasoning re-renders
    as ``</think>...``, and reasoning before a newer user turn is cleared; glmpost never re-renders past
    turns, so the ids stay those the model sampled.)"""
    line = calculator_glm_tasks(1, seed=5)[0]
    expression, answer = line["task"]["expression"], line["task"]["answer"]
    factory = resolve_environment("calculator-glm")
    question = [{"role": "user", "content": line["prompt"]}]
    prompt = encode_prompt(tok, question, factory.tools)
    call = {"function": {"name": "calculator", "arguments": {"expression": expression}}}
    messages = question + [{"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [call]},
                           {"role": "tool", "content": answer},
                           {"role": "assistant", "content": f"<answer>{answer}</answer>", "reasoning_content": "Got it."}]
    whole = rendered_ids(tok, messages, generation_prompt=False, tools=factory.tools)
    stop, marker = glm_stop_ids(tok)[0], tok.convert_tokens_to_ids("<|observation|>")
    first_turn = rendered_ids(tok, messages[:3], generation_prompt=False, tools=factory.tools)[len(prompt):]
    first = first_turn[: first_turn.index(marker) + 1]  # the model's turn ends with the <|observation|> it emits
    last = whole[len(rendered_ids(tok, messages[:3], tools=factory.tools)):] + [stop]
    generate, prompts = _scripted([first, last])
    renderer = ObservationRenderer(tok, ChatFormat(tok), reasoning_parser="glm45")
    settings = MultiTurnSettings(max_turns=4, max_new_tokens=64, context=4096, env_timeout=None)
    (trajectory,) = run_trajectories(generate, [prompt], ["q/0"], [line["task"]], factory, renderer, settings,
                                     lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert trajectory.status == "completed" and trajectory.reward == 1.0
    assert prompt + trajectory.response_ids() == whole + [stop]
    assert prompts[1] == rendered_ids(tok, messages[:3], tools=factory.tools)  # the second turn's prompt, exactly


def test_calculator_glm_rollouts_are_the_templates_rendering_and_close(glm_checkpoint, fmt, glmpost_cli, tmp_path):
    """``rollout --env calculator-glm`` under each format: the prompt is the template's rendering with
    the tools, each observation the template's tool turn, the reasoning counted, and the trainer's
    log-probs equal the rollout's on every action token (<= 1e-5)."""
    prompts = tmp_path / "calc.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in calculator_glm_tasks(3, seed=1)))
    out = tmp_path / "calc"
    result = glmpost_cli("rollout", prompts, "--checkpoint", glm_checkpoint, "--out", out, "--env", "calculator-glm",
                         "--group-size", "2", "--max-new-tokens", "8", "--max-turns", "3", "--stop-token-ids", STOPS,
                         "--temperature", "0.8", "--tool-call-parser", "engine")
    assert result.exit_code == 0, result.stderr
    tok, factory = glm_format_tokenizer(fmt), resolve_environment("calculator-glm")
    chat = ChatFormat(tok)
    records = [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]
    lines = {line["id"]: line for line in calculator_glm_tasks(3, seed=1)}
    observations = 0
    for record in records:
        question = [{"role": "user", "content": lines[record["prompt_id"]]["prompt"]}]
        assert record["prompt_token_ids"].tolist() == rendered_ids(tok, question, tools=factory.tools)
        ids = record["response_token_ids"].tolist()
        for segment in record["segments"]:
            if segment["kind"] == "observation":
                observations += 1
                text = tok.decode(ids[segment["start"] : segment["end"]])
                assert text.endswith("</tool_response>" + chat.generation_prompt), text
        reasoning = record["extra"]["env"].get("reasoning_tokens", [])
        assert len(reasoning) in (0, record["extra"]["env"]["turns"])
    assert observations >= 3
    diff = glmpost_cli("diff-logprobs", out, "--checkpoint", glm_checkpoint, "--out", tmp_path / "diff", "--json", "--no-plots")
    assert diff.exit_code == 0, diff.stderr
    overall = json.loads(diff.stdout)["overall"]
    assert overall["tokens"] == sum(int(r["action_mask"].sum()) for r in records) and overall["max_abs"] <= 1e-5


def test_single_turn_records_keep_their_reasoning_tokens_and_the_judge_reads_past_them(glm_checkpoint, fmt, glmpost_cli, tmp_path):
    """A single-turn rollout records each response's reasoning tokens (the glm45 split, resolved from
    the template and recorded in stage.json); the judge's verifiers read the content after them."""
    from glmpost.envs.reasoning import split_reasoning
    from glmpost.rewards.mixture import RecordView

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{d}", "prompt": f"count {d}"}) + "\n" for d in range(3)))
    out = tmp_path / "single"
    result = glmpost_cli("rollout", prompts, "--checkpoint", glm_checkpoint, "--out", out, "--group-size", "4",
                         "--max-new-tokens", "24", "--stop-token-ids", "0,4,6")
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "stage.json").read_text())["chat_format"] == {"reasoning_parser": "glm45"}
    tok, chat = glm_format_tokenizer(fmt), ChatFormat(glm_format_tokenizer(fmt))
    for record in (r for p in resolve_shard_paths([out]) for r in ShardReader(p)):
        ids = record["response_token_ids"].tolist()
        expected = split_reasoning(ids, tok, "glm45", prompt_in_reasoning=chat.prompt_in_reasoning).reasoning_tokens
        assert record["extra"]["reasoning_tokens"] == expected
    opened = "" if chat.prompt_in_reasoning else "<think>"
    response = tok.encode(f"{opened}It is <answer>7</answer>.</think>So: <answer>8</answer>", add_special_tokens=False)
    record = {"response_token_ids": response, "extra": {"reasoning_tokens": response.index(tok.convert_tokens_to_ids("</think>")) + 1}}
    assert RecordView(record, tok).text == "So: <answer>8</answer>"


def test_shards_import_and_qat_data_render_with_the_template_arguments(glm_checkpoint, fmt, glmpost_cli, tmp_path):
    """--chat-template-kwargs reaches every stage that renders prompts: shards import, qat's SFT data."""
    from glmpost.rl.qat_update import read_sft_records

    conversation = {"id": "c0", "messages": [*QUESTION, {"role": "assistant", "content": "417"}]}
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(conversation) + "\n")
    tok = glm_format_tokenizer(fmt)
    off = rendered_ids(tok, QUESTION, enable_thinking=False)
    assert off != rendered_ids(tok, QUESTION)
    result = glmpost_cli("shards", "import", data, "--checkpoint", glm_checkpoint, "--out", tmp_path / "imported",
                         "--chat-template-kwargs", '{"enable_thinking": false}')
    assert result.exit_code == 0, result.stderr
    (record,) = [r for p in resolve_shard_paths([tmp_path / "imported"]) for r in ShardReader(p)]
    assert record["prompt_token_ids"].tolist() == off
    revision = json.loads((glm_checkpoint / "glmpost.json").read_text())["tokenizer_revision"]
    (sft,) = read_sft_records([str(data)], tok, revision, template_kwargs={"enable_thinking": False})
    assert sft["prompt_token_ids"].tolist() == off
