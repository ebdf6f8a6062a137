"""Writing one batch's results: embeddings, shard reference and ledger ack in one transaction.

Rows are keyed by (task set, task id, model key) and inserted with ON CONFLICT DO NOTHING, and the
ack is fenced by the lease epoch in the same transaction: a retried batch finds its rows all there
and acknowledged, or not there at all, and never writes a row twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Engine

from fabric_pipelines.lib.broker.ledger import Lease, ack
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.models import Embedding, HiddenStateShard
from fabric_pipelines.lib.store.shards import ShardFile


@dataclass(frozen=True)
class BatchResults:
    task_set: str
    model_key: str
    task_ids: list[str]
    record_no: np.ndarray  # int64 [items]
    lengths: np.ndarray  # int64 [items]
    pooled: np.ndarray  # float32 [items, dim]


def write_batch(
    engine: Engine,
    lease: Lease,
    results: BatchResults,
    shard: ShardFile | None = None,
    layers: tuple[int, ...] = (),
) -> int:
    """Insert the batch's rows and ack its lease atomically; returns rows newly inserted."""
    pooled = np.ascontiguousarray(results.pooled, dtype="<f4")
    dim = int(pooled.shape[1])
    rows = [
        {
            "task_set": results.task_set,
            "task_id": task_id,
            "model_key": results.model_key,
            "record_no": int(record_no),
            "n_tokens": int(n_tokens),
            "dim": dim,
            "vector": vector.tobytes(),
            "plan_id": lease.plan_id,
            "batch_no": lease.batch_no,
        }
        for task_id, record_no, n_tokens, vector in zip(
            results.task_ids, results.record_no, results.lengths, pooled, strict=True
        )
    ]
    with engine.begin() as conn:
        # RETURNING counts the rows really inserted (executemany rowcounts are not portable).
        inserted = len(
            conn.execute(
                insert_ignoring_duplicates(engine, Embedding).returning(Embedding.id), rows
            ).all()
        )
        if shard is not None:
            conn.execute(
                insert_ignoring_duplicates(engine, HiddenStateShard),
                {
                    "sha256": shard.sha256,
                    "task_set": results.task_set,
                    "model_key": results.model_key,
                    "plan_id": lease.plan_id,
                    "batch_no": lease.batch_no,
                    "layers": json.dumps(list(layers)),
                    "n_items": len(rows),
                    "n_tokens": int(results.lengths.sum()),
                    "path": str(shard.path),
                    "bytes": shard.bytes,
                },
            )
        ack(conn, lease)
    return inserted
