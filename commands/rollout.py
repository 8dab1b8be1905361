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

import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer
from tqdm import tqdm

from glmpost.checkpoints import (
    CheckpointError,
    load_model,
    load_tokenizer,
    read_manifest,
    resolve_checkpoint,
)
from glmpost.commands.common import (
    MetricsWriter,
    check_same_options,
    config_option,
    effective_options,
    print_summary,
)
from glmpost.rollout.engine import LocalEngine, SamplingParams, sequence_seed
from glmpost.errors import GlmpostError, UsageError
from glmpost.formats import SHARD_SUFFIX, ShardWriter, select_shards
from glmpost.npu import resolve_device
from glmpost.rollout.records import (
    aborted_record,
    check_context,
    completion_from_sglang,
    load_rollout_prompts,
    rollout_record,
    sglang_sampling_params,
)
from glmpost.stage import log, write_stage_json

STAGE = "rollout"
# Options that may differ between the tasks or reruns writing one output directory.
PER_TASK_OPTIONS = ("shard_index", "num_shards", "overwrite", "as_json", "batch_size", "device", "config",
                    "engine_name", "server", "concurrency", "timeout", "retries")


def parse_stop_ids(value: str, default: list[int]) -> list[int]:
    if value == "default":
        return list(default)
    if value in ("", "none"):
        return []
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise UsageError(f"--stop-token-ids {value!r}: expected comma-separated integers, 'default' or 'none'") from None


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
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
    config: Optional[Path] = config_option(),
) -> None:

    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed)
    try:
        params.validate()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    torch_device = resolve_device(device)
    version_dir = resolve_checkpoint(checkpoint)
    try:
        policy_version = read_manifest(version_dir).policy_version
    except CheckpointError:
        log(f"{version_dir} has no glmpost.json; stamping policy version 0")
        policy_version = 0
    tokenizer, revision = load_tokenizer(version_dir)
    if engine_name not in ("local", "sglang"):
        raise UsageError(f"--engine must be local or sglang, got {engine_name!r}")
    if engine_name == "sglang" and not server:
        raise UsageError("--engine sglang needs --server URL[,URL...]")
    prompts = load_rollout_prompts(inputs, tokenizer, revision)[:limit]
    pool = None
    if engine_name == "sglang":
        from transformers import AutoConfig, GenerationConfig

        model = None
        model_config = AutoConfig.from_pretrained(str(version_dir))
        try:
            default_stops = GenerationConfig.from_pretrained(str(version_dir)).eos_token_id
        except OSError:
            default_stops = model_config.eos_token_id
        pool = _connect(server, revision=revision, version_dir=version_dir, concurrency=concurrency, timeout=timeout,
                        retries=retries, batch_size=batch_size)
    else:
        model = load_model(version_dir, device=torch_device, deterministic_topk=deterministic_topk)
        model_config = model.config
        default_stops = model.generation_config.eos_token_id
    eos_ids = default_stops if isinstance(default_stops, list) else [default_stops] if default_stops is not None else []
    params.stop_token_ids = parse_stop_ids(stop_token_ids, eos_ids)
    check_context(prompts, max_new_tokens=max_new_tokens, context=model_config.max_position_embeddings)
    if pool is not None:
        try:
            sglang_params = sglang_sampling_params(params, eos_ids)
        except ValueError as exc:
            raise UsageError(f"--engine sglang --stop-token-ids: {exc}") from None

    options = effective_options(ctx)
    out.mkdir(parents=True, exist_ok=True)
    check_same_options(out, STAGE, options, ignore=PER_TASK_OPTIONS, overwrite=overwrite,
                       facts={"policy_version": policy_version, "checkpoint": str(version_dir)}, ctx=ctx)
    write_stage_json(out, STAGE, options, checkpoint=str(version_dir), policy_version=policy_version)

    parts = [prompts[i : i + prompts_per_shard] for i in range(0, len(prompts), prompts_per_shard)]
    names = [f"rollout-{i:05d}{SHARD_SUFFIX}" for i in range(len(parts))]
    mine = select_shards([Path(n) for n in names], shard_index, num_shards)
    todo = [(names.index(str(p)), out / p) for p in mine if overwrite or not (out / p).exists()]
    if len(todo) < len(mine):
        log(f"{len(mine) - len(todo)} of this task's {len(mine)} shard(s) already exist in {out}; writing the rest")

    if pool is None:
        engine = LocalEngine(model, batch_size=batch_size, pad_token_id=tokenizer.pad_token_id)
        engine_info = {"engine": engine.name, "engine_version": _engine_version(), "group_size": group_size}
    else:
        engine_info = {"engine": "sglang", "engine_version": _engine_version(), "group_size": group_size}
    totals = {"shards": 0, "records": 0, "response_tokens": 0, "truncated": 0, "aborted": 0, "seconds": 0.0}
    progress = tqdm(total=sum(len(parts[i]) for i, _ in todo) * group_size, desc="rollout", unit="seq", leave=False, disable=None)
    with MetricsWriter(out / "metrics.jsonl") as metrics, progress:
        for part_index, path in todo:
            part = parts[part_index]
            keys = [f"{p.prompt_id}/{i}" for p in part for i in range(group_size)]
            sequences = [p.token_ids for p in part for _ in range(group_size)]
            started = time.perf_counter()
            if pool is None:
                completions = []
                for start in range(0, len(sequences), batch_size):
                    completions += engine.generate(sequences[start : start + batch_size], keys[start : start + batch_size], params)
                    progress.update(len(sequences[start : start + batch_size]))
                outcomes = [(c, None, None) for c in completions]
            else:
                outcomes = _generate_remote(pool, sequences, keys, params, sglang_params, batch_size, progress)
            seconds = time.perf_counter() - started
            completions = [c for c, _, _ in outcomes if c is not None]
            with ShardWriter(path, stage=STAGE, options=options, tokenizer_revision=revision, level=zstd_level) as writer:
                for index, (completion, version, reason) in enumerate(outcomes):
                    prompt = part[index // group_size]
                    common = {"sample_index": index % group_size, "params": params, "policy_version": policy_version,
                              "tokenizer_revision": revision, "engine": engine_info}
                    if completion is None:
                        writer.write(aborted_record(prompt, reason, **common))
                    else:
                        writer.write(rollout_record(prompt, completion, token_policy_version=_as_version(version), **common))
            aborted = len(outcomes) - len(completions)
            if aborted:
                log(f"{path.name}: {aborted} of {len(outcomes)} sequences aborted: {next(r for _, _, r in outcomes if r)}")
            lengths = np.array([len(c.token_ids) for c in completions] or [0])
            truncated = sum(c.finish_reason == "length" for c in completions)
            metrics.write(**{
                "shard": path.name,
                "rollout/records": len(completions),
                "rollout/tokens_per_s": round(float(lengths.sum()) / max(seconds, 1e-9), 2),
                "rollout/response_length_mean": float(lengths.mean()),
                "rollout/response_length_min": int(lengths.min()),
                "rollout/response_length_max": int(lengths.max()),
                "rollout/truncation_rate": truncated / max(len(completions), 1),
                "rollout/aborted": aborted,
                "rollout/policy_version": policy_version,
            })
            totals["shards"] += 1
            totals["records"] += len(outcomes)
            totals["aborted"] += aborted
            totals["response_tokens"] += int(lengths.sum())
            totals["truncated"] += truncated
            totals["seconds"] += seconds
    summary = {
        "out": str(out),
        "policy_version": policy_version,
        "prompts": len(prompts),
        "shards_written": totals["shards"],
        "shards_skipped": len(mine) - len(todo),
        "records": totals["records"],
        "response_tokens": totals["response_tokens"],
        "truncation_rate": round(totals["truncated"] / totals["records"], 4) if totals["records"] else 0.0,
        "aborted": totals["aborted"],
        "engine": engine_name,
        "tokens_per_s": round(totals["response_tokens"] / totals["seconds"], 1) if totals["seconds"] else 0.0,
    }
    human = (
        f"{out}: {summary['records']} trajectories of {len(prompts)} prompts x {group_size} in {totals['shards']} new shard(s) "
        f"({summary['shards_skipped']} kept), policy v{policy_version}, {summary['response_tokens']} tokens at "
        f"{summary['tokens_per_s']} tokens/s, truncation {summary['truncation_rate']:.0%}"
        + (f", {totals['aborted']} aborted" if totals["aborted"] else "")
    )
    if pool is not None:
        pool.close()
    print_summary(summary, as_json=as_json, human=human)


def _connect(server: str, *, revision: str, version_dir: Path, concurrency: int, timeout: float, retries: int,
             batch_size: int):
    """A pool over the --server URLs, each checked: reachable, and serving our tokenizer revision."""
    from glmpost.serving.sglang_client import ServerError, SGLangPool

    try:
        pool = SGLangPool(server, concurrency=concurrency, timeout=timeout, retries=retries)
    except ValueError as exc:
        raise UsageError(f"--server {server!r}: {exc}") from None
    for client in pool.clients:
        quick = type(client)(client.url, timeout=min(timeout, 30.0), retries=min(retries, 1), backoff=0.2)
        try:
            info = quick.model_info()
        except ServerError as exc:
            raise GlmpostError(f"--server {client.url}: unreachable ({exc})") from None
        served = info.get("tokenizer_revision") if isinstance(info, dict) else None
        if served is None:
            log(f"--server {client.url} does not report a tokenizer revision (not `glmpost serve`); "
                f"make sure it serves the tokenizer of {version_dir}")
        elif served != revision:
            raise GlmpostError(f"--server {client.url} serves tokenizer revision {served}; --checkpoint {version_dir} has {revision}")
        if isinstance(info, dict) and isinstance(info.get("batch_size"), int) and info["batch_size"] < batch_size:
            log(f"--server {client.url} batches {info['batch_size']} sequences, fewer than --batch-size {batch_size}: "
                "log-probs may differ from --engine local in the last bits")
    return pool


def _generate_remote(pool, sequences, keys, params, sglang_params, batch_size, progress):
    """One /generate batch request per --batch-size chunk (the local engine's batches), in parallel;
    returns ``(completion | None, weight_version, abort_reason)`` per sequence, in order."""
    from glmpost.serving.sglang_client import ServerError

    futures = []
    for number, start in enumerate(range(0, len(sequences), batch_size)):
        chunk = list(range(start, min(start + batch_size, len(sequences))))
        per_seq = [{**sglang_params, "sampling_seed": sequence_seed(params.seed, keys[i])} for i in chunk]
        ids = [sequences[i] for i in chunk]
        futures.append((chunk, pool.submit(number, lambda c, ids=ids, sp=per_seq: c.generate(ids, sp, return_logprob=True))))
    outcomes = []
    for chunk, future in futures:
        try:
            answers = future.result()
            if not isinstance(answers, list) or len(answers) != len(chunk):
                raise ServerError(f"{len(answers) if isinstance(answers, list) else 'no'} answers for {len(chunk)} sequences",
                                  url="?")
            outcomes += [completion_from_sglang(a, params.stop_token_ids) for a in answers]
        except ServerError as exc:
            outcomes += [(None, None, str(exc))] * len(chunk)
        progress.update(len(chunk))
    return outcomes


def _as_version(value) -> int | None:
    """A server's weight_version as a policy version when it is an integer, else None."""
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _engine_version() -> str:
    from glmpost import __version__

    return __version__
