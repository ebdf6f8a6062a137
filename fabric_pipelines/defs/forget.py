"""forget_job: `fabric forget TASK_SET` from the UI's launchpad (config: task_set, force).

A refusal (no such set, or a run is extracting it) fails the run with the reason; nothing is
removed then. A partition added in the UI without a file is removed the same way."""

import dagster as dg

from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS
from fabric_pipelines.defs.resources import ArtifactStore, Database
from fabric_pipelines.lib.core.names import InvalidNameError
from fabric_pipelines.lib.maintenance.forget import ForgetRefused, forget


class ForgetConfig(dg.Config):
    task_set: str
    force: bool = False  # also while a run extracts it (its acks are then refused)


@dg.op(
    description=(
        "Removes a task set: its results, ledger rows, stored files, inbox file and partition."
    )
)
def forget_task_set_op(
    context: dg.OpExecutionContext, config: ForgetConfig, store: ArtifactStore, database: Database
) -> dg.Output[int]:
    partition = context.instance.has_dynamic_partition(TASK_SET_PARTITIONS, config.task_set)
    try:
        forgotten = forget(
            database.engine(),
            store.paths(),
            config.task_set,
            has_partition=partition,
            force=config.force,
        )
    except (ForgetRefused, InvalidNameError) as exc:
        raise dg.Failure(description=f"forget: {exc}", allow_retries=False) from exc
    if partition:
        context.instance.delete_dynamic_partition(TASK_SET_PARTITIONS, forgotten.task_set)
    context.log.info(forgotten.message())
    return dg.Output(
        forgotten.completed or 0,
        metadata={"task_set": forgotten.task_set, "results_removed": forgotten.completed or 0},
    )


@dg.job(description="Remove a task set, its results, files and partition (fabric forget TASK_SET).")
def forget_job() -> None:
    forget_task_set_op()
