"""The `fabric` command line: demo, submit, run, status, verify, requeue, restore-plan, db,
index, receipt, worker.

Runs go through the same Dagster definitions the UI uses, in-process, against the instance in
DAGSTER_HOME, so every run shows up in the UI afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fabric_pipelines.cli.environment import prepare_environment
from fabric_pipelines.cli.errors import environment_error
from fabric_pipelines.cli.parser import build_parser
from fabric_pipelines.cli.pipeline import quiet_dagster
from fabric_pipelines.cli.workers import run_worker_process
from fabric_pipelines.lib.core.signals import stop_on_signals


def main(argv: Sequence[str] | None = None, started_at: float | None = None) -> int:
    """The `fabric` command. `started_at`: when the command started, where a warm runner's child
    runs it for a `fabric` process started earlier (cli/warm_client.py, cli/warm_server.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM interrupts like Ctrl-C (workers stopped, the run's clean-up done), also when the
    # shell that started us ignores SIGINT (docs/operating.md, "Stopping a run").
    stop_on_signals(sigterm_interrupts=True)
    if argv[:1] == ["worker"]:  # its own parser (fabric_pipelines.lib.worker.main), options and all
        return run_worker_process(argv[1:])
    from fabric_pipelines.cli.run_clock import begin

    begin("cli_started", at=started_at)
    args = build_parser().parse_args(argv)
    runs_pipeline = args.command in ("run", "demo") or (args.command == "submit" and args.run)
    environment = None
    if runs_pipeline:
        root = prepare_environment()
        environment = dict(os.environ)  # before the run changes it: the next run's runner key
        code = _in_warm_runner(argv, args, root)
        if code is not None:
            return code
    quiet_dagster()
    from fabric_pipelines.lib.core.names import InvalidNameError

    try:
        result: int = args.func(args)
    except InvalidNameError as exc:
        print(f"fabric {args.command}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        message = environment_error(exc)
        if message is None:
            raise
        print(f"fabric {args.command}: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"fabric {args.command}: interrupted; nothing acknowledged is lost, and running the "
            "same command again does only what is left",
            file=sys.stderr,
        )
        return 130
    if environment is not None:
        _leave_warm_runner(args, root, environment)
    return result


def _in_warm_runner(argv: list[str], args: argparse.Namespace, root: Path) -> int | None:
    """Run the command in a warm runner of this data root, code and settings, if one serves:
    its exit code; None to run it here."""
    from fabric_pipelines.cli.run_clock import marks
    from fabric_pipelines.cli.warm_client import enabled, forward

    if not enabled() or _pool_idle_seconds(args) <= 0:
        return None
    return forward(argv, root, marks()["cli_started"])


def _leave_warm_runner(args: argparse.Namespace, root: Path, environment: dict[str, str]) -> None:
    """After a run made here, start a warm runner for the next (idle exit as the engine pool)."""
    from fabric_pipelines.cli.warm_client import enabled, start_in_background

    if not enabled():
        return
    with contextlib.suppress(Exception):  # a run that worked is not failed for its successor
        start_in_background(root, _pool_idle_seconds(args), environment)


def _pool_idle_seconds(args: argparse.Namespace) -> float:
    from fabric_pipelines.lib.worker.pool.client import idle_seconds_setting

    try:
        return idle_seconds_setting(getattr(args, "pool_idle_seconds", None))
    except ValueError:
        return 0.0  # the run itself reports the bad setting


def run_command() -> None:
    """The `fabric` console script. Once a command has returned, everything it wrote is
    committed and fsynced: exit without the interpreter's teardown, which (torch and the CUDA
    context loaded by an index build) takes a second or more after a run."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
