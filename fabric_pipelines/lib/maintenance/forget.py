"""Forgetting a task set, as `fabric forget` and the UI's forget_job do it: what may be removed,
and the removal (lib/tasks/catalog.forget_task_set). The caller drops the Dagster partition."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.core.names import validate_task_set_name
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.keys import task_set_id as set_id_of_name
from fabric_pipelines.lib.store.result_links import sets_reading_hidden_states
from fabric_pipelines.lib.tasks.catalog import forget_task_set
from fabric_pipelines.lib.tasks.inbox import submitted_files


class ForgetRefused(ValueError):
    """Nothing was removed; the message says why and what to do."""


@dataclass(frozen=True)
class Forgotten:
    task_set: str
    completed: int | None  # results removed; None where the set was never ingested

    def message(self) -> str:
        done = f"{self.completed:,} result(s), " if self.completed is not None else ""
        return (
            f"forgot task set {self.task_set!r}: {done}its stored files, inbox file and "
            "partition. An index that held its vectors is stale now: the index staleness sensor "
            "rebuilds it (or materialise vector_index)."
        )


def forget(
    db: Engine, paths: FabricPaths, task_set: str, *, has_partition: bool, force: bool
) -> Forgotten:
    """Remove `task_set` (rows, results, files, inbox file); ForgetRefused, with nothing removed,
    where no such set exists or a run is extracting it (unless `force`). A partition with no
    set behind it (added in the UI without a file) is accepted: the caller drops it."""
    name = validate_task_set_name(task_set)
    in_inbox = bool(submitted_files(paths.inbox, name))
    try:
        with db.connect() as conn:
            counts = accounting(conn, name)
    except LookupError:
        counts = None
    if counts is None and not has_partition and not in_inbox:
        raise ForgetRefused(f"no task set named {name!r} (fabric status lists them)")
    if counts is not None and counts.in_flight and not force:
        raise ForgetRefused(
            f"task set {name!r} has {counts.in_flight:,} task(s) in flight: a run is extracting "
            "it. Wait for it to end, or force it (fabric forget --force, or forget_job's "
            "`force: true`): its workers' acks are then refused and their rows deleted with the "
            "rest"
        )
    if counts is not None:
        with db.connect() as conn:
            readers = sets_reading_hidden_states(conn, set_id_of_name(conn, name))
        if readers:
            raise ForgetRefused(
                f"task set {name!r} holds hidden states that task sets {readers} reuse (their "
                "tasks read them from its shard files): forget those first, or run them again "
                "with --no-reuse"
            )
    forget_task_set(db, paths, name)
    return Forgotten(name, counts.completed if counts is not None else None)
