"""``glmpost diff-logprobs``: two numerical paths' log-prob mismatch, its report and its CI gate."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import run_glmpost

from glmpost.checkpoints import MANIFEST, tokenizer_revision
from glmpost.diff.mismatch import inverse_cdf_samples, sampled_token_agreement, summarize
from glmpost.diff.report import parse_gates
from glmpost.kernel.engine import SamplingParams


def test_summary_statistics_hand_computed():
    ratios = np.array([1.2, 3.5, 0.3, 1.0])
    delta = np.log(ratios)
    stats = summarize(delta, beta=2.0, eps_low=0.2, eps_high=0.28)
    assert stats["tokens"] == 4
    assert stats["icepop_kept"] == 0.5  # 1.2 and 1.0 kept; 3.5 and 0.3 masked (brief's examples)
    assert stats["dis_kept"] == 0.5  # 1.2 and 1.0 inside (0.8, 1.28)
    assert stats["max_abs"] == pytest.approx(math.log(3.5))
    assert stats["k1"] == pytest.approx(-delta.mean())
    assert stats["k3"] == pytest.approx(np.mean(ratios - 1 - delta))
    assert "sample_agreement" not in stats
    assert summarize(delta, agree=np.array([True, False, True, True]))["sample_disagreement"] == 0.25
    assert summarize(np.zeros(0)) == {"tokens": 0}
    with pytest.raises(ValueError, match="METRIC=VALUE"):
        parse_gates(["max=1"])
    assert parse_gates(["max_abs=1e-3", "k3=0.5", "indexer_differing_sets=0"]) == {"max_abs": 1e-3, "k3": 0.5, "indexer_differing_sets": 0.0}


def test_inverse_cdf_sampling_and_agreement_hand_computed():
    # p = (0.1, 0.2, 0.7): CDF 0.1, 0.3, 1.0; u picks the first token whose CDF exceeds u.
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]] * 4))
    u = torch.tensor([0.05, 0.1, 0.29, 0.95], dtype=torch.float64)
    assert inverse_cdf_samples(logits, u, SamplingParams(temperature=1.0)).tolist() == [0, 1, 1, 2]
    assert inverse_cdf_samples(logits, u, SamplingParams(temperature=0.0)).tolist() == [2, 2, 2, 2]  # greedy
    # top_k 2 keeps (0.2, 0.7) -> CDF (0, 2/9, 1): u 0.05 and 0.1 now pick token 1.
    assert inverse_cdf_samples(logits, u, SamplingParams(top_k=2)).tolist() == [1, 1, 2, 2]
    assert sampled_token_agreement(np.array([True, True, False, True])) == 0.75
    assert sampled_token_agreement(np.zeros(0, dtype=bool)) == 1.0


@pytest.fixture(scope="module")
def shards(tiny_checkpoint, tmp_path_factory):
    """12 trajectories of 12 tokens sampled by the embedded engine with the deterministic top-k."""
    tmp = tmp_path_factory.mktemp("diff")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": "count: " + " ".join(str(d) * (1 + d % 3))}) + "\n" for d in range(6)))
    result = run_glmpost("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp / "rollout", "--group-size", "2",
                         "--max-new-tokens", "12", "--stop-token-ids", "none")
    assert result.exit_code == 0, result.stderr
    return tmp / "rollout"


def _report(glmpost_cli, *args):
    result = glmpost_cli("diff-logprobs", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_rollout_view_deterministic_topk_agrees_to_the_sampled_token(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    report = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "ok", "--fail-above", "max_abs=1e-4",
                     "--fail-above", "sample_disagreement=0")
    overall = report["overall"]
    assert report["mode"] == "rollout" and overall["tokens"] == 6 * 2 * 12 and overall["icepop_kept"] == 1.0
    # Same seeds, same uniforms, same weights and top-k rule: the trainer's forward resamples every
    # token the engine drew.
    assert overall["sample_agreement"] == 1.0 and report["resampled"]
    worst = report["worst"][0]
    assert {"token", "token_id", "context", "log_prob_a", "log_prob_b"} <= set(worst)
    assert worst["log_prob_a"] - worst["log_prob_b"] == pytest.approx(worst["delta"])
    saved = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert saved["gates"]["failed"] == [] and saved["plots"] == ["delta_hist.png", "abs_delta_vs_position.png", "scatter.png"]
    for name in saved["plots"]:
        assert (tmp_path / "ok" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["mismatch/sample_agreement"] == 1.0


def test_torch_topk_rollouts_fail_a_tight_gate(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": "count: " + " ".join(str(d) * (1 + d % 3))}) + "\n" for d in range(6)))
    result = glmpost_cli("rollout", prompts, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "ro", "--group-size", "2",
                         "--max-new-tokens", "12", "--stop-token-ids", "none", "--torch-topk")
    assert result.exit_code == 0, result.stderr
    failed = glmpost_cli("diff-logprobs", tmp_path / "ro", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "bad",
                         "--torch-topk", "--fail-above", "max_abs=1e-4", "--no-plots")
    assert failed.exit_code == 1 and "gate failed: max_abs" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert report["overall"]["max_abs"] > 1e-3 and report["worst"][0]["delta"] != 0.0
    assert "plots" not in report and not (tmp_path / "bad" / "scatter.png").exists()


def test_indexer_finds_the_sets_torch_topk_breaks_differently(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    # index_topk 8 < sequence length and relu scores tie at the boundary (shared/notes): torch.topk
    # on path B picks other tied keys than the deterministic rule on path A.
    gate = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "t", "--against-topk", "torch",
                       "--indexer", "--fail-above", "indexer_differing_sets=0")
    assert gate.exit_code == 1 and "gate failed: indexer_differing_sets" in gate.stderr
    assert "indexer:" in gate.stdout and "identical sets" in gate.stdout  # the terminal table
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    ix = report["indexer"]["overall"]
    assert report["mode"] == "local" and report["path_b"]["topk"] == "torch"
    assert ix["layers"] == 2 and ix["rows"] == 2 * sum(len(p) for p in _sequences(shards))
    assert ix["differing_sets"] > 0 and ix["identical_sets"] < 1.0 and ix["mean_jaccard"] < 1.0
    assert ix["boundary_ties_a"] > 0
    # Layer 0 sees the same scores on both paths, so every set it selects differently is a tie.
    assert report["indexer"]["by_layer"]["0"]["differing_with_ties"] == 1.0
    assert report["overall"]["indexer_differing_sets"] == ix["differing_sets"] and report["overall"]["max_abs"] > 1e-4


def test_deterministic_topk_selects_identical_sets_across_batch_sizes(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    report = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "d", "--batch-size", "12",
                     "--against-batch-size", "1", "--indexer", "--fail-above", "indexer_differing_sets=0", "--no-plots")
    ix = report["indexer"]["overall"]
    assert ix["differing_sets"] == 0 and ix["identical_sets"] == 1.0 and ix["identical_order"] == 1.0 and ix["mean_jaccard"] == 1.0
    assert ix["boundary_ties_a"] > 0  # ties exist; the rule resolves them the same way in both layouts
    # Batch 12 vs batch 1: different GEMM blockings round differently (4.8e-7 on AMD EPYC, 0.0 on
    # the Intel machines), so the log-probs agree to float rounding, not bit for bit; the sets above
    # and the sampled-token agreement are exact.
    assert report["overall"]["max_abs"] < 1e-5 and report["overall"]["sample_agreement"] == 1.0


def test_native_and_reference_attention_select_the_same_keys_and_agree_within_1e_5(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    report = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "a", "--against-attention",
                     "reference", "--indexer", "--fail-above", "indexer_differing_sets=0", "--no-plots")
    assert report["path_a"]["attention"] == "native" and report["path_b"]["attention"] == "reference"
    ix = report["indexer"]["overall"]
    assert ix["differing_sets"] == 0 and ix["identical_sets"] == 1.0 and ix["boundary_ties_a"] > 0
    # The native path absorbs MLA's key up-projection into the query: the products round differently.
    assert 0.0 < report["overall"]["max_abs"] < 1e-5 and report["overall"]["sample_agreement"] == 1.0
    bad = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "b", "--against-attention", "flash")
    assert bad.exit_code == 2 and "--against-attention 'flash': expected native or reference" in bad.stderr


def test_two_checkpoints_and_two_dtypes(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    for scheme, extra in (("fp8-block", ()), ("w4a16", ("--group-size", "16"))):
        result = glmpost_cli("quantize", tiny_checkpoint, "--out", tmp_path / scheme, "--scheme", scheme, *extra)
        assert result.exit_code == 0, result.stderr
    same = _report(glmpost_cli, shards, "--checkpoint", tmp_path / "fp8-block", "--against", tmp_path / "fp8-block", "--out", tmp_path / "s", "--no-plots")
    assert same["mode"] == "checkpoint" and same["overall"]["max_abs"] == 0.0 and same["overall"]["sample_agreement"] == 1.0
    fp8 = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--against", tmp_path / "fp8-block", "--out", tmp_path / "f", "--no-plots")
    w4 = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--against", tmp_path / "w4a16", "--out", tmp_path / "w", "--no-plots")
    assert 0 < fp8["overall"]["mean_abs"] < w4["overall"]["mean_abs"]  # 8-bit floats stay closer than 4-bit ints
    bf16 = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--dtype", "fp32", "--against-dtype", "bf16", "--out", tmp_path / "b", "--no-plots")
    assert bf16["path_b"]["dtype"] == "bf16" and bf16["overall"]["max_abs"] > 1e-3
    assert 0.5 < bf16["overall"]["sample_agreement"] <= 1.0


def _sequences(shards):
    from glmpost.formats import ShardReader, resolve_shard_paths

    return [np.concatenate([r["prompt_token_ids"], r["response_token_ids"]]) for p in resolve_shard_paths([shards]) for r in ShardReader(p)]


def test_refuses_shards_without_rollout_log_probs(glmpost_cli, tiny_checkpoint, tmp_path):
    imported = tmp_path / "imported"
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "count: 1", "response": "1111"}\n')
    assert glmpost_cli("shards", "import", data, "--checkpoint", tiny_checkpoint, "--out", imported).exit_code == 0
    result = glmpost_cli("diff-logprobs", imported, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "has no rollout_log_probs: run `glmpost rollout` first" in result.stderr
    assert not (tmp_path / "r").exists()
    # Two model paths need no rollout log-probs: imported data compares fine.
    report = _report(glmpost_cli, imported, "--checkpoint", tiny_checkpoint, "--against-dtype", "bf16", "--out", tmp_path / "r2", "--no-plots")
    assert report["overall"]["tokens"] > 0


def test_bad_input_one_line_errors(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    def fails(code, needle, *args):
        result = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "x", *args)
        assert result.exit_code == code and needle in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()

    fails(1, f"--against: checkpoint {tmp_path / 'nope'} does not exist", "--against", tmp_path / "nope")
    fails(1, "--against-server http://127.0.0.1:1: GET http://127.0.0.1:1/model_info", "--against-server", "http://127.0.0.1:1")
    fails(2, "--against-topk 'random'", "--against-topk", "random")
    fails(2, "--indexer compares two local paths", "--indexer")
    fails(2, "--fail-above 'agree=1'", "--fail-above", "agree=1")
    fails(2, "not measured in this comparison", "--fail-above", "indexer_differing_sets=0")

    other = tmp_path / "other"  # same weights, another tokenizer revision
    shutil.copytree(tiny_checkpoint, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["tokenizer_revision"] = tokenizer_revision(other)
    (other / MANIFEST).write_text(json.dumps(manifest))
    fails(1, "tokenizer revision", "--against", other)
    result = glmpost_cli("diff-logprobs", shards, "--checkpoint", other, "--out", tmp_path / "x")
    assert result.exit_code == 1 and "differs from the checkpoint's" in result.stderr


def test_against_a_real_glmpost_serve_process(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    import signal
    import subprocess
    import sys

    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "glmpost.commands.app", "serve", "--checkpoint", str(tiny_checkpoint),
                                 "--host", "127.0.0.1", "--port", "0", "--device", "cpu"],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()  # blocks until ready (or the server exits)
        assert line.startswith("glmpost serve: listening on http://"), (line, (tmp_path / "serve.log").read_text())
        url = line.strip().rsplit(" ", 1)[-1]
        report = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--against-server", url, "--out", tmp_path / "s",
                         "--fail-above", "max_abs=1e-4", "--no-plots")
        assert report["mode"] == "server" and report["path_b"]["url"] == url and report["path_b"]["weight_version"] is not None
        # The server's input log-probs (its own forward, full distribution over 512 ids) resample
        # every token the in-process trainer forward resamples.
        assert report["overall"]["tokens"] == 144 and report["overall"]["sample_agreement"] == 1.0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_top_k_minus_one_means_off_as_zero_does(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    """formats/SPEC.md: top_k 0 and -1 both mean no top-k filter (SGLang and synthetic data write -1)."""
    from glmpost.formats import ShardReader, ShardWriter

    minus_one = tmp_path / "minus-one"
    minus_one.mkdir()
    for path in sorted(shards.glob("*.msgpack.zst")):
        reader = ShardReader(path)
        records = [{**r, "sampling": {**r["sampling"], "top_k": -1}} for r in reader]
        assert records and all(r["sampling"]["top_k"] == -1 for r in records)
        with ShardWriter(minus_one / path.name, stage="rollout", options={}, tokenizer_revision=records[0]["tokenizer_revision"]) as w:
            for r in records:
                w.write(r)
    zero = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "zero")
    off = _report(glmpost_cli, minus_one, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "off")
    assert off["resampled"] and off["overall"]["sample_agreement"] == 1.0
    assert off["overall"] == zero["overall"]
    assert SamplingParams.from_record({"top_k": -1}).top_k == 0 and SamplingParams.from_record({"top_k": 20}).top_k == 20
    assert SamplingParams.from_record({}).top_p == 1.0 and SamplingParams.from_record({"top_p": None}).top_p == 1.0


def test_old_spellings_of_icepop_beta_and_the_dis_band_still_work_with_a_warning(glmpost_cli, tiny_checkpoint, shards, tmp_path):
    # --icepop-beta 1.0001 keeps only the tokens whose engines agree within 1e-4: the same report as
    # the deprecated --beta 1.0001 (a warning), and the old recipe keys map to the new options too.
    new = _report(glmpost_cli, shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "new", "--icepop-beta", "1.0001",
                  "--dis-low", "0.5", "--no-plots")
    old = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "old", "--beta", "1.0001",
                      "--eps-low", "0.5", "--no-plots", "--json")
    assert old.exit_code == 0, old.stderr
    assert "--beta is deprecated" in old.stderr and "use --icepop-beta" in old.stderr and "use --dis-low" in old.stderr
    assert json.loads(old.stdout)["overall"] == new["overall"]
    stage = json.loads((tmp_path / "old" / "stage.json").read_text())["options"]
    assert stage["icepop_beta"] == 1.0001 and stage["dis_low"] == 0.5 and "beta" not in stage and "eps_low" not in stage
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[diff-logprobs]\nbeta = 1.0001\n")
    from_recipe = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "recipe", "--no-plots",
                              "--config", recipe, "--json")
    assert from_recipe.exit_code == 0 and json.loads(from_recipe.stdout)["overall"] == new["overall"]
    both = glmpost_cli("diff-logprobs", shards, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "both", "--beta", "2",
                       "--icepop-beta", "2")
    assert both.exit_code == 2 and "--beta is the deprecated spelling of --icepop-beta: give one of them" in both.stderr
    assert not (tmp_path / "both").exists()
