"""The extraction family: tokenised_tasks -> shape_batches -> extraction_outputs, one partition
per task set, with the job that runs them and the inbox sensor that launches it.

Each asset is a thin call into fabric_pipelines.lib; results go to the database and to files
through resources, and each returns a MaterializeResult with a data version and small metadata.
"""

import contextlib
import hashlib
import time
import warnings
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from fabric_gpu.engines import input_layout
from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS, task_sets
from fabric_pipelines.defs.pipeline import CODE_VERSIONS, PIPELINE_GROUP
from fabric_pipelines.defs.resources import ArtifactStore, Database, EngineConfig
from fabric_pipelines.lib import run_extraction
from fabric_pipelines.lib.alerts import (
    InboxRejection,
    record_inbox_rejection,
)
from fabric_pipelines.lib.broker.ledger import Accounting, accounting
from fabric_pipelines.lib.broker.plans import current_plan, plan_task_set
from fabric_pipelines.lib.charts import power_of_two_bins
from fabric_pipelines.lib.gpu_pool import sync_gpu_pool
from fabric_pipelines.lib.index import vector_tail
from fabric_pipelines.lib.plots import chart_and_table
from fabric_pipelines.lib.preload import INDEX_MODULES, preload
from fabric_pipelines.lib.progress import TaskProgress, stage
from fabric_pipelines.lib.store.settle import settle_embeddings, settling_meanwhile
from fabric_pipelines.lib.tasks.catalog import get_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import record_first_seen, scan
from fabric_pipelines.lib.tasks.ingest import SubmissionError
from fabric_pipelines.lib.verify import verify_extraction


@dg.asset(
    partitions_def=task_sets,
    group_name=PIPELINE_GROUP,
    kinds={"python", "arrow"},
    code_version=CODE_VERSIONS["tokenised_tasks"],
    description=(
        "A submitted task set, tokenised with the model's fast tokenizer and stored as an Arrow "
        "IPC file (atomic write, sha256 checked on read). Bad records are failed back with a "
        "reason each; they never abort the set."
    ),
)
def tokenised_tasks(
    context: dg.AssetExecutionContext,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    manifest = engine.manifest()
    started = time.perf_counter()
    stage("ingest")
    try:
        summary = ingest_task_set(
            database.engine(),
            store.paths(),
            context.partition_key,
            model_id=manifest.model_id,
            max_seq_len=manifest.profile.max_seq_len,
            truncate=engine.truncate,
        )
    except (SubmissionError, ValueError) as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    # The reason starts with where the record is in the file ("line 5", "row 4").
    failures = "\n".join(f"| {f.task_id or ''} | {f.reason} |" for f in summary.failures[:50])
    lengths = summary.lengths
    return dg.MaterializeResult(
        metadata={
            "records": summary.n_records,
            "tasks": summary.n_tasks,
            "failed": summary.n_failed,
            "truncated": summary.truncated,
            "tokens": int(lengths.sum()),
            "mean_length": round(float(lengths.mean()), 2) if lengths.size else 0.0,
            "max_length": int(lengths.max()) if lengths.size else 0,
            "reused": summary.reused,
            "seconds": round(time.perf_counter() - started, 3),
            "path": dg.MetadataValue.path(str(summary.path)),
            "sha256": summary.content_sha256,
            "length_histogram": dg.MetadataValue.md(
                chart_and_table(
                    *power_of_two_bins(lengths), ("tokens", "tasks"), title="tasks per length"
                )
                if lengths.size
                else "no tasks"
            ),
            "failures": dg.MetadataValue.md(
                "| id | reason |\n|---|---|\n" + failures if failures else "none"
            ),
        },
        data_version=dg.DataVersion(summary.content_sha256),
    )


@dg.asset(
    partitions_def=task_sets,
    deps=[tokenised_tasks],
    group_name=PIPELINE_GROUP,
    kinds={"numpy", "arrow"},
    code_version=CODE_VERSIONS["shape_batches"],
    description=(
        "Shape-pure batches of the task set's outstanding items for the engine's consumer "
        "profile (max batch tokens, items, sequence length, granularity), plus one ledger row per "
        "batch in the database."
    ),
)
def shape_batches(
    context: dg.AssetExecutionContext,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    manifest = engine.manifest()
    started = time.perf_counter()
    stage("plan")
    summary = plan_task_set(
        database.engine(), store.paths(), context.partition_key, manifest, input_layout(manifest)
    )
    plan = summary.plan
    by_bucket = summary.padding_by_bucket()
    return dg.MaterializeResult(
        metadata={
            "plan_id": summary.plan_id,
            "batches": plan.n_batches,
            "new_ledger_rows": summary.new_batches,
            "items": int(plan.item_count.sum()),
            "real_tokens": int(plan.real_tokens.sum()),
            "padded_tokens": int(plan.padded_tokens.sum()),
            "padding_fraction": round(plan.padding_fraction, 5),
            "shapes": len(plan.shapes()),
            "padding_by_bucket": dg.MetadataValue.md(
                chart_and_table(
                    [f"{k} tokens" for k in by_bucket],
                    [100 * v for v in by_bucket.values()],
                    ("bucket", "padding %"),
                    title="padding per bucket (% of padded tokens)",
                    fmt="{:.3f}",
                    full=100.0,
                )
                if by_bucket
                else "no batches"
            ),
            "path": dg.MetadataValue.path(str(summary.path)),
            "seconds": round(time.perf_counter() - started, 3),
        },
        data_version=dg.DataVersion(summary.plan_id),
    )


def _partitioned_check_spec(name: str, **kwargs: Any) -> dg.AssetCheckSpec:
    """A check recorded per task set: a failed set's check is that partition's, and the UI
    keeps every other set's result beside it. (Dagster marks check partitions a preview.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec.*")
        return dg.AssetCheckSpec(name, partitions_def=task_sets, **kwargs)


@dg.asset(
    partitions_def=task_sets,
    deps=[shape_batches],
    group_name=PIPELINE_GROUP,
    kinds={"pytorch", "sql"},
    code_version=CODE_VERSIONS["extraction_outputs"],
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=2, delay=10),
    check_specs=[
        _partitioned_check_spec(
            "accounting",
            asset="extraction_outputs",
            blocking=True,
            description=(
                "tasks = completed + failed + in_flight + queued, nothing left in flight, and "
                "every stored output verified: each completed task has its embedding row and, "
                "when the engine keeps hook layers, is in exactly one shard file (sha256 "
                "checked) per layer"
            ),
        )
    ],
    description=(
        "Pooled embeddings (database rows) and hook-layer hidden states (content-addressed shard "
        "files) of every task, from the engine driven batch by batch off the ledger."
    ),
)
def extraction_outputs(
    context: dg.AssetExecutionContext,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    task_set = context.partition_key
    started = time.perf_counter()
    manifest = engine.manifest()
    db = database.engine()
    try:
        plan_row = current_plan(db, task_set)
    except LookupError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc

    stage("extract", tasks=plan_row.n_items, real_tokens=plan_row.real_tokens)
    bar = TaskProgress(f"extract {task_set}")

    def progress(counts: Accounting) -> None:
        bar.update(counts)
        context.log.info(
            f"{task_set}: {counts.completed:,} completed, {counts.failed:,} failed, "
            f"{counts.in_flight:,} in flight, {counts.queued:,} queued of {counts.tasks:,}"
        )
        context.log_event(
            dg.AssetObservation(
                asset_key=context.asset_key,
                partition=task_set,
                metadata={
                    "completed": counts.completed,
                    "in_flight": counts.in_flight,
                    "queued": counts.queued,
                },
            )
        )

    def waiting_for_gpus() -> None:
        context.log.info(f"{task_set}: waiting for {engine.workers} free GPU(s)")

    # The index step that follows needs torch and FAISS: import them while the workers run
    # (lib/preload.py).
    preload(INDEX_MODULES)
    try:
        # The index step's vectors are read while the workers write them (lib/index/vector_tail.py);
        # PostgreSQL's fresh pages are marked visible as they fill (lib/store/settle.py).
        with (
            vector_tail.following(db, manifest.model_key, task_set),
            settling_meanwhile(db),
            engine.devices(store.paths(), waiting_for_gpus, task_set) as devices,
        ):
            report = run_extraction.extract_task_set(
                db,
                store.paths(),
                task_set,
                manifest,
                database_url=database.resolved_url(),
                workers=engine.workers,
                lease_seconds=engine.lease_seconds,
                heartbeat_seconds=engine.heartbeat_seconds,
                devices=devices,
                on_progress=progress,
                pool_idle_seconds=engine.pool_idle(),
            )
    finally:
        bar.close()
    # PostgreSQL: make the fresh rows countable from the primary key alone (lib/store/settle.py).
    settle_started = time.perf_counter()
    if report.rows_inserted:
        settle_embeddings(db)
    settle_seconds = time.perf_counter() - settle_started
    with db.connect() as conn:
        counts = accounting(conn, task_set, manifest.model_key)
    # This run's engine promised its hook layers for what it extracted; batches of earlier runs
    # are held to the layers their own shard rows record.
    layers = manifest.hooks.layers if report.batches_done else None
    # Coverage, not a second hash of every shard: the writer hashed each one before its ack.
    verify_started = time.perf_counter()
    verified = verify_extraction(db, store.paths(), task_set, layers, rehash_shards=False)
    verify_seconds = time.perf_counter() - verify_started
    problems = [
        f"{f.kind} {f.subject}: {f.problem} (repair: {f.repair})" for f in verified.findings
    ]
    if report.superseded:
        # Another run of this set re-planned it: say so instead of a bare failed count.
        context.log.warning(report.superseded)
        problems.insert(0, report.superseded)
    version = hashlib.sha256(
        f"{plan_row.plan_id}:{counts.completed}:{counts.failed}".encode()
    ).hexdigest()
    return dg.MaterializeResult(
        metadata={
            "model_key": manifest.model_key,
            "database": database.describe(),
            "batches_done": report.batches_done,
            "batches_failed": report.batches_failed,
            "stale_acks": report.stale_acks,
            "workers": report.workers,
            "rows_inserted": report.rows_inserted,
            "real_tokens": report.real_tokens,
            "real_tokens_per_s": round(report.tokens_per_second, 1),
            # The step's wall time; the workers' part of it; their pulling window (first
            # engine ready, graphs captured, to the last batch acknowledged); the check after.
            "seconds": round(time.perf_counter() - started, 3),
            "extract_seconds": round(report.seconds, 3),
            "pulling_seconds": round(report.pulling_seconds, 3),
            "settle_seconds": round(settle_seconds, 3),
            "verify_seconds": round(verify_seconds, 3),
            "worker_timelines": dg.MetadataValue.json(list(report.timelines)),
            "pulling_tokens_per_s": round(
                report.real_tokens / report.pulling_seconds if report.pulling_seconds else 0.0, 1
            ),
            "completed": counts.completed,
            "failed": counts.failed,
            "superseded_by": report.superseded_by or "none",
            # What this extraction ran: its plan and its task file, by content hash.
            "plan_id": plan_row.plan_id,
            "plan_sha256": plan_row.sha256,
            "plan_path": dg.MetadataValue.path(str(plan_row.path)),
            **_task_file(database.engine(), context.partition_key),
        },
        data_version=dg.DataVersion(version),
        check_results=[
            dg.AssetCheckResult(
                check_name="accounting",
                passed=counts.finished and verified.clean,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata={
                    "task_set": task_set,
                    "tasks": counts.tasks,
                    "completed": counts.completed,
                    "failed": counts.failed,
                    "in_flight": counts.in_flight,
                    "queued": counts.queued,
                    "shard_files_verified": verified.checked.get("shard_files", 0),
                    "hidden_state_tasks": verified.checked.get("hidden_state_tasks", 0),
                    "findings": len(verified.findings),
                    "problems": "; ".join(problems[:20]) or "none",
                },
            )
        ],
    )


def _task_file(db: Any, task_set: str) -> dict[str, Any]:
    """The set's stored task file and its content hash, for the extraction's metadata."""
    row = get_task_set(db, task_set)
    return {
        "task_file_sha256": row.content_sha256,
        "task_file_path": dg.MetadataValue.path(str(row.path)),
    }


extract_task_set = dg.define_asset_job(
    "extract_task_set",
    selection=dg.AssetSelection.assets(tokenised_tasks, shape_batches, extraction_outputs),
    description="Tokenise, plan and extract one task set (one partition).",
)


@dg.sensor(
    job=extract_task_set,
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Registers each file dropped in the inbox as a task set and runs its extraction; keeps "
        "the gpu pool at one slot per visible GPU."
    ),
)
def inbox_sensor(context: dg.SensorEvaluationContext, store: ArtifactStore) -> dg.SensorResult:
    resized = sync_gpu_pool(context.instance)
    if resized is not None:
        context.log.info(f"gpu pool: {resized} slot(s), one per visible GPU")
    inbox = store.paths().inbox
    accepted, rejected = scan(inbox)
    for bad in rejected:  # said once per file version, and kept in alerts/inbox_rejections.jsonl
        with contextlib.suppress(FileNotFoundError):
            stat = bad.path.stat()
            rejection = InboxRejection(
                file=bad.path.name,
                version=f"{stat.st_size}:{stat.st_mtime_ns}",
                reason=bad.reason,
                seen_at=datetime.now(UTC).isoformat(timespec="seconds"),
            )
            if record_inbox_rejection(store.paths().root, rejection):
                context.log.warning(f"inbox: refusing {bad.path.name}: {bad.reason}")
    # A dropped file's hash is recorded when first seen: ingest refuses it if it changes later.
    for found in record_first_seen(inbox, accepted):
        context.log.info(f"inbox: {found.path.name} registered, sha256 {found.sha256[:16]}…")
    known = set(context.instance.get_dynamic_partitions(TASK_SET_PARTITIONS))
    new = sorted({f.task_set for f in accepted} - known)
    return dg.SensorResult(
        run_requests=[
            # The run key holds the content hash: the same file never runs twice, a replaced one
            # (refused as immutable by tokenised_tasks) shows up as a failed run with the reason.
            dg.RunRequest(run_key=f"{f.task_set}:{f.sha256[:16]}", partition_key=f.task_set)
            for f in accepted
        ],
        dynamic_partitions_requests=[task_sets.build_add_request(new)] if new else [],
    )
