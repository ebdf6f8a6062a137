"""Schedules: a nightly index refresh, so an index catches up even if no sensor fired."""

import dagster as dg

from fabric_pipelines.defs.sensors import index_job

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
