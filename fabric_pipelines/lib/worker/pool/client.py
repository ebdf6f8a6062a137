"""The warm engine pool: long-lived workers that keep their model loaded between runs.

A run's own workers start a Python process, import torch, load the weights and capture their
graphs, then exit when the plan is done: seconds that dominate a small job. A pool worker does
that once, then serves extraction jobs one after another until it has been idle for its idle time
(`FABRIC_POOL_IDLE_SECONDS`, the engine resource's `pool_idle_seconds`; 0 turns the pool off).
It runs the same `run_worker` loop as a run's own worker: it claims leases from the job's plan
and acks them, so a pool worker that dies loses nothing (its leases run out and are claimed again).

One pool worker per slot of a data root: a GPU (`gpu0`, ...; the run that uses it holds that
device's lease, see device_lease.py) or a CPU worker (`cpu0`, ...). Each listens on an abstract
Unix socket named after the data root and the slot (abstract: nothing on disk to go stale, and
the name exists exactly as long as the process does) and keeps a state file beside the data
(`<root>/pool/<slot>.json`: pid, manifest, what it is doing) for `fabric workers status`.

The protocol, one JSON object per line:
    worker -> run   {"hello": {"pid", "slot", "manifest_sha256", "jobs_done", "busy"}}
    run -> worker   {"job": {"task_set", "database_url", "lease_seconds", "heartbeat_seconds",
                             "max_attempts", "owner", "go_file",
                             "identity": {"root", "database"},
                             "pipes": {Pipes' bootstrap variables: where it reports}}}
    worker -> run   {"report": {...}} when the plan is done, {"error": "..."}, or
                    {"refused": "..."} when the job's data root or database is not the one the
                    worker is bound to (then it exits)
A worker serves one job at a time: a run that connects while it is busy gets a hello that says
so (`"busy": TASK_SET`) and starts its own worker instead of queueing behind the other run.

A worker is bound to its data root and database: it records the root's identity
(`FabricPaths.identity`) when it starts and reads the database's (lib/store/identity.py) through
the connections it keeps. A run names both in its job; after a fresh start (the data root deleted
while the worker lived) they differ, and the worker refuses the job and exits rather than serve a
database that is gone: the run's own worker stands in, and the next run starts a new pool worker.
The worker's side is server.py; this module is what runs, `fabric workers` and the sensor use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.worker.launch import share_of_cores
from fabric_pipelines.lib.worker.pool import SERVER_MODULE
from fabric_pipelines.lib.worker.procs import (
    abstract_socket,
    pid_alive,
    read_message,
    remove_state_if_pid,
    runs_module,
    send_message,
    start_detached,
)

POOL_IDLE_ENV = "FABRIC_POOL_IDLE_SECONDS"
DEFAULT_IDLE_SECONDS = 300.0  # a pool worker exits after this long without a job
START_TIMEOUT_S = 300.0  # a new worker's engine load (weights, graphs) may take this long
HELLO_TIMEOUT_S = 2.0  # a worker that neither greets nor refuses within this is taken as busy


def idle_seconds_setting(value: float | None = None) -> float:
    """The pool's idle time: `value` when given, else FABRIC_POOL_IDLE_SECONDS, else 300 s."""
    if value is None:
        raw = os.environ.get(POOL_IDLE_ENV, "").strip()
        try:
            value = float(raw) if raw else DEFAULT_IDLE_SECONDS
        except ValueError:
            raise ValueError(
                f"{POOL_IDLE_ENV}={raw!r}: give the pool's idle time in seconds (0 turns it off)"
            ) from None
    if value < 0:
        raise ValueError(f"pool_idle_seconds {value}: give 0 (no pool) or more seconds")
    return value


def manifest_sha256(manifest: Any) -> str:
    """The manifest's identity: the hash of its canonical JSON."""
    canonical = json.dumps(manifest.to_mapping(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def slots_for(manifest: Any, devices: list[int] | None, count: int) -> list[str]:
    """The pool slots a run of `count` workers uses: its leased GPUs, or CPU workers 0..n-1."""
    if manifest.backend != "cpu" and devices is not None:
        return [f"gpu{d}" for d in devices]
    return [f"cpu{i}" for i in range(count)]


def worker_threads(manifest: Any, count: int) -> int:
    """CPU threads for each of `count` pool workers: the cores shared out on the CPU engine (as a
    run's own workers get them); 0, torch's default, for GPU engines."""
    return share_of_cores(count) if manifest.backend == "cpu" else 0


def slot_address(root: Path, slot: str) -> str:
    """The abstract socket name of a data root's slot (Linux; no file on disk)."""
    digest = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:16]
    return abstract_socket(f"fabric-pool-{digest}-{slot}")


def pool_folder(root: Path) -> Path:
    return Path(root) / "pool"


# ---- what the runs see ------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolWorkerState:
    """A pool worker as its state file describes it."""

    slot: str
    pid: int
    manifest_sha256: str
    model_key: str
    started_at: float
    idle_seconds: float
    busy_with: str  # the task set of the job it runs, "" when idle
    since: float  # when it last started or finished a job
    jobs_done: int
    ready: bool = True  # False while its engine loads

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid) and _is_pool_worker(self.pid)


def pool_states(root: Path) -> list[PoolWorkerState]:
    """The pool workers of a data root whose process lives (state files of dead ones are
    removed on the way: a killed worker leaves its file behind)."""
    states = []
    folder = pool_folder(root)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            data = json.loads(path.read_text())
            state = PoolWorkerState(**data)
        except (OSError, ValueError, TypeError):
            continue  # being replaced at this moment, or not a state file
        if state.alive:
            states.append(state)
        else:
            remove_state_if_pid(path, state.pid)
    return states


def _is_pool_worker(pid: int) -> bool:
    return runs_module(pid, SERVER_MODULE)


def start_pool_worker(
    root: Path,
    slot: str,
    manifest_path: Path,
    *,
    idle_seconds: float,
    device: int | None = None,
    threads: int = 0,
) -> subprocess.Popen[bytes]:
    """Start a pool worker for `slot`, detached from the caller (its own session: it outlives the
    run that started it). Its log goes to <root>/pool/<slot>.log."""
    folder = pool_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FABRIC_HOME": str(root), "HF_HUB_OFFLINE": "1"}
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device)
    command = [
        sys.executable, "-m", SERVER_MODULE,
        "--slot", slot, "--manifest", str(manifest_path),
        "--idle-seconds", str(idle_seconds), "--threads", str(threads),
    ]  # fmt: skip
    return start_detached(command, env, folder / f"{slot}.log")


def stop_pool(root: Path, slots: list[str] | None = None, grace_s: float = 10.0) -> list[str]:
    """Ask the pool's workers (those of `slots`, default all) to exit; returns the slots
    stopped. A worker in the middle of a job stops too: its leases run out and are claimed by
    the run's other workers or the next run. Each is signalled through a pidfd opened once it
    was seen to run the pool worker: a pid the system gives to another process meanwhile is
    never signalled."""
    stopped: list[tuple[str, int]] = []
    for state in pool_states(root):
        if slots is not None and state.slot not in slots:
            continue
        try:
            handle = os.pidfd_open(state.pid)
        except (ProcessLookupError, PermissionError):
            continue
        if not _is_pool_worker(state.pid):  # the pid changed hands since pool_states looked
            os.close(handle)
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(handle, signal.SIGTERM)
        stopped.append((state.slot, handle))
    deadline = time.monotonic() + grace_s
    for _, handle in stopped:
        # A pidfd reads as readable once its process has exited.
        select.select([handle], [], [], max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(handle, signal.SIGKILL)  # a no-op once it has exited
        os.close(handle)
    return [slot for slot, _ in stopped]


@dataclass
class PoolJob:
    """A job for the pool worker of one slot, handed over and answered on a thread of its own
    (`start`), so that a run never waits on a worker that is still loading its engine.

    `state` ends as one of: "done" (`report` holds the worker's report), "refused" (the worker
    never took the job: none listens, it is busy with another run, serves another manifest, or
    is bound to another data root or database; nothing was claimed for it), "lost" (it took the
    job and ended before its report: its leases run out and are claimed again), "failed" (it
    answered with an error)."""

    root: Path
    slot: str
    manifest_sha: str
    job: dict[str, Any]
    starting: Callable[[], bool] | None = None  # while True, a worker for the slot is starting
    start_timeout_s: float = START_TIMEOUT_S
    hello_timeout_s: float = HELLO_TIMEOUT_S
    pid: int = 0
    state: str = "handing"
    report: dict[str, Any] | None = None
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    _conn: socket.socket | None = None
    _closed: bool = False

    def start(self) -> PoolJob:
        threading.Thread(target=self._run, name=f"pool-job-{self.slot}", daemon=True).start()
        return self

    def close(self) -> None:
        """Give the job up: a worker still waiting for its go serves the next run instead."""
        self._closed = True
        if self._conn is not None:
            with contextlib.suppress(OSError):
                # shutdown, not only close: it ends the read blocked on another thread, and
                # the worker sees the end of the connection.
                self._conn.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._conn.close()

    def _run(self) -> None:
        try:
            self._hand_over_and_wait()
        finally:
            self.done.set()

    def _hand_over_and_wait(self) -> None:
        greeted = _connect(
            self.root, self.slot, self.starting, self.start_timeout_s, self.hello_timeout_s,
            given_up=lambda: self._closed,
        )  # fmt: skip
        if greeted is None:
            self.state, self.error = "refused", "no free pool worker answered"
            return
        conn, hello = greeted
        self._conn, self.pid = conn, int(hello.get("pid", 0))
        if hello.get("busy") or hello.get("manifest_sha256") != self.manifest_sha or self._closed:
            self.state = "refused"
            self.error = (
                f"the pool worker is busy with {hello['busy']!r}"
                if hello.get("busy")
                else "the pool worker serves another manifest"
            )
            conn.close()
            return
        try:
            send_message(conn, {"job": self.job})
        except OSError as exc:
            self.state, self.error = "refused", f"could not send the job: {exc}"
            conn.close()
            return
        self.state = "running"
        try:
            answer = read_message(conn)
        except (OSError, ValueError) as exc:
            self.state = "lost"
            self.error = f"pool worker {self.slot} (pid {self.pid}) ended before its report: {exc}"
            return
        finally:
            with contextlib.suppress(OSError):
                conn.close()
        if isinstance(answer.get("report"), dict):
            self.state, self.report = "done", answer["report"]
        elif "refused" in answer:  # bound to another data root or database: it exits
            self.state = "refused"
            self.error = f"pool worker {self.slot} (pid {self.pid}) refused: {answer['refused']}"
        else:
            self.state = "failed"
            self.error = f"pool worker {self.slot} (pid {self.pid}): {answer.get('error')}"


def wait_until_serving(
    root: Path, slot: str, process: subprocess.Popen[bytes], start_timeout_s: float
) -> dict[str, Any] | None:
    """The hello of a worker just started, once it listens (None: it died or took too long).
    The connection is closed at once: the worker goes back to waiting for runs."""
    greeted = _connect(root, slot, lambda: process.poll() is None, start_timeout_s, HELLO_TIMEOUT_S)
    if greeted is None:
        return None
    greeted[0].close()
    return greeted[1]


def starting_pid(pid: int) -> Callable[[], bool]:
    """`starting` for a worker another run started (seen in its state file, not ready yet)."""
    return lambda: pid_alive(pid)


def _connect(
    root: Path,
    slot: str,
    starting: Callable[[], bool] | None,
    start_timeout_s: float,
    hello_timeout_s: float,
    given_up: Callable[[], bool] = lambda: False,
) -> tuple[socket.socket, dict[str, Any]] | None:
    """A connection to the slot's worker and its hello; None when nothing listens (waiting
    while `starting` says a worker is on its way) or nothing answers in time. The connect itself
    is bounded too: a full listen backlog would otherwise block it until the worker accepts."""
    address = slot_address(root, slot)
    deadline = time.monotonic() + start_timeout_s
    backlog_full_until = time.monotonic() + hello_timeout_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(hello_timeout_s)
        try:
            conn.connect(address)
            break
        except BlockingIOError:  # EAGAIN: a worker listens but its backlog is full: try again
            conn.close()
            if given_up() or time.monotonic() >= backlog_full_until:
                return None
            time.sleep(0.01)
        except OSError:
            conn.close()
            waiting = starting is not None and starting()
            if not waiting or given_up() or time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
    try:
        hello = read_message(conn).get("hello")
        conn.settimeout(None)
    except (OSError, ValueError):  # no answer in time, or gone
        conn.close()
        return None
    if not isinstance(hello, dict):
        conn.close()
        return None
    return conn, hello


def describe(state: PoolWorkerState, now: float | None = None) -> str:
    """One line about a pool worker, for `fabric workers status` and the Dagster sensor."""
    now = time.time() if now is None else now
    if not state.ready:
        doing = f"loading its engine for {now - state.since:.0f} s"
    elif state.busy_with:
        doing = f"running task set {state.busy_with!r} for {now - state.since:.0f} s"
    else:
        left = state.idle_seconds - (now - state.since)
        doing = f"idle for {now - state.since:.0f} s (exits in {max(0.0, left):.0f} s)"
    return (
        f"{state.slot}: pid {state.pid}, {state.model_key} (manifest {state.manifest_sha256[:12]}), "
        f"{doing}, {state.jobs_done} job(s) done"
    )
