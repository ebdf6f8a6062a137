"""The worker process (`python -m fabric_pipelines.lib.worker.main`): parse its arguments, load
the engine and the job, run the claim-submit-write loop (`worker/loop.py`) until no batch is left,
write its report. `worker/launch.py` starts and supervises it; the engine pool's server reuses the
job loading here.

A worker is bound to its supervisor: the kernel sends it SIGKILL when the thread that started it
exits (PR_SET_PDEATHSIG), and a watchdog thread checks its parent every second as well.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.broker.ledger import DEFAULT_LEASE_SECONDS, heartbeat_interval
from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.core.retry import retry
from fabric_pipelines.lib.core.signals import stop_on_signals
from fabric_pipelines.lib.worker.reporting import announce_done, announce_start, reporter

PR_SET_PDEATHSIG = 1  # linux/prctl.h


PARENT_GONE_EXIT = 75  # a worker that outlived its supervisor


def bind_to_parent(parent_pid: int) -> None:
    """End this process when `parent_pid` (its supervisor) is gone, however that dies."""
    if sys.platform.startswith("linux"):
        try:  # the kernel's own notice: SIGKILL when the thread that started us exits
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the watchdog alone
            pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(PARENT_GONE_EXIT)

    def watch() -> None:  # portable, and covers a parent that prctl cannot see die
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, name="fabric-parent-watchdog", daemon=True).start()


def prewarm(engine: Any) -> None:
    """Before the plan exists: capture the CUDA graph of the shape packed plans use for nearly
    every batch (a full one: max_batch_tokens, max_batch_items); the plan's other shapes (its
    last batch, mostly) are captured when it arrives. Other engines have nothing to do early."""
    if getattr(engine, "layout", None) != "packed" or not hasattr(engine, "capture"):
        return
    # A packed engine's max_batch_tokens is a multiple of PACKED_GRANULARITY (profile.py), so
    # a full batch's shape is max_batch_tokens itself.
    profile = engine.profile
    engine.capture(engine.shapes_for([(profile.max_batch_tokens, profile.max_batch_items)]))


def main(argv: list[str] | None = None) -> int:
    """One worker: run the task set's current plan until no batch is left; write a report."""
    parser = argparse.ArgumentParser(prog="fabric worker")
    parser.add_argument("task_set")
    parser.add_argument("--manifest", required=True, help="engine manifest (JSON or YAML)")
    parser.add_argument("--owner", default=f"{socket.gethostname()}:{os.getpid()}")
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument(
        "--heartbeat-seconds", type=float, default=None, help="default: a third of the lease"
    )
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--report", help="write the worker's report here (JSON)")
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for the engine (default: all cores)"
    )
    parser.add_argument(
        "--parent-pid", type=int, default=0, help="exit when this process (the supervisor) ends"
    )
    parser.add_argument(
        "--alive-file",
        help="touch this file every heartbeat: its supervisor tells a lost worker (stopped, its "
        "host gone) from a slow one by its age",
    )
    parser.add_argument(
        "--go-file",
        help="load the engine, then wait until this file exists before reading the plan "
        "(a worker started while its task set is still being ingested and planned)",
    )
    args = parser.parse_args(argv)
    main_at = time.time()
    stop_on_signals()  # its supervisor's SIGTERM ends it, whatever the shell left ignored
    if args.parent_pid:
        bind_to_parent(args.parent_pid)
    every = heartbeat_interval(args.lease_seconds, args.heartbeat_seconds)  # bad timing: now
    if args.alive_file:
        keep_alive(Path(args.alive_file), every)
    return _work(args, main_at)


def keep_alive(path: Path, every_s: float) -> None:
    """Write `path` (this host and pid: a launcher that did not start the process itself ends it
    by them) and touch it every `every_s` seconds, from a thread of its own, while this process
    runs (a stopped process stops touching it)."""
    write_bytes(path, f"{socket.gethostname()} {os.getpid()}\n".encode())

    def touch() -> None:
        while True:
            time.sleep(every_s)
            with contextlib.suppress(OSError):  # the run's folder went: the supervisor did
                os.utime(path)

    threading.Thread(target=touch, name="fabric-alive", daemon=True).start()


def _work(args: argparse.Namespace, main_at: float) -> int:
    if args.threads > 0:
        import torch

        # Several workers on one machine share its cores; oversubscribed, tiny ops stall.
        torch.set_num_threads(args.threads)
    # The runtime's threads hand batches to Python callbacks (engine stages, the database
    # writer): hand the GIL over in well under a millisecond, not the default 5 ms.
    sys.setswitchinterval(0.0002)

    from fabric_gpu.engines import create_engine
    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url, default_root
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_pipelines.lib.worker.loop import run_worker

    paths = FabricPaths(default_root()).ensure()
    db = make_engine(database_url(paths))
    manifest = EngineManifest.load(Path(args.manifest))
    # Where a worker's time goes (unix times), for the step's metadata.
    timeline = {"main_at": main_at, "started_at": time.time()}
    engine = create_engine(manifest)  # first: the slow part a warm worker does ahead of its plan
    timeline["engine_created_at"] = time.time()
    early: EarlyTaskSet | None = None  # the task set, read while waiting for the go
    # The reporter, opened after the go, is closed on every way out.
    with contextlib.ExitStack() as stack:
        try:
            if args.go_file:
                prewarm(engine)
                timeline["engine_ready_at"] = time.time()
                _import_job_modules()  # while the plan is still being made, not after the go
                early = read_task_set_before_go(db, args.task_set, Path(args.go_file))
            timeline["go_at"] = time.time()
            job = load_job(db, paths, args.task_set, manifest, early)
            timeline["job_loaded_at"] = time.time()
            # After the go: where the step listens through Pipes, its session is open by now.
            report = stack.enter_context(reporter())
            announce_start(report, args.owner, job.plan_id)
            done = run_worker(
                db, engine, job, owner=args.owner, lease_seconds=args.lease_seconds,
                heartbeat_seconds=args.heartbeat_seconds, max_attempts=args.max_attempts,
            )  # fmt: skip
            timeline["done_at"] = time.time()
        finally:
            engine.close()
        timeline["closed_at"] = time.time()
        summary = {"owner": args.owner, **asdict(done), "errors": done.errors[:20], **timeline}
        summary.pop("runtime", None)
        if args.report:
            write_bytes(Path(args.report), json.dumps(summary).encode())
        print(json.dumps({k: v for k, v in summary.items() if k != "errors"}))
        announce_done(report, args.owner, done, timeline["done_at"] - timeline["started_at"])
    return 0


def _import_job_modules() -> None:
    """The modules `load_job` and the run after it import (reading the plan, the task set)."""
    import fabric_pipelines.lib.broker.plans
    import fabric_pipelines.lib.tasks.arrow_files  # noqa: F401


@dataclass(frozen=True)
class EarlyTaskSet:
    """A task set's stored table, read (and its hash checked) before the go."""

    path: str
    content_sha256: str
    table: Any  # pa.Table


def read_task_set_before_go(
    db: Any,
    task_set: str,
    go_file: Path,
    poll_s: float = 0.01,
    db_poll_s: float = 0.05,
    given_up: Callable[[], bool] | None = None,
) -> EarlyTaskSet | None:
    """Wait for the go file (looked for every `poll_s`; `given_up` returning True ends the wait
    without it: a pool worker's run went away); meanwhile, as soon as the set's ingest
    has committed (asked every `db_poll_s`: on SQLite each ask takes the write lock a moment),
    read its stored table (a second or so at 1 M tasks, hashing included), which the plan being
    made meanwhile does not change. Best effort: anything that goes wrong here leaves the
    reading to `load_job`, after the go, where errors are reported."""
    from fabric_pipelines.lib.tasks.arrow_files import read_table
    from fabric_pipelines.lib.tasks.catalog import get_task_set

    early: EarlyTaskSet | None = None
    asked_at: float | None = -math.inf  # None once the set's row was found
    while not go_file.exists():
        if given_up is not None and given_up():
            break
        if asked_at is not None and time.monotonic() - asked_at >= db_poll_s:
            asked_at = time.monotonic()
            try:
                row = get_task_set(db, task_set)
            except Exception:  # not ingested yet (LookupError), or the database away a moment
                row = None
            if row is not None and row.content_sha256:
                asked_at = None
                # A damaged or missing file is left for `load_job` to report after the go.
                with contextlib.suppress(Exception):
                    table = read_table(Path(row.path), row.content_sha256)
                    early = EarlyTaskSet(row.path, row.content_sha256, table)
                continue
        time.sleep(poll_s)
    return early


def load_job(
    db: Any, paths: Any, task_set: str, manifest: Any, early: EarlyTaskSet | None = None
) -> Any:
    """The extraction job of the set's current plan (its rows read through transient errors);
    the task set's table is `early`'s when that is the stored file the set's row names now."""
    from fabric_pipelines.lib.broker.plans import current_plan, load_plan_order
    from fabric_pipelines.lib.tasks.arrow_files import read_table
    from fabric_pipelines.lib.tasks.catalog import get_task_set
    from fabric_pipelines.lib.worker.loop import ExtractionJob

    ts = retry(f"reading task set {task_set!r}", lambda: get_task_set(db, task_set))
    plan = retry(f"reading the plan of {task_set!r}", lambda: current_plan(db, task_set))
    if early is not None and (early.path, early.content_sha256) == (ts.path, ts.content_sha256):
        tasks = early.table
    else:
        tasks = read_table(Path(ts.path), ts.content_sha256)
    return ExtractionJob(
        task_set=task_set,
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=tasks,
        order=load_plan_order(Path(plan.path), plan.sha256),
        shard_folder=paths.shards,
    )


if __name__ == "__main__":
    code = main()
    # Rows committed, report written: skip the interpreter's teardown (unloading torch and the
    # CUDA context takes a second or more), so the supervisor sees the worker end at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
