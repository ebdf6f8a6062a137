"""Schedules: a nightly index refresh, so an index catches up even if no sensor fired, and a
weekly verification of every stored file."""

import dagster as dg

from fabric_pipelines.defs.index import index_job
from fabric_pipelines.defs.verify import verify_job

index_refresh = dg.ScheduleDefinition(
    name="nightly_index_refresh",
    job=index_job,
    cron_schedule="0 3 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description=(
        "Rebuilds vector_index at 03:00 UTC: stale shards are refilled, unchanged ones reused, "
        "every reused file re-verified against its receipt."
    ),
)

weekly_verify = dg.ScheduleDefinition(
    name="weekly_verify",
    job=verify_job,
    cron_schedule="0 4 * * 0",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description=(
        "Runs verify_job on Sundays at 04:00 UTC: every stored file hashed again, every "
        "ledger checked. Findings fail the run, so run_failure_alerts records them, with "
        "their repair commands, in <data root>/alerts/run_failures.jsonl."
    ),
)
