"""Sensors: new files in the inbox become task-set partitions and extraction runs."""

import dagster as dg

from fabric_pipelines.defs.assets import (
    extraction_outputs,
    shape_batches,
    tokenised_tasks,
    vector_index,
)
from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS, task_sets
from fabric_pipelines.defs.resources import ArtifactStore
from fabric_pipelines.lib.tasks.inbox import scan

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
    description="Registers each file dropped in the inbox as a task set and runs its extraction.",
)
def inbox_sensor(context: dg.SensorEvaluationContext, store: ArtifactStore) -> dg.SensorResult:
    accepted, rejected = scan(store.paths().inbox)
    for bad in rejected:
        context.log.warning(f"inbox: ignoring {bad.path.name}: {bad.reason}")
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
