"""Sample responses from a checkpoint and write rollout shards with all the evidence of each action.

Prompts come from JSONL (`prompt` text or chat `messages`, `domain`, `task`, optional `id`; rendered
with the checkpoint's chat template) or from shards (their prompt token ids). Every prompt is
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
unreachable one, or one whose tokenizer revision differs from --checkpoint's, is an error.

Work is split by --shard-index/--num-shards (Slurm array tasks) and written in parts of
--prompts-per-shard prompts; a rerun writes only the parts that are missing. The same seed gives
the same shards bit for bit, whatever the batch size or split.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from glmpost.commands.common import config_option, effective_options, option_flag, print_summary
from glmpost.commands.options import json_option
from glmpost.rollout.runner import RolloutConfig, RolloutRunner


def rollout(
    ctx: typer.Context,
    inputs: List[str] = typer.Argument(..., help="Prompt JSONL files, or shards / shard directories / globs to resample."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="Policy checkpoint: a root (its LATEST) or a version directory."),
    out: Path = typer.Option(..., "--out", help="Output directory for rollout shards (created; existing parts are kept)."),
    group_size: int = typer.Option(8, "--group-size", min=1, help="Samples per prompt (GRPO's G); siblings share a group_id."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0, help="Sampling temperature; 0 is greedy (log-probs 0)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]; 1 disables."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sample among the k most likely tokens; 0 disables."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, help="Most tokens sampled per response."),
    stop_token_ids: str = typer.Option(
        "default", "--stop-token-ids", help="Comma-separated ids that end a response (kept in it); 'default' = the model's eos ids, 'none' = never stop early."
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed; each sequence's generator derives from it and the sequence id."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Sequences decoded together (does not change the samples' seeds)."),
    prompts_per_shard: int = typer.Option(64, "--prompts-per-shard", min=1, help="Prompts per output shard (x group size records)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use only the first N prompts."),
    shard_index: int = typer.Option(0, "--shard-index", min=0, help="This task's index among --num-shards (Slurm array task id)."),
    num_shards: int = typer.Option(1, "--num-shards", min=1, help="Number of tasks splitting the prompts."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda[:N] or npu[:N]."),
    deterministic_topk: bool = typer.Option(
        True, "--deterministic-topk/--torch-topk",
        help="DSA indexer top-k with ties to the lower position (the same keys in rollout and training); --torch-topk keeps torch.topk's tie order.",
    ),
    engine_name: str = typer.Option("local", "--engine", help="local (in-process torch) or sglang (HTTP: --server)."),
    server: Optional[str] = typer.Option(
        None, "--server", help="With --engine sglang: comma-separated server URLs (SGLang or `glmpost serve`)."
    ),
    concurrency: int = typer.Option(8, "--concurrency", min=1, help="With --engine sglang: requests in flight at once."),
    timeout: float = typer.Option(600.0, "--timeout", min=0.1, help="With --engine sglang: seconds to wait for one answer."),
    retries: int = typer.Option(3, "--retries", min=0, help="With --engine sglang: retries of a failed request (backoff 0.5 s, doubling)."),
    zstd_level: int = typer.Option(3, "--zstd-level", min=1, max=22, help="zstd level of the shards."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Regenerate this task's shards even where they exist."),
    as_json: bool = json_option(),
    config: Optional[Path] = config_option(),
) -> None:

    config = RolloutConfig(
        inputs=list(inputs), checkpoint=checkpoint, out=out, group_size=group_size, temperature=temperature,
        top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
        batch_size=batch_size, prompts_per_shard=prompts_per_shard, limit=limit, shard_index=shard_index,
        num_shards=num_shards, device=device, deterministic_topk=deterministic_topk, engine_name=engine_name,
        server=server, concurrency=concurrency, timeout=timeout, retries=retries, zstd_level=zstd_level,
        overwrite=overwrite,
    )
    runner = RolloutRunner(config, options=effective_options(ctx), flag_name=lambda name: option_flag(ctx, name))
    summary = runner.run()
    human = (
        f"{out}: {summary['records']} trajectories of {summary['prompts']} prompts x {group_size} in "
        f"{summary['shards_written']} new shard(s) ({summary['shards_skipped']} kept), policy v{summary['policy_version']}, "
        f"{summary['response_tokens']} tokens at {summary['tokens_per_s']} tokens/s, truncation {summary['truncation_rate']:.0%}"
        + (f", {summary['aborted']} aborted" if summary["aborted"] else "")
    )
    print_summary(summary, as_json=as_json, human=human)
