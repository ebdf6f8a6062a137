"""The extraction_outputs step without Dagster: run the set's current plan, settle and count
what landed, verify the outputs, and say so (metadata, the accounting check, a data version)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import Engine

from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.ledger import Accounting, accounting
from fabric_pipelines.lib.broker.plans import current_plan
from fabric_pipelines.lib.core.preload import preload
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import INDEX_MODULES, vector_tail
from fabric_pipelines.lib.maintenance.verify import verify_extraction
from fabric_pipelines.lib.records.efficiency import Efficiency, extraction_efficiency, record_run
from fabric_pipelines.lib.records.engine_speeds import record_speed
from fabric_pipelines.lib.steps.metadata import (
    Metadata,
    accounting_check_metadata,
    extraction_metadata,
)
from fabric_pipelines.lib.steps.progress import TaskProgress, stage
from fabric_pipelines.lib.steps.run_extraction import (
    DEFAULT_MAX_RESTARTS,
    ExtractionSummary,
    extract_task_set,
)
from fabric_pipelines.lib.store.settle import settle_embeddings, settling_meanwhile
from fabric_pipelines.lib.tasks.catalog import get_task_set
from fabric_pipelines.lib.worker.launch import Launcher


@dataclass(frozen=True)
class WorkerOptions:
    """How the step runs its workers (the engine resource's settings)."""

    database_url: str
    workers: int
    lease_seconds: float
    heartbeat_seconds: float | None
    pool_idle_seconds: float
    max_restarts: int = DEFAULT_MAX_RESTARTS  # stand-ins for workers that died or were lost


@dataclass(frozen=True)
class ExtractionStep:
    report: ExtractionSummary
    counts: Accounting
    passed: bool  # the accounting check: everything accounted for and every output verified
    problems: list[str]
    data_version: str
    metadata: Metadata
    check_metadata: Metadata
    efficiency: Efficiency  # how well the engine was fed, and where the rest of the time went


@unit_of_work("counting the tasks of task set {task_set!r}")
def _accounting(db: Engine, task_set: str, model_key: str) -> Accounting:
    with db.connect() as conn:
        return accounting(conn, task_set, model_key)


def run_extraction_step(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    manifest: EngineManifest,
    options: WorkerOptions,
    *,
    database_name: str,
    devices: Callable[[], AbstractContextManager[list[int] | None]],
    on_progress: Callable[[Accounting], None],
    launcher: Launcher | None = None,
    on_event: Callable[[str], None] | None = None,
) -> ExtractionStep:
    """LookupError if the set has no plan (shape_batches has not run). `devices()`: the GPUs
    the workers may use, held for the step; `on_progress`: the set's counts as they move;
    `launcher`: where the workers run and what they report through (this host's processes and the
    step's Pipes sessions, a Kubernetes pod per worker, ...); `on_event`: each
    worker that died, was lost or was replaced."""
    started_at = time.time()  # the wall clock: the workers' timelines are on it too
    plan = current_plan(db, task_set)
    stage("extract", tasks=plan.n_items, real_tokens=plan.real_tokens)
    bar = TaskProgress(f"extract {task_set}")

    def progress(counts: Accounting) -> None:
        bar.update(counts)
        on_progress(counts)

    # The index step that follows needs torch and FAISS: import them while the workers run.
    preload(INDEX_MODULES)
    try:
        # The index step's vectors are read while the workers write them (index/vector_tail.py);
        # PostgreSQL's fresh pages are marked visible as they fill (store/settle.py).
        with (
            vector_tail.following(
                db,
                manifest.model_key,
                task_set,
                index_folder=paths.indexes,
                receipt_model=manifest.receipt_model(),
            ),  # fmt: skip
            settling_meanwhile(db),
            devices() as gpus,
        ):
            report = extract_task_set(
                db, paths, task_set, manifest, database_url=options.database_url,
                workers=options.workers, lease_seconds=options.lease_seconds,
                heartbeat_seconds=options.heartbeat_seconds, devices=gpus, on_progress=progress,
                pool_idle_seconds=options.pool_idle_seconds, launcher=launcher,
                max_restarts=options.max_restarts, on_event=on_event,
            )  # fmt: skip
    finally:
        bar.close()
    workers_done_at = time.time()
    # What this engine really did, for `fabric plan`'s predictions (engine_speeds.py).
    record_speed(
        db, manifest, json.loads(plan.profile_json).get("layout", "padded"),
        source=f"extraction of task set {task_set}", padded_tokens=report.padded_tokens,
        real_tokens=report.real_tokens, seconds=report.pulling_seconds,
    )  # fmt: skip
    # PostgreSQL: make the fresh rows countable from the primary key alone (store/settle.py).
    settle_started = time.perf_counter()
    if report.rows_inserted:
        settle_embeddings(db)
    settle_seconds = time.perf_counter() - settle_started
    counts = _accounting(db, task_set, manifest.model_key)
    # This run's engine promised its hook layers for what it extracted; batches of earlier runs
    # are held to the layers their own shard rows record.
    layers = manifest.hooks.layers if report.batches_done else None
    # Coverage, not a second hash of every shard: the writer hashed each one before its ack.
    verify_started = time.perf_counter()
    verified = verify_extraction(db, paths, task_set, layers, rehash_shards=False)
    verify_seconds = time.perf_counter() - verify_started
    problems = [
        f"{f.kind} {f.subject}: {f.problem} (repair: {f.repair})" for f in verified.findings
    ]
    if report.superseded:  # another run re-planned the set: say so, not a bare failed count
        problems.insert(0, report.superseded)
    task_file = get_task_set(db, task_set)
    efficiency = extraction_efficiency(
        real_tokens=report.real_tokens, padded_tokens=report.padded_tokens,
        timelines=report.timelines, step_started_at=started_at, workers_done_at=workers_done_at,
        step_ended_at=time.time(), settle_seconds=settle_seconds, verify_seconds=verify_seconds,
        gpu_busy_seconds=report.gpu_busy_seconds, gpu_span_seconds=report.gpu_span_seconds,
    )  # fmt: skip
    record_run(
        db, task_set, manifest.model_key, plan.plan_id,
        {
            **efficiency.as_mapping(), "sentence": efficiency.sentence(),
            "engine_items": report.engine_items, "reused": counts.reused,
            "completed": counts.completed, "failed": counts.failed,
        },
    )  # fmt: skip
    metadata = extraction_metadata(
        report, counts, plan, model_key=manifest.model_key, database=database_name,
        task_file=(str(task_file.path), task_file.content_sha256), efficiency=efficiency,
    )  # fmt: skip
    version = f"{plan.plan_id}:{counts.completed}:{counts.failed}"
    return ExtractionStep(
        report=report,
        counts=counts,
        passed=counts.finished and verified.clean,
        problems=problems,
        data_version=hashlib.sha256(version.encode()).hexdigest(),
        metadata=metadata,
        check_metadata=accounting_check_metadata(task_set, counts, verified, problems),
        efficiency=efficiency,
    )
