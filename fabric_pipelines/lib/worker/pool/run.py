"""A run's extraction on the warm engine pool (engine_pool.py).

For each of the run's slots (its leased GPUs, or CPU workers 0..n-1) the run finds the data
root's pool worker, starts one where there is none (or where an idle one serves another
manifest), and hands it the job, on a thread per slot: nothing here waits for an engine to load.
A slot whose pool worker does not take the job (busy with another run, it failed to start, or
it is bound to a data root or database deleted since: client.py) gets a worker of the run's own,
as without a pool. A pool worker lost on the way (killed, crashed) is replaced at once by a
worker of the run's own on the same device, which takes over the lost worker's batches once
their leases run out: nothing is lost or done twice, and the next run starts a new pool worker
for that slot by itself.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.broker.ledger import Accounting
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.core.signals import stop_requests
from fabric_pipelines.lib.store.identity import database_identity_at
from fabric_pipelines.lib.worker.launch import (
    LaunchSettings,
    LocalLauncher,
    WorkerChannel,
    WorkerProcess,
    launch_workers,
    read_accounting,
    stop_workers,
    supervise,
)
from fabric_pipelines.lib.worker.pool.client import (
    PoolJob,
    manifest_sha256,
    pool_states,
    slots_for,
    start_pool_worker,
    starting_pid,
    stop_pool,
    worker_threads,
)
from fabric_pipelines.lib.worker.reporting import pipes_env, pipes_files


@dataclass
class PoolRun:
    """The jobs a run handed to pool workers, and the workers of its own that stand in for
    those that refused the job or were lost."""

    settings: LaunchSettings
    go_file: Path | None = None
    channel: WorkerChannel | None = None  # the step's Pipes sessions, one per job and stand-in
    jobs: list[PoolJob] = field(default_factory=list)
    sessions: list[ExitStack] = field(default_factory=list)  # each job's, closed once it ends
    pipes: list[tuple[str, tuple[Path, Path]]] = field(default_factory=list)  # (owner, files)
    own: list[WorkerProcess] = field(default_factory=list)
    stand_ins: dict[str, str] = field(default_factory=dict)  # slot -> why it has one

    def close(self) -> None:
        """Stop the run's own workers; give the jobs up (a pool worker still waiting for its
        go serves the next run instead)."""
        stop_workers(self.own)
        for job in self.jobs:
            job.close()
        for session in self.sessions:
            session.close()

    def listen(self, index: int, channel: WorkerChannel) -> None:
        """Open the step's Pipes session for job `index` (before the job reads its plan: at
        its hand-over, or before a prestarted run's go); its stand-ins report through it too."""
        self.channel = channel
        owner, files = self.pipes[index]
        self.sessions[index].enter_context(channel(owner, *files))

    def stand_in(self, job: PoolJob) -> None:
        """A worker of the run's own in the slot of `job` (started from the thread that
        supervises it: a worker dies with the thread that started it)."""
        device = device_of(job.slot)
        folder = self.settings.folder / f"{job.slot}-{len(self.stand_ins)}"
        self.own += launch_workers(
            self.settings, 1, folder, [device] if device is not None else None, self.go_file,
            LocalLauncher(self.channel),
        )  # fmt: skip
        self.stand_ins[job.slot] = job.error


def device_of(slot: str) -> int | None:
    return int(slot[3:]) if slot.startswith("gpu") else None


def process_starting(process: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: process.poll() is None


def free_devices(root: Path, devices: list[int] | None) -> None:
    """Before a run's own workers start on its leased GPUs (the pool off): the pool workers
    idling there give the devices' memory back. None of them runs a job: every job comes from
    the holder of its device's lease, which is this run now."""
    if devices:
        stop_pool(root, [f"gpu{d}" for d in devices])


def open_pool_run(
    settings: LaunchSettings,
    manifest: Any,
    count: int,
    devices: list[int] | None,
    idle_seconds: float,
    go_file: Path | None = None,
    channel: WorkerChannel | None = None,
) -> PoolRun:
    """Start handing the run's job to a pool worker on each of its slots (starting the missing
    ones); returns at once. With `go_file`, every worker waits for that file before it reads the
    plan (the run started them before its plan existed); with `channel`, each job reports
    through a session opened for it (`listen`; a prestarted run's go comes before that)."""
    root = settings.data_root
    sha = manifest_sha256(manifest)
    # What the pool's workers must be bound to (made here first after a fresh start, before
    # any worker this run starts records the root's): a worker bound to others refuses.
    identity = {
        "root": FabricPaths(root).identity(),
        "database": database_identity_at(settings.database_url),
    }
    live = {state.slot: state for state in pool_states(root)}
    threads = worker_threads(manifest, count)
    run = PoolRun(settings, go_file, channel)
    try:
        for slot in slots_for(manifest, devices, count):
            state, starting = live.get(slot), None
            if state is not None and state.manifest_sha256 == sha:
                if not state.ready:  # another run started it: wait for its engine, as for ours
                    starting = starting_pid(state.pid)
            elif state is None or not state.busy_with:
                if state is not None:
                    stop_pool(root, [slot])  # idle, with another model: the slot is this run's now
                process = start_pool_worker(
                    root, slot, settings.manifest_path, idle_seconds=idle_seconds,
                    device=device_of(slot), threads=threads,
                )  # fmt: skip
                starting = process_starting(process)
            # else: busy with another model's run (a CPU slot): it refuses, a stand-in takes over
            job = {
                "task_set": settings.task_set,
                "database_url": settings.database_url,
                "lease_seconds": settings.lease_seconds,
                "heartbeat_seconds": settings.heartbeat_seconds,
                "max_attempts": settings.max_attempts,
                "owner": f"{socket.gethostname()}:{os.getpid()}:pool-{slot}:{time.time_ns()}",
                "go_file": str(go_file) if go_file is not None else None,
                "identity": identity,
            }
            # Where it reports through Pipes (lib/worker/reporting.py); heard once a session opens.
            files = pipes_files(settings.folder, f"pool-{slot}")
            job["pipes"] = pipes_env(*files)
            run.sessions.append(ExitStack())
            run.pipes.append((str(job["owner"]), files))
            if channel is not None:
                run.listen(len(run.jobs), channel)
            run.jobs.append(PoolJob(root, slot, sha, job, starting).start())
    except BaseException:  # the jobs handed over and the sessions opened so far
        run.close()
        raise
    return run


def supervise_pool_run(
    run: PoolRun,
    db: Any,
    task_set: str,
    on_progress: Callable[[Accounting], None] | None = None,
    poll_s: float = 5.0,
) -> list[dict[str, Any]]:
    """Wait for every pool job and own worker; returns their reports. A slot whose pool worker
    refused the job or was lost gets a stand-in (see the module's doc); a job that failed
    raises, as a failed worker does. No worker of the run's own is left running when this
    returns or raises."""
    try:
        with stop_requests() as check_stop:
            next_report = time.monotonic() + poll_s
            handled: set[int] = set()
            while True:
                for i, job in enumerate(run.jobs):
                    if i in handled or not job.done.is_set():
                        continue
                    handled.add(i)
                    run.sessions[i].close()  # its last messages are read
                    if job.state == "failed":
                        raise RuntimeError(job.error)
                    if job.state in ("refused", "lost"):
                        run.stand_in(job)
                if len(handled) == len(run.jobs) and all(
                    w.process.poll() is not None for w in run.own
                ):
                    break
                time.sleep(0.05)  # short naps: the stage ends as soon as its last worker does
                check_stop()  # SIGINT/SIGTERM: StopRequested, the jobs given up below
                if on_progress is not None and time.monotonic() >= next_report:
                    next_report = time.monotonic() + poll_s
                    on_progress(read_accounting(db, task_set))
        reports = [job.report for job in run.jobs if job.report is not None]
        return reports + (supervise(run.own, db, task_set) if run.own else [])
    finally:
        run.close()
