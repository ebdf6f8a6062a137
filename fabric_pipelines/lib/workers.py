"""Worker processes: one per GPU (or several on the CPU), each pulling batches from the ledger.

`launch_workers` starts them as `python -m fabric_pipelines.lib.workers ...` with the engine's
manifest in a file, the database URL in the environment (never on a command line, where a
password would show in `ps`), and CUDA_VISIBLE_DEVICES set per worker for GPU engines so each
owns one device. `supervise` waits for them, reporting progress from the database, and collects
each worker's JSON report. A worker that dies leaves its batch leased; its lease expires and a
surviving worker (or the next run) takes it over.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.broker.ledger import Accounting, accounting
from fabric_pipelines.lib.files import write_bytes


@dataclass(frozen=True)
class WorkerSettings:
    task_set: str
    manifest_path: Path  # the engine manifest, JSON
    data_root: Path
    database_url: str
    lease_seconds: float = 600.0
    max_attempts: int = 3


@dataclass
class WorkerProcess:
    owner: str
    process: subprocess.Popen[bytes]
    report_path: Path
    log_path: Path


def launch_workers(
    settings: WorkerSettings, count: int, folder: Path, devices: list[int] | None = None
) -> list[WorkerProcess]:
    """Start `count` worker processes; worker i gets GPU devices[i] when devices are given."""
    folder.mkdir(parents=True, exist_ok=True)
    workers = []
    for i in range(count):
        owner = f"{socket.gethostname()}:{os.getpid()}:w{i}"
        env = {
            **os.environ,
            "FABRIC_DATABASE_URL": settings.database_url,
            "FABRIC_HOME": str(settings.data_root),
            "HF_HUB_OFFLINE": "1",
        }
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(devices[i])  # the device lease: one GPU per worker
        report = folder / f"worker-{i}.json"
        log = folder / f"worker-{i}.log"
        command = [
            sys.executable, "-m", "fabric_pipelines.lib.workers",
            settings.task_set,
            "--manifest", str(settings.manifest_path),
            "--owner", owner,
            "--lease-seconds", str(settings.lease_seconds),
            "--max-attempts", str(settings.max_attempts),
            "--report", str(report),
            "--threads", str(max(1, (os.cpu_count() or 1) // count)),
        ]  # fmt: skip
        with open(log, "wb") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        workers.append(WorkerProcess(owner, process, report, log))
    return workers


def supervise(
    workers: list[WorkerProcess],
    db: Any,
    task_set: str,
    on_progress: Callable[[Accounting], None] | None = None,
    poll_s: float = 5.0,
) -> list[dict[str, Any]]:
    """Wait for every worker; returns their reports. A worker that failed raises, with its log."""
    while any(w.process.poll() is None for w in workers):
        time.sleep(poll_s if on_progress else 0.2)
        if on_progress is not None:
            with db.connect() as conn:
                on_progress(accounting(conn, task_set))
    reports = []
    for w in workers:
        if w.process.returncode != 0:
            tail = w.log_path.read_text(errors="replace")[-4000:] if w.log_path.exists() else ""
            raise RuntimeError(f"worker {w.owner} exited with {w.process.returncode}:\n{tail}")
        reports.append(json.loads(w.report_path.read_text()))
    return reports


def main(argv: list[str] | None = None) -> int:
    """One worker: run the task set's current plan until no batch is left; write a report."""
    parser = argparse.ArgumentParser(prog="fabric worker")
    parser.add_argument("task_set")
    parser.add_argument("--manifest", required=True, help="engine manifest (JSON or YAML)")
    parser.add_argument("--owner", default=f"{socket.gethostname()}:{os.getpid()}")
    parser.add_argument("--lease-seconds", type=float, default=600.0)
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--report", help="write the worker's report here (JSON)")
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for the engine (default: all cores)"
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        import torch

        # Several workers on one machine share its cores; oversubscribed, tiny ops stall.
        torch.set_num_threads(args.threads)
    # The runtime's threads hand batches to Python callbacks (engine stages, the database
    # writer): hand the GIL over in well under a millisecond, not the default 5 ms.
    sys.setswitchinterval(0.0002)

    from fabric_gpu.engines import create_engine
    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.lib.broker.plans import current_plan, load_plan_order
    from fabric_pipelines.lib.extraction import ExtractionJob, run_worker
    from fabric_pipelines.lib.settings import FabricPaths, database_url, default_root
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_pipelines.lib.tasks.catalog import get_task_set
    from fabric_pipelines.lib.tasks.store import read_table

    paths = FabricPaths(default_root()).ensure()
    db = make_engine(database_url(paths))
    manifest = EngineManifest.load(Path(args.manifest))
    ts = get_task_set(db, args.task_set)
    plan = current_plan(db, args.task_set)
    job = ExtractionJob(
        task_set=args.task_set,
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=read_table(Path(ts.path), ts.content_sha256),
        order=load_plan_order(Path(plan.path), plan.sha256),
        shard_folder=paths.shards,
    )
    engine = create_engine(manifest)
    try:
        report = run_worker(
            db, engine, job, owner=args.owner, lease_seconds=args.lease_seconds,
            max_attempts=args.max_attempts,
        )  # fmt: skip
    finally:
        engine.close()
    summary = {"owner": args.owner, **asdict(report), "errors": report.errors[:20]}
    summary.pop("runtime", None)
    if args.report:
        write_bytes(Path(args.report), json.dumps(summary).encode())
    print(json.dumps({k: v for k, v in summary.items() if k != "errors"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())


@dataclass(frozen=True)
class ExtractionSummary:
    """The stage's outcome over every worker; throughput counts delivered work only."""

    workers: int
    batches_done: int
    batches_failed: int
    stale_acks: int
    rows_inserted: int
    real_tokens: int
    seconds: float  # wall time of the stage, worker start-up included
    worker_seconds: tuple[float, ...] = ()  # each worker's run, from its engine's creation
    # From the first engine ready (graphs captured) to the last batch acknowledged, any worker.
    pulling_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0


def extract_task_set(
    db: Any,
    paths: Any,
    task_set: str,
    manifest: Any,
    *,
    database_url: str,
    workers: int,
    lease_seconds: float = 600.0,
    devices: list[int] | None = None,
    on_progress: Callable[[Accounting], None] | None = None,
) -> ExtractionSummary:
    """Run the task set's current plan: in this process (workers == 0) or in worker processes."""
    started = time.perf_counter()
    if workers == 0:
        from fabric_gpu.engines import create_engine
        from fabric_pipelines.lib.broker.plans import current_plan, load_plan_order
        from fabric_pipelines.lib.extraction import ExtractionJob, run_worker
        from fabric_pipelines.lib.tasks.catalog import get_task_set
        from fabric_pipelines.lib.tasks.store import read_table

        ts = get_task_set(db, task_set)
        plan = current_plan(db, task_set)
        job = ExtractionJob(
            task_set=task_set,
            plan_id=plan.plan_id,
            model_key=manifest.model_key,
            tasks=read_table(Path(ts.path), ts.content_sha256),
            order=load_plan_order(Path(plan.path), plan.sha256),
            shard_folder=paths.shards,
        )
        engine = create_engine(manifest)

        def progress(_report: Any) -> None:
            if on_progress is not None:
                with db.connect() as conn:
                    on_progress(accounting(conn, task_set))

        try:
            r = run_worker(
                db, engine, job, owner=f"{socket.gethostname()}:{os.getpid()}",
                lease_seconds=lease_seconds, progress=progress,
            )  # fmt: skip
        finally:
            engine.close()
        reports = [asdict(r)]
    else:
        folder = paths.root / "workers" / f"{task_set}-{int(time.time() * 1000)}"
        folder.mkdir(parents=True, exist_ok=True)
        manifest_path = folder / "engine.json"
        write_bytes(manifest_path, json.dumps(manifest.to_mapping()).encode())
        settings = WorkerSettings(
            task_set, manifest_path, paths.root, database_url, lease_seconds=lease_seconds
        )
        reports = supervise(
            launch_workers(settings, workers, folder, devices), db, task_set, on_progress
        )
    return ExtractionSummary(
        workers=max(workers, 1),
        batches_done=sum(r["batches_done"] for r in reports),
        batches_failed=sum(r["batches_failed"] for r in reports),
        stale_acks=sum(r["stale_acks"] for r in reports),
        rows_inserted=sum(r["rows_inserted"] for r in reports),
        real_tokens=sum(r["real_tokens"] for r in reports),
        seconds=time.perf_counter() - started,
        worker_seconds=tuple(float(r["seconds"]) for r in reports),
        pulling_seconds=_pulling_window(reports),
    )


def _pulling_window(reports: list[dict[str, Any]]) -> float:
    ready = [r["ready_at"] for r in reports if r.get("ready_at")]
    acked = [r["last_ack_at"] for r in reports if r.get("last_ack_at")]
    return max(acked) - min(ready) if ready and acked else 0.0
