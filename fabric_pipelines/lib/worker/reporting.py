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
def reporter() -> Iterator[Reporter]:
    """The worker's reporter, through Pipes when a session listens (its context file is there),
    else printing; Pipes' channel is closed on the way out."""
    from dagster_pipes import (
        DAGSTER_PIPES_CONTEXT_ENV_VAR,
        PipesDefaultContextLoader,
        decode_env_var,
        open_dagster_pipes,
    )

    raw = os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR)
    path = decode_env_var(raw).get(PipesDefaultContextLoader.FILE_PATH_KEY) if raw else None
    if path is None or not Path(path).exists():
        yield _Printed()
        return
    with open_dagster_pipes() as pipes:
        yield _Piped(pipes)
