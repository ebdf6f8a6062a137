"""The extraction step's workers report through Dagster Pipes.

Each worker the step runs gets a Pipes session of its own on the two files its launch named
(lib/worker/reporting.py: a file context injector and a file message reader, in the run's
worker folder on the data root), opened before the worker reads its job and closed once it has
exited: its log lines land in the step's log as they come, and its counts, its last message,
become an observation of the set's `extraction_outputs`, one per worker, in the run's event log.
The workers are processes of this host, started, stopped and replaced by lib/worker/launch.py
around a Pipes session the way `PipesSubprocessClient` runs one process, which, waiting on a
single process, could neither stop the group of a lost worker nor start its stand-in.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from fabric_pipelines.lib.worker.launch import WorkerChannel
from fabric_pipelines.lib.worker.reporting import COUNTS, pipes_env


def pipes_channel(context: dg.AssetExecutionContext) -> WorkerChannel:
    """A Pipes session per worker of this step (see the module's doc)."""

    @contextmanager
    def channel(owner: str, context_file: Path, messages_file: Path) -> Iterator[None]:
        with dg.open_pipes_session(
            context=context,
            context_injector=dg.PipesFileContextInjector(str(context_file)),
            message_reader=dg.PipesFileMessageReader(str(messages_file)),
            extras={"owner": owner},
        ) as session:
            # The worker was started with these variables: the session must be where it looks.
            if session.get_bootstrap_env_vars() != pipes_env(context_file, messages_file):
                raise RuntimeError(
                    f"the Pipes session of worker {owner} is not where the worker reports: "
                    f"{session.get_bootstrap_env_vars()} against "
                    f"{pipes_env(context_file, messages_file)}"
                )
            yield
        for message in session.get_custom_messages():
            if isinstance(message, dict) and message.get("kind") == COUNTS:
                counts = {k: v for k, v in message.items() if k != "kind"}
                context.log_event(
                    dg.AssetObservation(
                        asset_key=context.asset_key,
                        partition=context.partition_key,
                        metadata={"worker": owner, **counts},
                    )
                )

    return channel
