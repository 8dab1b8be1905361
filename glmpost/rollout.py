"""From prompts to rollout records: what the engine was fed, what it produced, with what evidence.

A rollout record carries everything later stages need to train on exactly the actions taken
(DESIGN.md §3, brief "TITO：token ID 是动作事实"): the exact prompt and response token ids, the
action / observation masks, the log-prob of each action under the distribution it was sampled from,
the policy version that produced it, the sampling settings and the tokenizer revision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from glmpost.engine import Completion, SamplingParams
from glmpost.errors import GlmpostError
from glmpost.formats import SHARD_SUFFIX, ShardReader, resolve_shard_paths
from glmpost.prompts import encode_prompt, read_prompts


@dataclass
class RolloutPrompt:
    """A prompt as token ids, with what the verifier and teacher routing need."""

    prompt_id: str
    token_ids: list[int]
    domain: str = ""
    task: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # file:line or shard:record, for error messages


def load_rollout_prompts(inputs: Sequence[str | Path], tokenizer, revision: str) -> list[RolloutPrompt]:
    """Prompts from JSONL files (rendered with the chat template) or shards (their prompt ids).

    Shards are accepted so a stage can resample the prompts of earlier trajectories; their records
    must have been tokenized with the same tokenizer revision. Prompt ids must be unique across
    inputs (records of one prompt in a shard collapse into one prompt).
    """
    prompts: list[RolloutPrompt] = []
    seen: dict[str, str] = {}
    for item in inputs:
        path = Path(item)
        if path.is_file() and not path.name.endswith(SHARD_SUFFIX):
            for prompt in read_prompts(path):
                where = f"{path}: prompt {prompt.id!r}"
                _add(prompts, seen, RolloutPrompt(prompt.id, encode_prompt(tokenizer, prompt.messages), prompt.domain, prompt.task, where))
            continue
        for shard in resolve_shard_paths([item]):
            for index, record in enumerate(ShardReader(shard)):
                where = f"{shard}: record {index}"
                if record["tokenizer_revision"] != revision:
                    raise GlmpostError(
                        f"{where}: tokenizer revision {record['tokenizer_revision']} differs from the checkpoint's {revision}"
                    )
                if record["prompt_id"] in seen:
                    continue
                _add(prompts, seen, RolloutPrompt(record["prompt_id"], record["prompt_token_ids"].tolist(),
                                                  record.get("domain", ""), record.get("task", {}), where))
    return prompts


def _add(prompts: list[RolloutPrompt], seen: dict[str, str], prompt: RolloutPrompt) -> None:
    if prompt.prompt_id in seen:
        raise GlmpostError(f"{prompt.source}: prompt id {prompt.prompt_id!r} repeats {seen[prompt.prompt_id]}")
    seen[prompt.prompt_id] = prompt.source
    prompts.append(prompt)


def check_context(prompts: Iterable[RolloutPrompt], *, max_new_tokens: int, context: int) -> None:
    """Refuse prompts that leave no room for ``max_new_tokens`` in the model's context."""
    for prompt in prompts:
        if len(prompt.token_ids) + max_new_tokens > context:
            raise GlmpostError(
                f"{prompt.source}: prompt is {len(prompt.token_ids)} tokens; with --max-new-tokens {max_new_tokens} "
                f"it exceeds the model's context of {context} tokens"
            )
        if not prompt.token_ids:
            raise GlmpostError(f"{prompt.source}: prompt has no tokens")


def group_id(prompt_id: str, *, seed: int, policy_version: int) -> str:
    """Sampling groups are unique per prompt, seed and policy version, so datasets can be merged."""
    return f"{prompt_id}@v{policy_version}s{seed}"


def rollout_record(
    prompt: RolloutPrompt,
    completion: Completion,
    *,
    sample_index: int,
    params: SamplingParams,
    policy_version: int,
    tokenizer_revision: str,
    engine: dict[str, Any],
) -> dict[str, Any]:
    """The trajectory record of one single-turn completion: every response token is an action."""
    length = len(completion.token_ids)
    group = group_id(prompt.prompt_id, seed=params.seed, policy_version=policy_version)
    return {
        "id": f"{group}/{sample_index}",
        "prompt_id": prompt.prompt_id,
        "group_id": group,
        "domain": prompt.domain,
        "task": prompt.task,
        "prompt_token_ids": np.asarray(prompt.token_ids, dtype=np.int32),
        "response_token_ids": np.asarray(completion.token_ids, dtype=np.int32),
        "action_mask": np.ones(length, dtype=bool),
        "observation_mask": np.zeros(length, dtype=bool),
        "rollout_log_probs": np.asarray(completion.log_probs, dtype=np.float32),
        "policy_versions": np.full(length, policy_version, dtype=np.int32),
        "sampling": {**params.to_json(), **engine},
        "tokenizer_revision": tokenizer_revision,
        "segments": [{"start": 0, "end": length, "kind": "action", "turn": 0}],
        "status": "completed" if completion.finish_reason == "stop" else "truncated",
    }
