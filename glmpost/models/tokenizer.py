"""A byte-level BPE tokenizer trained locally, with a GLM-style chat template.

Nothing is downloaded: the tokenizer is trained with the ``tokenizers`` library on the task text
shipped with glmpost (``glmpost/models/data/tokenizer_corpus.txt``). Byte-level BPE means every
string is encodable; special tokens and the chat layout follow GLM (``[gMASK]<sop>`` then
``<|role|>`` turns, ``<|observation|>`` for tool results).
"""

from __future__ import annotations

from importlib import resources
from typing import Iterable

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (
    EOS_TOKEN,
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
# Generation stops at end of text, or where the model starts the next user / tool turn (as GLM does).
STOP_TOKENS = (EOS_TOKEN, "<|user|>", "<|observation|>")

# Roles: system, user, assistant, and tool results as GLM's "observation" role ("tool" is an alias).
# With ``tools`` (JSON function schemas), GLM-4.5's "# Tools" system turn comes first: the schemas
# inside <tools></tools> and the <tool_call> / <arg_key> / <arg_value> format to call them in.
TOOLS_SECTION = (
    "{%- if tools -%}"
    "{{ '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson(ensure_ascii=False) }}{{ '\\n' }}{%- endfor -%}"
    "{{ '</tools>\\n\\nFor each function call, output the function name and arguments within the following XML "
    "format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{arg-value-1}</arg_value>\\n"
    "<arg_key>{arg-key-2}</arg_key>\\n<arg_value>{arg-value-2}</arg_value>\\n...\\n</tool_call>' }}"
    "{%- endif -%}"
)
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    + TOOLS_SECTION +
    "{%- for message in messages -%}"
    "{%- set role = 'observation' if message['role'] == 'tool' else message['role'] -%}"
    "<|{{ role }}|>\n{{ message['content'] }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{{ '\\n' }}{%- endif -%}"
)


def shipped_corpus() -> list[str]:
    text = resources.files("glmpost.models").joinpath("data/tokenizer_corpus.txt").read_text()
    return text.splitlines()


def train_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None):
    """Train a byte-level BPE of exactly ``vocab_size`` ids (256 bytes + specials + merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet plus special tokens ({minimum})")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(list(corpus if corpus is not None else shipped_corpus()), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def stop_token_ids(tokenizer) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
