"""``glmpost report``: a static page of a run's curves, on synthetic run directories whose
metrics.jsonl files have the trainer's, rollout's, judge's and eval's real key names."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from glmpost.report.plots import PLOTS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TITLES = {plot.name: plot.title for plot in PLOTS}
RL_PLOTS = [plot.name for plot in PLOTS if plot.name != "sft_loss"]  # what make_run has keys for


def _write_lines(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _stage(directory: Path, stage: str, **options) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stage.json").write_text(json.dumps({"stage": stage, "options": options}))


def _step(version: int, step: int, reward: float, *, lag: dict[int, int], lr: float) -> dict:
    return {"train/reward_mean": reward, "train/trusted_fraction": 1.0 - 0.01 * step - 0.1 * version, "train/lr": lr,
            "train/loss": 0.5 - 0.01 * step, "train/mismatch_abs_logp_mean": 0.001 * (step + 1),
            "train/mismatch_k3_kl": 1e-5 * (step + 1), "train/step": step, "train/policy_version": version,
            **{f"train/version_lag/{k}": n for k, n in lag.items()}, "train/version_lag/unknown": 0}


def make_run(top: Path, *, reward_scale: float, versions: int = 2, steps: int = 3, root: str = "policy",
             iters: str = "iter") -> dict:
    """A pipeline folder: ``versions`` x (rollout -> judge -> train), a checkpoint root, and an eval of
    the last version (whose own rollout must not count); returns the expected last values."""
    history = []
    for v in range(versions):
        rollout, judged = top / f"{iters}-{v:03d}" / "rollout", top / f"{iters}-{v:03d}" / "judged"
        shard = rollout / "rollout-00000.msgpack.zst"
        _stage(rollout, "rollout", checkpoint=str(top / root))
        _write_lines(rollout / "metrics.jsonl", [
            {"shard": shard.name, "rollout/policy_version": v, "rollout/records": 32, "rollout/response_length_mean": 8.0 + v,
             "rollout/response_length_min": 2 + v, "rollout/response_length_max": 16 + v, "time": 1.0}])
        _stage(judged, "judge", inputs=[str(rollout)])
        _write_lines(judged / "metrics.jsonl", [{"shard": shard.name, "input": str(shard), "judge/records": 32,
                                                  "judge/reward_mean": reward_scale * (v + 1)}])
        lines = [_step(v + 1, s, reward_scale * (v + 1), lag={0: 30, 1: 2 * v}, lr=1e-3 * (s + 1)) for s in range(steps)]
        _stage(top / root / f"v{v + 1:06d}", "train-grpo", inputs=[str(judged)], lr=1e-3)
        _write_lines(top / root / f"v{v + 1:06d}" / "metrics.jsonl", lines)  # the root's lines again: not read twice
        history += lines
    _write_lines(top / root / "metrics.jsonl", history)
    (top / root / "LATEST").write_text(f"v{versions:06d}\n")
    evaluation = top / f"eval-{root}"
    _stage(evaluation, "eval", n=4, checkpoint=str(top / root))
    _write_lines(evaluation / "metrics.jsonl", [{"policy_version": versions, "eval/avg@4": 0.25 * reward_scale,
                                                 "eval/pass@1": 0.25 * reward_scale, "eval/pass@4": 0.5 * reward_scale,
                                                 "eval/maj@4": 0.3, "eval/count/avg@4": 0.9}])
    _write_lines(evaluation / "rollout" / "metrics.jsonl", [{"rollout/policy_version": versions,
                                                             "rollout/response_length_mean": 999.0}])
    last = history[-1]
    lags = {0: 30, 1: 2 * (versions - 1)}
    return {**{k: v for k, v in last.items() if not k.startswith("train/version_lag")},
            "derived/version_lag_mean": sum(k * n for k, n in lags.items()) / sum(lags.values()),
            "derived/version_lag_max": max(k for k, n in lags.items() if n),
            "rollout/response_length_mean": 8.0 + versions - 1, "rollout/response_length_min": 2 + versions - 1,
            "rollout/response_length_max": 16 + versions - 1, "judge/reward_mean": reward_scale * versions,
            "eval/avg@4": 0.25 * reward_scale, "eval/pass@1": 0.25 * reward_scale, "eval/pass@4": 0.5 * reward_scale,
            "eval/maj@4": 0.3}


class Page(HTMLParser):
    """The parts of report.html the tests read: images, headings, table cells, text."""

    def __init__(self, text: str):
        super().__init__()
        self.images, self.headings, self.cells, self.text = [], [], {}, []
        self._heading, self._cell = None, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs)
        elif tag in ("h2", "h3"):
            self._heading = ""
        elif tag == "td" and "data-key" in attrs:
            self._cell = (attrs["data-series"], attrs["data-key"])
            self.cells[self._cell] = ""

    def handle_endtag(self, tag):
        if tag in ("h2", "h3") and self._heading is not None:
            self.headings.append(self._heading)
            self._heading = None
        elif tag == "td":
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._heading is not None:
            self._heading += data
        if self._cell is not None:
            self.cells[self._cell] += data


def read_page(out: Path) -> Page:
    page = Page((out / "report.html").read_text())
    for image in page.images:
        png = (out / image["src"]).read_bytes()
        assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR", image
        width, height = struct.unpack(">II", png[16:24])
        assert width >= 300 and height >= 200, image
    return page


def test_two_runs_side_by_side(glmpost_cli, tmp_path):
    expected = {"alpha": make_run(tmp_path / "alpha", reward_scale=0.1),
                "beta": make_run(tmp_path / "beta", reward_scale=0.2, steps=4)}
    out = tmp_path / "report"
    result = glmpost_cli("report", tmp_path / "alpha", tmp_path / "beta", "--out", out)
    assert result.exit_code == 0, result.stderr
    assert str(out / "report.html") in result.stdout and "alpha, beta" in result.stdout
    page = read_page(out)
    assert sorted(image["alt"] for image in page.images) == sorted(TITLES[name] for name in RL_PLOTS)
    assert {TITLES[name] for name in RL_PLOTS} <= set(page.headings) and "Not plotted" in page.headings
    assert f"{TITLES['sft_loss']}: no run has sft/loss" in "".join(page.text)
    assert {series for series, _ in page.cells} == {"alpha", "beta"}
    for name, values in expected.items():
        for key, value in values.items():
            if key in ("train/step", "train/policy_version"):
                continue
            assert float(page.cells[(name, key)]) == pytest.approx(value, rel=1e-5), (name, key)
    assert ("alpha", "eval/count/avg@4") not in page.cells  # a domain's eval metric is not the overall one
    line, = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["report/runs"] == ["alpha", "beta"] and line["report/plots"] == RL_PLOTS
    assert line["report/not_plotted"] == ["sft_loss"] and line["report/metrics_files"] == 2 * 6
    stage = json.loads((out / "stage.json").read_text())
    assert stage["stage"] == "report" and stage["options"]["runs"] == [str(tmp_path / "alpha"), str(tmp_path / "beta")]
    assert stage["runs"] == {"alpha": str(tmp_path / "alpha"), "beta": str(tmp_path / "beta")}


def test_plots_without_keys_are_left_out_and_named(glmpost_cli, tmp_path):
    rollout = tmp_path / "only-rollout"
    _write_lines(rollout / "metrics.jsonl", [{"shard": "a", "rollout/policy_version": 0, "rollout/records": 4,
                                              "rollout/response_length_mean": 5.0, "rollout/response_length_min": 1,
                                              "rollout/response_length_max": 9}])
    out = tmp_path / "report"
    result = glmpost_cli("report", rollout, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["plots"] == ["response_length.png"] and "reward" in summary["not_plotted"]
    page = read_page(out)
    assert [image["src"] for image in page.images] == ["response_length.png"]
    assert "Not plotted" in page.headings and f"{TITLES['reward']}: no run has " in "".join(page.text)
    assert float(page.cells[("only-rollout", "rollout/response_length_mean")]) == 5.0
    make_run(rollout, reward_scale=1.0)  # a rerun into the same OUT writes the report again
    assert glmpost_cli("report", rollout, "--out", out).exit_code == 0
    assert len(read_page(out).images) == len(RL_PLOTS) and len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_run_with_two_roots_has_a_line_per_root(glmpost_cli, tmp_path):
    run = tmp_path / "pipeline"
    first = make_run(run, reward_scale=0.1, root="policy", iters="iter")
    second = make_run(run, reward_scale=0.3, root="agentic-policy", iters="agentic-iter", versions=3)
    _write_lines(run / "warm-start" / "metrics.jsonl", [{"sft/loss": 6.0 - s, "sft/lr": 3e-3, "sft/step": s} for s in range(4)])
    (run / "warm-start" / "LATEST").write_text("v000001\n")  # a qat root: SFT loss and lr
    greedy = run / "eval-model" / "rollout"  # of a checkpoint that is no root of the run: the line "other"
    _stage(greedy, "rollout", checkpoint=str(run / "model"))
    _write_lines(greedy / "metrics.jsonl", [{"rollout/policy_version": 0, "rollout/response_length_mean": 3.0}])
    out = run / "report"  # inside the run: not read back on a rerun
    for _ in range(2):
        result = glmpost_cli("report", run, "--out", out, "--name", "quick", "--title", "Quickstart")
        assert result.exit_code == 0, result.stderr
    page = read_page(out)
    assert "Quickstart" in "".join(page.text)
    assert float(page.cells[("quick: policy", "train/reward_mean")]) == pytest.approx(first["train/reward_mean"])
    assert float(page.cells[("quick: agentic-policy", "rollout/response_length_mean")]) == second["rollout/response_length_mean"]
    assert float(page.cells[("quick: policy", "rollout/response_length_mean")]) == first["rollout/response_length_mean"]
    assert float(page.cells[("quick: agentic-policy", "eval/pass@4")]) == pytest.approx(0.5 * 0.3)  # its --checkpoint's
    assert float(page.cells[("quick: other", "rollout/response_length_mean")]) == 3.0
    assert float(page.cells[("quick: warm-start", "sft/loss")]) == 3.0 and page.cells[("quick: warm-start", "train/lr")] == ""
    assert [image["src"] for image in page.images] == [f"{plot.name}.png" for plot in PLOTS]


def test_a_checkpoint_root_or_one_version_alone(glmpost_cli, tmp_path):
    make_run(tmp_path / "run", reward_scale=0.1, steps=2)
    root, version = tmp_path / "run" / "policy", tmp_path / "run" / "policy" / "v000001"
    out = tmp_path / "report"
    result = glmpost_cli("report", root, version, "--out", out)
    assert result.exit_code == 0, result.stderr
    page = read_page(out)
    first_version = [json.loads(x) for x in (version / "metrics.jsonl").read_text().splitlines()]
    assert float(page.cells[("policy", "train/reward_mean")]) == pytest.approx(0.2)  # the root: its last version's
    assert float(page.cells[("v000001", "train/reward_mean")]) == pytest.approx(first_version[-1]["train/reward_mean"])
    assert {series for series, _ in page.cells} == {"policy", "v000001"}


def test_recipe_section(glmpost_cli, tmp_path):
    make_run(tmp_path / "run", reward_scale=0.1)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[report]\ntitle = "From the recipe"\ndpi = 60\nname = ["r1"]\n')
    out = tmp_path / "report"
    result = glmpost_cli("report", tmp_path / "run", "--out", out, "--config", recipe)
    assert result.exit_code == 0, result.stderr
    page = read_page(out)
    assert "From the recipe" in "".join(page.text) and ("r1", "train/lr") in page.cells
    assert json.loads((out / "stage.json").read_text())["options"]["dpi"] == 60


@pytest.mark.parametrize("case", ["missing", "empty", "malformed", "not_an_object", "names", "other_stage"])
def test_bad_input_is_one_line_naming_the_file(glmpost_cli, tmp_path, case):
    run = tmp_path / "run"
    make_run(run, reward_scale=0.1)
    out, args = tmp_path / "report", [run]
    if case == "missing":
        args, code, words = [tmp_path / "nope"], 2, [str(tmp_path / "nope"), "does not exist"]
    elif case == "empty":
        (tmp_path / "empty").mkdir()
        args, code, words = [run, tmp_path / "empty"], 2, [str(tmp_path / "empty"), "no metrics.jsonl"]
    elif case in ("malformed", "not_an_object"):
        bad = run / "iter-001" / "rollout" / "metrics.jsonl"
        bad.write_text(bad.read_text() + ('{"rollout/records": 3\n' if case == "malformed" else "[1, 2]\n"))
        code, words = 1, [f"{bad}:2: malformed metrics line"]
    elif case == "names":
        args += ["--name", "a", "--name", "b"]
        code, words = 2, ["--name is given 2 time(s) for 1 run directories"]
    else:
        _stage(out, "rollout")
        code, words = 2, [f"--out {out} holds output of `glmpost rollout`"]
    result = glmpost_cli("report", *args, "--out", out)
    assert result.exit_code == code, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and all(w in result.stderr for w in words), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def _chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None)


def test_the_page_renders_in_a_headless_browser(glmpost_cli, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium) to render the page")
    from PIL import Image  # matplotlib depends on Pillow

    make_run(tmp_path / "alpha", reward_scale=0.1)
    make_run(tmp_path / "beta", reward_scale=0.2)
    out = tmp_path / "report"
    assert glmpost_cli("report", tmp_path / "alpha", tmp_path / "beta", "--out", out).exit_code == 0
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", f"--screenshot={shot}",
                    "--window-size=1400,2400", (out / "report.html").as_uri()], capture_output=True, timeout=120, check=True)
    image = Image.open(shot).convert("L")
    assert image.size == (1400, 2400)
    low, high = image.getextrema()
    assert high - low > 100  # not blank: text and plot lines on a white page
    dark = sum(image.histogram()[:128]) / (image.size[0] * image.size[1])
    assert 0.002 < dark < 0.5
