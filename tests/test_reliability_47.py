"""Reliability, second round (issue 47): one writer per output whatever the path, nothing published
that cannot be served, inputs that are pipes, loops and mixed folders, the remaining one-line errors
and the minor items. Real processes and real files, as a user would meet them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_hardening_outputs import _holder

from glmpost.locks import OutputLocked, output_lock



def _stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


def _one_line(result, exit_code: int) -> str:
    assert result.exit_code == exit_code, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def _error(result, exit_code: int) -> str:
    """The error line a run ended with (log lines before it allowed), no traceback."""
    assert result.exit_code == exit_code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("glmpost: error: "), result.stderr
    return last


def _prompts(tmp_path: Path, n: int = 4, name: str = "prompts.jsonl") -> Path:
    prompts = tmp_path / name
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"count: {i}"}) + "\n" for i in range(n)))
    return prompts


# 1. One writer per output whatever the path.

def test_a_writer_through_a_symlink_is_refused_even_with_overwrite(glmpost_cli, tiny_checkpoint, tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    holder = _holder(real)
    try:
        with pytest.raises(OutputLocked, match=f"pid {holder.pid}"):
            with output_lock(link, stage="second"):
                pass
        busy = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", link, "--overwrite",
                           "--max-new-tokens", "2")
        assert f"{link} is being written by pid {holder.pid}" in _one_line(busy, 1)
        assert list(real.iterdir()) == []
    finally:
        _stop(holder)
    other = tmp_path / "parent-link"  # the parent reached through a link: the same directory
    other.symlink_to(tmp_path)
    holder = _holder(other / "real")
    try:
        with pytest.raises(OutputLocked, match=f"pid {holder.pid}"):
            with output_lock(real, stage="second"):
                pass
    finally:
        _stop(holder)


def test_a_task_writer_and_an_unsplit_writer_exclude_each_other(glmpost_cli, tiny_checkpoint, tmp_path):
    out = tmp_path / "rolled"
    task = _holder(out, 1, 2)
    try:
        with output_lock(out, stage="judge", task=(0, 2)):  # another task beside it: fine
            pass
        with pytest.raises(OutputLocked, match=f"pid {task.pid}"):
            with output_lock(out, stage="unsplit"):
                pass
        busy = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", out, "--overwrite",
                           "--max-new-tokens", "2")
        assert f"{out} is being written by pid {task.pid}" in _one_line(busy, 1) and "(holder, shard index 1 of 2)" in busy.stderr
    finally:
        _stop(task)
    whole = _holder(out)
    try:
        for index in (0, 1):
            with pytest.raises(OutputLocked, match=f"pid {whole.pid}"):
                with output_lock(out, stage="judge", task=(index, 2)):
                    pass
        busy = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", out, "--overwrite",
                           "--num-shards", "2", "--shard-index", "1", "--max-new-tokens", "2")
        assert f"{out} is being written by pid {whole.pid}" in _one_line(busy, 1)
    finally:
        _stop(whole)
    with output_lock(out, stage="judge", task=(0, 2)), output_lock(out, stage="judge", task=(1, 2)):
        pass
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")]  # the last task removed the lock


# 2. Nothing published that cannot be served.

def _damaged(tiny_checkpoint: Path, tmp_path: Path, *, version: int, value: float = float("nan")) -> tuple[Path, str]:
    """A copy of the tiny checkpoint as policy version ``version`` with one non-finite weight; (copy, its name)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    damaged = tmp_path / f"damaged-{version}"
    shutil.copytree(tiny_checkpoint, damaged)
    weights = load_file(damaged / "model.safetensors")
    name = sorted(k for k in weights if ".mlp." in k)[0]
    weights[name][0, 0] = value
    save_file(weights, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    manifest = json.loads((damaged / "glmpost.json").read_text())
    (damaged / "glmpost.json").write_text(json.dumps({**manifest, "policy_version": version}))
    return damaged, name


def test_sync_weights_and_quantize_refuse_non_finite_weights_naming_the_tensor(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.checkpoints import CheckpointRoot

    root = tmp_path / "rollout-root"
    assert glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", root).exit_code == 0
    damaged, name = _damaged(tiny_checkpoint, tmp_path, version=1)
    for extra in ([], ["--quantize", "fp8-block"]):
        result = glmpost_cli("sync-weights", "--checkpoint", damaged, "--out", root, *extra)
        assert f"{damaged}: weight {name} holds 1+ NaN or infinite value(s)" in _error(result, 1)
        assert CheckpointRoot(root).versions() == [0] and CheckpointRoot(root).latest() == 0
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no staging left
    infinite, name = _damaged(tiny_checkpoint, tmp_path, version=2, value=float("inf"))
    for scheme in ("none", "w8a16"):  # the weight is not one quantize packs: it is copied, so checked all the same
        result = glmpost_cli("quantize", infinite, "--out", tmp_path / f"q-{scheme}", "--scheme", scheme,
                             "--exclude", name.rsplit(".", 1)[0])
        assert f"weight {name} holds 1+ NaN or infinite value(s)" in _error(result, 1)
        assert not (tmp_path / f"q-{scheme}").exists()


# 3. Input expansion visits each real directory once.

def _shard(path: Path, n: int = 2, revision: str = "synthetic-tokenizer") -> Path:
    """A shard of ``n`` synthetic judged records (token ids past the tiny model's vocabulary)."""
    from glmpost.formats import ShardWriter
    from glmpost.formats.synthetic import synthetic_record

    path.parent.mkdir(parents=True, exist_ok=True)
    with ShardWriter(path, stage="judge", tokenizer_revision=revision) as writer:
        for index in range(n):
            writer.write(synthetic_record(index, index=index, prompt_len=4, response_len=6, turns=1,
                                          tokenizer_revision=revision, policy_version=0))
    return path


GLMPOST = [sys.executable, "-m", "glmpost.commands.app"]


def test_a_recursive_glob_over_symlink_loops_ends_and_says_so_in_one_line(tmp_path):
    d = tmp_path / "d"
    _shard(d / "a" / "one.msgpack.zst")
    _shard(d / "b" / "two.msgpack.zst")
    (d / "a" / "up").symlink_to("..")  # two loops back to d
    (d / "b" / "again").symlink_to(d)
    (d / "alias").symlink_to("a")  # an alias of a real directory: visited once, not a loop
    try:  # a guard only: today's glob walks 2^depth paths
        verify = subprocess.run([*GLMPOST, "shards", "verify", f"{d}/**"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("shards verify d/** did not end")
    assert verify.returncode == 0, verify.stderr
    assert verify.stdout.strip() == "ok: 2 shards, 4 records"
    [line] = [line for line in verify.stderr.splitlines() if "loop" in line]
    assert f"{d}/**: skipped 2 symbolic link loop(s): {d / 'a' / 'up'} -> {d}, {d / 'b' / 'again'} -> {d}" in line
    from glmpost.formats import resolve_shard_paths

    assert [p.name for p in resolve_shard_paths([f"{d}/**/*.msgpack.zst"])] == ["one.msgpack.zst", "two.msgpack.zst"]
    assert [p.name for p in resolve_shard_paths([f"{d}/*/*.msgpack.zst"])] == ["one.msgpack.zst", "two.msgpack.zst"]


def test_a_path_through_a_symlink_loop_is_named_a_loop_not_a_missing_file(glmpost_cli, tmp_path):
    (tmp_path / "self").symlink_to("self")
    (tmp_path / "ping").symlink_to("pong")
    (tmp_path / "pong").symlink_to("ping")
    for path in (tmp_path / "self", tmp_path / "ping" / "x.msgpack.zst"):
        result = glmpost_cli("shards", "verify", path)
        message = _one_line(result, 2)
        assert f"{path}: a symbolic link loop (too many levels of symbolic links)" in message
        assert "no such file" not in message


# 4. Prompts from a FIFO or a process substitution.

def _records(out: Path) -> list[dict]:
    from glmpost.formats import ShardReader, resolve_shard_paths

    return [r for path in resolve_shard_paths([out]) for r in ShardReader(path)]


def test_prompts_from_a_process_substitution_are_read_as_jsonl(tiny_checkpoint, tmp_path):
    prompts, out = _prompts(tmp_path), tmp_path / "rolled"
    command = " ".join([*GLMPOST, "rollout", f"<(cat {prompts})", "--checkpoint", str(tiny_checkpoint), "--out", str(out),
                        "--max-new-tokens", "2", "--group-size", "1"])
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(r["prompt_id"] for r in _records(out)) == ["q0", "q1", "q2", "q3"]


def test_prompts_from_a_fifo_say_what_they_wait_for_then_are_read_as_jsonl(tiny_checkpoint, tmp_path):
    fifo, out = tmp_path / "prompts.pipe", tmp_path / "rolled"
    os.mkfifo(fifo)
    process = subprocess.Popen([*GLMPOST, "rollout", str(fifo), "--checkpoint", str(tiny_checkpoint), "--out", str(out),
                                "--max-new-tokens", "2", "--group-size", "1"], stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(300, process.kill)  # a guard only: today's rollout blocks in open() without a word
    guard.start()
    try:
        lines = []
        for line in process.stderr:  # it says what it waits for, then waits (no writer yet)
            lines.append(line)
            if "waiting for" in line:
                break
        assert f"{fifo}: nothing written to this pipe yet: waiting for a process to write to it" in lines[-1], lines
        with open(fifo, "w") as writer:
            writer.write(_prompts(tmp_path).read_text())
        rest = process.stderr.read()
        assert process.wait() == 0, "".join(lines) + rest
    finally:
        guard.cancel()
        process.kill()
        process.wait()
    assert sorted(r["prompt_id"] for r in _records(out)) == ["q0", "q1", "q2", "q3"]


# 5. A folder mixing shards and prompt files.

def test_a_folder_holding_shards_and_prompt_files_is_refused_in_one_line(glmpost_cli, tiny_checkpoint, tmp_path):
    prompts, rolled = _prompts(tmp_path), tmp_path / "rolled"
    run = ["--checkpoint", tiny_checkpoint, "--max-new-tokens", "2", "--group-size", "1"]
    assert glmpost_cli("rollout", prompts, *run, "--out", rolled).exit_code == 0
    again = glmpost_cli("rollout", rolled, *run, "--out", tmp_path / "again")  # its own metrics.jsonl is no prompt file
    assert again.exit_code == 0, again.stderr
    (rolled / "more.jsonl").write_text('{"id": "extra", "prompt": "count: 9"}\n')
    mixed = glmpost_cli("rollout", rolled, *run, "--out", tmp_path / "mixed")
    message = _one_line(mixed, 2)
    assert f"{rolled}: holds both shards and prompt files (more.jsonl)" in message
    assert not (tmp_path / "mixed").exists()


# 6. A recipe that is not UTF-8, wherever it is read.

def test_recipe_check_and_plan_on_a_recipe_that_is_not_utf8_say_one_line(glmpost_cli, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_bytes("[rollout]\n# caf\u00e9\n".encode("latin-1"))
    for args in (["recipe", "check", recipe], ["plan", recipe]):
        result = glmpost_cli(*args)
        assert f"recipe {recipe}: not UTF-8 text (byte 15: invalid continuation byte)" in _one_line(result, 2), args


# 7. A full disk names the output, never an input.

@pytest.mark.parametrize("stage, sizes_k", [("sync-weights", (700, 720, 740, 760)), ("rollout", (4, 8)),
                                            ("train-grpo", (760, 2040, 2056))])
def test_a_full_disk_names_the_output_never_an_input(glmpost_cli, tiny_checkpoint, tmp_path, stage, sizes_k):
    """tmpfs sizes (KiB) measured to run out at each kind of write: the weights (safetensors), the
    tokenizer files copied from the input (today: the input named), the small files after them
    (today: no path named); a size at which the run fits anyway is allowed, so long as one fails."""
    from test_hardening_storage import _tmpfs
    from test_train_grpo import _judged

    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path) if stage != "sync-weights" else tmp_path / "none"
    failed = []
    for size in sizes_k:
        with _tmpfs(tmp_path / f"small-{size}", f"size={size}k") as small:
            out = small / "out"
            args = {"sync-weights": ["sync-weights", "--checkpoint", tiny_checkpoint],
                    "rollout": ["rollout", judged, "--checkpoint", tiny_checkpoint, "--max-new-tokens", "16", "--group-size", "4"],
                    "train-grpo": ["train-grpo", judged, "--checkpoint", tiny_checkpoint]}[stage]
            result = glmpost_cli(*args, "--out", out)
            if result.exit_code == 0:
                continue
            line = _error(result, 1)
            assert f"{out}" in line and "No space left on device" in line, (size, line)
            assert str(tiny_checkpoint) not in line and str(judged) not in line, (size, line)
            failed.append(size)
    assert failed, f"no size of {sizes_k} ran out of space"


# 8. A recipe value out of its range names the recipe, section, key and range.

@pytest.mark.parametrize("key, value, flag, problem", [
    ("lr", -1.0, "--lr", "is out of range: must be > 0"),
    ("icepop-beta", 0.5, "--icepop-beta", "is out of range: must be >= 1"),
    ("eps-low", 1.5, "--eps-low", "is out of range: must be in [0, 1)"),
])
def test_a_recipe_value_out_of_range_names_the_recipe_section_key_and_range(glmpost_cli, tiny_checkpoint, tmp_path, key,
                                                                             value, flag, problem):
    from glmpost.checkpoints import tokenizer_revision

    judged = tmp_path / "judged"
    _shard(judged / "a.msgpack.zst", revision=tokenizer_revision(tiny_checkpoint))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"[train-grpo]\n{key} = {value}\n")
    run = ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", tmp_path / "root"]
    result = glmpost_cli(*run, "--config", recipe)
    assert f"recipe {recipe}: [train-grpo] {key} = {value!r} {problem}" in _error(result, 2)
    typed = glmpost_cli(*run, flag, str(value))  # typed on the command line: the flag, and the range too
    assert f"{flag} {value!r} {problem}" in _error(typed, 2)
    assert not (tmp_path / "root").exists()


# 9. An unknown sub-table is refused like an unknown key.

def test_an_unknown_sub_table_is_refused_by_config_and_by_recipe_check(glmpost_cli, tiny_checkpoint, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text("[rollout]\ntemperature = 0.5\n[rollout.sampling]\ntop-p = 0.9\n")
    result = glmpost_cli("rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out",
                         "--config", recipe)
    assert f"recipe {recipe}: unknown sub-table [rollout.sampling] (known keys: " in _one_line(result, 2)
    assert not (tmp_path / "out").exists()
    check = glmpost_cli("recipe", "check", recipe)
    assert check.exit_code != 0 and "unknown sub-table [rollout.sampling]" in check.stderr + check.stdout
    recipe.write_text("[judge]\nverifier = []\n[judge.domains]\ngsm8k = \"math\"\n")  # a sub-table that is an option
    assert glmpost_cli("recipe", "check", recipe).exit_code == 0


# 10. The minor items.

def test_a_rerun_naming_the_root_after_publishing_is_already_done(glmpost_cli, tiny_checkpoint, tmp_path):
    from test_train_grpo import _judged

    from glmpost.checkpoints import CheckpointRoot

    judged, root = _judged(glmpost_cli, tiny_checkpoint, tmp_path), tmp_path / "root"
    assert glmpost_cli("train-grpo", judged, "--checkpoint", tiny_checkpoint, "--out", root).exit_code == 0
    again = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout) == {"out": str(root / "v000001"), "skipped": True, "policy_version": 1}
    assert f"{root / 'v000001'} was trained from these inputs with these options" in again.stderr
    assert CheckpointRoot(root).versions() == [1]
    other = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--lr", "2e-6")  # another update
    assert other.exit_code == 2 and "1 behind --checkpoint's 1" in other.stderr
    # Admitting records a version old asks for the next update on them (tests/test_trackers.py: the same
    # options, --max-version-lag 1 in both runs, train a second update; they are not "already done").
    lagged = glmpost_cli("train-grpo", judged, "--checkpoint", root, "--out", root, "--max-version-lag", "1", "--json")
    assert lagged.exit_code == 0, lagged.stderr
    assert json.loads(lagged.stdout)["policy_version"] == 2 and CheckpointRoot(root).versions() == [1, 2]


def test_serve_answers_a_negative_content_length_400_and_a_client_leaving_early_is_one_line(tiny_checkpoint):
    import socket
    import struct
    from urllib.parse import urlsplit

    from serve_process import start_server, stop_server

    proc, url = start_server(tiny_checkpoint)
    address = urlsplit(url)
    try:
        with socket.create_connection((address.hostname, address.port)) as sock:
            sock.settimeout(120)  # a guard only: today's server reads to the end of the stream, which never comes
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -5\r\n\r\n")
            head, _, body = sock.makefile("rb").read().partition(b"\r\n\r\n")  # the connection is closed after it
        assert head.split(b"\r\n")[0].split(b" ")[1] == b"400", head
        assert json.loads(body)["error"]["message"] == "Content-Length -5 is negative"
        leaving = socket.create_connection((address.hostname, address.port))
        leaving.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # half its headers, then a reset
        leaving.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        port = leaving.getsockname()[1]
        leaving.close()
        with socket.create_connection((address.hostname, address.port)) as sock:  # served after it
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.makefile("rb").read().split(b" ")[1] == b"200"
    finally:
        stop_server(proc)
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr, stderr
    assert [line for line in stderr.splitlines() if f":{port} " in line] == [
        f"glmpost: 127.0.0.1:{port} left before its request was read (ConnectionResetError)"], stderr


def test_a_failed_run_leaves_no_empty_output_folder(glmpost_cli, tiny_checkpoint, tmp_path):
    from test_train_grpo import _judged

    judged = _judged(glmpost_cli, tiny_checkpoint, tmp_path)
    damaged, _ = _damaged(tiny_checkpoint, tmp_path, version=1)
    failing = [["rollout", _prompts(tmp_path), "--checkpoint", tiny_checkpoint, "--engine", "sglang", "--server",
                "http://127.0.0.1:9", "--retries", "0"],
               ["sync-weights", "--checkpoint", damaged],
               ["train-grpo", judged, "--checkpoint", tiny_checkpoint, "--mini-batches", "99"]]
    for number, args in enumerate(failing):
        out = tmp_path / f"new-{number}" / "deeper" / "out"
        result = glmpost_cli(*args, "--out", out)
        assert result.exit_code != 0
        assert not (tmp_path / f"new-{number}").exists(), (args[0], sorted(map(str, (tmp_path / f"new-{number}").rglob("*"))))
    kept = tmp_path / "kept"  # a folder that was there before is left as it was
    kept.mkdir()
    assert glmpost_cli("sync-weights", "--checkpoint", damaged, "--out", kept / "root").exit_code == 1
    assert kept.is_dir() and not (kept / "root").exists()


def test_sync_weights_says_when_it_repairs_latest(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.checkpoints import LATEST, CheckpointRoot

    root = tmp_path / "rollout-root"
    assert glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", root).exit_code == 0
    newer, _ = _damaged(tiny_checkpoint, tmp_path, version=1, value=0.0)  # finite: a good version 1
    assert glmpost_cli("sync-weights", "--checkpoint", newer, "--out", root).exit_code == 0
    (root / LATEST).write_text("v000000\n")  # as if killed between moving v000001 in and moving LATEST
    again = glmpost_cli("sync-weights", "--checkpoint", newer, "--out", root)
    assert again.exit_code == 0, again.stderr
    assert f"{root}: LATEST named v000000, but v000001 was published; moved it" in again.stderr
    assert CheckpointRoot(root).latest() == 1


def test_the_held_out_line_says_what_avg_at_n_and_the_score_are(glmpost_cli, tiny_checkpoint, tmp_path):
    from glmpost.evaluation.run import describe_scores

    overall = {"prompts": 8, "samples": 8, "n": 1, "avg@1": 0.0, "pass@1": 0.0, "maj@1": 0.0, "score_mean": 0.0875,
               "failures": 0}
    assert describe_scores(overall, threshold=1.0) == (
        "avg@1 0.0000, pass@1 0.0000, maj@1 0.0000 (a response counts as correct at a verifier score >= 1), "
        "score_mean 0.0875 (the mean verifier score: partial credit counts, so it can be above 0 when avg@1 is 0)")
    root = tmp_path / "root"
    assert glmpost_cli("sync-weights", "--checkpoint", tiny_checkpoint, "--out", root).exit_code == 0
    prompts = Path(__file__).resolve().parents[1] / "recipes" / "data" / "count-train.jsonl"
    result = glmpost_cli("eval", prompts, "--follow", root, "--idle-timeout", "0", "--out", tmp_path / "eval", "--n", "1",
                         "--limit", "4", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("glmpost: evaluated v000000: ")]
    report = json.loads((tmp_path / "eval" / "v000000" / "report.json").read_text())["overall"]
    assert line == f"glmpost: evaluated v000000: {describe_scores(report, threshold=1.0)}"



def test_serve_answers_every_client_that_reached_it_when_sigterm_comes(tiny_checkpoint):
    """300 clients connecting at once as SIGTERM comes: each one the server took (its listen backlog
    included) gets an answer, 200 or 503 with Retry-After, none a reset (before: about half were
    reset, the backlog closed under them); one that comes after the socket closed is refused."""
    import http.client
    import signal
    import time
    from collections import Counter
    from urllib.parse import urlsplit

    from serve_process import start_server

    proc, url = start_server(tiny_checkpoint, "--batch-size", "2")
    address = urlsplit(url)
    outcomes: list[object] = []
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    barrier = threading.Barrier(301)

    def client() -> None:
        barrier.wait()
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
        try:
            connection.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            outcomes.append(response.status if response.status != 503 or response.getheader("Retry-After") else "503 bare")
        except ConnectionRefusedError:
            outcomes.append("refused")  # came after the server had gone: not one of its clients
        except (OSError, http.client.HTTPException) as exc:  # reset, broken pipe, cut short
            outcomes.append(type(exc).__name__)
        finally:
            connection.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(300)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for thread in threads:
        thread.join(timeout=120)
    counts = Counter(map(str, outcomes))
    assert len(outcomes) == 300 and set(counts) <= {"200", "503", "refused"}, counts
    assert "Traceback" not in proc.stderr.read()
