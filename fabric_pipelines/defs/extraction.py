"""The extraction family: tokenised_tasks -> shape_batches -> extraction_outputs, one partition
per task set, with the job that runs them and the inbox sensor that launches it.

Each asset is a thin call into fabric_pipelines.lib; results go to the database and to files
through resources, and each returns a MaterializeResult with a data version and small metadata.
"""

import contextlib
import warnings
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from fabric_gpu.engines import input_layout
from fabric_pipelines.defs.asset_group import CODE_VERSIONS, PIPELINE_GROUP
from fabric_pipelines.defs.gpu_pool import GPU_POOL, sync_gpu_pool
from fabric_pipelines.defs.metadata import dagster_metadata
from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS, task_sets
from fabric_pipelines.defs.resources import ArtifactStore, Database, EngineConfig
from fabric_pipelines.defs.worker_pipes import worker_launcher
from fabric_pipelines.lib.broker.ledger import Accounting
from fabric_pipelines.lib.core.alerts import (
    InboxRejection,
    record_inbox_rejection,
)
from fabric_pipelines.lib.core.signals import StopRequested
from fabric_pipelines.lib.steps.ahead import IngestInputs, PlanInputs, ingested, planned
from fabric_pipelines.lib.steps.extraction import run_extraction_step
from fabric_pipelines.lib.steps.metadata import ingest_metadata, plan_metadata
from fabric_pipelines.lib.steps.progress import stage
from fabric_pipelines.lib.tasks.inbox import record_first_seen, scan
from fabric_pipelines.lib.tasks.ingest import SubmissionError
from fabric_pipelines.lib.tasks.prompts import set_prompt
from fabric_pipelines.lib.worker.client_launch import SharedDatabaseRequired


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
    stage("ingest")
    paths, task_set = store.paths(), context.partition_key
    try:
        inputs = IngestInputs.of(
            database.resolved_url(), paths, task_set, manifest, engine.long_input_policy(),
            set_prompt(paths.inbox, task_set, manifest.model_id),
        )  # fmt: skip
        # Made ahead by `fabric submit --run` in this process while Dagster loaded, else now.
        made = ingested(database.engine, paths, inputs)
    except (SubmissionError, ValueError) as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    return dg.MaterializeResult(
        metadata=dagster_metadata(
            {**ingest_metadata(made.result, made.seconds), **made.metadata()}
        ),
        data_version=dg.DataVersion(made.result.content_sha256),
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
    stage("plan")
    paths = store.paths()
    inputs = PlanInputs.of(
        database.resolved_url(), paths, context.partition_key, manifest, input_layout(manifest),
        engine.reuse_results,
    )  # fmt: skip
    made = planned(database.engine, paths, inputs, manifest)  # ahead, as the ingest
    return dg.MaterializeResult(
        metadata=dagster_metadata({**plan_metadata(made.result, made.seconds), **made.metadata()}),
        data_version=dg.DataVersion(made.result.plan_id),
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
    pool=GPU_POOL,
    retry_policy=dg.RetryPolicy(max_retries=2, delay=10),
    check_specs=[
        _partitioned_check_spec(
            "accounting",
            asset="extraction_outputs",
            blocking=True,
            description=(
                "tasks = completed + reused + failed + in_flight + queued, nothing left in "
                "flight, and "
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
    try:
        launcher = worker_launcher(
            context, engine.launcher, engine.worker_pods, store.paths().root,
            database.resolved_url(),
        )  # fmt: skip
    except (ValueError, OSError) as exc:  # a launcher or pod setting to fix: a retry cannot
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    try:
        step = run_extraction_step(
            database.engine(), store.paths(), task_set, engine.manifest(),
            engine.worker_options(database.resolved_url()), database_name=database.describe(),
            devices=lambda: engine.devices(store.paths(), lambda: _waiting(context, engine), task_set),
            on_progress=lambda counts: _progress(context, task_set, counts),
            launcher=launcher, on_event=context.log.warning,
        )  # fmt: skip
    except (LookupError, SharedDatabaseRequired) as exc:  # no plan; SQLite for other hosts
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    except StopRequested as exc:  # SIGINT/SIGTERM: the user stopped it; a retry would undo that
        raise dg.Failure(
            description=f"{exc}: the workers were stopped; what they acknowledged is kept, and "
            f"`fabric run {task_set}` does what is left",
            allow_retries=False,
        ) from exc
    if step.report.superseded:
        context.log.warning(step.report.superseded)
    context.log.info(f"{task_set}: {step.efficiency.sentence()}")
    return dg.MaterializeResult(
        metadata=dagster_metadata(step.metadata),
        data_version=dg.DataVersion(step.data_version),
        check_results=[
            dg.AssetCheckResult(
                check_name="accounting",
                passed=step.passed,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata=dagster_metadata(step.check_metadata),
            )
        ],
    )


def _progress(context: dg.AssetExecutionContext, task_set: str, counts: Accounting) -> None:
    context.log.info(
        f"{task_set}: {counts.completed:,} completed, {counts.reused:,} reused, "
        f"{counts.failed:,} failed, "
        f"{counts.in_flight:,} in flight, {counts.queued:,} queued of {counts.tasks:,}"
    )
    context.log_event(
        dg.AssetObservation(
            asset_key=context.asset_key,
            partition=task_set,
            metadata={
                "completed": counts.completed,
                "reused": counts.reused,
                "in_flight": counts.in_flight,
                "queued": counts.queued,
            },
        )
    )


def _waiting(context: dg.AssetExecutionContext, engine: EngineConfig) -> None:
    context.log.info(f"{context.partition_key}: waiting for {engine.workers} free GPU(s)")


extract_job = dg.define_asset_job(
    "extract_task_set",
    selection=dg.AssetSelection.assets(tokenised_tasks, shape_batches, extraction_outputs),
    description="Tokenise, plan and extract one task set (one partition).",
)


@dg.sensor(
    job=extract_job,
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
