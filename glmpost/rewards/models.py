"""Learned rewards: an Outcome Reward Model (ORM) and a generative judge, both run locally.

- :class:`OutcomeRewardModel`: an ``AutoModelForSequenceClassification`` checkpoint with one label,
  scored in batches on the record's exact ``prompt_token_ids + response_token_ids`` (no
  re-tokenization, so it must share the policy's tokenizer revision). The reward is
  ``sigmoid(logit)`` (``activation="sigmoid"``) or the logit as is (``"none"``).
- :class:`GenerativeJudge`: a causal LM prompted with a rubric (``{prompt}``, ``{response}`` and
  ``{max_score}`` placeholders) rendered through the judge's own chat template; it greedy-decodes
  up to ``max_new_tokens`` and :func:`parse_score` reads ``score / max_score`` from its output.
  Generation (:meth:`GenerativeJudge.generate`) and parsing (:meth:`GenerativeJudge.scores`) are
  separate steps, so the parse path can be fed known text. An unparsable output is a failure
  carrying an excerpt of the raw output, never a 0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from glmpost.checkpoints import CheckpointError, resolve_checkpoint, tokenizer_revision
from glmpost.errors import GlmpostError
from glmpost.formats.prompts import encode_prompt
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.loading import apply_attention, load_model, load_tokenizer
from glmpost.kernel.lora import apply_adapter
from glmpost.kernel.lora_versions import is_lora_version, read_lora_base

ACTIVATIONS = ("sigmoid", "none")
DEFAULT_SCORE_PATTERN = r"Score:\s*([0-9]+(?:\.[0-9]+)?)"
DEFAULT_RUBRIC = (
    "You are grading an assistant's reply.\n\n"
    "[Request]\n{prompt}\n\n"
    "[Reply]\n{response}\n\n"
    "Judge whether the reply is correct, helpful, honest and follows the request. "
    "Explain briefly, then end with a line 'Score: N' where N is a number from 0 to {max_score}."
)
EXCERPT_CHARS = 200
_PLACEHOLDER = re.compile(r"\{(prompt|response|max_score)\}")


@dataclass(frozen=True)
class ModelScore:
    """One record's score from a reward model: ``value`` in the reward scale, or ``failure`` (then NaN)."""

    value: float
    failure: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(exc).__name__


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """At most ``limit`` characters of ``text`` (an ellipsis marks a cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------------------------
# Outcome Reward Model


@dataclass(frozen=True)
class OrmConfig:
    """``checkpoint``: a sequence-classification checkpoint with ``num_labels = 1``;
    ``activation``: ``sigmoid`` (reward in (0, 1)) or ``none`` (the logit); ``batch_size``: records
    per forward pass; ``attention``: ``native`` or ``reference`` GLM-5 attention."""

    checkpoint: str
    activation: str = "sigmoid"
    batch_size: int = 8
    attention: str = "native"  # a GLM-5 classifier's attention (glmpost.models.native_attention)


class OutcomeRewardModel:
    """Scores token ids with a one-label sequence classifier (the model's own last-token pooling)."""

    def __init__(self, config: OrmConfig, *, tokenizer_revision: str, device: Any = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification

        if config.activation not in ACTIVATIONS:
            raise GlmpostError(f"ORM activation {config.activation!r}: expected one of {', '.join(ACTIVATIONS)}")
        directory = resolve_checkpoint(config.checkpoint)
        revision = _tokenizer_revision(directory)
        if revision != tokenizer_revision:
            raise CheckpointError(
                f"ORM {directory}: tokenizer revision {revision} differs from the policy's {tokenizer_revision}; "
                "an ORM scores the records' token ids, so it must share the policy tokenizer"
            )
        lora = is_lora_version(directory)  # a LoRA version: its base classifier, then its adapter
        weights = read_lora_base(directory) if lora else directory
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(weights), dtype="auto", output_loading_info=True
            )
        except Exception as exc:  # transformers raises many types for a bad checkpoint
            raise CheckpointError(f"ORM {directory}: does not load as a sequence classifier ({_first_line(exc)})") from None
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise CheckpointError(
                f"ORM {directory}: weights missing ({', '.join(missing[:3])}); not a sequence-classification checkpoint"
            )
        if lora:
            model = apply_adapter(model, directory, where=f"ORM {directory}")
        if model.config.num_labels != 1:
            raise CheckpointError(f"ORM {directory}: num_labels is {model.config.num_labels}, expected 1 (a scalar score)")
        self.config = config
        self.directory = directory
        self.revision = revision
        apply_attention(model, config.attention)
        self.model = model.to(device).eval()
        text_config = model.config.get_text_config()
        self.pad_token_id = text_config.pad_token_id
        self.max_length = getattr(text_config, "max_position_embeddings", None)
        self._torch = torch

    def score(self, sequences: Sequence[Sequence[int]]) -> list[ModelScore]:
        """One score per token-id sequence; sequences over the model's context length fail alone.

        Batches are right-padded with the model's pad id and masked, so a sequence scores the same
        alone or in a batch. Without a pad id the model pools the last position, so rows go one by one.
        """
        results: list[ModelScore | None] = [None] * len(sequences)
        runnable = []
        for i, ids in enumerate(sequences):
            if not len(ids):
                results[i] = ModelScore(math.nan, "empty sequence")
            elif self.max_length and len(ids) > self.max_length:
                results[i] = ModelScore(math.nan, f"{len(ids)} tokens exceed the ORM's {self.max_length}-token context")
            else:
                runnable.append(i)
        batch_size = self.config.batch_size if self.pad_token_id is not None else 1
        for start in range(0, len(runnable), batch_size):
            rows = runnable[start : start + batch_size]
            for i, logit in zip(rows, self._logits([sequences[i] for i in rows])):
                value = 1.0 / (1.0 + math.exp(-logit)) if self.config.activation == "sigmoid" else logit
                if math.isfinite(value):
                    results[i] = ModelScore(value, details={"logit": logit})
                else:
                    results[i] = ModelScore(math.nan, f"non-finite ORM logit {logit!r}")
        return results  # type: ignore[return-value]

    def _logits(self, batch: list[Sequence[int]]) -> list[float]:
        torch = self._torch
        width = max(len(ids) for ids in batch)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.as_tensor([int(t) for t in ids], dtype=torch.long)
            attention[row, : len(ids)] = 1
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
        return [float(v) for v in logits.float().reshape(len(batch)).cpu()]


def _tokenizer_revision(directory: Path) -> str:
    try:
        return tokenizer_revision(directory)
    except CheckpointError as exc:
        raise CheckpointError(f"ORM {exc}") from None


# --------------------------------------------------------------------------------------------
# Generative judge


class ScoreParseError(ValueError):
    """The judge's output holds no score the pattern can read (or one outside [0, max_score])."""


@dataclass(frozen=True)
class GenerativeJudgeConfig:
    """``checkpoint``: a causal LM; ``template``: the rubric (``{prompt}``, ``{response}``,
    ``{max_score}``); ``max_new_tokens``: greedy decoding budget; ``score_pattern``: a regex whose
    first group is the score (the last match counts); ``max_score``: the score that maps to 1.0;
    ``batch_size``: prompts decoded together; ``attention``: ``native`` or ``reference`` GLM-5 attention."""

    checkpoint: str
    template: str = DEFAULT_RUBRIC
    max_new_tokens: int = 64
    score_pattern: str = DEFAULT_SCORE_PATTERN
    max_score: float = 10.0
    batch_size: int = 8
    attention: str = "native"


def check_judge_config(config: GenerativeJudgeConfig) -> re.Pattern[str]:
    """Validate the parts of a judge config that need no model; returns the compiled score pattern."""
    if "{response}" not in config.template:
        raise ValueError("template has no {response} placeholder")
    if not (isinstance(config.max_score, (int, float)) and math.isfinite(config.max_score) and config.max_score > 0):
        raise ValueError(f"max_score must be a finite number > 0, got {config.max_score!r}")
    if config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    try:
        pattern = re.compile(config.score_pattern)
    except re.error as exc:
        raise ValueError(f"score_pattern {config.score_pattern!r} is not a regex ({exc})") from None
    if pattern.groups < 1:
        raise ValueError(f"score_pattern {config.score_pattern!r} needs a capture group around the score")
    return pattern


def render_rubric(template: str, *, prompt: str, response: str, max_score: float) -> str:
    """Fill ``{prompt}``, ``{response}`` and ``{max_score}`` in one pass (text inside them is never
    re-expanded; other braces, e.g. ``\\boxed{}``, are left alone)."""
    values = {"prompt": prompt, "response": response, "max_score": f"{max_score:g}"}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_score(output: str, pattern: re.Pattern[str] | str, max_score: float) -> tuple[float, float]:
    """``(raw, raw / max_score)`` from the *last* match of ``pattern`` in ``output``.

    Raises :class:`ScoreParseError` when nothing matches, the group is not a number, or the score
    lies outside ``[0, max_score]``.
    """
    if isinstance(pattern, str):
        pattern = re.compile(pattern)
    matches = list(pattern.finditer(output))
    if not matches:
        raise ScoreParseError(f"no score matching {pattern.pattern!r}")
    text = matches[-1].group(1)
    try:
        raw = float(text)
    except (TypeError, ValueError):
        raise ScoreParseError(f"score {text!r} is not a number") from None
    if not (math.isfinite(raw) and 0.0 <= raw <= max_score):
        raise ScoreParseError(f"score {raw:g} is outside [0, {max_score:g}]")
    return raw, raw / max_score


class GenerativeJudge:
    """A causal LM that reads a rubric prompt and writes an assessment ending in a score."""

    def __init__(self, config: GenerativeJudgeConfig, *, device: Any = "cpu"):
        self.config = config
        self.pattern = check_judge_config(config)
        self.tokenizer, self.revision = load_tokenizer(config.checkpoint)
        self.directory = resolve_checkpoint(config.checkpoint)
        model = load_model(config.checkpoint, device=device, attention=config.attention)

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.engine = LocalEngine(model, batch_size=config.batch_size, pad_token_id=pad)
        eos = model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.stop_token_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, rubric: str) -> list[int]:
        """Token ids of the rubric as a user turn of the judge's chat template (plain text without one)."""
        if self.has_chat_template:

            return encode_prompt(self.tokenizer, [{"role": "user", "content": rubric}])
        return [int(i) for i in self.tokenizer.encode(rubric)]

    def generate(self, prompts: Sequence[str], responses: Sequence[str], keys: Sequence[str]) -> list[str | ModelScore]:
        """The judge's greedy output text for each (prompt, response); a rubric too long for the
        judge's context comes back as a failed :class:`ModelScore` instead."""

        outputs: list[str | ModelScore] = []
        todo: list[int] = []
        encoded: list[list[int]] = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            ids = self.encode(render_rubric(self.config.template, prompt=prompt, response=response, max_score=self.config.max_score))
            limit = self.max_length - self.config.max_new_tokens if self.max_length else None
            if limit is not None and len(ids) > limit:
                outputs.append(
                    ModelScore(math.nan, f"rubric prompt is {len(ids)} tokens; the judge's context leaves room for {limit}")
                )
            else:
                outputs.append("")
                todo.append(i)
                encoded.append(ids)
        if todo:
            params = SamplingParams(
                temperature=0.0, max_new_tokens=self.config.max_new_tokens, stop_token_ids=self.stop_token_ids
            )
            completions = self.engine.generate(encoded, [str(keys[i]) for i in todo], params)
            for i, completion in zip(todo, completions):
                outputs[i] = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return outputs

    def scores(self, outputs: Sequence[str | ModelScore]) -> list[ModelScore]:
        """Parse and scale each output (see :func:`score_output`); failures pass through."""
        return [o if isinstance(o, ModelScore) else score_output(o, self.pattern, self.config.max_score) for o in outputs]

    def score(self, prompts: Sequence[str], responses: Sequence[str], keys: Sequence[str]) -> list[ModelScore]:
        """:meth:`generate` then :meth:`scores`."""
        return self.scores(self.generate(prompts, responses, keys))


def score_output(output: str, pattern: re.Pattern[str] | str, max_score: float) -> ModelScore:
    """A judge output as a :class:`ModelScore`: the scaled score with the raw one and an excerpt of
    the output, or a failure naming why with that excerpt."""
    details: dict[str, Any] = {"output": excerpt(output)}
    try:
        raw, scaled = parse_score(output, pattern, max_score)
    except ScoreParseError as exc:
        return ModelScore(math.nan, f"unparsable judge output: {exc}", details)
    details["raw_score"] = raw
    return ModelScore(scaled, details=details)
