"""Result writes into the database: the product's path against the SQLAlchemy ORM, same run.

The product's path is the write-behind writer (result_writer.py) exactly as extraction uses it
(two writer threads with a connection each on PostgreSQL; also measured with one): groups of
batches, each batch's ledger ack and its rows in one transaction, rows sent as one
binary COPY built in bulk into the logged `embeddings` table (primary key, unique key, index).
The peer is the ORM: `session.add_all(Embedding(...) for each row)` then `commit()` per batch.
Embeddings are float32 with their metadata; 384 dimensions against the peer, plus 768 and 1,024,
and SQLite (executemany) at 384. A scratch PostgreSQL database is created and dropped.

    .venv/bin/python bench/db_write.py [--rows 400000] [--url postgresql+psycopg://...]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import insert
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fabric_testing, beside the product
from fabric_gpu.batching import BatchPlan
from fabric_pipelines.lib.broker.ledger import claim_many, register_plan
from fabric_pipelines.lib.results.writer import BatchRows, WriteBehind
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import BatchPlanRow, Embedding, TaskSet
from fabric_testing.scratch_db import scratch_database

BATCH_ROWS = 512  # items per batch: a 32K-token batch at ~64 tokens per item


def prepare(engine, n_batches: int) -> tuple[int, int, list]:  # type: ignore[no-untyped-def]
    """A task set, a model and a plan of leased batches, so acks are real."""
    create_schema(engine)
    plan = BatchPlan(
        order=np.arange(n_batches * BATCH_ROWS),
        seq_len=np.full(n_batches, 64),
        item_start=np.arange(n_batches) * BATCH_ROWS,
        item_count=np.full(n_batches, BATCH_ROWS),
        real_tokens=np.full(n_batches, BATCH_ROWS * 60),
        padded_tokens=np.full(n_batches, BATCH_ROWS * 64),
    )
    with engine.begin() as conn:
        set_id = conn.execute(
            insert(TaskSet).returning(TaskSet.id),
            {
                "name": "bench", "source_sha256": "s", "content_sha256": "c", "path": "p",
                "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 64,
                "n_records": n_batches * BATCH_ROWS, "n_tasks": n_batches * BATCH_ROWS,
                "truncated": 0, "current_plan_id": "plan",
            },
        ).scalar_one()  # fmt: skip
        model = model_id(conn, "bench-model")
        conn.execute(
            insert(BatchPlanRow),
            {
                "plan_id": "plan", "task_set_id": set_id, "model_id": model, "profile_json": "{}",
                "n_batches": n_batches, "n_items": n_batches * BATCH_ROWS, "real_tokens": 0,
                "padded_tokens": 0, "path": "p", "sha256": "x",
            },
        )  # fmt: skip
        register_plan(conn, "plan", "bench", plan)
    leases = claim_many(engine, "plan", "bench", 3600, n_batches)
    return set_id, model, leases


def ours(engine, rows: int, dim: int, writers: int | None = None) -> float:  # type: ignore[no-untyped-def]
    """Rows/s through the write-behind writer as extraction uses it (`writers=None`: the
    product's default, two connections on PostgreSQL and one on SQLite)."""
    n_batches = rows // BATCH_ROWS
    set_id, model, leases = prepare(engine, n_batches)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((BATCH_ROWS, dim)).astype(np.float32)
    written = [0]

    def count(outcome) -> None:  # type: ignore[no-untyped-def]
        written[0] += outcome.inserted

    writer = WriteBehind(engine, count, writers=writers)
    start = time.perf_counter()
    for lease in sorted(leases, key=lambda lease: lease.batch_no):
        first = lease.batch_no * BATCH_ROWS
        writer.put(
            BatchRows(
                lease=lease, task_set="bench", task_set_id=set_id, model_key="bench-model",
                model_id=model, record_no=np.arange(first, first + BATCH_ROWS),
                n_tokens=np.full(BATCH_ROWS, 60), pooled=vectors,
            )
        )  # fmt: skip
    writer.close()
    seconds = time.perf_counter() - start
    assert written[0] == n_batches * BATCH_ROWS
    return written[0] / seconds


def orm(engine, rows: int, dim: int) -> float:  # type: ignore[no-untyped-def]
    create_schema(engine)
    vectors = np.random.default_rng(1).standard_normal((BATCH_ROWS, dim)).astype(np.float32)
    blobs = [v.tobytes() for v in vectors]
    start = time.perf_counter()
    for b in range(rows // BATCH_ROWS):
        with Session(engine) as session:
            session.add_all(
                Embedding(
                    task_set_id=99,
                    record_no=b * BATCH_ROWS + i,
                    model_id=99,
                    n_tokens=60,
                    vector=blobs[i],
                )
                for i in range(BATCH_ROWS)
            )
            session.commit()
    return (rows // BATCH_ROWS) * BATCH_ROWS / (time.perf_counter() - start)


def on_scratch_database(server_url: str, measure) -> float:  # type: ignore[no-untyped-def]
    """`measure(engine)` on a database created for it and dropped after."""
    with scratch_database(server_url, "fabric_bench") as url:
        engine = make_engine(url)
        try:
            return round(measure(engine))
        finally:
            engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--orm-rows", type=int, default=40_960)
    parser.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    pg, rows = args.url, args.rows
    result: dict[str, float] = {}
    for dim in (384, 768, 1024):
        result[f"rows_per_s_{dim}"] = on_scratch_database(pg, lambda e, d=dim: ours(e, rows, d))
        print(f"PostgreSQL {dim:4d}-d: {result[f'rows_per_s_{dim}']:>9,} rows/s", flush=True)
    one = on_scratch_database(pg, lambda e: ours(e, rows, 384, writers=1))
    result["rows_per_s_384_one_writer"] = one
    print(f"PostgreSQL  384-d, one writer thread: {one:>9,} rows/s", flush=True)
    result["orm_rows_per_s_384"] = on_scratch_database(pg, lambda e: orm(e, args.orm_rows, 384))
    result["ratio_vs_orm_384"] = round(result["rows_per_s_384"] / result["orm_rows_per_s_384"], 1)
    print(
        f"ORM add_all + commit 384-d: {result['orm_rows_per_s_384']:,} rows/s "
        f"-> ours {result['ratio_vs_orm_384']}x"
    )
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(f"sqlite:///{Path(tmp) / 'bench.db'}")
        result["rows_per_s_sqlite_384"] = round(ours(engine, min(rows, 200_000), 384))
    print(f"SQLite 384-d: {result['rows_per_s_sqlite_384']:,} rows/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
