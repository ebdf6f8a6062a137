"""Shard watermarks: how many embedding rows of each index shard were inserted, deleted or changed.

A model's index may be split into N shards; a row's shard is (task_set_id * 7919 + record_no)
mod N. For each (model, N, shard) registered in `shard_watermarks`, `version` moves by one for
every row of that shard inserted or deleted (an update counts its old and its new row).

Who counts (migrations 0003, 0005, 0006):
- PostgreSQL: statement-level triggers over transition tables, for inserts, updates and deletes.
- SQLite: row-level triggers for updates and deletes. Inserts are counted by the writer, in the
  transaction that inserts them (`count_inserted`): a row trigger fired once per inserted row
  cost the single writer a third of its rows a second. A row inserted into `embeddings` on SQLite
  by anything but the writer therefore does not move its watermark; the index step's vector
  tail still notices it (it sees a row the watermarks did not count) and reads the table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHARD_PRIME = 7919


def shard_of_rows(task_set_id: np.ndarray, record_no: np.ndarray, n_shards: int) -> np.ndarray:
    """Each row's shard: the same expression the triggers use."""
    task_set_id = np.asarray(task_set_id, dtype=np.int64)
    record_no = np.asarray(record_no, dtype=np.int64)
    return (task_set_id * SHARD_PRIME + record_no) % n_shards


def count_inserted(
    cursor: Any, task_set_id: np.ndarray, model_id: np.ndarray, record_no: np.ndarray
) -> None:
    """Move the registered watermarks of SQLite rows just inserted on `cursor`'s transaction
    (a DB-API cursor). One UPDATE per touched shard, not per row."""
    if len(record_no) == 0:
        return
    models = np.unique(model_id).tolist()
    marks = ",".join("?" * len(models))
    registered = cursor.execute(
        f"SELECT DISTINCT model_id, n_shards FROM shard_watermarks WHERE model_id IN ({marks})",
        models,
    ).fetchall()
    updates: list[tuple[int, int, int, int]] = []
    for model, n_shards in registered:
        rows = model_id == model
        counts = np.bincount(
            shard_of_rows(task_set_id[rows], record_no[rows], n_shards), minlength=n_shards
        )
        updates += [
            (int(n), model, n_shards, shard) for shard, n in enumerate(counts.tolist()) if n
        ]
    if updates:
        cursor.executemany(
            "UPDATE shard_watermarks SET version = version + ? "
            "WHERE model_id = ? AND n_shards = ? AND shard = ?",
            updates,
        )
