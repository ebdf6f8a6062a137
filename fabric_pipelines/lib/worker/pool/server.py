"""One worker of the warm engine pool (engine_pool.py): `python -m fabric_pipelines.lib.worker.pool.server`.

It owns its slot for its whole life (an `flock` on `<root>/pool/<slot>.lock`: a second worker
started for the same slot exits at once), says so in the slot's state file from its first
moment (`ready: false` while the engine loads), loads the engine once, then serves jobs one after
another until it has idled for its idle time.

Connections are accepted on a thread of their own. When the worker is free, the connection is
the next job's; when it is busy, the run is told so at once (`{"hello": {..., "busy": SET}}`)
(a connection that holds the worker without a job yet, such as a status probe, settles first:
a run that knocks meanwhile waits for it a moment instead of being turned away)
and closed, so it starts its own worker without waiting and nothing piles up in the listen
backlog. While a job runs, a watcher sees the run's connection end (the run was cancelled, or
its process died) and ends this process: a pool worker never goes on extracting for a run that
is gone (its leases run out and the set's next run claims them again). A job that fails inside
the engine loop ends the worker too, after its error is sent: its engine may be what failed.
A job whose data root or database is not the one this worker is bound to (the root deleted and
made again while it lived: a fresh start) is refused, and the worker exits (client.py).

On the way out the listener closes first (no run connects to a worker that is leaving), then
the state file goes, then the engine; the process ends with `os._exit` whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.core.settings import FabricPaths, default_root
from fabric_pipelines.lib.core.signals import stop_on_signals
from fabric_pipelines.lib.worker.pool.client import (
    DEFAULT_IDLE_SECONDS,
    PoolWorkerState,
    manifest_sha256,
    pool_folder,
    slot_address,
)
from fabric_pipelines.lib.worker.procs import read_message, remove_state_if_pid, send_message

JOB_READ_TIMEOUT_S = 30.0  # a run that connected sends its job within this
WATCH_EVERY_S = 0.25  # how often a running job's connection is looked at
# A connection that holds the worker without a job yet (a status probe, or a run about to send
# its job) settles within moments: a run that knocks meanwhile waits this long for it.
SETTLING_WAIT_S = 2.0
RUN_GONE_EXIT = 75  # the run whose job this worker ran went away

JOB_FIELDS: dict[str, type | tuple[type, ...]] = {
    "task_set": str,
    "database_url": str,
    "lease_seconds": (int, float),
    "owner": str,
    "max_attempts": int,
}


def check_job(job: object) -> dict[str, Any]:
    """A job as a run sent it, or ValueError naming the field that is wrong."""
    if not isinstance(job, dict):
        raise ValueError(f"job: expected a JSON object, got {type(job).__name__}")
    for name, kind in JOB_FIELDS.items():
        if not isinstance(job.get(name), kind):
            raise ValueError(f"job field {name!r}: missing or of the wrong type")
    if job.get("heartbeat_seconds") is not None and not isinstance(
        job["heartbeat_seconds"], (int, float)
    ):
        raise ValueError("job field 'heartbeat_seconds': a number of seconds or null")
    if job.get("go_file") is not None and not isinstance(job["go_file"], str):
        raise ValueError("job field 'go_file': a path or null")
    pipes = job.get("pipes")
    if pipes is not None and not (
        isinstance(pipes, dict) and all(isinstance(v, str) for v in pipes.values())
    ):
        raise ValueError("job field 'pipes': Dagster Pipes' bootstrap variables, or null")
    identity = job.get("identity")
    if not isinstance(identity, dict) or not all(
        isinstance(identity.get(name), str) for name in ("root", "database")
    ):
        raise ValueError("job field 'identity': the run's data root and database identities")
    return job


class _GivenUp(Exception):
    """The run that sent a job with a go file closed its connection before the go."""


class _EngineFailed(Exception):
    """The job failed inside the engine loop: the worker reports it, then retires."""


def closed_by_peer(conn: socket.socket) -> bool:
    """Whether the run closed its end (a readable socket with nothing to read)."""
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class PoolWorker:
    """One pool worker: an engine loaded once, and the jobs it runs with it."""

    def __init__(self, root: Path, slot: str, manifest_path: Path, idle_seconds: float) -> None:
        from fabric_gpu.manifest import EngineManifest

        self.root = root
        self.slot = slot
        self.manifest = EngineManifest.load(manifest_path)
        self.manifest_sha = manifest_sha256(self.manifest)
        self.idle_seconds = idle_seconds
        self.state_path = pool_folder(root) / f"{slot}.json"
        self.root_identity = FabricPaths(root).identity()  # the root this worker is bound to
        self.started_at = time.time()
        self.jobs_done = 0
        self.busy_with = ""
        self._databases: dict[str, Any] = {}
        self._jobs: queue.Queue[socket.socket] = queue.Queue(maxsize=1)
        self._lock = threading.Lock()  # guards `_holding`, `_leaving` and `busy_with`
        self._settled = threading.Condition(self._lock)  # one of them changed
        self._holding = False  # a run's connection is queued or being served
        self._leaving = False

    # ---- the state file ----

    def write_state(self, ready: bool = True) -> None:
        state = PoolWorkerState(
            self.slot, os.getpid(), self.manifest_sha, self.manifest.model_key, self.started_at,
            self.idle_seconds, self.busy_with, time.time(), self.jobs_done, ready,
        )  # fmt: skip
        write_bytes(self.state_path, json.dumps(asdict(state)).encode())

    # ---- serving ----

    def serve(self) -> int:
        pool_folder(self.root).mkdir(parents=True, exist_ok=True)
        slot_lock = os.open(pool_folder(self.root) / f"{self.slot}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(slot_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"slot {self.slot} has a worker already: exiting", flush=True)
            return 0
        self.write_state(ready=False)  # seen by `status`, `stop` and runs while the engine loads
        listener: socket.socket | None = None
        engine = None
        try:
            from fabric_gpu.engines import create_engine
            from fabric_pipelines.lib.worker.main import _import_job_modules, prewarm

            engine = create_engine(self.manifest)
            prewarm(engine)
            _import_job_modules()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Bound once the engine is ready: a run that can connect gets a hello at once.
            listener.bind(slot_address(self.root, self.slot))
            # Room for every run that knocks at once while the accept thread waits for the GIL:
            # a full backlog would refuse a connection as if no worker were there.
            listener.listen(socket.SOMAXCONN)
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
            self.write_state()
            print(f"pool worker {self.slot} (pid {os.getpid()}) serving", flush=True)
            while (conn := self._next_job()) is not None:
                with conn:
                    healthy = self._handle(conn, engine)  # frees the slot before its answer
                if not healthy:
                    return 1  # the engine failed a job, or the job was another root's: retire
            print(f"idle for {self.idle_seconds:g} s: exiting", flush=True)
            return 0
        finally:
            self._leave(listener, engine)

    def _leave(self, listener: socket.socket | None, engine: Any) -> None:
        with self._lock:
            self._leaving = True
            self._settled.notify_all()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()  # first: no run connects to a worker on its way out
        remove_state_if_pid(self.state_path, os.getpid())
        if engine is not None:
            engine.close()

    def _next_job(self) -> socket.socket | None:
        """The next run's connection, or None once idle for the idle time."""
        try:
            return self._jobs.get(timeout=self.idle_seconds)
        except queue.Empty:
            with self._lock:
                if not self._holding:
                    self._leaving = True  # late connections are told so from now on
                    self._settled.notify_all()
                    return None
            return self._jobs.get()  # one arrived as the wait ended

    def _accept(self, listener: socket.socket) -> None:
        """Hand a connection to the main thread when it waits for a job; tell it busy else."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener closed: the worker is leaving
            with self._lock:
                # Held, but with no job yet: a probe that goes away, or a run whose job is on
                # its way. Wait for it to settle rather than turn this run away as busy.
                self._settled.wait_for(
                    lambda: not self._holding or self._leaving or bool(self.busy_with),
                    timeout=SETTLING_WAIT_S,
                )
                free = not self._holding and not self._leaving
                if free:
                    self._holding = True
                    self._jobs.put_nowait(conn)
            if not free:
                with contextlib.suppress(OSError):
                    busy = "leaving" if self._leaving else self.busy_with or "another run"
                    send_message(conn, {"hello": self._hello(busy=busy)})
                conn.close()

    def _hello(self, busy: str = "") -> dict[str, Any]:
        return {
            "pid": os.getpid(), "slot": self.slot, "manifest_sha256": self.manifest_sha,
            "jobs_done": self.jobs_done, "busy": busy,
        }  # fmt: skip

    def _free(self, retiring: bool = False) -> None:
        """Take the next run's connection from now on (retiring: tell runs it is leaving).
        Called before a job's last message: a run that connects as soon as it reads the
        answer must find the worker free, not be told it is busy."""
        with self._lock:
            self._holding = False
            self._leaving = self._leaving or retiring
            self._settled.notify_all()

    def _handle(self, conn: socket.socket, engine: Any) -> bool:
        """Run one connection's job; False when the engine failed it or it was refused as
        another data root's or database's (the worker retires)."""
        try:
            send_message(conn, {"hello": self._hello()})
            conn.settimeout(JOB_READ_TIMEOUT_S)
            message = read_message(conn)
            conn.settimeout(None)
        except (OSError, ValueError):
            self._free()
            return True  # the run went away before sending its job (a status probe): next one
        try:
            job = check_job(message.get("job"))
        except ValueError as exc:
            self._free()
            with contextlib.suppress(OSError):
                send_message(conn, {"error": str(exc)})
            return True
        refusal = self._bound_elsewhere(job)
        if refusal:
            print(f"refused the job of {job['task_set']!r}: {refusal}; exiting", flush=True)
            self._free(retiring=True)
            with contextlib.suppress(OSError):
                send_message(conn, {"refused": refusal})
            return False
        with self._lock:
            self.busy_with = job["task_set"]
            self._settled.notify_all()  # a run knocking meanwhile is told busy at once
        self.write_state()
        healthy = True
        try:
            answer: dict[str, Any] = {"report": self._run_job(job, engine, conn)}
        except _GivenUp:
            answer = {"error": "the run went away before its go"}
        except _EngineFailed as exc:
            answer, healthy = {"error": str(exc)}, False
        except Exception as exc:  # reading the job (a task set not ingested, say): next one
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        self.jobs_done += 1
        self.busy_with = ""
        self.write_state()
        self._free(retiring=not healthy)
        with contextlib.suppress(OSError):
            send_message(conn, answer)
        return healthy

    def _bound_elsewhere(self, job: dict[str, Any]) -> str:
        """Why this worker must not run `job` ("" when it may): the run's data root or database
        is not the one this worker is bound to. The database's identity is read through this
        worker's own connections for the URL: after a fresh start they still read the old
        SQLite file, deleted under them."""
        from fabric_pipelines.lib.store.identity import database_identity

        theirs = job["identity"]
        if theirs["root"] != self.root_identity:
            return (
                f"the run's data root {self.root} has identity {theirs['root']}, this worker's "
                f"{self.root_identity} (the root was deleted and made again since it started)"
            )
        try:
            ours = database_identity(self._database(job["database_url"]))
        except Exception as exc:  # the old database lacks the table, or is unreadable
            ours = f"none readable ({type(exc).__name__})"
        if theirs["database"] != ours:
            return (
                f"the run's database has identity {theirs['database']}, this worker's "
                f"connections read {ours} (the database was made again since it connected)"
            )
        return ""

    def _database(self, url: str) -> Any:
        from fabric_pipelines.lib.store.db import make_engine

        if url not in self._databases:
            self._databases[url] = make_engine(url)
        return self._databases[url]

    def _run_job(self, job: dict[str, Any], engine: Any, conn: socket.socket) -> dict[str, Any]:
        from fabric_pipelines.lib.worker.loop import run_worker
        from fabric_pipelines.lib.worker.main import load_job, read_task_set_before_go
        from fabric_pipelines.lib.worker.reporting import announce_done, announce_start, reporter

        timeline = {"started_at": time.time(), "main_at": self.started_at}
        db = self._database(job["database_url"])
        paths = FabricPaths(self.root).ensure()
        early = None
        if job.get("go_file"):
            timeline["engine_ready_at"] = time.time()
            early = read_task_set_before_go(
                db, job["task_set"], Path(job["go_file"]), given_up=lambda: closed_by_peer(conn)
            )
            if not Path(job["go_file"]).exists():
                raise _GivenUp  # the run ended before its plan (ingest failed, say)
        timeline["go_at"] = time.time()
        extraction = load_job(db, paths, job["task_set"], self.manifest, early)
        timeline["job_loaded_at"] = time.time()
        finished = threading.Event()
        threading.Thread(target=self._watch, args=(conn, finished), daemon=True).start()
        # The run's step listens through Pipes on the files the job names (lib/worker/reporting.py).
        with reporter(job.get("pipes") or {}) as said:
            announce_start(said, job["owner"], extraction.plan_id)
            try:
                report = run_worker(
                    db, engine, extraction, owner=job["owner"],
                    lease_seconds=job["lease_seconds"],
                    heartbeat_seconds=job.get("heartbeat_seconds"),
                    max_attempts=job["max_attempts"],
                )  # fmt: skip
            except Exception as exc:
                raise _EngineFailed(f"{type(exc).__name__}: {exc}") from exc
            finally:
                finished.set()
            timeline["done_at"] = timeline["closed_at"] = time.time()
            announce_done(said, job["owner"], report, timeline["done_at"] - timeline["started_at"])
        summary = {
            "owner": job["owner"], **asdict(report), "errors": report.errors[:20], **timeline,
            "pool_slot": self.slot, "pool_pid": os.getpid(), "pool_jobs_before": self.jobs_done,
        }  # fmt: skip
        summary.pop("runtime", None)
        return summary

    def _watch(self, conn: socket.socket, finished: threading.Event) -> None:
        """End this process if the run's connection ends while its job runs."""
        while not finished.wait(WATCH_EVERY_S):
            if closed_by_peer(conn):
                print(f"the run of {self.busy_with!r} went away mid-job: exiting", flush=True)
                remove_state_if_pid(self.state_path, os.getpid())
                sys.stdout.flush()
                os._exit(RUN_GONE_EXIT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fabric_pipelines.lib.worker.pool.server")
    parser.add_argument("--slot", required=True, help="gpu<N> or cpu<N>")
    parser.add_argument("--manifest", required=True, help="engine manifest (JSON or YAML)")
    parser.add_argument("--idle-seconds", type=float, default=DEFAULT_IDLE_SECONDS)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    args = parser.parse_args(argv)
    if args.idle_seconds <= 0:
        parser.error("--idle-seconds must be more than 0")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    sys.setswitchinterval(0.0002)  # as a run's worker: the runtime's threads hand over the GIL

    def stop(*_: object) -> None:
        raise SystemExit(0)

    stop_on_signals()  # SIGINT too, whatever the shell that started the first run ignored
    signal.signal(signal.SIGTERM, stop)  # cleans up (listener, state file, engine) on the way
    return PoolWorker(default_root(), args.slot, Path(args.manifest), args.idle_seconds).serve()


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException as exc:  # printed to the slot's log; the exit below still happens
        print(f"pool worker failed: {type(exc).__name__}: {exc}", flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip unloading torch and the CUDA context
