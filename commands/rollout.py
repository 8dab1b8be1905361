"""Sample responses from a checkpoint and write rollout shards with all the evidence of each action.

Prompts come from JSONL (`prompt` text or chat `messages`, `domain`, `task`, optional `id`; `id` and
`domain` are text, an integer is kept as its decimal text; rendered with the checkpoint's chat
template) or from shards (their prompt token ids). Parquet files (streamed batch by batch), CSV files
and .json files holding one JSON array (through the `datasets` library), and directories that
`Dataset.save_to_disk` wrote (memory-mapped) are read row by row like JSONL lines (`pip install
'glmpost[data]'`); --prompt-column, --messages-column, --domain-column and --task-column name the
columns to read, --answer-column one to put into the task as its answer (a column a setting names
that the file lacks is one error naming both; a null cell is a missing value). Every prompt is
sampled --group-size times; siblings share a group_id. Each record carries the exact token ids, the
log-prob of each sampled token under the distribution it was sampled from (temperature, top-k,
top-p), the checkpoint's policy version per token, the sampling settings and the tokenizer
revision. status is "truncated" when --max-new-tokens ended the response.

--engine sglang sends the same batches to SGLang servers (--server URL[,URL...]; `glmpost serve` or
real SGLang) with each sequence's seed as sampling_seed, so against `glmpost serve` (with a
--batch-size at least rollout's) it writes the same records as --engine local. Requests run
--concurrency at a time, spread over the servers, with --timeout and --retries (exponential backoff,
failing over to the next server); a request that finally fails becomes records with status
"aborted" and the reason in extra.status_reason, never a lost prompt. Servers are checked first: an
unreachable one, one that refuses --api-key (HTTP 401), one whose tokenizer revision differs from
--checkpoint's, or one that rejects a sampling field (old SGLang builds reject sampling_seed) is one
error for the run. Each server's /server_info is read once: records carry
sampling.seed_reproducible (true only when every server says enable_deterministic_inference; true
for --engine local) and sampling.log_prob_kind, what rollout_log_probs are log-probs of:
--server-log-prob-kind, or with auto the kind the server reports (`glmpost serve` does), else the
kind a probe of four 1-token requests finds.

--engine vllm sends them to vLLM's OpenAI server (or `glmpost serve --api vllm`): one /v1/completions
request per sequence with its seed, token ids in and out (return_token_ids, logprobs 0, explicit
max_tokens and neutral penalties). The log-prob kind is the server's --logprobs-mode (raw_logprobs:
raw, processed_logprobs: sampled; logits modes refused), seed_reproducible its VLLM_BATCH_INVARIANT
(both from the dev-mode /server_info, else the probe). vLLM reports no weight version: each server's
weights are confirmed by fingerprint against --checkpoint's (--fingerprint-tolerance) when the run
opens and after every generate call, and records from a server not confirmed carry no
policy_versions.

--env NAME runs multi-turn (agentic) trajectories against an environment (calculator, calculator-glm,
kv-lookup, kv-recall, latency, or package.module:Class with reset(task) and step(action); --env-options
is a JSON object of its keyword arguments). An environment that declares tools (JSON function schemas;
calculator-glm does) gets them rendered into the prompt by the checkpoint's chat template
(apply_chat_template(tools=...); a template that does not render them is refused) and each action's
GLM tool calls (<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>) parsed from
its exact ids; the results come back as <tool_response> observations. Turn after turn the model's exact ids are the action (ending with the
turn marker it emitted, which is trained) and the environment's answer is rendered once with the
chat template's observation turn and appended as exact ids: each turn's prompt is exactly what came
before, nothing is re-tokenized. Observation tokens carry observation_mask, NaN log-probs and
policy version -1; segments record each part with its turn; extra.env the environment's reward,
turns, malformed tool calls and per-step info. A trajectory ends "completed" when the environment
says done, "truncated" at --max-turns, a turn at --max-new-tokens, or a context overflow, and
"env_error" (the reason in extra.status_reason; the run goes on) when the environment raises, takes
longer than --env-timeout or answers malformed. With several --server URLs every turn of a
trajectory goes to the same server (a stable hash of its key: its prefix cache holds the history);
when that server fails, the trajectory continues on the next one with its exact ids and
extra.env.server_moves records the move. extra.env.retokenize_drift (and the shard's
rollout/retokenize_drift_tokens metric) counts the action tokens a text round trip would change.
--engine local keeps each trajectory's KV cache between its turns: a turn prefills only what the
last turn and its observation added. --refill-rounds N resamples the failed samples (env_error,
aborted) of every group whose valid samples are more than half of it, up to N rounds (GLM-5's rule;
groups with half or fewer are left to the trainer, which drops them): a refill takes the prompt's
next sample index, records extra.refill {replaces, round}, and the failed sample stays recorded.

--compaction summary (with --env; CompactionRL) bounds every turn's context by --context-budget C:
when C - |h| < --compaction-threshold T_comp (or the next turn could overflow C), the last
observation is followed by --summary-prompt as a user turn and the policy writes a summary (a
segment of kind summary: action tokens, trained with the trajectory's final reward; cut at
--max-summary-tokens and recorded truncated); the trajectory goes on in a rebuilt context: the
prompt's own turns, --resume-template holding the summary's exact ids, and the newest --keep-last
action-observation pairs. Each later window's first segment records its context as exact ids, so
the trainer scores every token on precisely what the engine saw; the copied pairs are context,
never trained twice. --compaction drop rebuilds without a summary (the baseline); without
compaction a trajectory that would overflow --context-budget ends truncated. extra.compaction
records the windows, each summary and the peak context (formats/SPEC.md §5).

--follow SPOOL makes it a long-running producer of asynchronous RL: round after round (round r at
--seed + r, so trajectory ids never repeat) it publishes each part into the spool the moment its
groups are complete, switching between parts (and, with the local engine, between the turns of
multi-turn trajectories) to the newest version of --reload-root (the trainer's --out; default
--checkpoint when it is a root) and stamping every token with the version that sampled it. At a
switch between turns, --kv-on-switch recompute drops the trajectories' KV caches (the next turn
prefills under the new weights) and keep reuses them, recording in extra.kv_cache.stale_turns the
turns that attended to the old weights' keys and values (diff-logprobs reports them apart). A
restart skips the parts the spool holds; SIGTERM stops after the part in progress, --max-rounds
after that many rounds (formats/SPEC.md §12). --max-queued N waits before a part while N shards
wait in the spool and the --queue spools; with servers, --max-server-lag N waits before a part while
a server samples a version more than N behind --reload-root's LATEST (until sync-weights moves it),
so no record is sampled further behind than that.

Work is split by --shard-index/--num-shards (Slurm array tasks) and written in parts of
--prompts-per-shard prompts; a rerun writes only the parts that are missing. The same seed gives
the same shards bit for bit, whatever the batch size or split.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, print_summary
from glmpost.commands.options import config_from, json_option, with_config, with_options
from glmpost.errors import UsageError
from glmpost.kernel.sglang_client import without_api_key
from glmpost.rollout.follow import RolloutFollowConfig, follow_rollout
from glmpost.rollout.runner import RolloutRunner
from glmpost.rollout.settings import RolloutConfig


@with_options(RolloutFollowConfig, ("follow", "producer", "reload_root", "max_rounds", "max_queued", "max_server_lag", "queue",
                                     "kv_on_switch"))
@with_config(RolloutConfig)
def rollout(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., help="Prompt JSONL, parquet, CSV or JSON files or datasets directories, or shards / shard directories / globs to resample."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Policy checkpoint: a root (its LATEST) or a version directory."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory for rollout shards (created; existing parts are kept); not with --follow."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
    **follow_options,
) -> None:
    group_size = ctx.params["group_size"]
    follow = config_from(ctx, RolloutFollowConfig)
    if follow.follow is not None:
        if out is not None:
            raise UsageError("--follow publishes into the spool: drop --out")
        summary = follow_rollout(config_from(ctx, RolloutConfig), follow, options=without_api_key(effective_options(ctx)))
        return print_summary(summary, as_json=as_json, human=(
            f"{summary['spool']}: {summary['shards_published']} shard(s) published by {summary['producer']} over "
            f"{summary['rounds']} round(s), policy versions {summary['policy_versions']}, stopped by {summary['stopped_by']}"))
    if out is None:
        raise UsageError("--out DIR is needed (or --follow SPOOL)")
    summary = RolloutRunner(config_from(ctx, RolloutConfig), options=without_api_key(effective_options(ctx))).run()
    human = (
        f"{out}: {summary['records']} trajectories of {summary['prompts']} prompts x {group_size} in "
        f"{summary['shards_written']} new shard(s) ({summary['shards_skipped']} kept), policy v{summary['policy_version']}, "
        f"{summary['response_tokens']} tokens at {summary['tokens_per_s']} tokens/s, truncation {summary['truncation_rate']:.0%}"
        + (f", {summary['aborted']} aborted" if summary["aborted"] else "")
    )
    print_summary(summary, as_json=as_json, human=human)
