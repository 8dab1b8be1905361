"""MoE routing closure (issue 33): one deterministic router top-k, recording, ``diff-logprobs --routing``
and routing replay (R3) on tiny GLM-5 (``GlmMoeDsaForCausalLM``) and Qwen3-MoE / GLM-4.5 / DeepSeek-V3."""

from __future__ import annotations

import base64
import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_glmpost
from safetensors.torch import load_file, save_file
from test_agentic import STOPS, _prompts
from test_plan_architectures import _model
from transformers import AutoConfig, AutoModelForCausalLM

from glmpost.diff.routing_probe import kth_margin, path_routing
from glmpost.errors import GlmpostError
from glmpost.formats import ShardReader, ShardWriter, resolve_shard_paths
from glmpost.kernel.engine import LocalEngine, SamplingParams
from glmpost.kernel.loading import load_model
from glmpost.kernel.logprobs import sequence_log_probs
from glmpost.kernel.routing import (
    RoutingLayout,
    RoutingSession,
    all_layer_rows,
    compact_ids,
    config_routing_layout,
    gate_weights,
    group_limited_choice,
    install_routing,
    moe_layer_indices,
    prompt_routing,
    routed_from_sglang,
    routers,
    routing_dtype,
    routing_session,
    select_moe_rows,
)
from glmpost.models.tiny import TINY_GLM5
from glmpost.rl.batches import train_example
from glmpost.rl.micro_batches import collate
from glmpost.rl.routing_replay import attach_routing, replay_context, replay_session
from glmpost.rollout.records import RolloutPrompt, rollout_record

ARCHITECTURES = ("qwen3_moe", "glm4_moe", "deepseek_v3")


def _glm5():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("glm_moe_dsa", **TINY_GLM5))


def test_gate_weights_group_limit_and_margin_hand_computed():
    scores = torch.tensor([[0.9, 0.6, 0.3, 0.2]])
    ids = torch.tensor([[2, 0]])
    # sigmoid family: w = s[ids] / (sum + 1e-20) * scale; a replayed set gets the same formula.
    assert torch.allclose(gate_weights(scores, ids, family="sigmoid", norm_topk_prob=True, scaling=2.5),
                          torch.tensor([[0.3 / 1.2 * 2.5, 0.9 / 1.2 * 2.5]]))
    assert torch.allclose(gate_weights(scores, ids, family="sigmoid", norm_topk_prob=False, scaling=2.0),
                          torch.tensor([[0.6, 1.8]]))
    assert torch.allclose(gate_weights(scores, ids, family="softmax", norm_topk_prob=True), torch.tensor([[0.25, 0.75]]))
    # Two groups of two: group scores 0.9+0.6 = 1.5 and 0.3+0.2 = 0.5; topk_group 1 keeps group 0.
    kept = group_limited_choice(scores, 2, 1)
    assert kept[0, :2].tolist() == pytest.approx([0.9, 0.6]) and torch.isinf(kept[0, 2:]).all()
    # Tied groups (1.0 each): the lower group index wins.
    tied = group_limited_choice(torch.tensor([[0.5, 0.5, 0.7, 0.3]]), 2, 1)
    assert torch.isfinite(tied[0, :2]).all() and torch.isinf(tied[0, 2:]).all()
    # k-th margin: sorted 0.9, 0.6, 0.3, 0.2 -> k=2: 0.6 - 0.3.
    assert kth_margin(scores, 2).item() == pytest.approx(0.3)
    assert kth_margin(scores, 4).item() == float("inf")


@pytest.mark.parametrize("name", (*ARCHITECTURES, "glm_moe_dsa"))
def test_patched_routers_compute_the_transformers_forward_bit_for_bit(name):
    """Replay off and no ties: the deterministic rule changes nothing (today's results unchanged)."""
    model = (_glm5() if name == "glm_moe_dsa" else _model(name)).eval()
    ids = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert install_routing(model) == len(routers(model)) > 0
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("name", ("qwen3_moe", "glm4_moe"))
def test_router_ties_go_to_the_lower_expert_id(name):
    model = _model(name).eval()
    install_routing(model)
    router = routers(model)[0][1]
    with torch.no_grad():
        router.weight.zero_()  # every expert scores the same
        session = RoutingSession()
        with routing_session(model, session):
            model(input_ids=torch.tensor([[1, 2, 3]]))
    assert session.chosen[0].sort(dim=-1).values.tolist() == [[0, 1]] * 3


def _expert_inputs(model):
    """The hidden states each MoE layer's router sees, captured by forward hooks."""
    seen, hooks = {}, []
    for layer, (_, router) in enumerate(routers(model)):
        hooks.append(router.register_forward_hook(lambda m, args, out, layer=layer: seen.__setitem__(layer, args[0].reshape(-1, args[0].shape[-1]))))
    return seen, hooks


@pytest.mark.parametrize("name", ("qwen3_moe", "glm_moe_dsa"))
def test_engine_records_the_experts_of_each_sampled_token(name):
    """fp32 engine (incremental, left padded) vs the trainer's full forward (right padded): the same experts."""
    model = (_glm5() if name == "glm_moe_dsa" else _model(name)).eval()
    install_routing(model)
    engine = LocalEngine(model, batch_size=4, record_routing=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    completions = engine.generate(prompts, ["a", "b", "c"], SamplingParams(max_new_tokens=6))
    layers = len(routers(model))
    for prompt, completion in zip(prompts, completions):
        routed = completion.routed_experts
        assert routed.dtype == np.uint8 and routed.shape == (len(completion.token_ids), layers, 2)
        session = RoutingSession()
        with torch.no_grad(), routing_session(model, session):
            model(input_ids=torch.tensor([prompt + completion.token_ids]))
        own = session.experts()[len(prompt) - 1 : len(prompt) - 1 + len(completion.token_ids)]
        assert (own.sort(-1).values.numpy() == np.sort(routed, -1)).all()


def _records(model, prompts, *, max_new_tokens=8):
    engine = LocalEngine(model, batch_size=8, record_routing=True)
    params = SamplingParams(max_new_tokens=max_new_tokens, seed=3)
    completions = engine.generate(prompts, [str(i) for i in range(len(prompts))], params)
    return [rollout_record(RolloutPrompt(f"p{i}", p), c, sample_index=0, params=params, policy_version=0,
                           tokenizer_revision="t", engine={"engine": "glmpost-local"})
            for i, (p, c) in enumerate(zip(prompts, completions))]


def _replayed_forward(model, records, *, replay: bool):
    """The trainer's forward of ``records`` (one micro-batch, right padded) with or without replay:
    per-record log-probs of the response, and the experts the experts module actually used."""
    examples = [train_example(r, 0.0) for r in records]
    attach_routing(examples, records)
    batch = collate(examples, pad_token_id=0, device=torch.device("cpu"))
    used = {}
    experts = [m for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_hook(lambda m, args, out, i=i: used.__setitem__(i, args[1])) for i, e in enumerate(experts)]
    try:
        with torch.no_grad(), replay_context(model, batch, replay):
            scored = sequence_log_probs(model, batch.input_ids, batch.attention_mask).log_probs
    finally:
        for hook in hooks:
            hook.remove()
    width = batch.input_ids.shape[1]
    out = []
    for row, r in enumerate(records):
        at, n = len(r["prompt_token_ids"]) - 1, len(r["response_token_ids"])
        ids = torch.stack([used[i].view(len(records), width, -1)[row, at : at + n] for i in sorted(used)], dim=1)
        out.append((scored[row, at : at + n].double().numpy(), ids.numpy()))
    return out


@pytest.mark.parametrize("name", ("qwen3_moe", "glm_moe_dsa"))
def test_bf16_rollout_fp32_trainer_routing_differs_and_replay_closes_it(name):
    """A bf16 engine's records scored by an fp32 trainer: some tokens route differently; with replay
    the trainer's experts equal the record's on every recorded token, and the log-prob delta of
    the tokens that routed differently drops."""
    fp32 = (_glm5() if name == "glm_moe_dsa" else _model(name)).eval()
    install_routing(fp32)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 512, (int(n),), generator=generator).tolist() for n in torch.randint(3, 9, (24,), generator=generator)]
    records = _records(bf16, prompts, max_new_tokens=12)
    free = _replayed_forward(fp32, records, replay=False)
    replayed = _replayed_forward(fp32, records, replay=True)
    differs, delta_free, delta_replayed = [], [], []
    for r, (lp_free, ids_free), (lp_replayed, ids_replayed) in zip(records, free, replayed):
        routed = r["routed_experts"].astype(np.int64)
        assert (np.sort(ids_replayed, -1) == np.sort(routed, -1)).all()  # replay: the record's experts, every token
        differs.append((np.sort(ids_free, -1) != np.sort(routed, -1)).any(axis=(1, 2)))
        delta_free.append(np.abs(lp_free - r["rollout_log_probs"]))
        delta_replayed.append(np.abs(lp_replayed - r["rollout_log_probs"]))
    differs, delta_free, delta_replayed = map(np.concatenate, (differs, delta_free, delta_replayed))
    assert 0 < differs.mean() < 0.5, differs.mean()
    # Where routing differed, replay removes the routing part of the delta (bf16 rounding remains).
    assert delta_replayed[differs].mean() < 0.8 * delta_free[differs].mean(), (delta_replayed[differs].mean(), delta_free[differs].mean())


def _perturbed_bias_checkpoint(checkpoint, path, *, shift=0.02):
    """``checkpoint`` with every router's ``e_score_correction_bias`` shifted: a trainer whose
    aux-free balancing bias moved since the rollout (routing differs only where the margin is small)."""
    shutil.copytree(checkpoint, path)
    weights = path / "model.safetensors"
    state = load_file(weights)
    names = [n for n in state if n.endswith("e_score_correction_bias")]
    assert names
    for n in names:
        state[n] = state[n] + shift * torch.arange(state[n].numel(), dtype=state[n].dtype)
    save_file(state, weights, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def routed_shards(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d} {d}"}) + "\n" for d in range(6)))
    result = run_glmpost("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp / "rollout", "--group-size", "2",
                         "--max-new-tokens", "12", "--stop-token-ids", "none", "--record-routing")
    assert result.exit_code == 0, result.stderr
    return tmp / "rollout"


def test_diff_logprobs_routing_reports_differences_verified_by_hand(glmpost_cli, routed_shards, tiny_checkpoint, tmp_path):
    shifted = _perturbed_bias_checkpoint(tiny_checkpoint, tmp_path / "shifted")
    same = glmpost_cli("diff-logprobs", routed_shards, "--checkpoint", tiny_checkpoint, "--routing", "--out", tmp_path / "same",
                       "--no-plots")
    assert same.exit_code == 0, same.stderr
    assert json.loads((tmp_path / "same" / "report.json").read_text())["routing"]["overall"]["differing_tokens"] == 0.0
    out = glmpost_cli("diff-logprobs", routed_shards, "--checkpoint", shifted, "--routing", "--out", tmp_path / "d", "--no-plots")
    assert out.exit_code == 0, out.stderr
    assert "routing: 144 tokens x 1 MoE layers, experts differ on " in out.stdout
    report = json.loads((tmp_path / "d" / "report.json").read_text())["routing"]
    overall = report["overall"]
    assert 0 < overall["differing_tokens"] < 1 and overall["tokens"] == 6 * 2 * 12
    assert overall["delta_differing"]["tokens"] == round(overall["differing_tokens"] * overall["tokens"])
    # By hand: the shifted router's choice (sigmoid(W h) + bias, top 2, ties to the lower id) at
    # each token's producing position, against the record.
    model = load_model(shifted)
    router = routers(model)[0][1]
    records = [r for path in resolve_shard_paths([routed_shards]) for r in ShardReader(path)]
    seen, hooks = _expert_inputs(model)
    differing = 0
    for r in records:
        ids = np.concatenate([r["prompt_token_ids"], r["response_token_ids"]]).astype(np.int64)
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids)[None])
        h = seen[0]
        choice = torch.sigmoid(h.float() @ router.weight.float().T) + router.e_score_correction_bias
        at = len(r["prompt_token_ids"]) - 1
        for t in range(len(r["response_token_ids"])):
            mine = sorted(torch.sort(choice[at + t], descending=True, stable=True).indices[:2].tolist())
            differing += mine != sorted(r["routed_experts"][t, 0].tolist())
    for hook in hooks:
        hook.remove()
    assert differing == round(overall["differing_tokens"] * overall["tokens"]) > 0
    assert overall["margin_where_differing"]["max"] < 0.02 * 3  # the shift decided only close calls
    replay = glmpost_cli("diff-logprobs", routed_shards, "--checkpoint", shifted, "--routing", "--routing-replay",
                         "--out", tmp_path / "r", "--no-plots")
    assert replay.exit_code == 0, replay.stderr
    replayed = json.loads((tmp_path / "r" / "report.json").read_text())["routing"]["overall"]
    # The shift moves only the choice (gate weights use sigmoid scores without the bias), and GLM-5's
    # one MoE layer is the last: replay leaves the incremental-vs-full-forward rounding only.
    assert replayed["delta_differing"]["max_abs"] < 1e-4 < overall["delta_differing"]["max_abs"]


def test_routing_replay_trains_and_refuses_records_without_routing(glmpost_cli, routed_shards, tiny_checkpoint, tmp_path):
    judged = tmp_path / "judged"
    plain = tmp_path / "plain"
    judged.mkdir()
    plain.mkdir()
    for path in resolve_shard_paths([routed_shards]):
        reader = ShardReader(path)
        records = list(reader)
        for out, strip in ((judged, False), (plain, True)):
            with ShardWriter(out / path.name, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as writer:
                for i, r in enumerate(records):
                    reward = float(i % 2) + float(np.mean(r["response_token_ids"] % 2))
                    kept = {k: v for k, v in r.items() if not (strip and k == "routed_experts")}
                    writer.write({**kept, "reward": reward, "rewards": {"correct": reward}, "reward_info": {}})
    common = ["--checkpoint", str(tiny_checkpoint), "--lr", "1e-3", "--mini-batches", "2", "--json"]
    refused = glmpost_cli("train-grpo", plain, *common, "--out", tmp_path / "x", "--routing-replay")
    assert refused.exit_code == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "record 'q" in refused.stderr and "has no routed_experts" in refused.stderr
    # Replay off: a record with routing trains exactly as one without.
    for name, data in (("with", judged), ("without", plain)):
        assert glmpost_cli("train-grpo", data, *common, "--out", tmp_path / name).exit_code == 0
    a, b = (load_file(tmp_path / n / "v000001" / "model.safetensors") for n in ("with", "without"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    replayed = glmpost_cli("train-grpo", judged, *common, "--out", tmp_path / "replayed", "--routing-replay")
    assert replayed.exit_code == 0, replayed.stderr
    metrics = [json.loads(line) for line in (tmp_path / "replayed" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "routing/replayed_fraction" in m]
    assert steps and steps[0]["routing/replayed_fraction"] == 1.0 and steps[0]["routing/would_differ_fraction"] == 0.0
    # A trainer whose router bias moved since the rollout: without replay its old log-probs (what
    # IcePop compares) are off where routing differs; with replay they are the rollout's again.
    shifted = _perturbed_bias_checkpoint(tiny_checkpoint, tmp_path / "shifted")
    moved = ["--checkpoint", str(shifted), "--lr", "1e-3", "--json"]
    first = {}
    for name, extra in (("free", []), ("replay", ["--routing-replay"])):
        assert glmpost_cli("train-grpo", judged, *moved, "--out", tmp_path / f"moved-{name}", *extra).exit_code == 0
        first[name] = json.loads((tmp_path / f"moved-{name}" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < first["replay"]["routing/would_differ_fraction"] < 1
    assert first["replay"]["train/mismatch_abs_logp_mean"] < 1e-6 < first["free"]["train/mismatch_abs_logp_mean"]


def test_record_dtype_and_order():
    assert routing_dtype(4, 2) == routing_dtype(256, 8) == np.uint8  # 255 is an id; a row of 8 x 255 is not
    assert routing_dtype(256, 1) == routing_dtype(257, 2) == np.uint16
    assert compact_ids(torch.tensor([[[3, 1]], [[-1, -1]]]), 4).tolist() == [[[1, 3]], [[255, 255]]]


def test_wide_routing_replays_through_the_int16_view():
    """uint16 experts (>= 255 routed experts) ride in micro-batches as int16 bits and come back exact."""
    record = {"id": "r", "prompt_token_ids": np.array([1, 2], dtype=np.int32), "response_token_ids": np.array([3, 4, 5], dtype=np.int32),
              "action_mask": np.ones(3, dtype=bool), "observation_mask": np.zeros(3, dtype=bool),
              "rollout_log_probs": np.zeros(3, dtype=np.float32), "group_id": "g",
              "routed_experts": np.array([[[300, 40000]], [[65535, 65535]], [[7, 255]]], dtype=np.uint16)}
    example = train_example(record, 0.0)
    attach_routing([example], [record])
    session = replay_session(collate([example], pad_token_id=0, device=torch.device("cpu")))
    # Input positions 0..4; token j's experts at position 1 + j; the unrecorded row and the rest free.
    assert session.replay.tolist() == [False, True, False, True, False]
    assert session.forced[1, 0].tolist() == [300, 40000] and session.forced[3, 0].tolist() == [7, 255]


def test_plan_counts_the_routing_field(glmpost_cli, tmp_path):
    recipe = (Path(__file__).parent.parent / "recipes" / "tiny-reasoning-rl.toml").read_text()
    (tmp_path / "r.toml").write_text(recipe.replace("[rollout]\n", "[rollout]\nrecord_routing = true\n", 1))
    glm5 = json.loads(glmpost_cli("plan", tmp_path / "r.toml", "--model", "glm5", "--json").stdout)["roles"]["routed_experts"]
    assert glm5["used"] and glm5["details"]["bytes_per_token"] == 75 * 8 * 1  # 78 layers, 3 dense; 8 of 256: uint8
    tiny = json.loads(glmpost_cli("plan", tmp_path / "r.toml", "--json").stdout)["roles"]["routed_experts"]
    assert tiny["details"]["bytes_per_token"] == 1 * 2 * 1  # one MoE layer, 2 of 4 experts: uint8
    off = json.loads(glmpost_cli("plan", Path(__file__).parent.parent / "recipes" / "tiny-reasoning-rl.toml", "--json").stdout)
    assert not off["roles"]["routed_experts"]["used"]


def _judge(src, dst, *, strip=False):
    dst.mkdir()
    for path in resolve_shard_paths([src]):
        reader = ShardReader(path)
        with ShardWriter(dst / path.name, stage="judge", tokenizer_revision=reader.header["tokenizer_revision"]) as writer:
            for i, r in enumerate(reader):
                reward = float(i % 2) + float(np.mean(r["response_token_ids"] % 2))
                kept = {k: v for k, v in r.items() if not (strip and k == "routed_experts")}
                writer.write({**kept, "reward": reward, "rewards": {"correct": reward}, "reward_info": {}})
    return dst


def test_opd_merge_and_train_sao_replay_and_refuse(glmpost_cli, routed_shards, tiny_checkpoint, tmp_path):
    judged, plain = _judge(routed_shards, tmp_path / "judged"), _judge(routed_shards, tmp_path / "plain", strip=True)
    for name, data in (("scored", judged), ("scored-plain", plain)):
        result = glmpost_cli("score-teacher", data, "--out", tmp_path / name, "--teacher", tiny_checkpoint)
        assert result.exit_code == 0, result.stderr
    runs = {"opd-merge": lambda data, out: ("opd-merge", data, "--checkpoint", tiny_checkpoint, "--out", out),
            "train-sao": lambda data, out: ("train-sao", data, "--checkpoint", tiny_checkpoint, "--critic", tmp_path / f"{out.name}-critic",
                                            "--init-critic", "--out", out)}
    inputs = {"opd-merge": (tmp_path / "scored", tmp_path / "scored-plain"), "train-sao": (judged, plain)}
    for stage, args in runs.items():
        with_routing, without = inputs[stage]
        refused = glmpost_cli(*args(without, tmp_path / f"{stage}-x"), "--routing-replay")
        assert refused.exit_code == 1 and "has no routed_experts" in refused.stderr, (stage, refused.stderr)
        assert len(refused.stderr.strip().splitlines()) == 1
        done = glmpost_cli(*args(with_routing, tmp_path / stage), "--routing-replay")
        assert done.exit_code == 0, (stage, done.stderr)
        lines = [json.loads(line) for line in (tmp_path / stage / "metrics.jsonl").read_text().splitlines()]
        replayed = [m for m in lines if "routing/replayed_fraction" in m]
        assert replayed and replayed[0]["routing/replayed_fraction"] == 1.0, stage


def test_multi_turn_records_route_actions_and_leave_observations_unrecorded(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "ro"
    result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", out, "--env", "test_agentic:Countdown",
                         "--group-size", "2", "--max-new-tokens", "16", "--max-turns", "4", "--stop-token-ids", STOPS,
                         "--temperature", "0.8", "--record-routing")
    assert result.exit_code == 0, result.stderr
    records = [r for p in resolve_shard_paths([out]) for r in ShardReader(p)]
    assert any(r["observation_mask"].any() for r in records)
    model = load_model(tiny_checkpoint)
    for r in records:
        routed = r["routed_experts"]
        assert (routed[r["observation_mask"]] == 255).all() and (routed[r["action_mask"]] != 255).all()
        session = RoutingSession()
        ids = np.concatenate([r["prompt_token_ids"], r["response_token_ids"]]).astype(np.int64)
        with torch.no_grad(), routing_session(model, session):
            model(input_ids=torch.from_numpy(ids)[None])
        at = len(r["prompt_token_ids"]) - 1
        own = session.experts()[at : at + len(routed)].sort(-1).values.numpy()
        actions = r["action_mask"]
        # The engine decoded each turn on its KV cache; the trainer runs the whole sequence at once.
        assert (own[actions] == routed[actions]).all()


def test_refusals_are_one_line(glmpost_cli, tiny_checkpoint, routed_shards, tmp_path):
    # (--engine vllm --record-routing is taken since issue 42: tests/test_vllm.py checks its refusals.)
    plain = _judge(routed_shards, tmp_path / "plain", strip=True)
    diff = glmpost_cli("diff-logprobs", plain, "--checkpoint", tiny_checkpoint, "--routing", "--out", tmp_path / "d")
    assert diff.exit_code == 1 and len(diff.stderr.strip().splitlines()) == 1
    assert "record 'q" in diff.stderr and "has no routed_experts (rollout --record-routing records them)" in diff.stderr
    gate = glmpost_cli("diff-logprobs", routed_shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "g",
                       "--fail-above", "routing_differing_tokens=0")
    assert gate.exit_code == 2 and "add --routing" in gate.stderr


def test_routing_of_another_shape_is_refused(tmp_path):
    model = _model("qwen3_moe").eval()  # 2 MoE layers, 2 experts per token
    records = _records(model, [[5, 6, 7]], max_new_tokens=3)
    records[0]["routed_experts"] = records[0]["routed_experts"][:, :1]
    with pytest.raises(GlmpostError, match="the records route 2 experts in 1 MoE layers; Qwen3MoeForCausalLM routes 2 in 2"):
        path_routing(model, records, batch_size=1, replay=True, where="diff-logprobs")
    examples = [train_example(records[0], 0.0)]
    attach_routing(examples, records)
    batch = collate(examples, pad_token_id=0, device=torch.device("cpu"))
    with pytest.raises(GlmpostError, match="--routing-replay: the records route"):
        replay_context(model, batch, True)
    with pytest.raises(GlmpostError, match="has no MoE router"):
        path_routing(_model("qwen3").eval(), records, batch_size=1, replay=False, where="diff-logprobs")


# ------------------------------------------------------------------ server payloads of all hidden layers (issue 42)

def test_moe_layer_indices_hand_computed():
    # first_k_dense_replace (GLM-4.5/4.7, DeepSeek-V3): MoE from layer 2 on; moe_layer_freq 2: every other one.
    assert moe_layer_indices({"num_hidden_layers": 5, "n_routed_experts": 8, "first_k_dense_replace": 2}) == (2, 3, 4)
    assert moe_layer_indices({"num_hidden_layers": 6, "n_routed_experts": 8, "first_k_dense_replace": 1,
                              "moe_layer_freq": 2}) == (2, 4)
    # Qwen3-MoE: (i + 1) % 2 == 0 -> 1, 3, 5; mlp_only_layers takes 3 out.
    assert moe_layer_indices({"num_hidden_layers": 6, "num_experts": 4, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3]}) == (1, 5)
    assert moe_layer_indices({"num_hidden_layers": 3, "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": []}) == (0, 1, 2)
    # mlp_layer_types wins over first_k_dense_replace (GLM-5 has both, consistent).
    assert moe_layer_indices({"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 3,
                              "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}) == (1, 3)
    assert moe_layer_indices({"num_hidden_layers": 3, "num_local_experts": 8}) == (0, 1, 2)  # Mixtral: every layer
    assert moe_layer_indices({"num_hidden_layers": 3}) is None  # dense
    assert moe_layer_indices({"num_hidden_layers": 3, "num_experts": 0, "decoder_sparse_step": 1}) is None
    # GLM-5 at full depth: 78 layers, the first 3 dense (transformers fills mlp_layer_types from first_k_dense_replace).
    glm5 = AutoConfig.for_model("glm_moe_dsa", **{**TINY_GLM5, "num_hidden_layers": 78, "first_k_dense_replace": 3})
    assert moe_layer_indices(glm5) == tuple(range(3, 78))


@pytest.mark.parametrize("name", (*ARCHITECTURES, "glm_moe_dsa"))
def test_moe_layer_indices_are_the_models_router_layers(name):
    model = _glm5() if name == "glm_moe_dsa" else _model(name)
    from_names = tuple(int(n.split("layers.")[1].split(".")[0]) for n, _ in routers(model))
    assert moe_layer_indices(model.config) == from_names == ((0, 1) if name == "qwen3_moe" else (1,))
    layout = config_routing_layout(model.config)
    assert layout == RoutingLayout(hidden_layers=2, moe_layers=from_names, k=2, experts=4)


def _b64(rows) -> str:
    return base64.b64encode(np.asarray(rows, dtype=np.int32).tobytes()).decode()


def test_routed_from_sglang_selects_the_moe_layers_of_an_all_layer_payload():
    """SGLang / vLLM: ``[prompt + output - 1, num_hidden_layers, k]``, dense layers' rows 0."""
    layout = RoutingLayout(hidden_layers=3, moe_layers=(1, 2), k=2, experts=8)
    # 4 positions (prompt 3 + output 2 - 1) x 3 layers x 2; layer 0 is dense.
    rows = [[[0, 0], [5, 1], [7, 2]],
            [[0, 0], [3, 4], [6, 0]],
            [[0, 0], [2, 7], [1, 5]],
            [[0, 0], [4, 0], [3, 6]]]
    got = routed_from_sglang(_b64(rows), prompt_tokens=3, tokens=2, shape=layout)  # positions 2 and 3
    assert got.tolist() == [[[2, 7], [1, 5]], [[0, 4], [3, 6]]] and got.dtype == np.uint8  # each set sorted
    # The MoE-only width (older servers) reads the same.
    moe_only = [[r[1], r[2]] for r in rows]
    assert routed_from_sglang(_b64(moe_only), prompt_tokens=3, tokens=2, shape=layout).tolist() == got.tolist()
    # Any other width is refused in one line; so are experts in a layer the config calls dense.
    with pytest.raises(ValueError, match=r"^routed_experts holds 8 ids, not 4 positions x 2 MoE layers x 2 nor x 3 "
                                         r"hidden layers x 2$"):
        routed_from_sglang(_b64([r[:1] for r in rows]), prompt_tokens=3, tokens=2, shape=layout)
    wrong = copy.deepcopy(rows)
    wrong[1][0] = [1, 2]
    with pytest.raises(ValueError, match=r"experts in layer 0, dense in the model config \(MoE layers \[1, 2\]\)"):
        routed_from_sglang(_b64(wrong), prompt_tokens=3, tokens=2, shape=layout)
    with pytest.raises(ValueError, match="not base64"):
        routed_from_sglang("%%%", prompt_tokens=3, tokens=2, shape=layout)
    # all_layer_rows is select_moe_rows' inverse.
    back = all_layer_rows(np.asarray(moe_only), layout)
    assert back.dtype == np.int32 and back.tolist() == rows
    assert select_moe_rows(back, layout).tolist() == moe_only


def test_routed_from_sglang_reads_glm45_and_deepseek_v3_payloads_as_the_local_engine_records():
    """A GLM-4.5- and a DeepSeek-V3-shaped payload built from the models' own routing (2 hidden
    layers, layer 0 dense: what SGLang's capturer returns) gives the local engine's record."""
    for name in ("glm4_moe", "deepseek_v3"):
        model = _model(name).eval()
        layout = config_routing_layout(model.config)
        prompt = [5, 6, 7, 8]
        record = _records(model, [prompt], max_new_tokens=4)[0]
        tokens = record["response_token_ids"].tolist()
        full = prompt_routing(model, prompt + tokens)  # [P + n - 1, 1, 2]: each position's own choice
        payload = all_layer_rows(full, layout)
        assert payload.shape == (len(prompt) + len(tokens) - 1, 2, 2) and not payload[:, 0].any()
        got = routed_from_sglang(_b64(payload), prompt_tokens=len(prompt), tokens=len(tokens), shape=layout)
        assert got.dtype == record["routed_experts"].dtype and np.array_equal(got, record["routed_experts"]), name


def test_the_pre_flight_check_decodes_and_shape_checks_one_real_answer():
    """check_routing_returned sends one 1-token request and reads its payload as every answer is
    read: a payload of another model's shape is refused up front, in one line."""
    from glmpost.config import ConfigError
    from glmpost.rollout.servers import check_routing_returned

    layout = RoutingLayout(hidden_layers=3, moe_layers=(1, 2), k=2, experts=8)

    class Server:
        url, engine = "http://x", "sglang"

        def __init__(self, rows):
            self.rows, self.asked = rows, []

        def generate(self, ids, sampling, **fields):
            self.asked.append((ids, sampling, fields))
            return {"output_ids": [9], "meta_info": {"prompt_tokens": len(ids), "routed_experts": _b64(self.rows)}}

    good = Server(np.zeros((2, 3, 2)) + np.array([0, 1, 1])[None, :, None])  # 2 + 1 - 1 positions
    check_routing_returned(good, [5, 6], layout)
    assert good.asked == [([5, 6], {"max_new_tokens": 1}, {"return_logprob": True, "return_routed_experts": True})]
    for rows, words in ((np.ones((2, 4, 2)), "not 2 positions x 2 MoE layers x 2 nor x 3 hidden layers x 2"),
                        (np.ones((2, 3, 2)), "experts in layer 0, dense in the model config")):
        with pytest.raises(ConfigError) as caught:
            check_routing_returned(Server(rows), [5, 6], layout)
        message = str(caught.value)
        assert len(message.splitlines()) == 1 and "http://x returns routed experts the checkpoint's model cannot have" in message
        assert words in message


def _moe_checkpoint(name: str, tiny_checkpoint: Path, out: Path) -> Path:
    """A checkpoint of the tiny ``name`` model (GLM-4.5 / DeepSeek-V3 shaped: 2 hidden layers,
    layer 0 dense) with the tiny GLM-5's tokenizer, generation config and manifest."""
    _model(name).eval().save_pretrained(out)
    for path in tiny_checkpoint.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors", "metrics.jsonl", "stage.json"):
            shutil.copy2(path, out / path.name)
    return out


def _shard_records(out: Path) -> list[dict]:
    return [r for path in resolve_shard_paths([out]) for r in ShardReader(path)]


def test_glm45_rollout_through_sglang_records_the_experts_the_local_engine_records(glmpost_cli, tiny_checkpoint, tmp_path):
    """--record-routing through serve's SGLang API on a GLM-4.5-shaped model: the server answers
    every hidden layer (the dense layer 0's rows 0) as SGLang does, and the records hold the MoE
    layer's experts, the local engine's token for token."""
    from serve_process import start_server, stop_server
    from test_serve import _prompts as serve_prompts

    from glmpost.kernel.sglang_client import SGLangClient

    checkpoint = _moe_checkpoint("glm4_moe", tiny_checkpoint, tmp_path / "glm45")
    common = [serve_prompts(tmp_path, 2), "--checkpoint", checkpoint, "--group-size", "2", "--max-new-tokens", "5",
              "--seed", "7", "--batch-size", "4", "--record-routing"]
    local = glmpost_cli("rollout", *common, "--out", tmp_path / "local")
    assert local.exit_code == 0, local.stderr
    proc, url = start_server(checkpoint, "--batch-size", "8", "--log-prob-kind", "sampled")
    try:
        answer = SGLangClient(url, retries=0).generate([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True},
                                                       return_routed_experts=True)
        rows = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype=np.int32)
        assert rows.size == (3 + 3 - 1) * 2 * 2  # positions x num_hidden_layers x k
        rows = rows.reshape(5, 2, 2)
        assert not rows[:, 0].any() and (rows[:, 1, 0] != rows[:, 1, 1]).all()  # layer 0 dense; 2 distinct experts
        remote = glmpost_cli("rollout", *common, "--out", tmp_path / "remote", "--engine", "sglang", "--server", url)
        assert remote.exit_code == 0, remote.stderr
    finally:
        stop_server(proc)
    a, b = _shard_records(tmp_path / "local"), _shard_records(tmp_path / "remote")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x["response_token_ids"].tolist() == y["response_token_ids"].tolist()
        assert x["routed_experts"].shape == (len(x["response_token_ids"]), 1, 2)
        assert x["routed_experts"].dtype == y["routed_experts"].dtype and np.array_equal(x["routed_experts"], y["routed_experts"])
