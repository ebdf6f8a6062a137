"""What a worker tells the step that launched it, through Dagster Pipes where the step listens.

Every worker is started with Pipes' bootstrap variables naming two files in its run folder (its
context, its messages: `pipes_files`), on the data root, which a worker on another host sees
too. A step that listens opens a Pipes session on those files (defs/worker_pipes.py) before the
worker reads its job: the worker's log lines then land in the run's event log as they come, and
its counts, its last message, become an observation of the set. Where no session was opened (the
fault drills, a run outside Dagster) the context file is not there and the worker prints alone.
`dagster_pipes` is the external process's side of Pipes: a small package that does not import
Dagster itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

# The custom message a worker ends with (the step reads it by this kind).
COUNTS = "worker_counts"


class Reporter(Protocol):
    def info(self, message: str) -> None: ...

    def counts(self, counts: Mapping[str, Any]) -> None: ...


class _Printed:
    def info(self, message: str) -> None:
        print(message, flush=True)

    def counts(self, counts: Mapping[str, Any]) -> None:
        pass  # the report file and the final JSON line say it


class _Piped:
    def __init__(self, pipes: Any) -> None:
        self._pipes = pipes

    def info(self, message: str) -> None:
        print(message, flush=True)  # the worker's own log file keeps it too
        self._pipes.log.info(message)

    def counts(self, counts: Mapping[str, Any]) -> None:
        self._pipes.report_custom_message({"kind": COUNTS, **counts})


def pipes_files(folder: Path, stem: str) -> tuple[Path, Path]:
    """Where worker `stem` of a run finds its Pipes context and writes its messages."""
    return folder / f"{stem}.pipes-context.json", folder / f"{stem}.pipes-messages.jsonl"


def pipes_env(context_path: Path, messages_path: Path) -> dict[str, str]:
    """Pipes' bootstrap variables for a worker reading and writing those files: what a session
    opened on them with a file context injector and a file message reader gives."""
    from dagster_pipes import (
        DAGSTER_PIPES_CONTEXT_ENV_VAR,
        DAGSTER_PIPES_MESSAGES_ENV_VAR,
        PipesDefaultContextLoader,
        PipesDefaultMessageWriter,
        encode_env_var,
    )

    return {
        DAGSTER_PIPES_CONTEXT_ENV_VAR: encode_env_var(
            {PipesDefaultContextLoader.FILE_PATH_KEY: str(context_path)}
        ),
        DAGSTER_PIPES_MESSAGES_ENV_VAR: encode_env_var(
            {
                PipesDefaultMessageWriter.FILE_PATH_KEY: str(messages_path),
                PipesDefaultMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: False,
            }
        ),
    }


@contextlib.contextmanager
def reporter(bootstrap: Mapping[str, str] | None = None) -> Iterator[Reporter]:
    """The worker's reporter, through Pipes when a session listens (a client's variables, or its
    context file is there), else printing; Pipes' channel is closed on the way out. `bootstrap`:
    Pipes' variables for this job (a pool worker's, handed with each job), else the
    environment's. A context of its own each time, not Pipes' process-wide one: a pool worker
    reports to a new session for every job."""
    from dagster_pipes import (
        DAGSTER_PIPES_CONTEXT_ENV_VAR,
        PipesContext,
        PipesDefaultContextLoader,
        PipesDefaultMessageWriter,
        PipesMappingParamsLoader,
        decode_env_var,
    )

    variables = os.environ if bootstrap is None else bootstrap
    raw = variables.get(DAGSTER_PIPES_CONTEXT_ENV_VAR)
    if not raw:  # no Pipes client started it (a fault drill, a run outside Dagster)
        yield _Printed()
        return
    # A context file this host's launcher named but no step opened a session on: nobody listens.
    # A client's own injection (its context in the variable, a file it wrote) is always heard.
    path = decode_env_var(raw).get(PipesDefaultContextLoader.FILE_PATH_KEY)
    if path is not None and not Path(path).exists():
        yield _Printed()
        return
    params = PipesMappingParamsLoader(dict(variables))
    with PipesContext(params, PipesDefaultContextLoader(), PipesDefaultMessageWriter()) as pipes:
        yield _Piped(pipes)


def announce_start(report: Reporter, owner: str, plan_id: str) -> None:
    """A worker's first line to its step, once it has its job."""
    report.info(
        f"worker {owner} started (pid {os.getpid()}, device "
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'cpu')}): pulling batches of plan {plan_id}"
    )


def announce_done(report: Reporter, owner: str, done: Any, seconds: float) -> None:
    """A worker's last line and its counts (`done`: its loop's report)."""
    report.info(
        f"worker {owner} done: {done.batches_done} batches, {done.rows_inserted} rows, "
        f"{done.real_tokens} real tokens, {done.batches_failed} batches failed, "
        f"{done.stale_acks} stale acks, {seconds:.1f} s"
    )
    report.counts({
        "owner": owner, "batches_done": done.batches_done,
        "batches_failed": done.batches_failed, "rows_inserted": done.rows_inserted,
        "real_tokens": done.real_tokens, "stale_acks": done.stale_acks,
        "seconds": round(seconds, 3),
    })  # fmt: skip
