"""Multi-turn rollouts against environments (``rollout --env``): exact token ids across turns (TITO),
the record layout, closure of the trainer's log-probs across observations, and failure accounting.

The environments here are user classes loaded as ``test_agentic:Class`` (the tests directory is on
the path), the way a user names theirs; the model is the session's tiny random checkpoint, stopped
after a few tokens per turn by a wide set of stop ids so that trajectories have several turns.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from glmpost.envs import Step
from glmpost.formats import ShardReader, ShardWriter, resolve_shard_paths
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.rl.batches import prepare_batch
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.trainer import PolicyTrainer

# A third of the ids end a turn (short turns), the model's eos ids among them (SGLang always stops there).
STOPS = ",".join(str(i) for i in sorted(set(range(0, 512, 3)) | {0, 4, 6}))


class Countdown:
    """Done with reward 1 after ``turns`` steps; each observation says how many are left."""

    def __init__(self, turns: int = 3):
        self.left = turns

    def reset(self, task):
        return ""

    def step(self, action):
        self.left -= 1
        if self.left == 0:
            return Step("", 1.0, True, {"left": 0})
        return Step(f"tick {self.left}", 0.0, False, {"left": self.left})


class Flaky(Countdown):
    """Raises on the second step of every other trajectory (by task digit), sleeps on another."""

    def reset(self, task):
        self.digit = int(task.get("digit", 0))
        return ""

    def step(self, action):
        if self.left == 2 and self.digit == 1:
            raise RuntimeError("the tool server crashed")
        if self.left == 2 and self.digit == 2:
            time.sleep(2.0)
        if self.left == 2 and self.digit == 3:
            return {"observation": "not a Step"}
        return super().step(action)


class KillOnFirstStep(Countdown):
    """Countdown that kills process ``pid`` (a server) when the first trajectory takes its first step."""

    def __init__(self, turns: int = 3, pid: int = 0):
        super().__init__(turns)
        self.pid = pid

    def step(self, action):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return super().step(action)


class FailingResets(Countdown):
    """Countdown whose first ``fails[digit]`` resets of a task with that digit raise (counted per ``run``)."""

    started: dict = {}

    def __init__(self, fails: dict, run: str, turns: int = 2):
        super().__init__(turns)
        self.fails, self.run = fails, run

    def reset(self, task):
        key = (self.run, str(task["digit"]))
        FailingResets.started[key] = FailingResets.started.get(key, 0) + 1
        if FailingResets.started[key] <= int(self.fails.get(str(task["digit"]), 0)):
            raise RuntimeError("the sandbox did not start")
        return ""


def judged_by_env(out: Path, judged: Path, *, spread: float) -> Path:
    """``out``'s records judged by hand: the environment's reward plus ``spread`` times the record's
    index mod 3 (so groups have different rewards)."""
    judged.mkdir()
    for path in resolve_shard_paths([out]):
        reader = ShardReader(path)
        with ShardWriter(judged / path.name, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as writer:
            for index, record in enumerate(reader):
                reward = record["extra"]["env"]["reward"] + spread * (index % 3)
                writer.write({**record, "reward": reward, "rewards": {"env": reward}, "reward_info": {}})
    return judged


def _prompts(tmp_path, count=4):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d}", "domain": "countdown", "task": {"digit": d}}) + "\n"
                            for d in range(count)))
    return path


def _rollout(glmpost_cli, checkpoint, tmp_path, env="test_agentic:Countdown", *extra, name="ro"):
    out = tmp_path / name
    result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", checkpoint, "--out", out, "--env", env,
                         "--group-size", "2", "--max-new-tokens", "16", "--max-turns", "4", "--stop-token-ids", STOPS,
                         "--temperature", "0.8", *extra)
    assert result.exit_code == 0, result.stderr
    return out, [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]


def test_trajectories_are_exact_ids_turn_after_turn(glmpost_cli, tiny_checkpoint, tmp_path):
    _, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    tokenizer, _ = load_tokenizer(tiny_checkpoint)
    observation_id = tokenizer.convert_tokens_to_ids("<|observation|>")
    completed = [r for r in records if r["status"] == "completed"]
    assert len(completed) >= 4  # most trajectories run the three turns Countdown asks for
    for record in completed:
        segments, ids = record["segments"], record["response_token_ids"].tolist()
        assert [s["kind"] for s in segments] == ["action", "observation"] * 2 + ["action"]
        assert [s["turn"] for s in segments] == [0, 0, 1, 1, 2]
        assert segments[-1]["end"] == len(ids) and all(a["end"] == b["start"] for a, b in zip(segments, segments[1:]))
        for s, left in zip(segments[1::2], (2, 1)):
            observation = ids[s["start"] : s["end"]]
            after_marker = ids[s["start"] - 1] == observation_id  # the model's turn ended by calling the tool
            expected = ("" if after_marker else "<|observation|>") + f"\ntick {left}<|assistant|>\n"
            assert tokenizer.decode(observation) == expected
        actions, observations = record["action_mask"], record["observation_mask"]
        assert not (actions & observations).any() and (actions | observations).all()
        assert np.isnan(record["rollout_log_probs"][observations]).all()
        assert np.isfinite(record["rollout_log_probs"][actions]).all()
        assert (record["policy_versions"][observations] == -1).all() and (record["policy_versions"][actions] == 0).all()
        env = dict(record["extra"]["env"])
        assert isinstance(env.pop("retokenize_drift"), int)
        # the longest context a turn was sampled on: everything before the last action, and the action
        assert env.pop("peak_context") == len(record["prompt_token_ids"]) + len(ids)
        assert env == {"name": "test_agentic:Countdown", "reward": 1.0, "turns": 3, "malformed": 0,
                       "steps": [{"left": 2}, {"left": 1}, {"left": 0}]}
    for record in records:
        if record["status"] == "truncated":
            assert record["extra"]["status_reason"] in ("a turn reached max_new_tokens",)


def test_the_trainer_scores_exactly_what_the_engine_sampled_across_turns(glmpost_cli, tiny_checkpoint, tmp_path):
    """Closure on multi-turn records: diff-logprobs (the trainer's forward) agrees with the rollout's
    log-probs to float rounding and resamples every action token, turn by turn; train-grpo trusts
    every action token."""
    out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    assert sum(len(r["segments"]) > 1 for r in records) >= 4
    diff = glmpost_cli("diff-logprobs", out, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "diff", "--json", "--no-plots")
    assert diff.exit_code == 0, diff.stderr
    overall = json.loads(diff.stdout)["overall"]
    assert overall["tokens"] == sum(int(r["action_mask"].sum()) for r in records)
    assert overall["max_abs"] <= 1e-5 and overall["sample_agreement"] == 1.0

    judged = judged_by_env(out, tmp_path / "judged", spread=0.1)
    train = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "policy", "--json")
    assert train.exit_code == 0, train.stderr
    assert json.loads(train.stdout)["trusted_fraction"] == 1.0


def test_observation_tokens_never_receive_gradient(glmpost_cli, tiny_checkpoint, tmp_path):
    """The gradient reaching the last hidden state at a position that predicts an observation token
    is exactly zero; at positions predicting action tokens it is not."""
    _, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    tokenizer, _ = load_tokenizer(tiny_checkpoint)
    for index, record in enumerate(records):
        record["reward"] = float(index % 2)
    examples = prepare_batch(records).examples
    model = load_model(tiny_checkpoint)
    captured = []

    def keep(_module, _args, kwargs, out):
        if out.last_hidden_state.requires_grad:  # the training forward (old log-probs run without grad)
            out.last_hidden_state.retain_grad()
            captured.append((kwargs["input_ids"], out.last_hidden_state))

    model.model.register_forward_hook(keep, with_kwargs=True)
    trainer = PolicyTrainer(model, GRPOConfig(lr=1e-3, micro_batch_size=len(examples)), pad_token_id=tokenizer.pad_token_id)
    trainer.train(examples)
    ((input_ids, hidden),) = captured  # one epoch, one mini-batch, one micro-batch (rows shuffled)
    rows = {tuple(row.tolist()): i for i, row in enumerate(input_ids)}
    moved = still = 0
    for record in records:
        ids = record["prompt_token_ids"].tolist() + record["response_token_ids"].tolist()
        row = next(r for key, r in rows.items() if list(key[: len(ids)]) == ids)
        start = len(record["prompt_token_ids"]) - 1  # position t predicts token t + 1
        grads = hidden.grad[row, start : start + len(record["response_token_ids"])].abs().sum(-1)
        obs = torch.from_numpy(record["observation_mask"])
        assert torch.all(grads[obs] == 0), record["id"]
        moved += int((grads[~obs] > 0).sum())
        still += int(obs.sum())
    assert moved > 0 and still > 0


def test_environment_failures_end_one_trajectory_each_with_the_reason(glmpost_cli, tiny_checkpoint, tmp_path):
    _, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "test_agentic:Flaky", "--env-timeout", "0.5")
    by_digit = {}
    for record in records:
        by_digit.setdefault(record["task"]["digit"], []).append(record)
    reasons = {d: {r["extra"].get("status_reason") for r in rs if r["status"] == "env_error"} for d, rs in by_digit.items()}
    reached = {d: [r for r in rs if len(r["segments"]) >= 3 or r["status"] == "env_error"] for d, rs in by_digit.items()}
    if reached[1]:
        assert reasons[1] == {"step() raised RuntimeError: the tool server crashed"}
    if reached[2]:
        assert reasons[2] == {"step() took longer than --env-timeout 0.5 s"}
    if reached[3]:
        assert reasons[3] == {"step() returned dict, not a Step"}
    assert sum(bool(reached[d]) for d in (1, 2, 3)) >= 2
    assert all(r["status"] in ("completed", "truncated") for r in by_digit[0])  # the others are unaffected


def test_an_environment_that_is_not_one_is_a_one_line_error(glmpost_cli, tiny_checkpoint, tmp_path):
    cases = {("--env", "calculater"): "--env: unknown environment 'calculater'",
             ("--env", "test_agentic:Step"): "is not an environment: it lacks reset() and step()",
             ("--env", "calculator", "--env-options", "[1]"): "--env-options '[1]': expected a JSON object",
             ("--env", "calculator", "--env-options", '{"size": 2}'): "--env: calculator cannot be built with options {'size': 2}"}
    for args, message in cases.items():
        result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad", *args)
        assert result.exit_code == 2 and message in result.stderr and result.stderr.count("\n") == 1, (args, result.stderr)
        assert not (tmp_path / "bad").exists()


def test_judge_env_verifier_takes_the_environments_reward(glmpost_cli, tiny_checkpoint, tmp_path):
    out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    judged = glmpost_cli("judge", out, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "judged", "--default-verifier", "env")
    assert judged.exit_code == 0, judged.stderr
    scored = {r["id"]: r for p in resolve_shard_paths([tmp_path / "judged"]) for r in ShardReader(p)}
    for record in records:
        assert scored[record["id"]]["reward"] == record["extra"]["env"]["reward"]
        assert scored[record["id"]]["reward_info"]["components"]["correct"]["turns"] == record["extra"]["env"]["turns"]
    single = tmp_path / "single"
    assert glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", single,
                       "--max-new-tokens", "3").exit_code == 0
    plain = glmpost_cli("judge", single, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "j2", "--default-verifier", "env",
                        "--json")
    assert plain.exit_code == 0 and json.loads(plain.stdout)["failures"] > 0
    failed = next(r for p in resolve_shard_paths([tmp_path / "j2"]) for r in ShardReader(p))
    assert np.isnan(failed["reward"]) and "no extra.env.reward" in json.dumps(failed["reward_info"])


def test_rollout_metrics_count_turns_observations_and_statuses(glmpost_cli, tiny_checkpoint, tmp_path):
    out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    (line,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["rollout/turns_mean"] == np.mean([r["extra"]["env"]["turns"] for r in records])
    assert line["rollout/observation_tokens"] == sum(int(r["observation_mask"].sum()) for r in records)
    assert line["rollout/env_reward_mean"] == np.mean([r["extra"]["env"]["reward"] for r in records])
    statuses = {}
    for record in records:
        statuses[record["status"]] = statuses.get(record["status"], 0) + 1
    assert {k.split("/")[-1]: v for k, v in line.items() if k.startswith("rollout/status/")} == statuses


def test_the_drift_ledger_counts_what_retokenizing_would_change(glmpost_cli, tiny_checkpoint, tmp_path):
    """A tool call the model spelled one byte-token at a time: decoding and re-encoding merges it,
    so naive re-tokenization would change those action tokens; the record keeps (and train-grpo
    scores) the exact ids."""
    from glmpost.rl.batches import train_example
    from glmpost.rollout.agentic import retokenize_drift

    tokenizer, _ = load_tokenizer(tiny_checkpoint)
    text = "<calc>count: 12+30</calc>"
    spelled = [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]
    merged = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(spelled) == text and len(merged) < len(spelled)
    observation = tokenizer.encode("<|observation|>\n42<|assistant|>\n", add_special_tokens=False)
    response = spelled + observation
    actions = [True] * len(spelled) + [False] * len(observation)
    drift = retokenize_drift(tokenizer, response, actions)
    assert 0 < drift <= len(spelled)
    assert retokenize_drift(tokenizer, merged + observation, [True] * len(merged) + [False] * len(observation)) == 0
    record = {"prompt_token_ids": np.array([5, 6]), "response_token_ids": np.array(response), "group_id": "g",
              "action_mask": np.array(actions), "observation_mask": ~np.array(actions),
              "rollout_log_probs": np.zeros(len(response), dtype=np.float32)}
    assert train_example(record, 1.0).input_ids == [5, 6] + response  # the exact ids, never re-encoded

    out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    (line,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["rollout/retokenize_drift_tokens"] == sum(r["extra"]["env"]["retokenize_drift"] for r in records)
    for record in records:
        actions = record["action_mask"].tolist()
        assert record["extra"]["env"]["retokenize_drift"] == retokenize_drift(tokenizer, record["response_token_ids"], actions)


def test_shards_inspect_reports_the_drift_ledger(glmpost_cli, tiny_checkpoint, tmp_path):
    out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path)
    result = glmpost_cli("shards", "inspect", out, "--json")
    assert result.exit_code == 0, result.stderr
    (dataset,) = json.loads(result.stdout)["datasets"]
    assert dataset["tokens"]["retokenize_drift"] == sum(r["extra"]["env"]["retokenize_drift"] for r in records)
    assert dataset["tokens"]["observation"] == sum(int(r["observation_mask"].sum()) for r in records)
    text = glmpost_cli("shards", "inspect", out)
    assert "action tokens a text round trip would change" in text.stdout


def test_trajectories_stay_on_their_server_and_move_with_their_ids_when_it_dies(glmpost_cli, tiny_checkpoint, tmp_path):
    """Two servers: every turn of a trajectory goes to its home server (its prefix cache), both
    servers get trajectories, and the tokens equal the local engine's; when one server dies between
    turns, its trajectories continue on the other with their exact ids, and the move is recorded."""
    from serve_process import start_server, stop_server

    first, url_a = start_server(tiny_checkpoint, "--batch-size", "16")
    second, url_b = start_server(tiny_checkpoint, "--batch-size", "16")
    try:
        servers = ("--engine", "sglang", "--server", f"{url_a},{url_b}", "--retries", "0", "--batch-size", "16")
        _, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "test_agentic:Countdown", *servers, name="both")
        _, local = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "test_agentic:Countdown", "--batch-size", "16", name="local")
        assert {r["extra"]["env"]["server"] for r in records} == {url_a, url_b}
        assert all(r["extra"]["env"]["server_moves"] == [] for r in records)
        assert [r["response_token_ids"].tolist() for r in records] == [r["response_token_ids"].tolist() for r in local]

        options = json.dumps({"pid": first.pid})
        _, moved = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "test_agentic:KillOnFirstStep", "--env-options", options,
                            *servers, name="moved")
        homed_a = [r for r in moved if r["extra"]["env"]["server"] == url_a and r["extra"]["env"]["turns"] > 1]
        assert homed_a and all(r["extra"]["env"]["server_moves"] == [{"turn": 1, "from": url_a, "to": url_b}] for r in homed_a)
        assert all(r["status"] in ("completed", "truncated") for r in moved)  # nobody aborted, nothing lost
        assert [r["response_token_ids"].tolist() for r in moved] == [r["response_token_ids"].tolist() for r in local]
    finally:
        stop_server(first)
        stop_server(second)


def test_groups_more_than_half_valid_are_refilled_to_full_size(glmpost_cli, tiny_checkpoint, tmp_path):
    """GLM-5's rule at rollout time (--refill-rounds): q1 loses 1 of 4 samples and gets one refill
    (the next sample index, extra.refill naming the sample it replaces); q2 loses 2 of 4, is not
    refilled, and the trainer drops it; every failure stays recorded."""
    options = json.dumps({"fails": {"1": 1, "2": 2}, "run": str(tmp_path)})
    out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "test_agentic:FailingResets", "--env-options", options,
                            "--group-size", "4", "--refill-rounds", "2")
    by_prompt = {}
    for record in records:
        by_prompt.setdefault(record["prompt_id"], []).append(record)
    assert {p: len(rs) for p, rs in by_prompt.items()} == {"q0": 4, "q1": 5, "q2": 4, "q3": 4}
    refill = [r for r in records if "refill" in (r.get("extra") or {})]
    assert len(refill) == 1 and refill[0]["prompt_id"] == "q1" and refill[0]["id"].endswith("/4")
    failed = [r for r in by_prompt["q1"] if r["status"] == "env_error"]
    assert refill[0]["extra"]["refill"] == {"replaces": failed[0]["id"], "round": 1}
    assert refill[0]["status"] == "completed" and refill[0]["group_id"] == failed[0]["group_id"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("rollout/refilled", 0) for m in metrics) == 1 == sum(m.get("rollout/refill_valid", 0) for m in metrics)
    for record in records:
        record["reward"] = 1.0 if record["status"] == "completed" else 0.0
    batch = prepare_batch(records)
    assert batch.group_sizes == {4: 3} and batch.failed == {"env_error": 3} and batch.excluded["small_group"] == 2


def test_trajectories_a_lost_server_ends_are_counted_aborted(glmpost_cli, tiny_checkpoint, tmp_path):
    """One server, killed after the first turn: the trajectories it served end aborted with the
    reason, and the shards' metrics count them (not only sequences the engine never started)."""
    from serve_process import start_server, stop_server

    proc, url = start_server(tiny_checkpoint, "--batch-size", "16")
    try:
        options = json.dumps({"pid": proc.pid})
        out, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "test_agentic:KillOnFirstStep", "--env-options",
                                options, "--engine", "sglang", "--server", url, "--retries", "0", "--batch-size", "16")
    finally:
        stop_server(proc)
    aborted = [r for r in records if r["status"] == "aborted"]
    assert aborted and all(r["extra"]["status_reason"] for r in aborted)
    assert all(len(r["segments"]) >= 1 for r in aborted)  # the first turn is kept
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["rollout/aborted"] for m in metrics if "rollout/aborted" in m) == len(aborted)


def test_concurrent_environment_steps_write_the_same_records(glmpost_cli, tiny_checkpoint, tmp_path):
    """--env-workers runs one turn's tool steps at once (each trajectory has its own environment):
    the latency tail is paid once per turn, and the records are those of steps one after another."""
    import json as _json

    from glmpost.formats import ShardReader, resolve_shard_paths

    prompts = tmp_path / "calc.jsonl"
    source = Path(__file__).resolve().parents[1] / "recipes" / "data" / "calc-train.jsonl"
    prompts.write_text("".join(source.read_text().splitlines(keepends=True)[:4]))
    options = _json.dumps({"inner": "calculator", "median_s": 0.01, "sigma": 1.0})
    outs = {}
    for workers in (1, 8):
        out = tmp_path / f"w{workers}"
        result = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", out, "--env", "latency", "--env-options",
                             options, "--max-turns", "2", "--group-size", "2", "--max-new-tokens", "8", "--env-workers", workers)
        assert result.exit_code == 0, result.stderr
        outs[workers] = [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]
    for a, b in zip(outs[1], outs[8], strict=True):
        assert a["id"] == b["id"] and a["status"] == b["status"]
        assert a["response_token_ids"].tolist() == b["response_token_ids"].tolist()
        assert a["extra"]["env"]["reward"] == b["extra"]["env"]["reward"]
