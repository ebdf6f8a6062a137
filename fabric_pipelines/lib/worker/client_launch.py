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
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.worker.launch import (
    LaunchSettings,
    WorkerInvocation,
    WorkerProcess,
    share_of_cores,
    worker_invocation,
)
from fabric_pipelines.lib.worker.procs import pid_alive, runs_module

# How long a killed client run may take to return before the step stops waiting for it (its
# thread is a daemon: a client stuck in a cluster call does not hold the step), and how often it
# is asked again meanwhile.
KILL_WAIT_S = 60.0
CANCEL_AGAIN_S = 2.0
# A worker of another host that has not written its alive file this long after its start (a pod
# not scheduled, its image not pulled) counts as silent from then on: lost after its lease.
DEFAULT_START_GRACE_S = 900.0

log = logging.getLogger(__name__)


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
    it returned, 1 when it raised (`error` says what), None while it runs.

    Stopping it asks its launcher to end it (`cancel`) and asks again while the thread runs: a
    first ask can come before the pod or process exists. A run that does not return within
    KILL_WAIT_S of the kill is given up on (137): its thread is a daemon."""

    def __init__(self, name: str, run: Callable[[], Any], cancel: Callable[[bool], None]):
        self.name = name
        self.returncode: int | None = None
        self.result: Any = None  # what `run` returned (Pipes: the completed invocation)
        self.error: BaseException | None = None
        self._run = run
        self._cancel = cancel
        self._graceful: bool | None = None  # how it was asked to end, once it was
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
        if self.returncode is None:  # not given up on meanwhile
            self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        deadline = time.monotonic() + (KILL_WAIT_S if timeout is None else timeout)
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(min(CANCEL_AGAIN_S, max(0.0, deadline - time.monotonic())))
            if self._thread.is_alive() and self._graceful is not None:
                self._ask(self._graceful)  # the pod or process may exist only now
        if self.returncode is None:
            if timeout is not None:
                raise subprocess.TimeoutExpired(self.name, timeout)
            self.give_up()  # its client did not return after the kill
        assert self.returncode is not None
        return self.returncode

    def stop(self) -> None:
        if self.returncode is None:
            self._graceful = True if self._graceful is None else self._graceful
            self._ask(self._graceful)

    def kill(self) -> None:
        if self.returncode is None:
            self._graceful = False
            self._ask(False)

    def give_up(self) -> None:
        if self.returncode is None:
            log.warning("worker %s did not end when asked: no longer waited for", self.name)
            self.returncode = 137

    def _ask(self, graceful: bool) -> None:
        try:
            self._cancel(graceful)
        except Exception as exc:  # a cluster that does not answer: asked again while waiting
            log.warning("ending worker %s: %s: %s", self.name, type(exc).__name__, exc)


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
    start_grace_s: float = DEFAULT_START_GRACE_S

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
        threads = share_of_cores(threads_of) if self.on_this_host else 0  # 0: the pod's all
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
            invocation.owner, run, invocation.report, invocation.log, index, invocation.alive,
            start_grace_s=None if self.on_this_host else self.start_grace_s,
        )  # fmt: skip
        if self.finished is not None:
            finished = self.finished
            worker.channel.callback(
                lambda: finished(invocation.owner, run.result) if run.result is not None else None
            )
        run.start()
        return worker


def end_local_worker(invocation: WorkerInvocation, graceful: bool) -> None:
    """End a worker process of this host by the pid it wrote in its alive file (a client that
    runs it, such as `PipesSubprocessClient`, keeps its process to itself), if that pid is still
    the worker's."""
    pid = alive_pid(invocation.alive)
    if pid is not None and runs_worker(pid, invocation.alive):
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


def runs_worker(pid: int, alive: Path) -> bool:
    """`pid` is still the worker that writes `alive` (not a process that took its pid since it
    exited: pids come round again within a long run)."""
    return pid_alive(pid) and runs_module(pid, str(alive))
