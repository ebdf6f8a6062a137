"""Sensors that watch the deployment rather than the data: failed runs are written down, and the
warm engine pool's state is shown."""

from datetime import UTC, datetime
from typing import Any

import dagster as dg

from fabric_pipelines.defs.failures import failed_checks_in_run, innermost_error
from fabric_pipelines.defs.resources import ArtifactStore
from fabric_pipelines.lib.core.alerts import (
    RunFailure,
    record_run_failure,
)
from fabric_pipelines.lib.worker.pool.client import describe, pool_states


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
        f"{e.step_key}: {innermost_error(e.step_failure_data.error)}"
        for e in context.get_step_failure_events()
        if e.step_failure_data.error is not None
    ]
    checks = failed_checks_in_run(context.instance, run.run_id)
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


@dg.sensor(
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Shows the warm engine pool (lib/worker/pool/client.py) in its ticks: each worker's slot, "
        "model, and whether it runs a task set or idles until it exits. Starts no runs."
    ),
)
def engine_pool_sensor(context: dg.SensorEvaluationContext, store: ArtifactStore) -> dg.SkipReason:
    states = pool_states(store.paths().root)
    if not states:
        return dg.SkipReason("no pool workers: the next run starts them (or fabric workers start)")
    return dg.SkipReason("; ".join(describe(state) for state in states))
