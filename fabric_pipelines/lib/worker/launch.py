"""Worker processes: one per GPU (or several on the CPU), each pulling batches from the ledger.

`launch_workers` starts them as `python -m fabric_pipelines.lib.worker.main ...` (the child's side
is `worker/main.py`) with the engine's
manifest in a file, the database URL in the environment (never on a command line, where a
password would show in `ps`), and CUDA_VISIBLE_DEVICES set per worker for GPU engines so each
owns one device. `supervise` waits for them, reporting progress from the database, and collects
each worker's JSON report. A worker that dies leaves its batch leased; its lease expires and a
surviving worker (or the next run) takes it over.

Where a worker runs is the caller's `Launcher`: `LocalLauncher` starts processes of this host (the
default), `worker/client_launch.py` starts each through any Dagster Pipes client (a Kubernetes
pod, a process) in a thread that looks like a process to `supervise`. A local worker reports
through a channel the caller may open for it (`WorkerChannel`: the step's Dagster Pipes session,
whose bootstrap variables go into the worker's environment, so its log lines and counts land in
the run's event log); a client's worker through the client's own session. With a `Replacement`, `supervise` starts a worker
in place of one that died, or that was lost (stopped, its host gone: its alive file, touched every
heartbeat, older than its lease), after a back-off and up to a bound; the stage fails only when
no worker is left and work remains, naming what failed.

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
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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
from fabric_pipelines.lib.worker.reporting import pipes_env, pipes_files

STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL
REMOTE_REAP_S = 60.0  # a killed client run's (pod's) time to return, for all of them together

log = logging.getLogger(__name__)

# A worker's channel to the step that runs it, given its owner name and its Pipes files (context,
# messages: lib/worker/reporting.py): opened before the worker reads its job, closed once it has
# exited and its last messages were read.
WorkerChannel = Callable[[str, Path, Path], AbstractContextManager[object]]


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


class RemoteProcess(Protocol):
    """A worker `supervise` cannot signal as a process group of this host (worker/client_launch.py:
    a Pipes client's run): it asks it to stop, or ends it at once."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def stop(self) -> None: ...

    def kill(self) -> None: ...

    def give_up(self) -> None:
        """Stop waiting for it (returncode 137): what it runs in is left to end on its own."""
        ...


@dataclass
class WorkerProcess:
    owner: str
    process: subprocess.Popen[bytes] | RemoteProcess
    report_path: Path
    log_path: Path
    index: int = 0  # its place among the run's workers (its device, where there are GPUs)
    alive_path: Path | None = None  # touched every heartbeat while it runs
    pipes_files: tuple[Path, Path] | None = None  # its Pipes context and messages
    channel: ExitStack = field(default_factory=ExitStack)  # closed once it is reaped
    # Another host's worker with no alive file this long after its start counts as silent
    # (never scheduled, say); None: one of this host, which writes it within seconds.
    start_grace_s: float | None = None
    started_at: float = field(default_factory=time.time)

    def open_channel(self, channel: WorkerChannel) -> None:
        """Listen to this worker through `channel` (before it reads its job: at its start, or
        before a prestarted one's go)."""
        if self.pipes_files is not None:
            self.channel.enter_context(channel(self.owner, *self.pipes_files))

    def close_channel(self) -> None:
        try:
            self.channel.close()
        except Exception as exc:  # its last counts were not logged; the rest still stops
            log.warning(
                "closing the channel of worker %s: %s: %s", self.owner, type(exc).__name__, exc
            )

    def silent_for(self) -> float:
        """Seconds since the worker last touched its alive file (0 where it has none yet, but
        for another host's worker past its start grace)."""
        if self.alive_path is None:
            return 0.0
        try:
            return max(0.0, time.time() - self.alive_path.stat().st_mtime)
        except FileNotFoundError:  # not written yet: still starting
            if self.start_grace_s is None:
                return 0.0
            return max(0.0, time.time() - self.started_at - self.start_grace_s)


@dataclass(frozen=True)
class Replacement:
    """How `supervise` replaces a worker that died or was lost: `launch(replaced, generation)`
    starts one in its place (same device); at most `max_restarts` for the stage, each after a
    back-off doubling from `backoff_s` (with jitter); a worker silent for `lost_after_s` (its
    lease) is lost: killed, then replaced."""

    launch: Callable[[WorkerProcess, int], WorkerProcess]
    lost_after_s: float
    max_restarts: int = 3
    backoff_s: float = 1.0


class Launcher(Protocol):
    """Where and how a step starts its workers: the one seam every worker start goes through."""

    @property
    def on_this_host(self) -> bool:
        """Its workers are processes of this host: they share its cores, are handed its leased
        GPUs by CUDA_VISIBLE_DEVICES and may use SQLite; a launcher of other hosts' workers gets
        none of that. (Only `LocalLauncher`'s are prestarted or pooled.)"""
        ...

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
        """Start worker `index` (its `generation`-th stand-in when > 0) on `device`, its files
        in `folder`, sharing its host with `threads_of` workers."""
        ...


@dataclass(frozen=True)
class LocalLauncher:
    """Worker processes of this host, each reporting through `channel` when one is given."""

    channel: WorkerChannel | None = None
    on_this_host: bool = True

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
        return launch_worker(
            settings, index, folder, device, go_file, self.channel,
            threads_of=threads_of, generation=generation,
        )  # fmt: skip


def launch_workers(
    settings: LaunchSettings,
    count: int,
    folder: Path,
    devices: list[int] | None = None,
    go_file: Path | None = None,
    launcher: Launcher | None = None,
) -> list[WorkerProcess]:
    """Start `count` workers through `launcher` (this host's processes by default); worker i
    gets GPU devices[i] when devices are given. With `go_file`, each loads its engine and then
    waits for that file before reading the plan.

    A local worker is the leader of a new process group (stop them with `stop_workers`) and dies
    with the thread that starts it: start them from the thread that supervises them."""
    starter = launcher or LocalLauncher()
    workers: list[WorkerProcess] = []
    try:
        for i in range(count):
            device = devices[i] if devices is not None else None
            workers.append(
                starter.start(settings, i, folder, device, threads_of=count, go_file=go_file)
            )
    except BaseException:
        stop_workers(workers)
        raise
    return workers


@dataclass(frozen=True)
class WorkerInvocation:
    """How worker `owner` is run, wherever it runs: its command line, the variables it adds to
    its host's environment (Pipes' files), and the files it writes into the run's folder."""

    owner: str
    command: list[str]
    env: dict[str, str]
    report: Path
    log: Path
    alive: Path
    pipes_files: tuple[Path, Path]


def worker_invocation(
    settings: LaunchSettings,
    index: int,
    folder: Path,
    *,
    threads: int,
    generation: int = 0,
    go_file: Path | None = None,
    python: str = sys.executable,
    parent_pid: int | None = None,
) -> WorkerInvocation:
    """Worker `index` (its `generation`-th stand-in when > 0) with `threads` CPU threads; with
    `parent_pid`, it exits when that process does (a worker of this host)."""
    every = heartbeat_interval(settings.lease_seconds, settings.heartbeat_seconds)
    name = f"w{index}" if generation == 0 else f"w{index}.{generation}"
    owner = f"{socket.gethostname()}:{os.getpid()}:{name}"
    stem = f"worker-{index}" if generation == 0 else f"worker-{index}.{generation}"
    report, log, alive = (folder / f"{stem}{suffix}" for suffix in (".json", ".log", ".alive"))
    files = pipes_files(folder, stem)  # it reports through them once a step listens
    command = [
        python, "-m", MAIN_MODULE,
        settings.task_set,
        "--manifest", str(settings.manifest_path),
        "--owner", owner,
        "--lease-seconds", str(settings.lease_seconds),
        "--heartbeat-seconds", str(every),
        "--max-attempts", str(settings.max_attempts),
        "--report", str(report),
        "--alive-file", str(alive),
        "--threads", str(threads),
    ]  # fmt: skip
    if parent_pid is not None:
        command += ["--parent-pid", str(parent_pid)]
    if go_file is not None:
        command += ["--go-file", str(go_file)]
    return WorkerInvocation(owner, command, pipes_env(*files), report, log, alive, files)


def share_of_cores(workers: int) -> int:
    """CPU threads for each of `workers` workers sharing this host's cores (at least one)."""
    return max(1, (os.cpu_count() or 1) // workers)


def worker_env(settings: LaunchSettings, device: int | None) -> dict[str, str]:
    """What a worker of this host adds to the environment it is started with."""
    env = {
        "FABRIC_DATABASE_URL": settings.database_url,
        "FABRIC_HOME": str(settings.data_root),
        "HF_HUB_OFFLINE": "1",
    }
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)  # the device lease: one GPU each
    return env


def launch_worker(
    settings: LaunchSettings,
    index: int,
    folder: Path,
    device: int | None = None,
    go_file: Path | None = None,
    channel: WorkerChannel | None = None,
    *,
    threads_of: int = 1,
    generation: int = 0,
) -> WorkerProcess:
    """Start worker `index` of this host (its `generation`-th stand-in when > 0), sharing the
    cores with `threads_of` workers. The database URL goes in its environment, never on its
    command line (where a password would show in `ps`)."""
    folder.mkdir(parents=True, exist_ok=True)
    run = worker_invocation(
        settings, index, folder, threads=share_of_cores(threads_of),
        generation=generation, go_file=go_file, parent_pid=os.getpid(),
    )  # fmt: skip
    env = {**os.environ, **worker_env(settings, device), **run.env}
    opened = ExitStack()
    try:
        if channel is not None:
            opened.enter_context(channel(run.owner, *run.pipes_files))
        with open(run.log, "wb") as out:
            process = subprocess.Popen(
                run.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
    except BaseException:
        opened.close()
        raise
    return WorkerProcess(
        run.owner, process, run.report, run.log, index, run.alive, run.pipes_files, opened
    )


def _signal_group(process: subprocess.Popen[bytes] | RemoteProcess, sig: int) -> None:
    if not isinstance(process, subprocess.Popen):  # a client's: ask its launcher
        try:
            if sig == signal.SIGTERM:
                process.stop()
            elif sig == signal.SIGKILL:
                process.kill()
        except Exception as exc:  # one that cannot be asked must not keep the rest running
            log.warning("signalling a worker: %s: %s", type(exc).__name__, exc)
        return
    # The group outlives its leader while anything the worker started still runs in it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def stop_workers(workers: list[WorkerProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Terminate every worker's process group, give it `grace_s` to go, kill what is left and
    reap the workers. A no-op for workers that already exited on their own."""
    workers = list({id(w): w for w in workers}.values())  # each once, however often named
    for w in workers:
        _signal_group(w.process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        _signal_group(w.process, signal.SIGKILL)
    # A client's run that does not return (a cluster that does not answer) is given up on, all
    # of them within one reap window, not one window each.
    reap_deadline = time.monotonic() + REMOTE_REAP_S
    for w in workers:
        if isinstance(w.process, subprocess.Popen):
            w.process.wait()
        else:
            try:
                w.process.wait(timeout=max(0.0, reap_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.process.give_up()
        w.close_channel()


def kill_lost(worker: WorkerProcess) -> None:
    """End a lost worker's group at once: it may be stopped, where SIGTERM would wait."""
    _signal_group(worker.process, signal.SIGCONT)
    _signal_group(worker.process, signal.SIGKILL)
    worker.process.wait()
    worker.close_channel()


def supervise(
    workers: list[WorkerProcess],
    db: Any,
    task_set: str,
    on_progress: Callable[[Accounting], None] | None = None,
    poll_s: float = 5.0,
    replacement: Replacement | None = None,
    on_event: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Wait for every worker (and every replacement); returns the reports of those that ended
    well. Without a `replacement`, a worker that failed raises, with its log; with one, failed
    and lost workers are replaced while work remains, and this raises only when no worker is
    left and work remains. `on_event` hears each worker lost, failed or started in another's
    place.

    Whatever way this returns or raises, no worker of it is left running (`stop_workers`); SIGINT
    or SIGTERM meanwhile raises StopRequested here, after the workers are stopped."""
    live = list(workers)
    waiting: list[tuple[float, WorkerProcess, int]] = []  # (when, the one replaced, generation)
    reports: list[dict[str, Any]] = []
    failures: list[str] = []
    last_failed: WorkerProcess | None = None
    restarts = 0

    def event(message: str) -> None:
        if on_event is not None:
            on_event(message)

    try:
        with stop_requests() as check_stop:
            next_report = time.monotonic() + poll_s
            while live or waiting:
                # Short naps: the stage ends as soon as its last worker does, not at the next
                # report.
                time.sleep(0.05)
                check_stop()
                for w in list(live):
                    code = w.process.poll()
                    lost = (
                        code is None
                        and replacement is not None
                        and w.silent_for() > replacement.lost_after_s
                    )
                    if lost:
                        assert replacement is not None
                        event(
                            f"worker {w.owner} lost: silent for {w.silent_for():.0f} s, longer "
                            f"than its {replacement.lost_after_s:.0f} s lease; stopping it"
                        )
                        kill_lost(w)
                        code = w.process.returncode
                    if code is None:
                        continue
                    live.remove(w)
                    w.close_channel()  # its last messages are read
                    if code == 0 and not lost:
                        reports.append(json.loads(w.report_path.read_text()))
                        continue
                    failure = "lost" if lost else f"exited with {code}"
                    if replacement is None:
                        raise RuntimeError(f"worker {w.owner} {failure}:\n{_log_tail(w)}")
                    failures.append(f"worker {w.owner} {failure}")
                    last_failed = w
                    event(f"worker {w.owner} {failure}; its leases return to the ledger")
                    if restarts < replacement.max_restarts and _work_remains(db, task_set):
                        restarts += 1
                        delay = replacement.backoff_s * 2 ** (restarts - 1)
                        delay *= random.uniform(0.5, 1.0)
                        waiting.append((time.monotonic() + delay, w, restarts))
                        event(
                            f"replacing worker {w.owner} in {delay:.1f} s (replacement "
                            f"{restarts} of at most {replacement.max_restarts})"
                        )
                for due in [entry for entry in waiting if entry[0] <= time.monotonic()]:
                    waiting.remove(due)
                    assert replacement is not None
                    _, replaced, generation = due
                    started = replacement.launch(replaced, generation)
                    live.append(started)
                    event(f"worker {started.owner} started in place of {replaced.owner}")
                if on_progress is not None and time.monotonic() >= next_report:
                    next_report = time.monotonic() + poll_s
                    on_progress(read_accounting(db, task_set))
        if failures and _work_remains(db, task_set):
            tail = _log_tail(last_failed) if last_failed is not None else ""
            raise RuntimeError(
                f"no worker is left and task set {task_set!r} has work remaining: "
                + "; ".join(failures)
                + f" ({restarts} replacement(s) started); the last one's log ends:\n{tail}"
            )
        return reports
    finally:
        stop_workers([*live, *workers])


def _log_tail(worker: WorkerProcess) -> str:
    path = worker.log_path
    if path.exists():
        return path.read_text(errors="replace")[-4000:]
    return str(getattr(worker.process, "error", "") or "")[-4000:]  # a client's: what it raised


def _work_remains(db: Any, task_set: str) -> bool:
    counts = read_accounting(db, task_set)
    return counts.queued + counts.in_flight > 0


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
