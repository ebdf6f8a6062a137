"""Worker processes: one per GPU (or several on the CPU), each pulling batches from the ledger.

`launch_workers` starts them as `python -m fabric_pipelines.lib.worker.main ...` (the child's side
is `worker/main.py`) with the engine's
manifest in a file, the database URL in the environment (never on a command line, where a
password would show in `ps`), and CUDA_VISIBLE_DEVICES set per worker for GPU engines so each
owns one device. `supervise` waits for them, reporting progress from the database, and collects
each worker's JSON report. A worker that dies leaves its batch leased; its lease expires and a
surviving worker (or the next run) takes it over.

Workers are bound to their run. Each runs in a process group of its own, which the supervisor
terminates (then kills, then reaps) on every way out of `supervise` — a failed worker, a failed
database poll, a cancelled or interrupted step — so no orphan keeps writing rows, or keeps using
a GPU whose device lease the step gives back once `extract_task_set` returns. A worker whose
supervisor dies outright (SIGKILL) follows it: the kernel sends it SIGKILL (PR_SET_PDEATHSIG),
and a watchdog thread checks its parent every second as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.broker.ledger import (
    DEFAULT_LEASE_SECONDS,
    Accounting,
    accounting,
    heartbeat_interval,
)
from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.core.retry import retry
from fabric_pipelines.lib.core.signals import stop_requests
from fabric_pipelines.lib.worker import MAIN_MODULE

STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL


@dataclass(frozen=True)
class LaunchSettings:
    task_set: str
    manifest_path: Path  # the engine manifest, JSON
    data_root: Path
    database_url: str
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    heartbeat_seconds: float | None = None  # None: a third of the lease
    max_attempts: int = 3

    @property
    def folder(self) -> Path:
        """Where the run's manifest, worker reports and logs live."""
        return self.manifest_path.parent


@dataclass
class WorkerProcess:
    owner: str
    process: subprocess.Popen[bytes]
    report_path: Path
    log_path: Path


def launch_workers(
    settings: LaunchSettings,
    count: int,
    folder: Path,
    devices: list[int] | None = None,
    go_file: Path | None = None,
) -> list[WorkerProcess]:
    """Start `count` worker processes; worker i gets GPU devices[i] when devices are given.
    With `go_file`, each loads its engine and then waits for that file before reading the plan.

    Each is the leader of a new process group (stop them with `stop_workers`) and dies with the
    thread that starts it: start them from the thread that supervises them."""
    every = heartbeat_interval(settings.lease_seconds, settings.heartbeat_seconds)
    folder.mkdir(parents=True, exist_ok=True)
    workers: list[WorkerProcess] = []
    try:
        for i in range(count):
            owner = f"{socket.gethostname()}:{os.getpid()}:w{i}"
            env = {
                **os.environ,
                "FABRIC_DATABASE_URL": settings.database_url,
                "FABRIC_HOME": str(settings.data_root),
                "HF_HUB_OFFLINE": "1",
            }
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(devices[i])  # the device lease: one GPU each
            report = folder / f"worker-{i}.json"
            log = folder / f"worker-{i}.log"
            command = [
                sys.executable, "-m", MAIN_MODULE,
                settings.task_set,
                "--manifest", str(settings.manifest_path),
                "--owner", owner,
                "--lease-seconds", str(settings.lease_seconds),
                "--heartbeat-seconds", str(every),
                "--max-attempts", str(settings.max_attempts),
                "--report", str(report),
                "--threads", str(max(1, (os.cpu_count() or 1) // count)),
                "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            if go_file is not None:
                command += ["--go-file", str(go_file)]
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            workers.append(WorkerProcess(owner, process, report, log))
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    # The group outlives its leader while anything the worker started still runs in it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def stop_workers(workers: list[WorkerProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Terminate every worker's process group, give it `grace_s` to go, kill what is left and
    reap the workers. A no-op for workers that already exited on their own."""
    for w in workers:
        _signal_group(w.process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        _signal_group(w.process, signal.SIGKILL)
    for w in workers:
        w.process.wait()


def supervise(
    workers: list[WorkerProcess],
    db: Any,
    task_set: str,
    on_progress: Callable[[Accounting], None] | None = None,
    poll_s: float = 5.0,
) -> list[dict[str, Any]]:
    """Wait for every worker; returns their reports. A worker that failed raises, with its log.

    Whatever way this returns or raises, no worker of it is left running (`stop_workers`); SIGINT
    or SIGTERM meanwhile raises StopRequested here, after the workers are stopped."""

    try:
        with stop_requests() as check_stop:
            next_report = time.monotonic() + poll_s
            while any(w.process.poll() is None for w in workers):
                # Short naps: the stage ends as soon as its last worker does, not at the next
                # report.
                time.sleep(0.05)
                check_stop()
                if on_progress is not None and time.monotonic() >= next_report:
                    next_report = time.monotonic() + poll_s
                    on_progress(read_accounting(db, task_set))
        reports = []
        for w in workers:
            if w.process.returncode != 0:
                tail = w.log_path.read_text(errors="replace")[-4000:] if w.log_path.exists() else ""
                raise RuntimeError(f"worker {w.owner} exited with {w.process.returncode}:\n{tail}")
            reports.append(json.loads(w.report_path.read_text()))
        return reports
    finally:
        stop_workers(workers)


def read_accounting(db: Any, task_set: str) -> Accounting:
    """The set's accounting for a progress report, read through transient database errors."""

    def poll() -> Accounting:
        with db.connect() as conn:
            return accounting(conn, task_set)

    return retry(f"reading the accounting of task set {task_set!r}", poll)


def launch_settings(
    paths: Any,
    task_set: str,
    manifest: Any,
    database_url: str,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    heartbeat_seconds: float | None = None,
) -> LaunchSettings:
    """A run's worker settings, with a fresh folder holding its manifest, reports and logs."""
    folder = paths.root / "workers" / f"{task_set}-{time.time_ns() // 1000}"
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / "engine.json"
    write_bytes(manifest_path, json.dumps(manifest.to_mapping()).encode())
    return LaunchSettings(
        task_set,
        manifest_path,
        paths.root,
        database_url,
        lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_seconds,
    )
