"""MoE routing record and replay with a LoRA version (issue 45: "routing record and replay"): the
embedded engine records the experts its base + adapter routed to (the router itself is never
adapted), ``diff-logprobs --routing`` of the same LoRA version finds every route equal and the
log-probs closed, while its base routes otherwise (the adapter moves the routers' inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from glmpost.formats import ShardReader
from test_lora_versions import CLOSE, make_lora_version
from conftest import run_glmpost


@pytest.fixture(scope="module")
def lora_routed(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("lora-routing")
    lora = make_lora_version(tiny_checkpoint, tmp / "lora" / "v000001", seed=11)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{d}", "prompt": f"count: {d} {d}"}) + "\n" for d in range(6)))
    result = run_glmpost("rollout", prompts, "--checkpoint", lora, "--out", tmp / "rollout", "--group-size", "2",
                         "--max-new-tokens", "12", "--stop-token-ids", "none", "--record-routing")
    assert result.exit_code == 0, result.stderr
    return lora, tmp / "rollout"


def _routing_report(glmpost_cli, records: Path, checkpoint: Path, out: Path, *extra: str) -> dict:
    result = glmpost_cli("diff-logprobs", records, "--checkpoint", checkpoint, "--routing", "--dtype", "fp32", "--out", out,
                         "--no-plots", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads((out / "report.json").read_text())


def test_a_lora_versions_routes_are_recorded_and_close_under_its_own_diff(glmpost_cli, lora_routed, tiny_checkpoint, tmp_path):
    lora, rollout = lora_routed
    records = [r for path in sorted(rollout.glob("*.msgpack.zst")) for r in ShardReader(path)]
    assert len(records) == 12 and all(np.asarray(r["routed_experts"]).shape[0] == 12 for r in records)
    same = _routing_report(glmpost_cli, rollout, lora, tmp_path / "same")
    assert same["routing"]["overall"]["differing_tokens"] == 0.0 and same["routing"]["overall"]["tokens"] == 6 * 2 * 12
    assert same["overall"]["max_abs"] <= CLOSE
    base = _routing_report(glmpost_cli, rollout, tiny_checkpoint, tmp_path / "base")
    assert base["routing"]["overall"]["differing_tokens"] > 0  # the adapter moved the routes: the record is the adapter's
    replayed = _routing_report(glmpost_cli, rollout, lora, tmp_path / "replay", "--routing-replay")
    assert replayed["overall"]["max_abs"] <= CLOSE
