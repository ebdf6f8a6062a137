"""Index shards: which rows belong to which shard, and each shard's watermark version.

A row's shard is (task_set_id * 7919 + record_no) mod N: the expression the database's triggers
and the SQLite writer use (store/watermarks.py), so the build and the watermarks agree on every
row.
"""

from __future__ import annotations

import numpy as np
from sqlalchemy import Connection, select

from fabric_pipelines.lib.index.vectors import ID_STRIDE
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.models import ShardWatermark
from fabric_pipelines.lib.store.watermarks import shard_of_rows


def shard_of(ids: np.ndarray, n_shards: int) -> np.ndarray:
    """The shard of each index id (task_set_id * ID_STRIDE + record_no)."""
    ids = np.asarray(ids, dtype=np.int64)
    return shard_of_rows(ids // ID_STRIDE, ids % ID_STRIDE, n_shards)


def register(conn: Connection, model_id: int, n_shards: int) -> None:
    """Start counting changes for the model's N shards (idempotent)."""
    conn.execute(
        insert_ignoring_duplicates(conn.engine, ShardWatermark),
        [
            {"model_id": model_id, "n_shards": n_shards, "shard": s, "version": 0}
            for s in range(n_shards)
        ],
    )


def versions(conn: Connection, model_id: int, n_shards: int) -> list[int]:
    rows = dict(
        conn.execute(
            select(ShardWatermark.shard, ShardWatermark.version).where(
                ShardWatermark.model_id == model_id, ShardWatermark.n_shards == n_shards
            )
        ).all()
    )
    return [int(rows.get(s, 0)) for s in range(n_shards)]
