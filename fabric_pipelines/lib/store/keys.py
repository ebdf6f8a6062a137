"""The small integers every table refers to task sets and models by (store/models.py)."""

from __future__ import annotations

from sqlalchemy import Connection, ScalarSelect, select

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


def set_id_of(name: str) -> ScalarSelect[int]:
    """The id of the task set named `name`, inside a statement (no row: NULL, matching nothing)."""
    return select(TaskSet.id).where(TaskSet.name == name).scalar_subquery()


def model_id_of(model_key: str) -> ScalarSelect[int]:
    """The id of the model `model_key`, inside a statement (not registered: NULL)."""
    return select(Model.id).where(Model.model_key == model_key).scalar_subquery()
