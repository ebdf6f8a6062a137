"""The small integers embeddings refer to task sets and models by."""

from __future__ import annotations

from sqlalchemy import Connection, select

from fabric_pipelines.lib.store.models import Model, TaskSet


def task_set_id(conn: Connection, name: str) -> int:
    key = conn.execute(select(TaskSet.id).where(TaskSet.name == name)).scalar_one_or_none()
    if key is None:
        raise LookupError(f"no task set named {name!r}")
    return int(key)


def model_id(conn: Connection, model_key: str, create: bool = True) -> int:
    """The id of `model_key`, registered on first use (idempotent under concurrency)."""
    from fabric_pipelines.lib.store.db import insert_ignoring_duplicates

    key = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar_one_or_none()
    if key is None:
        if not create:
            raise LookupError(f"no results for model {model_key!r}")
        conn.execute(insert_ignoring_duplicates(conn.engine, Model).values(model_key=model_key))
        key = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar_one()
    return int(key)
