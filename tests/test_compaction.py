"""CompactionRL (brief, "CompactionRL：摘要也要为任务结果负责"): the policy writes its own context
summaries in ``rollout --compaction``, each rebuilt context is recorded as exact ids, and the trainers
score every window on exactly that context, normalise over all trainable tokens and scale a window's
advantages by ``(gamma * lambda)^{N_{>s}}``.

Hand-computed cases first (the registered normalisations and the cross-segment factor), then real
rollouts of the session's tiny random checkpoint in a test environment whose observations are short
(``test_compaction:Ticks``), stopped after a few tokens per turn by a wide set of stop ids, under a
budget that forces several compactions per trajectory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_agentic import STOPS, Countdown, judged_by_env
from test_formats import compacted_record

from glmpost.formats import ShardReader, context_windows, resolve_shard_paths
from glmpost.formats.chat_format import ChatFormat
from glmpost.kernel.distribution import ScoredDistribution
from glmpost.kernel.loading import load_model, load_tokenizer
from glmpost.rl.advantages import ADVANTAGE_SCALINGS, cross_segment_factor, later_trainable_tokens
from glmpost.rl.batches import prepare_batch, segment_accounting, train_examples
from glmpost.rl.configs import GRPOConfig
from glmpost.rl.losses import LOSS_NORMALIZATIONS
from glmpost.rl.micro_batches import MicroBatch
from glmpost.rl.trainer import PolicyTrainer
from glmpost.rollout.compaction import CompactionSettings, ContextBuilder

BUDGET = 80


class Ticks(Countdown):
    """A countdown of six steps that shows a fact at reset and says each tick twice."""

    def __init__(self, turns: int = 6):
        super().__init__(turns)

    def reset(self, task):
        return "fact 417"

    def step(self, action):
        answer = super().step(action)
        answer.observation = f"{answer.observation} " * 2 if answer.observation else ""
        return answer


# --------------------------------------------------------------------------------------------
# hand-computed: N_{>s}, the cross-segment factor, the two normalisations


def test_later_trainable_tokens_count_what_comes_after_each_segment():
    assert later_trainable_tokens([5, 3, 4]) == [7, 4, 0]
    assert later_trainable_tokens([6]) == [0]
    assert later_trainable_tokens([]) == []


def test_the_cross_segment_factor_on_three_segments():
    """Segments of 5, 3 and 4 trainable tokens, gamma = 0.9, lambda = 0.95: gamma*lambda = 0.855 and
    N_{>s} = 7, 4, 0, so the factors are 0.855^7 = 0.334013, 0.855^4 = 0.534398, 1."""
    later = torch.tensor([7.0, 4.0, 0.0])
    factor = cross_segment_factor(later, 0.9 * 0.95)
    assert factor.tolist() == pytest.approx([0.3340125639, 0.5343975506, 1.0], abs=1e-9)
    assert cross_segment_factor(later, 1.0).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        cross_segment_factor(later, 1.5)

    class Config:
        def segment_decay_base(self):
            return 0.9 * 0.95

    batch = MicroBatch(*(torch.zeros(3, 2),) * 4, advantages=torch.zeros(3, 1), later_tokens=later)
    local = torch.tensor([[1.0, -2.0], [0.5, 0.5], [2.0, -1.0]])  # A^loc per token of each segment
    scaled = ADVANTAGE_SCALINGS["cross_segment"](batch, local, Config())
    expected = [[0.33401256, -0.66802513], [0.26719878, 0.26719878], [2.0, -1.0]]
    assert torch.allclose(scaled, torch.tensor(expected), atol=1e-7, rtol=0)


def _loss(name: str, segments: list[list[float]]) -> tuple[float, list[float]]:
    """The normalised loss of per-token values grouped in segments, and each segment's share of it."""
    counts = torch.tensor([float(len(s)) for s in segments], dtype=torch.float64)
    weights, denominator = LOSS_NORMALIZATIONS[name](counts)
    parts = [float(w) * sum(s) / float(denominator) for w, s in zip(weights, segments)]
    return sum(parts), parts


def test_token_level_normalisation_does_not_upweight_a_trajectory_compacted_more_often():
    """Trajectory A is one segment of 6 tokens whose losses are 1; trajectory B was compacted twice,
    three segments of 2, 3 and 1 tokens whose losses are 2. Token level (CompactionRL): 12 tokens
    weigh the same, L = (6*1 + 6*2) / 12 = 1.5 and each trajectory carries half the tokens' weight.
    The per-segment mean it replaces: L = (1 + 2 + 2 + 2) / 4 = 1.75 and B, cut into more segments,
    gets 3/4 of the weight."""
    a, b = [[1.0] * 6], [[2.0] * 2, [2.0] * 3, [2.0] * 1]
    loss, parts = _loss("token", a + b)
    assert loss == pytest.approx(1.5)
    assert parts[0] == pytest.approx(0.5) and sum(parts[1:]) == pytest.approx(1.0)
    weights, denominator = LOSS_NORMALIZATIONS["token"](torch.tensor([6.0, 2.0, 3.0, 1.0], dtype=torch.float64))
    assert weights.tolist() == [1.0] * 4 and float(denominator) == 12.0
    loss, parts = _loss("segment", a + b)
    assert loss == pytest.approx(1.75)
    assert parts[0] == pytest.approx(0.25) and sum(parts[1:]) == pytest.approx(1.5)
    # the same trajectory B, uncompacted: both normalisations agree that A and B weigh the same
    assert _loss("segment", a + [[2.0] * 6])[0] == pytest.approx(_loss("token", a + [[2.0] * 6])[0]) == pytest.approx(1.5)
    weights, denominator = LOSS_NORMALIZATIONS["segment"](torch.tensor([4.0, 0.0], dtype=torch.float64))
    assert weights.tolist() == [0.25, 0.0] and float(denominator) == 1.0  # a segment without tokens counts nowhere


@pytest.mark.parametrize("normalization, expected", [("token", 0.125), ("segment", -0.25)])
def test_the_trainer_averages_the_loss_by_the_registered_normalisation(tiny_checkpoint, normalization, expected):
    """Two segments, 2 action tokens at advantage 1 and 6 at -0.5; at the first step the ratio is 1,
    so each token's policy loss is -A. Token level: -(2 * 1 + 6 * -0.5) / 8 = 0.125; the per-segment
    mean: -(1 + -0.5) / 2 = -0.25."""
    from glmpost.rl.batches import TrainExample

    tokenizer, _ = load_tokenizer(tiny_checkpoint)

    def example(prompt: list[int], response: list[int], advantage: float) -> TrainExample:
        return TrainExample(prompt + response, len(prompt), np.ones(len(response), dtype=bool),
                            np.full(len(response), -1.0, dtype=np.float32), advantage, "g")

    examples = [example([5, 6, 7], [20, 21], 1.0), example([5, 8], [30, 31, 32, 33, 34, 35], -0.5)]
    config = GRPOConfig(lr=1e-9, micro_batch_size=1, icepop=False, loss_normalization=normalization)
    (step,) = PolicyTrainer(load_model(tiny_checkpoint), config, pad_token_id=tokenizer.pad_token_id).train(examples)
    assert step["train/loss"] == pytest.approx(expected, abs=1e-5)
    assert step["train/trusted_tokens"] == 8


# --------------------------------------------------------------------------------------------
# the trainer's examples of a compacted record


def test_a_compacted_record_trains_each_window_on_its_own_context():
    record = compacted_record(windows=3)
    examples = train_examples(record, 0.75)
    windows = context_windows(record)
    assert [e.window for e in examples] == [0, 1, 2] and len(windows) == 3
    counts = [int(record["action_mask"][w.start : w.end].sum()) for w in windows]
    assert [e.later_tokens for e in examples] == later_trainable_tokens(counts)
    for example, window in zip(examples, windows):
        assert example.input_ids == window.context.tolist() + record["response_token_ids"][window.start : window.end].tolist()
        assert example.prompt_length == len(window.context)
        assert example.action_mask.tolist() == record["action_mask"][window.start : window.end].tolist()
        assert example.advantage == 0.75 and example.trajectory == record["id"]
    # every action token of the record is trained exactly once, the copied tail in no example
    assert sum(int(e.action_mask.sum()) for e in examples) == int(record["action_mask"].sum())
    metrics, lines = segment_accounting(examples, 0.5)
    assert metrics["compaction/trajectories"] == 1 and metrics["compaction/compactions"] == 2
    assert metrics["compaction/segments"] == 3
    assert [line["compaction/factor"] for line in lines] == [0.5 ** n for n in later_trainable_tokens(counts)]
    assert segment_accounting(train_examples({**record, "segments": record["segments"][:3]}, 0.0), 0.5) == ({}, [])


def test_the_copied_tail_carries_no_gradient(tiny_checkpoint):
    """The gradient reaching the last hidden state at every position of a window's context (the
    pairs a rebuilt context copied among them) is exactly zero; at positions predicting the window's
    action tokens it is not."""
    tokenizer, _ = load_tokenizer(tiny_checkpoint)
    records = [compacted_record(i, windows=3) for i in range(2)]
    for i, record in enumerate(records):  # ids within the tiny model's vocabulary
        record.update(reward=float(i), group_id="g", prompt_token_ids=record["prompt_token_ids"] % 500,
                      response_token_ids=record["response_token_ids"] % 500)
        for segment in record["segments"]:
            if "context" in segment:
                segment["context"] = segment["context"] % 500
    examples = prepare_batch(records).examples
    assert len(examples) == 6
    model = load_model(tiny_checkpoint)
    captured = []

    def keep(_module, _args, kwargs, out):
        if out.last_hidden_state.requires_grad:
            out.last_hidden_state.retain_grad()
            captured.append((kwargs["input_ids"], out.last_hidden_state))

    model.model.register_forward_hook(keep, with_kwargs=True)
    config = GRPOConfig(lr=1e-3, micro_batch_size=len(examples), icepop=False, trust_mask=["icepop"])
    PolicyTrainer(model, config, pad_token_id=tokenizer.pad_token_id).train(examples)
    ((input_ids, hidden),) = captured
    trained = 0
    for example in examples:
        (row,) = [r for r in range(len(input_ids)) if input_ids[r, : len(example.input_ids)].tolist() == example.input_ids]
        grads = hidden.grad[row].abs().sum(-1)
        context = example.prompt_length - 1  # positions before it predict context tokens
        assert torch.all(grads[:context] == 0)
        predicts = torch.from_numpy(example.action_mask)
        assert torch.all(grads[context : context + len(predicts)][predicts] > 0)
        trained += int(predicts.sum())
    assert trained == sum(int(r["action_mask"].sum()) for r in records)


# --------------------------------------------------------------------------------------------
# rollouts with compaction


def _prompts(tmp_path: Path, count: int = 4) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{d}", "prompt": f"count {d}", "domain": "ticks", "task": {}}) + "\n"
                            for d in range(count)))
    return path


def _rollout(run, checkpoint, tmp_path: Path, *extra, name="ro"):
    out = tmp_path / name
    result = run("rollout", _prompts(tmp_path), "--checkpoint", checkpoint, "--out", out, "--env", "test_compaction:Ticks",
                 "--group-size", "2", "--max-new-tokens", "8", "--max-turns", "8", "--stop-token-ids", STOPS,
                 "--temperature", "0.8", "--context-budget", str(BUDGET), "--keep-last", "1", "--max-summary-tokens", "8",
                 *extra)
    assert result.exit_code == 0, result.stderr
    return out, [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]


@pytest.fixture(scope="module")
def compacted(tiny_checkpoint, tmp_path_factory):
    from conftest import run_glmpost

    tmp = tmp_path_factory.mktemp("compaction")
    return _rollout(run_glmpost, tiny_checkpoint, tmp, "--compaction", "summary")


def _builder(checkpoint, mode="summary"):
    tokenizer, _ = load_tokenizer(checkpoint)
    settings = CompactionSettings(mode, BUDGET, 8, 1, "Summarize what you must remember to finish the task.",
                                  "Summary: {summary}", 8)
    stops = [int(i) for i in STOPS.split(",")]
    return tokenizer, ContextBuilder(ChatFormat(tokenizer), settings, stops)


def _head(record, tokenizer):
    """(s): the prompt's ids before the reset observation."""
    prompt = record["prompt_token_ids"].tolist()
    return prompt[: prompt.index(tokenizer.convert_tokens_to_ids("<|observation|>"))]


def test_summaries_are_actions_and_each_rebuilt_context_is_recorded_as_ids(compacted, tiny_checkpoint):
    _, records = compacted
    tokenizer, builder = _builder(tiny_checkpoint)
    opener = builder.opener
    rebuilt = 0
    for record in records:
        segments, ids = record["segments"], record["response_token_ids"].tolist()
        info = record["extra"]["compaction"]
        summaries = [s for s in segments if s["kind"] == "summary"]
        assert info["mode"] == "summary" and info["budget"] == BUDGET and info["keep_last"] == 1
        assert len(info["summaries"]) == len(summaries)
        assert info["windows"] == 1 + sum("context" in s for s in segments)
        for index, segment in enumerate(segments):
            span = slice(segment["start"], segment["end"])
            if segment["kind"] == "summary":  # the policy's: trained like any action
                assert record["action_mask"][span].all() and np.isfinite(record["rollout_log_probs"][span]).all()
                assert (record["policy_versions"][span] == 0).all()
                request = segments[index - 1]
                assert request["kind"] == "observation" and request.get("role") == "summary_request"
                assert tokenizer.decode(ids[request["start"] : request["end"]]).endswith(
                    "<|user|>\nSummarize what you must remember to finish the task.<|assistant|>\n")
            if "context" not in segment:
                continue
            rebuilt += 1
            summary = segments[index - 1]
            assert summary["kind"] == "summary"  # a window opens right after the summary that made it
            request, action = segments[index - 2], segments[index - 3]
            body = builder.summary_body(ids[summary["start"] : summary["end"]])
            head = _head(record, tokenizer) + builder.resume_before + body + builder.resume_after
            context = segment["context"].tolist()
            assert context[: len(head)] == head
            # the kept pair: the action before the summary request, then its observation rendered
            # with the generation prompt (the request's observation part, then <|assistant|>\n)
            pair = context[len(head) :]
            last_action = ids[action["start"] : action["end"]]
            assert action["kind"] == "action" and pair[: len(last_action)] == last_action
            observation = pair[len(last_action) :]
            assert observation[-len(opener) :] == opener
            assert ids[request["start"] : request["start"] + len(observation) - len(opener)] == observation[: -len(opener)]
        assert info["peak_context"] == record["extra"]["env"]["peak_context"]
    assert rebuilt >= 4  # the budget forced compactions


def test_the_trainer_scores_every_action_and_summary_token_on_its_own_window_as_the_rollout_did(compacted, tiny_checkpoint, glmpost_cli, tmp_path):
    """Closure across compactions: the trainer's log-prob of every action and summary token, on its
    window's recorded context, equals the rollout's to float rounding (<= 1e-5); diff-logprobs (the
    same forward) agrees and resamples every token."""
    out, records = compacted
    tokenizer, _ = load_tokenizer(tiny_checkpoint)
    for index, record in enumerate(records):
        record["reward"] = float(index % 2)
    examples = prepare_batch(records).examples
    assert len(examples) > len(records)  # windows
    trainer = PolicyTrainer(load_model(tiny_checkpoint), GRPOConfig(micro_batch_size=4), pad_token_id=tokenizer.pad_token_id)
    old = trainer.old_policy(examples, list(range(len(examples))), ScoredDistribution(temperature=0.8))  # the rollout's
    worst, tokens = 0.0, 0
    for index, example in enumerate(examples):
        p = example.prompt_length
        mine = old.old_log_probs[index][p - 1 : p - 1 + len(example.action_mask)].double().numpy()
        acting = example.action_mask
        worst = max(worst, float(np.abs(mine[acting] - example.rollout_log_probs[acting]).max()))
        tokens += int(acting.sum())
    assert tokens == sum(int(r["action_mask"].sum()) for r in records)
    assert worst <= 1e-5, worst
    diff = glmpost_cli("diff-logprobs", out, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "diff", "--json", "--no-plots")
    assert diff.exit_code == 0, diff.stderr
    overall = json.loads(diff.stdout)["overall"]
    assert overall["tokens"] == tokens and overall["max_abs"] <= 1e-5 and overall["sample_agreement"] == 1.0


def test_score_teacher_scores_each_window_on_its_own_context(compacted, tiny_checkpoint, glmpost_cli, tmp_path):
    """The teacher prefills each window on the context the student saw: its log-prob of every action
    and summary token equals a forward over that window's context and tokens (<= 1e-5)."""
    from glmpost.formats import window_inputs
    from glmpost.kernel.logprobs import sequence_log_probs

    out, _ = compacted
    scored = glmpost_cli("score-teacher", out, "--teacher", tiny_checkpoint, "--out", tmp_path / "scored")
    assert scored.exit_code == 0, scored.stderr
    model = load_model(tiny_checkpoint)
    worst, windows = 0.0, 0
    for path in resolve_shard_paths([tmp_path / "scored"]):
        for record in ShardReader(path):
            actions = record["action_mask"]
            assert np.isfinite(record["teacher_log_probs"][actions]).all()
            for window in context_windows(record):
                ids, p = window_inputs(record, window)
                with torch.no_grad():
                    mine = sequence_log_probs(model, torch.tensor([ids])).log_probs[0, p - 1 :].double().numpy()
                acting = actions[window.start : window.end]
                teacher = record["teacher_log_probs"][window.start : window.end]
                worst = max(worst, float(np.abs(mine[acting] - teacher[acting]).max()))
                windows += 1
    assert windows > 8 and worst <= 1e-5, worst


def _metric_lines(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "v000001" / "metrics.jsonl").read_text().splitlines()]


def test_train_grpo_accounts_for_every_segment(compacted, tiny_checkpoint, glmpost_cli, tmp_path):
    out, records = compacted
    judged = judged_by_env(out, tmp_path / "judged", spread=0.25)
    trained = glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "policy",
                          "--segment-decay", "0.9", "--json")
    assert trained.exit_code == 0, trained.stderr
    summary = json.loads(trained.stdout)
    compacted_records = [r for r in records if r["extra"]["compaction"]["windows"] > 1]
    assert summary["trained_records"] == len(records)
    assert summary["compactions"] == sum(r["extra"]["compaction"]["windows"] - 1 for r in compacted_records)
    lines = _metric_lines(tmp_path / "policy")
    step, segments = lines[0], [line for line in lines if "compaction/window" in line]
    assert step["compaction/trajectories"] == len(compacted_records)
    assert len(segments) == step["compaction/segments"] == sum(r["extra"]["compaction"]["windows"] for r in compacted_records)
    for line in segments:
        assert line["compaction/factor"] == pytest.approx(0.9 ** line["compaction/later_tokens"])
    for record in compacted_records:
        mine = sorted((line for line in segments if line["compaction/trajectory"] == record["id"]),
                      key=lambda line: line["compaction/window"])
        assert sum(line["compaction/trainable_tokens"] for line in mine) == int(record["action_mask"].sum())
        assert mine[-1]["compaction/later_tokens"] == 0 and mine[0]["compaction/later_tokens"] > 0


def test_train_sao_runs_gae_per_window_and_scales_it_across_windows(compacted, tiny_checkpoint, glmpost_cli, tmp_path):
    out, records = compacted
    judged = judged_by_env(out, tmp_path / "judged", spread=0.25)
    trained = glmpost_cli("train-sao", judged, "--checkpoint", tiny_checkpoint, "--critic", tmp_path / "critic",
                          "--init-critic", "--out", tmp_path / "policy", "--gamma", "0.9", "--lambda", "0.95", "--json")
    assert trained.exit_code == 0, trained.stderr
    assert json.loads(trained.stdout)["trained_records"] == len(records)
    segments = [line for line in _metric_lines(tmp_path / "policy") if "compaction/window" in line]
    assert segments and all(line["compaction/factor"] == pytest.approx(0.855 ** line["compaction/later_tokens"])
                            for line in segments)
    assert min(line["compaction/factor"] for line in segments) < 1.0


def test_drop_rebuilds_without_a_summary_and_off_truncates_at_the_budget(tiny_checkpoint, glmpost_cli, tmp_path):
    _, dropped = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "--compaction", "drop", name="drop")
    tokenizer, builder = _builder(tiny_checkpoint, "drop")
    windows = 0
    for record in dropped:
        assert all(s["kind"] != "summary" and "role" not in s for s in record["segments"])
        assert record["extra"]["compaction"]["mode"] == "drop" and record["extra"]["compaction"]["summaries"] == []
        for index, segment in enumerate(record["segments"]):
            if "context" in segment:
                windows += 1
                head = _head(record, tokenizer) + builder.opener
                action = record["segments"][index - 1]  # its observation lives in the context only
                last = record["response_token_ids"][action["start"] : action["end"]].tolist()
                assert segment["context"].tolist()[: len(head) + len(last)] == head + last
    assert windows >= 4
    _, kept = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, name="off")
    assert all("compaction" not in r["extra"] for r in kept)
    assert all(r["extra"]["env"]["peak_context"] <= BUDGET for r in kept)
    overflowed = [r for r in kept if r["status"] == "truncated" and "overflow the context of 80" in r["extra"].get("status_reason", "")]
    assert overflowed  # without compaction the budget ends trajectories that compaction carried on


def test_a_summary_cut_at_its_budget_is_recorded_and_the_trajectory_goes_on(tiny_checkpoint, glmpost_cli, tmp_path):
    _, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "--compaction", "summary", "--max-summary-tokens", "1",
                          name="cut")
    cut = [s for r in records for s in r["extra"]["compaction"]["summaries"] if s["truncated"]]
    assert cut and all(s["tokens"] == 1 for s in cut)
    went_on = [r for r in records if r["extra"]["compaction"]["windows"] > 1]
    assert went_on and all(r["status"] in ("completed", "truncated") for r in records)


def test_pairs_that_do_not_fit_the_budget_are_dropped_oldest_first_and_recorded(tiny_checkpoint, glmpost_cli, tmp_path):
    """--keep-last 6 under a budget of 80: a rebuilt context copies only the newest pairs that leave
    the next turn its room (the threshold, 8), and extra.compaction.kept_pairs says how many."""
    _, records = _rollout(glmpost_cli, tiny_checkpoint, tmp_path, "--compaction", "summary", "--keep-last", "6",
                          "--compaction-threshold", "8", name="keep6")
    kept = [n for r in records for n in r["extra"]["compaction"]["kept_pairs"]]
    assert kept and 2 <= max(kept) < 6  # more than one pair when they fit, never the six asked for
    for record in records:
        for segment in record["segments"]:
            if "context" in segment:
                assert BUDGET - len(segment["context"]) >= 8


@pytest.mark.parametrize("options, message", [
    (("--compaction", "summary", "--compaction-threshold", "100"),
     "--compaction-threshold 100 is larger than --context-budget 80"),
    (("--compaction", "summary", "--context-budget", "9999"), "--context-budget 9999 exceeds the model's context of 512"),
    (("--compaction", "summary", "--resume-template", "no slot"), "--resume-template must contain {summary} exactly once"),
    (("--compaction", "sometimes"), "--compaction must be one of off, summary, drop"),
    (("--compaction", "summary", "--context-budget", "40"), "more than --context-budget 40"),
])
def test_bad_compaction_settings_are_one_line_errors(tiny_checkpoint, glmpost_cli, tmp_path, options, message):
    out = tmp_path / "out"
    result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", out,
                         "--env", "test_compaction:Ticks", "--max-new-tokens", "8", "--context-budget", "80", *options)
    assert result.exit_code in (1, 2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not list(out.glob("*.msgpack.zst"))


def test_compaction_needs_a_multi_turn_rollout(tiny_checkpoint, glmpost_cli, tmp_path):
    result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out",
                         "--compaction", "summary")
    assert result.exit_code == 2
    assert "--compaction and --context-budget apply to multi-turn rollouts: add --env" in result.stderr
