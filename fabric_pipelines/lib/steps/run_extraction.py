"""One run's extraction stage: the task set's current plan run in this process, by worker
processes of the run's own, or on the warm engine pool, and the summary over every worker.

Workers and the pool sit below this module (worker/launch.py, worker/pool/run.py, worker/prestart.py); the
assets, the CLI and the fault drills call `extract_task_set`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fabric_pipelines.lib.broker.ledger import DEFAULT_LEASE_SECONDS, Accounting, heartbeat_interval
from fabric_pipelines.lib.broker.plans import current_plan, plan_task_set
from fabric_pipelines.lib.broker.reuse import (
    Waits,
    fail_pending_of,
    wait_for_other_sets,
    waiting_duplicates_of,
)
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.results.documents import combine_task_set
from fabric_pipelines.lib.worker.launch import (
    Launcher,
    LaunchSettings,
    LocalLauncher,
    Replacement,
    WorkerProcess,
    launch_settings,
    launch_workers,
    read_accounting,
    stop_workers,
    supervise,
)
from fabric_pipelines.lib.worker.main import load_job
from fabric_pipelines.lib.worker.pool.run import free_devices, open_pool_run, supervise_pool_run
from fabric_pipelines.lib.worker.prestart import take_prestarted

# Replacements for workers that died or were lost, for the whole stage (a worker that keeps dying
# on its own input would otherwise be restarted for ever).
DEFAULT_MAX_RESTARTS = 3
# Rounds of computing what a stopped set left behind (each a plan and a run of workers); a key
# taken over is this set's own from then on, so one round settles it unless more sets stop.
MAX_TAKE_OVER_ROUNDS = 3

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from fabric_gpu.manifest import EngineManifest


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
    padded_tokens: int = 0  # what the engine computed, padding included
    worker_seconds: tuple[float, ...] = ()  # each worker's run, from its engine's creation
    # From the first engine ready (graphs captured) to the last batch acknowledged, any worker.
    pulling_seconds: float = 0.0
    # Another run re-planned the set meanwhile: the plan that took over ("" if none), and the
    # sentence that says so; this run's accounting check cannot pass then.
    superseded_by: str = ""
    superseded: str = ""
    # Per worker process, seconds from its start to each point (engine_ready, go, job_loaded,
    # ready, last_ack, done, closed): where its time went.
    timelines: tuple[dict[str, float], ...] = ()
    # Chunked documents whose vectors this run combined from their windows (lib/results/documents.py).
    documents_combined: int = 0
    # Rows the engines returned (their own count, retries included), and the duplicates inside
    # the set that read their first's row, stored by this run's workers (lib/broker/reuse.py).
    engine_items: int = 0
    duplicates_after: int = 0
    # Summed over the GPU workers (their runtimes' timing marks): seconds the GPU ran batches,
    # and each GPU's span from its first batch's start to its last batch's end. 0: no GPU.
    gpu_busy_seconds: float = 0.0
    gpu_span_seconds: float = 0.0

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
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    heartbeat_seconds: float | None = None,
    devices: list[int] | None = None,
    on_progress: Callable[[Accounting], None] | None = None,
    progress_every_s: float = 5.0,
    pool_idle_seconds: float = 0.0,
    launcher: Launcher | None = None,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    on_event: Callable[[str], None] | None = None,
) -> ExtractionSummary:
    """Run the task set's current plan: in this process (workers == 0) or in worker processes,
    on the warm engine pool when `pool_idle_seconds` > 0 (pool_run.py; workers it starts stay
    that long after their last job). Workers this call starts are started by `launcher` (this
    host's processes by default; only those may be prestarted or pooled) and replaced, up to
    `max_restarts` times, when they die or are lost (`supervise`); `on_event` hears of each.

    With worker processes, none of the run's own is left running when this returns or raises
    (call it inside the device lease, which must outlive the workers)."""
    heartbeat_interval(lease_seconds, heartbeat_seconds)  # refuse bad timing before any work
    started = time.perf_counter()
    waiting = waiting_duplicates_of(db, task_set, manifest.model_key)

    def run_current_plan(first_round: bool) -> list[dict[str, Any]]:
        """The set's current plan run to its end by this process or its workers; their reports."""
        if workers == 0:
            return [
                _extract_here(
                    db, paths, task_set, manifest, lease_seconds, heartbeat_seconds,
                    on_progress, progress_every_s,
                )
            ]  # fmt: skip
        starter: Launcher = launcher or LocalLauncher()
        channel = starter.channel if isinstance(starter, LocalLauncher) else None
        # Prestarted and pooled workers are this host's own processes: the local launcher's.
        pooled = isinstance(starter, LocalLauncher)
        warm = None
        if pooled and first_round:
            warm = take_prestarted(
                task_set, manifest, workers, database_url=database_url,
                lease_seconds=lease_seconds, heartbeat_seconds=heartbeat_seconds,
            )  # fmt: skip
        if warm is not None:  # started while the set was ingested and planned: let them go
            with warm:
                if channel is not None:
                    for worker in warm.workers:
                        worker.open_channel(channel)
                    if warm.pool_run is not None:
                        for i in range(len(warm.pool_run.jobs)):
                            warm.pool_run.listen(i, channel)
                started_workers = warm.go()
                if warm.pool_run is not None:
                    return supervise_pool_run(
                        warm.pool_run, db, task_set, on_progress, progress_every_s
                    )
                return supervise(
                    started_workers, db, task_set, on_progress, progress_every_s,
                    replacement=_replacement(
                        warm.settings, warm.count, warm.devices, starter, max_restarts
                    ),
                    on_event=on_event,
                )  # fmt: skip
        settings = launch_settings(
            paths, task_set, manifest, database_url, lease_seconds, heartbeat_seconds
        )
        if pool_idle_seconds > 0 and pooled:
            run = open_pool_run(
                settings, manifest, workers, devices, pool_idle_seconds, channel=channel
            )
            return supervise_pool_run(run, db, task_set, on_progress, progress_every_s)
        if starter.on_this_host:
            free_devices(paths.root, devices)
        with _running(settings, workers, devices, starter) as started_workers:
            return supervise(
                started_workers, db, task_set, on_progress, progress_every_s,
                replacement=_replacement(settings, workers, devices, starter, max_restarts),
                on_event=on_event,
            )  # fmt: skip

    reports = run_current_plan(True)
    # Tasks waiting for what another running set computes: wait for it; where that set stopped,
    # plan what it left to this set and run again (lib/broker/reuse.py).
    for _ in range(MAX_TAKE_OVER_ROUNDS):
        waits = wait_for_other_sets(
            db, task_set, manifest.model_key, stopped_after_s=lease_seconds,
            on_wait=None if on_event is None else _say_waiting(on_event),
        )  # fmt: skip
        if not waits.taken_over:
            break
        if on_event is not None:
            on_event(
                f"{waits.taken_over} tasks waited for another task set that stopped running; "
                "this set computes them"
            )
        _plan_again(db, paths, task_set, manifest)
        reports += run_current_plan(False)
    superseded = next((r for r in reports if r.get("superseded_by")), None)
    combined, resolved = finish_task_set(db, task_set, manifest, waiting)
    return ExtractionSummary(
        workers=max(workers, 1),
        batches_done=sum(r["batches_done"] for r in reports),
        batches_failed=sum(r["batches_failed"] for r in reports),
        stale_acks=sum(r["stale_acks"] for r in reports),
        rows_inserted=sum(r["rows_inserted"] for r in reports),
        real_tokens=sum(r["real_tokens"] for r in reports),
        padded_tokens=sum(r.get("padded_tokens", 0) for r in reports),
        seconds=time.perf_counter() - started,
        worker_seconds=tuple(float(r["seconds"]) for r in reports),
        pulling_seconds=_pulling_window(reports),
        superseded_by=superseded["superseded_by"] if superseded else "",
        superseded=superseded["superseded"] if superseded else "",
        timelines=tuple(_timeline(r) for r in reports if r.get("started_at")),
        documents_combined=combined,
        engine_items=sum(r.get("engine_items", 0) for r in reports),
        duplicates_after=resolved,
        gpu_busy_seconds=sum(r.get("gpu_busy_seconds", 0.0) for r in reports),
        gpu_span_seconds=sum(r.get("gpu_span_seconds", 0.0) for r in reports),
    )


def _say_waiting(on_event: Callable[[str], None]) -> Callable[[Waits], None]:
    """Tell `on_event` once what the set waits for (not at every look)."""
    said: set[tuple[int, ...]] = set()

    def say(waits: Waits) -> None:
        key = tuple(sorted(waits.waiting))
        if key not in said:
            said.add(key)
            total = sum(waits.waiting.values())
            on_event(
                f"{total} tasks wait for results that task set ids {list(key)} are computing "
                "now (the same token ids)"
            )

    return say


def _plan_again(db: Engine, paths: Any, task_set: str, manifest: EngineManifest) -> None:
    """Plan the set's outstanding tasks in the layout of its current plan (reuse on: waits
    exist only where it is)."""
    layout = json.loads(current_plan(db, task_set).profile_json).get("layout", "padded")
    plan_task_set(db, paths, task_set, manifest, layout, reuse=True)


@unit_of_work("finishing task set {task_set!r} (combining documents, failing orphaned duplicates)")
def finish_task_set(
    db: Engine, task_set: str, manifest: EngineManifest, waiting: np.ndarray | None = None
) -> tuple[int, int]:
    """What ends every extraction run once its workers are done: chunked documents combined from
    their windows, then duplicates inside the set whose first failed failed with it (the others
    read their first's row, lib/broker/reuse.py); (documents combined, how many of the
    duplicates `waiting` when the workers started read their first's row now)."""
    combined = combine_task_set(db, task_set, manifest)
    fail_pending_of(db, task_set, manifest.model_key)
    still = waiting_duplicates_of(db, task_set, manifest.model_key)
    resolved = 0 if waiting is None else int(np.setdiff1d(waiting, still).size)
    return combined, resolved


def _timeline(report: dict[str, Any]) -> dict[str, float]:
    start = float(report["started_at"])
    return {
        "started_at": start,  # the wall clock, to line workers up with the run's own marks
        **{
            name.removesuffix("_at"): round(float(report[name]) - start, 3)
            for name in TIMELINE_POINTS
            if report.get(name)
        },
    }


TIMELINE_POINTS = (
    "main_at", "engine_created_at", "engine_ready_at", "go_at", "job_loaded_at", "ready_at",
    "last_ack_at", "done_at", "closed_at",
)  # fmt: skip


def _replacement(
    settings: LaunchSettings,
    count: int,
    devices: list[int] | None,
    launcher: Launcher,
    max_restarts: int,
) -> Replacement | None:
    """A dead or lost worker's stand-in: the same place (and device), the same launcher. None
    with `max_restarts` 0: a worker that fails fails the stage, and a silent one is waited for."""
    if max_restarts <= 0:
        return None

    def launch(replaced: WorkerProcess, generation: int) -> WorkerProcess:
        device = devices[replaced.index] if devices is not None else None
        return launcher.start(
            settings, replaced.index, settings.folder, device, threads_of=count,
            generation=generation,
        )  # fmt: skip

    return Replacement(launch, lost_after_s=settings.lease_seconds, max_restarts=max_restarts)


@contextlib.contextmanager
def _running(
    settings: LaunchSettings,
    count: int,
    devices: list[int] | None,
    launcher: Launcher,
) -> Iterator[list[WorkerProcess]]:
    workers = launch_workers(settings, count, settings.folder, devices, launcher=launcher)
    try:
        yield workers
    finally:  # supervise stops them too; this covers an exit between launch and supervise
        stop_workers(workers)


def _extract_here(
    db: Any,
    paths: Any,
    task_set: str,
    manifest: Any,
    lease_seconds: float,
    heartbeat_seconds: float | None,
    on_progress: Callable[[Accounting], None] | None,
    progress_every_s: float,
) -> dict[str, Any]:
    from fabric_gpu.engines import create_engine
    from fabric_pipelines.lib.worker.loop import run_worker

    job = load_job(db, paths, task_set, manifest)
    engine = create_engine(manifest)

    def progress(_report: Any) -> None:
        if on_progress is not None:
            on_progress(read_accounting(db, task_set))

    try:
        report = run_worker(
            db, engine, job, owner=f"{socket.gethostname()}:{os.getpid()}",
            lease_seconds=lease_seconds, heartbeat_seconds=heartbeat_seconds,
            progress=progress, progress_every_s=progress_every_s,
        )  # fmt: skip
    finally:
        engine.close()
    return asdict(report)


def _pulling_window(reports: list[dict[str, Any]]) -> float:
    ready = [r["ready_at"] for r in reports if r.get("ready_at")]
    acked = [r["last_ack_at"] for r in reports if r.get("last_ack_at")]
    return max(acked) - min(ready) if ready and acked else 0.0
