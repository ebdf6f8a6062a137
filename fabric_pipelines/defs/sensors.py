"""Sensors: inbox files become task-set runs, changed rows rebuild their index shards, failed
runs are written down."""

import contextlib
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from fabric_pipelines.defs.assets import (
    extraction_outputs,
    shape_batches,
    tokenised_tasks,
    vector_index,
)
from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS, task_sets
from fabric_pipelines.defs.resources import ArtifactStore, Database
from fabric_pipelines.lib.alerts import (
    InboxRejection,
    RunFailure,
    record_inbox_rejection,
    record_run_failure,
)
from fabric_pipelines.lib.engine_pool import describe, pool_states
from fabric_pipelines.lib.gpu_pool import sync_gpu_pool
from fabric_pipelines.lib.index.staleness import indexed_models, staleness
from fabric_pipelines.lib.tasks.inbox import record_first_seen, scan

extract_task_set = dg.define_asset_job(
    "extract_task_set",
    selection=dg.AssetSelection.assets(tokenised_tasks, shape_batches, extraction_outputs),
    description="Tokenise, plan and extract one task set (one partition).",
)

index_job = dg.define_asset_job(
    "build_vector_index",
    selection=dg.AssetSelection.assets(vector_index),
    description="Build the vector index over every embedding of the engine's model.",
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


index_automation = dg.AutomationConditionSensorDefinition(
    "index_automation",
    target=dg.AssetSelection.assets(vector_index),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    description="Rebuilds vector_index once new extraction outputs land (eager condition).",
)


@dg.sensor(
    job=index_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Rebuilds an index whose rows changed in the database (per-shard watermarks kept by "
        "triggers) or whose file is gone; only the stale shards are rebuilt."
    ),
)
def index_staleness_sensor(
    context: dg.SensorEvaluationContext, store: ArtifactStore, database: Database
) -> dg.SensorResult:
    busy = context.instance.get_runs_count(
        dg.RunsFilter(
            statuses=[
                dg.DagsterRunStatus.QUEUED,
                dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.STARTED,
            ]
        )
    )
    if busy:  # rows may still be landing, or the eager condition already asked for a build
        return dg.SensorResult(skip_reason=f"{busy} run(s) in progress; checking after they end")
    requests = []
    with database.engine().connect() as conn:
        for model_key in indexed_models(conn):
            found = staleness(conn, model_key, store.paths().indexes)
            if found is None or not found.stale:
                continue
            shards = ",".join(map(str, found.stale_shards)) or "none"
            context.log.info(
                f"index of {model_key} is stale: shards [{shards}]"
                + ("; served file missing" if found.index_missing else "")
            )
            requests.append(
                dg.RunRequest(
                    # One run per (receipt, stale set): a failed rebuild is not retried in a loop.
                    run_key=f"{found.receipt_sha256[:16]}:{shards}:{found.index_missing}",
                    tags={"fabric/model_key": model_key, "fabric/stale_shards": shards},
                )
            )
    return dg.SensorResult(run_requests=requests)


@dg.run_failure_sensor(
    name="run_failure_alerts",
    default_status=dg.DefaultSensorStatus.RUNNING,
    monitor_all_code_locations=False,
    description="Writes every failed run, with its reason, to <data root>/alerts/run_failures.jsonl.",
)
def run_failure_alerts(context: dg.RunFailureSensorContext, store: ArtifactStore) -> None:
    run = context.dagster_run
    # The run's own message names the failed steps; the steps' errors say why.
    causes = [
        f"{e.step_key}: {_root_cause(e.step_failure_data.error)}"
        for e in context.get_step_failure_events()
        if e.step_failure_data.error is not None
    ]
    checks = _failed_checks(context.instance, run.run_id)
    parts = [context.failure_event.message or "run failed", *checks, *causes]
    # Each part without its own closing stop: "failed.; step: error." reads as noise.
    message = "; ".join(part.strip().rstrip(".") for part in parts if part.strip()) + "."
    job = _job_label(context.instance, run)
    path = record_run_failure(
        store.paths().root,
        RunFailure(
            run_id=run.run_id,
            job=job,
            partition=run.tags.get("dagster/partition"),
            failed_at=datetime.now(UTC).isoformat(timespec="seconds"),
            reason=message[:2000],
        ),
    )
    context.log.warning(f"run {run.run_id} of {job} failed: {message[:200]} ({path})")


def _job_label(instance: Any, run: Any) -> str:
    """What ran, in words: the job's name, or for a run launched from the UI's asset graph (a
    hidden job such as `__ASSET_JOB`) the assets it was to materialise."""
    if not run.job_name.startswith("__"):
        return str(run.job_name)
    keys = {key.to_user_string() for key in (run.asset_selection or ())}
    if not keys:  # the run's planned materialisations say which
        planned = instance.get_records_for_run(
            run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED
        ).records
        keys = {
            r.event_log_entry.dagster_event.asset_key.to_user_string()
            for r in planned
            if r.event_log_entry.dagster_event is not None
            and r.event_log_entry.dagster_event.asset_key is not None
        }
    return f"materialise {', '.join(sorted(keys))}" if keys else "materialise assets"


def _failed_checks(instance: Any, run_id: str) -> list[str]:
    """Each asset check that failed in the run, with the numbers its metadata gives (a recall
    and its floor, what to change)."""
    records = instance.get_records_for_run(
        run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION
    ).records
    found = []
    for record in records:
        event = record.event_log_entry.dagster_event
        evaluation = event.event_specific_data if event is not None else None
        if evaluation is None or evaluation.passed:
            continue
        numbers = ", ".join(
            f"{name} {getattr(value, 'value', value)}"
            for name, value in evaluation.metadata.items()
        )
        found.append(
            f"check {evaluation.check_name} of {evaluation.asset_key.to_user_string()} failed"
            + (f" ({numbers})" if numbers else "")
        )
    return found


def _root_cause(error: Any) -> str:
    """The innermost error of Dagster's wrapped error chain: the user's own exception."""
    while error.cause is not None:
        error = error.cause
    return str(error.message).strip()


@dg.sensor(
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Shows the warm engine pool (lib/engine_pool.py) in its ticks: each worker's slot, "
        "model, and whether it runs a task set or idles until it exits. Starts no runs."
    ),
)
def engine_pool_sensor(context: dg.SensorEvaluationContext, store: ArtifactStore) -> dg.SkipReason:
    states = pool_states(store.paths().root)
    if not states:
        return dg.SkipReason("no pool workers: the next run starts them (or fabric workers start)")
    return dg.SkipReason("; ".join(describe(state) for state in states))
