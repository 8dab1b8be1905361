"""The ``glmpost`` command: one typer app, one module per stage."""

from __future__ import annotations

import logging
import sys
from typing import Any

import typer

from glmpost import __version__
from glmpost.commands import (
    diff_logprobs,
    eval,
    import_model,
    init_critic,
    init_model,
    judge,
    opd_merge,
    plan,
    qat,
    quantize,
    recipe,
    report,
    rollout,
    score_teacher,
    serve,
    shards,
    shards_import,
    sync_weights,
    train_grpo,
    train_sao,
)
from glmpost.commands.options import spelled_with_flags
from glmpost.errors import GlmpostError, first_line, storage_error

app = typer.Typer(
    name="glmpost",
    help=(
        "GLM-style post-training beyond SFT as Unix-style stages. Each stage reads and writes "
        "trajectory shards or checkpoints, so shell or Slurm scripts chain them and any stage can "
        "be rerun on saved shards. Exit codes: 0 done, 1 the work failed, 2 the invocation was wrong."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"glmpost {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", help="Print the glmpost version and exit.", is_eager=True, callback=_print_version
    ),
) -> None:
    """GLM-style post-training beyond SFT as Unix-style stages."""


# In the order of GLM-5's pipeline, then the tools around it; every stage's metrics lines go to its --tracker.
def _stage(name: str, module: Any, fn: Any, *, group: Any = app, section: str | None = None) -> None:
    group.command(name, help=module.__doc__)(spelled_with_flags(fn, tracked=section or name))


_stage("init-model", init_model, init_model.init_model)
_stage("import-model", import_model, import_model.import_model)
_stage("init-critic", init_critic, init_critic.init_critic)
_stage("qat", qat, qat.qat)
_stage("rollout", rollout, rollout.rollout)
_stage("judge", judge, judge.judge)
_stage("eval", eval, eval.eval_command)
_stage("train-grpo", train_grpo, train_grpo.train_grpo)
_stage("train-sao", train_sao, train_sao.train_sao)
_stage("sync-weights", sync_weights, sync_weights.sync_weights)
_stage("serve", serve, serve.serve)
_stage("score-teacher", score_teacher, score_teacher.score_teacher)
_stage("opd-merge", opd_merge, opd_merge.opd_merge)
_stage("quantize", quantize, quantize.quantize)
_stage("diff-logprobs", diff_logprobs, diff_logprobs.diff_logprobs)
_stage("import", shards_import, shards_import.shards_import, group=shards.app, section="shards import")
app.add_typer(shards.app, name="shards")
app.add_typer(recipe.app, name="recipe")
app.command("plan", help=plan.__doc__)(spelled_with_flags(plan.plan))
_stage("report", report, report.report)


class _LogsToStderr(logging.Logger):
    """A logger whose console handlers write to stderr even when a library asks for stdout."""

    def addHandler(self, handler: logging.Handler) -> None:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
        handler.addFilter(_drop_cpu_fallback_notice)
        super().addHandler(handler)


def _drop_cpu_fallback_notice(record: logging.LogRecord) -> bool:
    # DeepSpeed warns on every import that it fell back to CPU; on a CPU run that is expected.
    return not record.getMessage().startswith("Setting accelerator to CPU")


def _keep_stdout_for_results() -> None:
    """stdout carries results (``--json``): DeepSpeed, which transformers imports when it saves or
    loads a model, logs to stdout; its logger is created here first, so its messages go to stderr."""
    previous = logging.getLoggerClass()
    logging.setLoggerClass(_LogsToStderr)
    try:
        logging.getLogger("DeepSpeed")
    finally:
        logging.setLoggerClass(previous)


# typer may bundle its own copy of click: find its exception classes through typer's public names.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_ClickUsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors become one line on stderr and an exit code, never a traceback."""
    _keep_stdout_for_results()
    try:
        code = app(args=argv, prog_name="glmpost", standalone_mode=False)
    except GlmpostError as exc:
        sys.stderr.write(f"glmpost: error: {exc}\n")
        sys.exit(exc.exit_code)
    except _ClickUsageError as exc:  # a missing or invalid option: one line, and where to look
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `glmpost` or `glmpost shards`: the help
            sys.stderr.write(exc.format_message().rstrip("\n") + "\n")
            sys.exit(2)
        where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        sys.stderr.write(f"glmpost: error: {exc.format_message()}{where}\n")
        sys.exit(2)
    except _ClickException as exc:
        sys.stderr.write(f"glmpost: error: {exc.format_message()}\n")
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        sys.stderr.write("glmpost: interrupted\n")
        sys.exit(130)
    except BrokenPipeError:  # a reader such as `| head` went away: not an error of ours
        sys.stderr.close()
        sys.exit(0)
    except Exception as exc:  # a full or read-only file system, wherever it happens: one line
        if not storage_error(exc):
            raise
        if isinstance(exc, OSError):
            written = exc.filename2 or exc.filename  # a copy names its source first, the file it writes second
            message = f"{written}: {exc.strerror}" if written else str(exc.strerror or exc)
        else:
            message = f"{type(exc).__name__}: {first_line(exc)}"
        sys.stderr.write(f"glmpost: error: {message}\n")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
