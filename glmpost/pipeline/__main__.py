"""``python -m glmpost.pipeline RECIPE [--shell | --json]``: the plan for ``bin/pipeline`` and
``bin/slurm/submit-pipeline`` (see :mod:`glmpost.pipeline`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from glmpost.errors import GlmpostError, UsageError
from glmpost.pipeline.plan import plan, shell_assignments
from glmpost.pipeline.recipe import load_pipeline
from glmpost.pipeline.steps import pipeline_steps, step_assignments
from glmpost.toml import tomllib


def _parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE in TOML (``iterations=2``, ``launcher="npu"``); a bare word is a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UsageError(f"--set {text}: expected KEY=VALUE (a [pipeline] key and a TOML value)")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glmpost.pipeline",
        description="Validate a recipe's [pipeline] section and print its plan (paths of every step).",
    )
    parser.add_argument("recipe", help="TOML recipe with a [pipeline] section.")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="Override a [pipeline] key (TOML value); repeatable.")
    parser.add_argument("--run-dir", help="Override [pipeline] run-dir.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--shell", action="store_true", help="Print the plan and its steps as bash assignments for eval.")
    mode.add_argument("--json", action="store_true", help="Print the configuration, plan and steps (name, argv, inputs, outputs, ranks) as JSON.")
    args = parser.parse_args(argv)
    try:
        overrides = dict(_parse_override(s) for s in args.set)
        if args.run_dir:
            overrides["run-dir"] = args.run_dir
        config = load_pipeline(args.recipe, overrides)
        paths = plan(config)
        steps = pipeline_steps(config, paths)
    except GlmpostError as exc:
        sys.stderr.write(f"glmpost: error: {exc}\n")
        return exc.exit_code
    if args.shell:
        sys.stdout.write(shell_assignments(config, paths) + step_assignments(steps))
    elif args.json:
        payload = {"config": asdict(config), "plan": asdict(paths), "steps": [asdict(step) for step in steps]}
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    else:
        sys.stdout.write(f"ok: {config.recipe}: stages {' -> '.join(config.stages)} ({len(steps)} steps); outputs under {config.run_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
