"""Workers started through a Dagster Pipes client: a Kubernetes pod each (`PipesK8sClient`,
defs/k8s_workers.py), a process (`PipesSubprocessClient`), or any client with a blocking `run`.

A client's `run` starts one external process, holds its Pipes session and returns when it ends,
raising if it failed. `ClientRun` calls it in a thread of its own and looks like a process to
`supervise` (poll, wait, stop, kill), so the step starts, watches, replaces and stops these
workers as it does its own processes: lost workers are told by the same alive file on the shared
data root, stopping one is the launcher's `cancel` (delete its pod, end its process). The worker
itself is the same program whatever started it: it reads Pipes' bootstrap variables, which the
client sets.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.worker.launch import (
    LaunchSettings,
    WorkerInvocation,
    WorkerProcess,
    worker_invocation,
)

# How long a killed client run may take to return before the step stops waiting for it (its
# thread is a daemon: a client stuck in a cluster call does not hold the step).
KILL_WAIT_S = 60.0


class SharedDatabaseRequired(ValueError):
    """Workers on other hosts were asked for with a results database only this host can open."""


def require_shared_database(url: str, task_set: str) -> None:
    """Refuse SQLite for workers on other hosts: its file is on this host's disk."""
    if url.startswith("sqlite"):
        raise SharedDatabaseRequired(
            f"task set {task_set!r}: workers on other hosts need a results database they can "
            f"reach, and SQLite ({url}) is a file on this host. Set FABRIC_DATABASE_URL to a "
            "PostgreSQL URL (and the Secret that deploy/k8s/workers.yaml names to the same URL), "
            "or run the workers on this host (the engine's launcher: local)."
        )


class ClientRun:
    """A Pipes client's `run` of one worker, in a thread, seen as a process: returncode 0 when
    it returned, 1 when it raised (`error` says what), None while it runs."""

    def __init__(self, name: str, run: Callable[[], Any], cancel: Callable[[bool], None]):
        self.name = name
        self.returncode: int | None = None
        self.result: Any = None  # what `run` returned (Pipes: the completed invocation)
        self.error: BaseException | None = None
        self._run = run
        self._cancel = cancel
        self._thread = threading.Thread(target=self._main, name=f"fabric-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            self.result = self._run()
            code = 0
        except BaseException as exc:  # the client's error is the worker's failure, named
            self.error = exc
            code = 1
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(KILL_WAIT_S if timeout is None else timeout)
        if self.returncode is None:
            if timeout is not None:
                raise subprocess.TimeoutExpired(self.name, timeout)
            self.returncode = 137  # given up on: its client did not return after the kill
        return self.returncode

    def stop(self) -> None:
        if self.returncode is None:
            self._cancel(True)

    def kill(self) -> None:
        if self.returncode is None:
            self._cancel(False)


@dataclass(frozen=True)
class PipesClientLauncher:
    """Starts each worker with `run(settings, invocation, device)` (a Pipes client's run, in a
    thread) and ends one with `cancel(invocation, graceful)`. `on_this_host`: the workers are
    processes here (bound to this process, handed their GPU by CUDA_VISIBLE_DEVICES, sharing
    its cores); otherwise they need a database other hosts reach. `finished(owner, result)`
    hears each run that returned, from the supervising thread once it is reaped."""

    run: Callable[[LaunchSettings, WorkerInvocation, int | None], Any]
    cancel: Callable[[WorkerInvocation, bool], None]
    on_this_host: bool
    finished: Callable[[str, Any], None] | None = None
    python: str = sys.executable

    def start(
        self,
        settings: LaunchSettings,
        index: int,
        folder: Path,
        device: int | None,
        *,
        threads_of: int,
        generation: int = 0,
        go_file: Path | None = None,
    ) -> WorkerProcess:
        if not self.on_this_host:
            require_shared_database(settings.database_url, settings.task_set)
        folder.mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // threads_of) if self.on_this_host else 0
        invocation = worker_invocation(
            settings, index, folder, threads=threads, generation=generation, go_file=go_file,
            python=self.python, parent_pid=os.getpid() if self.on_this_host else None,
        )  # fmt: skip
        run = ClientRun(
            invocation.owner,
            lambda: self.run(settings, invocation, device),
            lambda graceful: self.cancel(invocation, graceful),
        )
        worker = WorkerProcess(
            invocation.owner, run, invocation.report, invocation.log, index, invocation.alive
        )
        if self.finished is not None:
            finished = self.finished
            worker.channel.callback(
                lambda: finished(invocation.owner, run.result) if run.result is not None else None
            )
        run.start()
        return worker


def local_worker_env(settings: LaunchSettings, device: int | None) -> dict[str, str]:
    """What a worker on this host adds to the environment a client starts it with."""
    env = {
        "FABRIC_DATABASE_URL": settings.database_url,
        "FABRIC_HOME": str(settings.data_root),
        "HF_HUB_OFFLINE": "1",
    }
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    return env


def end_local_worker(invocation: WorkerInvocation, graceful: bool) -> None:
    """End a worker process of this host by the pid it wrote in its alive file (a client that
    runs it, such as `PipesSubprocessClient`, keeps its process to itself)."""
    pid = alive_pid(invocation.alive)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if not graceful:
                os.kill(pid, signal.SIGCONT)  # a stopped one cannot act on SIGTERM
            os.kill(pid, signal.SIGTERM if graceful else signal.SIGKILL)


def alive_pid(path: Path) -> int | None:
    """The pid a worker of this host wrote in its alive file (None: not written yet, or the
    worker runs on another host)."""
    try:
        host, pid = path.read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    return int(pid) if host == socket.gethostname() else None
