"""The extraction step's workers report through Dagster Pipes, whichever launcher starts them.

`worker_launcher` picks the engine resource's launcher (lib/worker/launch.py's seam):
- "local" (the default): this host's processes, started, stopped and replaced by
  lib/worker/launch.py around a Pipes session each, on the two files its launch named
  (lib/worker/reporting.py: a file context injector and a file message reader, in the run's
  worker folder), opened before the worker reads its job and closed once it has exited. This is
  how `PipesSubprocessClient` runs one process; that client, waiting on a single process, could
  neither stop the group of a lost worker nor start its stand-in, nor hand a prestarted worker a
  session;
- "pipes-subprocess": the same processes through `PipesSubprocessClient` itself, one per thread
  (lib/worker/client_launch.py): the seam the pods use, checked on one host;
- "kubernetes": a pod per worker through dagster-k8s's `PipesK8sClient` (defs/k8s_workers.py).
Whichever it is, a worker's log lines land in the step's log as they come, and its counts, its
last message, become an observation of the set's `extraction_outputs`, one per worker.
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

from fabric_pipelines.lib.worker.client_launch import (
    PipesClientLauncher,
    end_local_worker,
    require_shared_database,
)
from fabric_pipelines.lib.worker.launch import (
    Launcher,
    LaunchSettings,
    LocalLauncher,
    WorkerChannel,
    WorkerInvocation,
    worker_env,
)
from fabric_pipelines.lib.worker.reporting import COUNTS, pipes_env

LAUNCHERS = ("local", "pipes-subprocess", "kubernetes")


def worker_launcher(
    context: dg.AssetExecutionContext,
    launcher: str,
    worker_pods: str,
    data_root: Path,
    database_url: str,
) -> Launcher:
    """The engine resource's `launcher` for this step (see the module's doc)."""
    if launcher == "local":
        return LocalLauncher(pipes_channel(context))
    if launcher == "pipes-subprocess":
        return subprocess_client_launcher(context)
    if launcher == "kubernetes":
        from fabric_pipelines.defs.k8s_workers import kubernetes_launcher
        from fabric_pipelines.lib.worker.pods import DEFAULT_CONFIG, WorkerPods

        require_shared_database(database_url, context.partition_key)  # before the pods' file
        pods = WorkerPods.load(Path(worker_pods) if worker_pods else DEFAULT_CONFIG)
        return kubernetes_launcher(
            context, pods, data_root, database_url, finished=_counts_logger(context)
        )
    raise ValueError(
        f"the engine's launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}: set "
        "resources.engine.config.launcher (fabric: --launcher)"
    )


def pipes_channel(context: dg.AssetExecutionContext) -> WorkerChannel:
    """A Pipes session per local worker of this step (see the module's doc)."""

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
        log_counts(context, owner, session.get_custom_messages())

    return channel


def log_counts(context: dg.AssetExecutionContext, owner: str, messages: Iterable[Any]) -> None:
    """A worker's counts (its last custom message) as an observation of the step's set."""
    for message in messages:
        if isinstance(message, dict) and message.get("kind") == COUNTS:
            counts = {k: v for k, v in message.items() if k != "kind"}
            context.log_event(
                dg.AssetObservation(
                    asset_key=context.asset_key,
                    partition=context.partition_key if context.has_partition_key else None,
                    metadata={"worker": owner, **counts},
                )
            )


def subprocess_client_launcher(context: dg.AssetExecutionContext) -> PipesClientLauncher:
    """This host's workers, each run by `PipesSubprocessClient` in a thread of its own."""
    client = dg.PipesSubprocessClient()

    def run(settings: LaunchSettings, invocation: WorkerInvocation, device: int | None) -> Any:
        # The worker's output goes to its log file, as a local worker's does (`exec`: the pid
        # it writes in its alive file is the one to end).
        command = [
            "/bin/sh",
            "-c",
            'exec "$@" >"$0" 2>&1',
            str(invocation.log),
            *invocation.command,
        ]
        return client.run(
            context=context, command=command, env=worker_env(settings, device),
            extras={"owner": invocation.owner},
        )  # fmt: skip

    return PipesClientLauncher(
        run, end_local_worker, on_this_host=True, finished=_counts_logger(context)
    )


def _counts_logger(context: dg.AssetExecutionContext) -> Callable[[str, Any], None]:
    """What a Pipes client's completed run of a worker reported, logged as its counts."""
    return lambda owner, result: log_counts(context, owner, result.get_custom_messages())
