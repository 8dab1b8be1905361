"""Test chat templates in the two real GLM formats (issue 43), the tiny tokenizer carrying them, and a
tiny checkpoint that speaks them (a test helper, not a test file).

The formats are those of ``shared/notes/glm-chat-formats.md``: GLM-4.5 / 4.6 (``GLM46_TEMPLATE``)
and GLM-4.7 / GLM-5 (``GLM47_TEMPLATE``). The templates are our own, written to render what the real
checkpoints' templates render: ``[gMASK]<sop>``, then an optional ``# Tools`` system turn (the
schemas inside ``<tools></tools>``), system / user / assistant / ``tool`` turns, and the generation
prompt; reasoning as ``<think>R</think>`` (cleared from assistant turns before the last user turn;
GLM-4.7 keeps it with ``clear_thinking=false``); OpenAI-style ``tool_calls`` (arguments a mapping or
a JSON object string) as ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``
(string values raw, others JSON); a run of ``tool`` messages under one ``<|observation|>``, one
``<tool_response>`` block each; ``enable_thinking=false``. As the real templates do, they silently
drop a message of any other role (GLM has no ``observation`` role).

``glm_format_tokenizer`` is glmpost's tiny byte-level BPE with GLM's tags as added tokens
(``special=False``, as GLM's ``tokenizer_config`` declares them), so each tag is one id;
``glm_format_checkpoint`` copies a tiny checkpoint with that tokenizer and GLM's stop ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# GLM's tags that are added tokens but not special ones (decode(skip_special_tokens=True) keeps them).
# ``/nothink`` is one in GLM's vocabulary (the GLM-4.5 / 4.6 template appends it with enable_thinking=false).
GLM_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<tool_response>", "</tool_response>", "/nothink")
# What GLM's generation_config.json lists as eos ids: the end of text, and the start of a user or tool turn.
GLM_STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
FORMATS = ("glm46", "glm47")

# Macros both templates share. Only expressions emit text and every tag strips the whitespace around
# it, so the source's layout never reaches the rendering (with or without trim_blocks / lstrip_blocks).
# glm_json_args reads arguments given as a JSON object string (the OpenAI form) as json.loads would:
# string values unescaped and written raw, other values re-written with tojson's separators.
_MACROS = r"""
{%- macro glm_text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is mapping -%}{{- content.text if content.text is defined else '' -}}
  {%- elif content is iterable -%}
    {%- for part in content -%}
      {%- if part is string -%}{{- part -}}
      {%- elif part is mapping and part.type == 'text' -%}{{- part.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- elif content is defined and content is not none -%}{{- content -}}
  {%- endif -%}
{%- endmacro -%}

{%- macro glm_reasoning(m) -%}
  {%- set text = glm_text(m.content) -%}
  {%- if m.reasoning_content is string -%}{{- m.reasoning_content -}}
  {%- elif '</think>' in text -%}{{- text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -}}
  {%- endif -%}
{%- endmacro -%}

{%- macro glm_answer(m) -%}
  {%- set text = glm_text(m.content) -%}
  {%- if m.reasoning_content is not string and '</think>' in text -%}{{- text.split('</think>')[-1].lstrip('\n') -}}
  {%- else -%}{{- text -}}
  {%- endif -%}
{%- endmacro -%}

{%- macro glm_unescape(s) -%}
  {%- set u = namespace(esc=false, hex=none, high=0, out='') -%}
  {%- set simple = {'"': '"', '\\': '\\', '/': '/', 'b': '\b', 'f': '\f', 'n': '\n', 'r': '\r', 't': '\t'} -%}
  {%- for c in s -%}
    {%- if u.hex is not none -%}
      {%- set u.hex = u.hex ~ c -%}
      {%- if u.hex | length == 4 -%}
        {%- set code = u.hex | int(base=16) -%}
        {%- set u.hex = none -%}
        {%- if 55296 <= code < 56320 -%}{%- set u.high = code -%}
        {%- elif 56320 <= code < 57344 and u.high -%}
          {%- set u.out = u.out ~ '%c' % (65536 + (u.high - 55296) * 1024 + code - 56320) -%}
          {%- set u.high = 0 -%}
        {%- else -%}{%- set u.out = u.out ~ '%c' % code -%}
        {%- endif -%}
      {%- endif -%}
    {%- elif u.esc -%}
      {%- set u.esc = false -%}
      {%- if c == 'u' -%}{%- set u.hex = '' -%}{%- else -%}{%- set u.out = u.out ~ simple.get(c, c) -%}{%- endif -%}
    {%- elif c == '\\' -%}{%- set u.esc = true -%}
    {%- else -%}{%- set u.out = u.out ~ c -%}
    {%- endif -%}
  {%- endfor -%}
  {{- u.out -}}
{%- endmacro -%}

{%- macro glm_reescape(s) -%}
  {%- set r = namespace(controls='', out='') -%}
  {%- for i in range(32) -%}{%- set r.controls = r.controls ~ '%c' % i -%}{%- endfor -%}
  {%- set short = {'"': '\\"', '\\': '\\\\', '\n': '\\n', '\r': '\\r', '\t': '\\t', '\b': '\\b', '\f': '\\f'} -%}
  {%- for c in s -%}
    {%- if c in short -%}{%- set r.out = r.out ~ short[c] -%}
    {%- elif c in r.controls -%}{%- set r.out = r.out ~ '\\u%04x' % r.controls.find(c) -%}
    {%- else -%}{%- set r.out = r.out ~ c -%}
    {%- endif -%}
  {%- endfor -%}
  {{- r.out -}}
{%- endmacro -%}

{%- macro glm_compact(s) -%}
  {%- set q = namespace(instr=false, esc=false, inner='', out='') -%}
  {%- for c in s -%}
    {%- if q.instr -%}
      {%- if q.esc -%}{%- set q.esc = false -%}{%- set q.inner = q.inner ~ c -%}
      {%- elif c == '\\' -%}{%- set q.esc = true -%}{%- set q.inner = q.inner ~ c -%}
      {%- elif c == '"' -%}
        {%- set q.instr = false -%}{%- set q.out = q.out ~ '"' ~ glm_reescape(glm_unescape(q.inner)) ~ '"' -%}
      {%- else -%}{%- set q.inner = q.inner ~ c -%}
      {%- endif -%}
    {%- elif c == '"' -%}{%- set q.instr = true -%}{%- set q.inner = '' -%}
    {%- elif c == ',' or c == ':' -%}{%- set q.out = q.out ~ c ~ ' ' -%}
    {%- elif c not in ' \t\r\n' -%}{%- set q.out = q.out ~ c -%}
    {%- endif -%}
  {%- endfor -%}
  {{- q.out -}}
{%- endmacro -%}

{%- macro glm_json_value(s) -%}
  {%- if s.startswith('"') and s.endswith('"') and s | length > 1 -%}{{- glm_unescape(s[1:-1]) -}}
  {%- else -%}{{- glm_compact(s) -}}
  {%- endif -%}
{%- endmacro -%}

{%- macro glm_arg(key, value, nl) -%}
  {{- '<arg_key>' ~ key ~ '</arg_key>' ~ nl ~ '<arg_value>' ~ value ~ '</arg_value>' ~ nl -}}
{%- endmacro -%}

{%- macro glm_json_args(text, nl) -%}
  {%- set p = namespace(depth=0, instr=false, esc=false, part='', key=none, pairs=[]) -%}
  {%- for c in (text.strip() if text.strip().startswith('{') else '') -%}
    {%- if p.instr -%}
      {%- set p.part = p.part ~ c -%}
      {%- if p.esc -%}{%- set p.esc = false -%}
      {%- elif c == '\\' -%}{%- set p.esc = true -%}
      {%- elif c == '"' -%}{%- set p.instr = false -%}
      {%- endif -%}
    {%- elif c == '"' -%}{%- set p.instr = true -%}{%- set p.part = p.part ~ c -%}
    {%- elif c in '{[' -%}
      {%- set p.depth = p.depth + 1 -%}
      {%- if p.depth > 1 -%}{%- set p.part = p.part ~ c -%}{%- endif -%}
    {%- elif c in '}]' -%}
      {%- set p.depth = p.depth - 1 -%}
      {%- if p.depth > 0 -%}{%- set p.part = p.part ~ c -%}
      {%- elif p.key is not none -%}
        {%- set p.pairs = p.pairs + [[p.key, p.part]] -%}{%- set p.key = none -%}{%- set p.part = '' -%}
      {%- endif -%}
    {%- elif p.depth == 1 and c == ':' and p.key is none -%}{%- set p.key = p.part -%}{%- set p.part = '' -%}
    {%- elif p.depth == 1 and c == ',' and p.key is not none -%}
      {%- set p.pairs = p.pairs + [[p.key, p.part]] -%}{%- set p.key = none -%}{%- set p.part = '' -%}
    {%- else -%}{%- set p.part = p.part ~ c -%}
    {%- endif -%}
  {%- endfor -%}
  {%- for pair in p.pairs -%}
    {{- glm_arg(glm_json_value(pair[0].strip()), glm_json_value(pair[1].strip()), nl) -}}
  {%- endfor -%}
{%- endmacro -%}

{%- macro glm_call(tc, nl) -%}
  {%- set call = tc.function if tc.function is defined and tc.function is mapping else tc -%}
  {{- nl ~ '<tool_call>' ~ call.name ~ nl -}}
  {%- set args = call.arguments if call.arguments is defined else none -%}
  {%- if args is string -%}{{- glm_json_args(args, nl) -}}
  {%- elif args is mapping -%}
    {%- for key, value in args.items() -%}
      {{- glm_arg(key, value if value is string else value | tojson(ensure_ascii=False), nl) -}}
    {%- endfor -%}
  {%- endif -%}
  {{- '</tool_call>' -}}
{%- endmacro -%}

{%- macro glm_responses(content, nl) -%}
  {%- if content is string -%}{{- nl ~ '<tool_response>' ~ nl ~ content ~ nl ~ '</tool_response>' -}}
  {%- elif content is iterable and content is not mapping -%}
    {%- for item in content -%}
      {%- set text = item.output if item.output is defined else (item.text if item.text is defined else item) -%}
      {{- nl ~ '<tool_response>' ~ nl ~ text ~ nl ~ '</tool_response>' -}}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- set glm = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set glm.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- set no_think = enable_thinking is defined and not enable_thinking -%}
"""

_TOOLS_INTRO = (r"<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_OUTRO = r"</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"


def _tools_section(call_format: str) -> str:
    """The ``# Tools`` system turn: one schema a line (``tojson``), then how to write a call."""
    return ("{%- if tools -%}{{- '" + _TOOLS_INTRO + "' -}}"
            "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) ~ '\\n' -}}{%- endfor -%}"
            "{{- '" + _TOOLS_OUTRO + call_format + "' -}}{%- endif -%}")


# GLM-4.5 / 4.6: a newline after each role tag; every assistant turn opens a <think> block (empty when
# its reasoning is cleared); /nothink on the user turns and an empty <think></think> with enable_thinking=false.
_GLM46_TURNS = r"""
{{- '[gMASK]<sop>' -}}
""" + _tools_section(r"<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
                     r"<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>") + r"""
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{{- '<|system|>\n' ~ glm_text(m.content) -}}
  {%- elif m.role == 'user' -%}
    {%- set text = glm_text(m.content) -%}
    {{- '<|user|>\n' ~ text -}}
    {%- if no_think and not text.endswith('/nothink') -%}{{- '/nothink' -}}{%- endif -%}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = glm_reasoning(m) -%}
    {%- set answer = glm_answer(m).strip() -%}
    {{- '<|assistant|>' -}}
    {%- if loop.index0 > glm.last_user and reasoning -%}{{- '\n<think>' ~ reasoning.strip() ~ '</think>' -}}
    {%- else -%}{{- '\n<think></think>' -}}
    {%- endif -%}
    {%- if answer -%}{{- '\n' ~ answer -}}{%- endif -%}
    {%- for tc in (m.tool_calls or []) -%}{{- glm_call(tc, '\n') -}}{%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
    {{- glm_responses(m.content, '\n') -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>' -}}
  {%- if no_think -%}{{- '\n<think></think>' -}}{%- endif -%}
{%- endif -%}
"""

# GLM-4.7 / GLM-5: nothing between tags; a turn whose reasoning is not shown opens with a lone </think>;
# the generation prompt opens the reasoning (<think>), or closes it with enable_thinking=false.
_GLM47_TURNS = r"""
{{- '[gMASK]<sop>' -}}
""" + _tools_section(r"<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
                     r"<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>") + r"""
{%- set keep_reasoning = clear_thinking is defined and not clear_thinking -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{{- '<|system|>' ~ glm_text(m.content) -}}
  {%- elif m.role == 'user' -%}{{- '<|user|>' ~ glm_text(m.content) -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = glm_reasoning(m) -%}
    {{- '<|assistant|>' -}}
    {%- if (keep_reasoning or loop.index0 > glm.last_user) and reasoning -%}{{- '<think>' ~ reasoning.strip() ~ '</think>' -}}
    {%- else -%}{{- '</think>' -}}
    {%- endif -%}
    {{- glm_answer(m).strip() -}}
    {%- for tc in (m.tool_calls or []) -%}{{- glm_call(tc, '') -}}{%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
    {{- glm_responses(m.content, '') -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' ~ ('</think>' if no_think else '<think>') -}}{%- endif -%}
"""

GLM46_TEMPLATE = (_MACROS + _GLM46_TURNS).strip()
GLM47_TEMPLATE = (_MACROS + _GLM47_TURNS).strip()
TEMPLATES = {"glm46": GLM46_TEMPLATE, "glm47": GLM47_TEMPLATE}


def glm_format_tokenizer(fmt: str, vocab_size: int = 512):
    """glmpost's tiny tokenizer trained to ``vocab_size - len(GLM_TAGS)`` ids, then GLM's tags added
    (``special=False``, one id each, the last ones), so ``len(tokenizer) == vocab_size``; its chat
    template is ``fmt``'s (``"glm46"`` or ``"glm47"``)."""
    from tokenizers import AddedToken

    from glmpost.models.tokenizer import train_tokenizer

    if fmt not in TEMPLATES:
        raise ValueError(f"unknown GLM format {fmt!r}; expected one of {', '.join(FORMATS)}")
    tokenizer = train_tokenizer(vocab_size - len(GLM_TAGS))
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in GLM_TAGS])
    if len(tokenizer) != vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} ids, not {vocab_size}")
    tokenizer.chat_template = TEMPLATES[fmt]
    return tokenizer


def glm_stop_ids(tokenizer) -> list[int]:
    """The ids GLM's generation_config lists as eos: ``<|endoftext|>``, ``<|user|>``, ``<|observation|>``."""
    return [int(tokenizer.convert_tokens_to_ids(token)) for token in GLM_STOP_TOKENS]


def _set_json(path: Path, **values) -> None:
    payload = json.loads(path.read_text())
    payload.update(values)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def glm_format_checkpoint(tiny_checkpoint: Path, out: Path, fmt: str) -> Path:
    """A copy of the tiny checkpoint's version directory at ``out`` whose tokenizer is
    :func:`glm_format_tokenizer` (``fmt``, the model's vocabulary size), whose eos ids (config and
    generation config) are GLM's stops, and whose manifest records the new tokenizer revision, so
    ``load_tokenizer`` and ``rollout`` take it as they take any checkpoint; returns ``out``."""
    from glmpost.checkpoints import (
        TOKENIZER_FILES,
        read_manifest,
        resolve_checkpoint,
        tokenizer_revision,
        write_manifest,
    )

    source = resolve_checkpoint(tiny_checkpoint)
    out = Path(out)
    shutil.copytree(source, out)
    for name in TOKENIZER_FILES:
        (out / name).unlink(missing_ok=True)
    tokenizer = glm_format_tokenizer(fmt, vocab_size=json.loads((out / "config.json").read_text())["vocab_size"])
    tokenizer.save_pretrained(out)
    stops, pad = glm_stop_ids(tokenizer), tokenizer.pad_token_id
    _set_json(out / "config.json", eos_token_id=stops, pad_token_id=pad)
    _set_json(out / "generation_config.json", eos_token_id=stops, pad_token_id=pad)
    manifest = read_manifest(out)
    manifest.tokenizer_revision = tokenizer_revision(out)
    manifest.extra = {**manifest.extra, "chat_format": fmt}
    write_manifest(out, manifest)
    return out
