"""Alembic migrations on both databases: upgrade from empty, downgrade one step, the migrated
schema matches the models exactly, 0004's rekeying of shard rows keeps and drops the right rows,
and processes upgrading a fresh database at once all succeed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, insert, inspect, select, text
from sqlalchemy.exc import IntegrityError

from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import Base, Embedding
from fabric_pipelines.lib.store.schema import current_revision, downgrade, stores_pgvector, upgrade

TABLES = {
    "task_sets", "tasks", "models", "task_failures", "batch_plans", "batches", "embeddings",
    "hidden_state_shards", "index_receipts",
}  # fmt: skip


HEAD = "0017"


def test_upgrade_from_empty_then_downgrade_one_step(db_url: str) -> None:
    engine = make_engine(db_url)
    assert current_revision(engine) is None
    upgrade(engine)
    assert current_revision(engine) == HEAD
    assert set(inspect(engine).get_table_names()) >= TABLES | {"int8_calibrations"}
    with engine.connect() as conn:  # 0015: one identity row, made with the schema
        assert len(conn.execute(text("SELECT id FROM database_identity")).all()) == 1
        # 0016: a row per task, reused or not, in the view pgvector users query
        assert conn.execute(text("SELECT count(*) FROM task_embeddings")).scalar_one() == 0
        # 0017: the waits for results another running set computes
        assert conn.execute(text("SELECT count(*) FROM awaited_results")).scalar_one() == 0
    downgrade(engine, "-1")
    assert current_revision(engine) == "0016"
    assert "awaited_results" not in set(inspect(engine).get_table_names())
    downgrade(engine, "-1")
    assert current_revision(engine) == "0015"
    with engine.connect() as conn:
        assert "task_embeddings" not in set(inspect(conn).get_view_names())
    downgrade(engine, "-1")
    assert current_revision(engine) == "0014"
    assert "database_identity" not in set(inspect(engine).get_table_names())
    downgrade(engine, "-1")
    assert current_revision(engine) == "0013"
    assert not {"content_keys", "reused_results"} & set(inspect(engine).get_table_names())
    downgrade(engine, "-1")  # 0013 adds pgvector columns only; neither server here has them
    assert current_revision(engine) == "0012"
    downgrade(engine, "-1")
    assert current_revision(engine) == "0011"
    assert set(inspect(engine).get_table_names()) >= TABLES | {"document_windows"}
    assert "int8_calibrations" not in set(inspect(engine).get_table_names())
    upgrade(engine)
    assert current_revision(engine) == HEAD
    downgrade(engine, "base")
    assert not TABLES & set(inspect(create_engine(db_url)).get_table_names())
    engine.dispose()


def test_migrated_schema_matches_the_models(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    if stores_pgvector(engine):  # the pgvector column is not in the models (chosen at run time)
        diff = [d for d in diff if "embedding" not in str(d)]
    assert diff == [], diff
    engine.dispose()


def test_embeddings_are_float32_bytes_without_pgvector(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        available = (
            engine.dialect.name == "postgresql"
            and conn.exec_driver_sql(
                "select 1 from pg_available_extensions where name = 'vector'"
            ).first()
            is not None
        )
    assert stores_pgvector(engine) == available
    engine.dispose()


def _shard(sha: str, plan: str, batch_no: int) -> dict[str, Any]:
    return {
        "sha256": sha, "task_set": f"set-{plan}", "model_key": "m", "plan_id": plan,
        "batch_no": batch_no, "layers": "[-1]", "n_items": 1, "n_tokens": 3,
        "path": f"/shards/{sha}.arrow", "bytes": 10,
    }  # fmt: skip


def _insert_shards(engine: Engine, rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO hidden_state_shards ({', '.join(columns)}) "
                f"VALUES ({', '.join(':' + c for c in columns)})"
            ),
            rows,
        )


def _shard_keys(engine: Engine) -> list[tuple[str, str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT sha256, plan_id, batch_no FROM hidden_state_shards ORDER BY 1, 2, 3")
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def test_0004_keys_shard_rows_by_batch_and_back(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine, "0003")
    # Under the old key: two rows of batch (p, 0) (a replay that wrote a second file), one more.
    _insert_shards(engine, [_shard("aa", "p", 0), _shard("bb", "p", 0), _shard("cc", "p", 1)])
    upgrade(engine, "0004")
    assert _shard_keys(engine) == [("aa", "p", 0), ("cc", "p", 1)]  # the smaller sha256 stays
    # A second set's batches naming the same files each get a row; a second row of a batch
    # does not.
    _insert_shards(engine, [_shard("aa", "q", 0), _shard("cc", "q", 1)])
    with pytest.raises(IntegrityError):
        _insert_shards(engine, [_shard("dd", "q", 0)])
    assert len(_shard_keys(engine)) == 4
    assert {i["name"]: i["column_names"] for i in inspect(engine).get_indexes(
        "hidden_state_shards"
    )}["ix_hidden_state_shards_sha256"] == ["sha256"]  # fmt: skip

    downgrade(engine, "0003")  # sha256 is the key again: rows sharing a file go, one stays each
    assert _shard_keys(engine) == [("aa", "p", 0), ("cc", "p", 1)]
    assert inspect(engine).get_pk_constraint("hidden_state_shards")["constrained_columns"] == [
        "sha256"
    ]
    with pytest.raises(IntegrityError):
        _insert_shards(engine, [_shard("aa", "r", 0)])
    upgrade(engine, "0009")  # (0010 drops shard rows of sets and batches that are not stored)
    assert _shard_keys(engine) == [("aa", "p", 0), ("cc", "p", 1)]
    engine.dispose()


def _fill_at_0009(engine: Engine) -> None:
    """Two task sets with a plan, ledger rows, failures, shard rows, results and a receipt, as
    the schema before 0010 stored them (names, not ids), and rows naming a set that is gone."""
    rows = {
        "task_sets": [
            {"id": 3, "name": "alpha", "n": 2},
            {"id": 7, "name": "beta", "n": 1},
        ],
        "models": [{"id": 1, "model_key": "m@a:mean"}],
        "task_failures": [
            {"task_set": "alpha", "record_no": 2, "stage": "ingest", "reason": "too long"},
            {"task_set": "beta", "record_no": 1, "stage": "extract", "reason": "bad"},
            {"task_set": "gone", "record_no": 0, "stage": "ingest", "reason": "orphan"},
        ],
        "batch_plans": [
            {"plan_id": "pa", "task_set": "alpha", "model_key": "m@a:mean"},
            {"plan_id": "pb", "task_set": "beta", "model_key": "m@b:cls"},  # not registered
            {"plan_id": "pg", "task_set": "gone", "model_key": "m@a:mean"},
        ],
        "batches": [
            {"plan_id": "pa", "batch_no": 0, "task_set": "alpha", "state": "completed"},
            {"plan_id": "pa", "batch_no": 1, "task_set": "alpha", "state": "queued"},
            {"plan_id": "pb", "batch_no": 0, "task_set": "beta", "state": "completed"},
            {"plan_id": "pg", "batch_no": 0, "task_set": "gone", "state": "completed"},
        ],
        "hidden_state_shards": [
            {**_shard("aa", "pa", 0), "task_set": "alpha", "model_key": "m@a:mean"},
            {**_shard("aa", "pb", 0), "task_set": "beta", "model_key": "m@b:cls"},
        ],
    }
    with engine.begin() as conn:
        for ts in rows["task_sets"]:
            conn.execute(
                text(
                    "INSERT INTO task_sets (id, name, source_sha256, content_sha256, path, "
                    "model_id, tokenizer_sha256, max_seq_len, n_records, n_tasks, truncated, "
                    "prompt, created_at) VALUES (:id, :name, 's', 'c', '/p', 'm', 't', 8, :n, "
                    ":n, 0, '', CURRENT_TIMESTAMP)"
                ),
                ts,
            )
        conn.execute(text("INSERT INTO models (id, model_key) VALUES (:id, :model_key)"),
                     rows["models"])  # fmt: skip
        conn.execute(
            text(
                "INSERT INTO task_failures (task_set, record_no, stage, reason, created_at) "
                "VALUES (:task_set, :record_no, :stage, :reason, CURRENT_TIMESTAMP)"
            ),
            rows["task_failures"],
        )
        conn.execute(
            text(
                "INSERT INTO batch_plans (plan_id, task_set, model_key, profile_json, n_batches, "
                "n_items, real_tokens, padded_tokens, path, sha256, created_at) VALUES "
                "(:plan_id, :task_set, :model_key, '{}', 2, 2, 6, 8, '/plan', 'h', "
                "CURRENT_TIMESTAMP)"
            ),
            rows["batch_plans"],
        )
        conn.execute(
            text(
                "INSERT INTO batches (plan_id, batch_no, task_set, state, seq_len, item_start, "
                "item_count, real_tokens, padded_tokens, lease_epoch, attempts) VALUES "
                "(:plan_id, :batch_no, :task_set, :state, 4, 0, 1, 3, 4, 0, 0)"
            ),
            rows["batches"],
        )
        conn.execute(
            text(
                "INSERT INTO index_receipts (receipt_sha256, model_key, index_path, index_sha256, "
                "n_vectors, recall_at_k, receipt_json, created_at) VALUES ('r1', 'm@b:cls', "
                "'/i', 'ih', 2, 0.99, '{\"task_sets\": [\"beta\"]}', CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO engine_speeds (model_key, backend, layout, device, source, "
                "padded_tokens, real_tokens, seconds, measured_at) VALUES "
                "('m@c:mean', 'cpu', 'padded', 'cpu', 'bench', 10, 8, 0.5, CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            insert(Embedding).values(model_id=1, task_set_id=3, record_no=0, n_tokens=3,
                                     vector=b"\0" * 4)
        )  # fmt: skip
    _insert_shards(engine, [
        *rows["hidden_state_shards"],
        {**_shard("bb", "pa", 1), "task_set": "alpha", "model_key": "m@a:mean"},
        {**_shard("cc", "pg", 0), "task_set": "gone", "model_key": "m@a:mean"},
    ])  # fmt: skip


def test_0010_upgrades_a_filled_database_in_place_to_ids_under_foreign_keys(
    db_url: str,
) -> None:
    """Every row that refers to a stored set is kept under the set's and model's ids, names read
    back as before; rows naming a set that is gone are dropped; the keys then hold (a row
    naming no set is refused, deleting a set deletes its rows); downgrade gives the names back."""
    from sqlalchemy.orm import Session

    from fabric_pipelines.lib.store.models import (
        Batch,
        BatchPlanRow,
        EngineSpeed,
        HiddenStateShard,
        IndexReceipt,
        TaskFailure,
    )  # fmt: skip

    engine = make_engine(db_url)
    upgrade(engine, "0009")
    _fill_at_0009(engine)
    upgrade(engine)
    assert current_revision(engine) == HEAD
    with Session(engine) as session:
        failures = [
            (f.task_set_id, f.task_set, f.record_no, f.reason)
            for f in session.scalars(select(TaskFailure).order_by(TaskFailure.reason))
        ]
        plans = [
            (p.plan_id, p.task_set_id, p.task_set, p.model_key)
            for p in session.scalars(select(BatchPlanRow).order_by(BatchPlanRow.plan_id))
        ]
        batches = [
            (b.plan_id, b.batch_no, b.task_set_id, b.state)
            for b in session.scalars(select(Batch).order_by(Batch.plan_id, Batch.batch_no))
        ]
        shards = [
            (h.plan_id, h.batch_no, h.task_set, h.model_key, h.sha256)
            for h in session.scalars(
                select(HiddenStateShard).order_by(
                    HiddenStateShard.plan_id, HiddenStateShard.batch_no
                )
            )
        ]
        receipt = session.scalars(select(IndexReceipt)).one()
        speed = session.scalars(select(EngineSpeed)).one()
    assert failures == [(7, "beta", 1, "bad"), (3, "alpha", 2, "too long")]
    assert plans == [("pa", 3, "alpha", "m@a:mean"), ("pb", 7, "beta", "m@b:cls")]
    assert batches == [("pa", 0, 3, "completed"), ("pa", 1, 3, "queued"), ("pb", 0, 7, "completed")]
    assert shards == [("pa", 0, "alpha", "m@a:mean", "aa"), ("pa", 1, "alpha", "m@a:mean", "bb"),
                      ("pb", 0, "beta", "m@b:cls", "aa")]  # fmt: skip
    assert (receipt.receipt_sha256, receipt.model_key, receipt.receipt_json) == (
        "r1",
        "m@b:cls",
        '{"task_sets": ["beta"]}',
    )
    assert (speed.model_key, speed.real_tokens) == ("m@c:mean", 8)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM embeddings")).scalar() == 1

    with pytest.raises(IntegrityError), engine.begin() as conn:  # a failure of no stored set
        conn.execute(insert(TaskFailure).values(
                task_set_id=99, record_no=0, stage="ingest", reason="x"))  # fmt: skip
    with pytest.raises(IntegrityError), engine.begin() as conn:  # a batch of no stored plan
        conn.execute(insert(Batch).values(
                plan_id="nope", batch_no=0, task_set_id=3, state="queued", seq_len=4,
                item_start=0, item_count=1, real_tokens=1, padded_tokens=4))  # fmt: skip
    with engine.begin() as conn:  # the set's failures, plan, batches and shard rows go with it
        conn.execute(text("DELETE FROM task_sets WHERE name = 'alpha'"))
    with engine.connect() as conn:
        left = {
            t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar()
            for t in ("task_failures", "batch_plans", "batches", "hidden_state_shards")
        }
    assert left == {"task_failures": 1, "batch_plans": 1, "batches": 1, "hidden_state_shards": 1}

    downgrade(engine, "0009")
    with engine.connect() as conn:
        back = conn.execute(text("SELECT plan_id, task_set, model_key FROM batch_plans")).all()
        receipts = conn.execute(text("SELECT model_key FROM index_receipts")).scalars().all()
    assert [tuple(r) for r in back] == [("pb", "beta", "m@b:cls")] and receipts == ["m@b:cls"]
    engine.dispose()


def test_processes_upgrading_a_fresh_database_at_once_all_succeed(db_url: str) -> None:
    """Every entry point upgrades, so workers started together on a new database race to create
    it; each thread here has its own engine (its own connections), as a process would."""
    engines = [make_engine(db_url) for _ in range(4)]
    assert current_revision(engines[0]) is None
    start = threading.Barrier(len(engines))
    errors: list[BaseException] = []

    def open_database(engine: Engine) -> None:
        try:
            start.wait()
            create_schema(engine)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=open_database, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [], errors
    for engine in engines:
        assert current_revision(engine) == HEAD
        engine.dispose()
    check = make_engine(db_url)
    assert set(inspect(check).get_table_names()) >= TABLES
    check.dispose()


def test_watermarks_move_by_the_rows_changed_on_both_databases(db_url: str) -> None:
    """A shard's watermark moves by the rows the writer inserted and the rows deleted (an update
    counts its old and new row): on PostgreSQL by statement triggers (0005), on SQLite by the
    writer and row triggers (0006). A row inserted by hand moves it on PostgreSQL only."""
    from fabric_pipelines.lib.index import shards
    from fabric_pipelines.lib.results.writer import BatchRows, insert_rows

    engine = make_engine(db_url)
    upgrade(engine)

    def total() -> int:
        with engine.connect() as conn:
            return sum(shards.versions(conn, 1, 4))

    def rows(model: int, records: range) -> BatchRows:
        return BatchRows(
            lease=None,  # type: ignore[arg-type]  # only the rows are written here
            task_set="s", task_set_id=1, model_key="", model_id=model,
            record_no=np.array(records), n_tokens=np.full(len(records), 3),
            pooled=np.zeros((len(records), 1), np.float32),
        )  # fmt: skip

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO models (id, model_key) VALUES (1, 'm'), (2, 'other')"))
        shards.register(conn, 1, 4)
    with engine.begin() as conn:  # 50 rows, and another model's row
        assert insert_rows(conn, [rows(1, range(50)), rows(2, range(1))]) == 51
    assert total() == 50
    with engine.connect() as conn:
        assert shards.versions(conn, 1, 4) == [13, 12, 12, 13]  # (7919 + r) % 4: 3, 0, 1, 2, 3, ...
    with engine.begin() as conn:  # a replay inserts nothing new
        assert insert_rows(conn, [rows(1, range(48, 52))], upsert=True) == 2
    assert total() == 52
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM embeddings WHERE model_id = 1 AND record_no < 5"))
        conn.execute(
            text("UPDATE embeddings SET n_tokens = 4 WHERE model_id = 1 AND record_no < 8")
        )
    assert total() == 52 + 5 + 2 * 3
    by_hand = {"model_id": 1, "task_set_id": 1, "record_no": 99, "n_tokens": 3, "vector": b""}
    with engine.begin() as conn:
        conn.execute(insert(Embedding).values(by_hand))
    assert total() == 52 + 5 + 2 * 3 + (engine.dialect.name == "postgresql")
    engine.dispose()


def test_sqlite_downgrade_from_0006_counts_inserts_by_trigger_again(tmp_path: Path) -> None:
    from fabric_pipelines.lib.index import shards

    engine = make_engine(f"sqlite:///{tmp_path / 'down.db'}")
    upgrade(engine)
    downgrade(engine, "0005")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO models (id, model_key) VALUES (1, 'm')"))
        shards.register(conn, 1, 4)
        conn.execute(
            insert(Embedding).values(model_id=1, task_set_id=1, record_no=3, n_tokens=3, vector=b"")
        )
    with engine.connect() as conn:
        assert sum(shards.versions(conn, 1, 4)) == 1
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(
            insert(Embedding).values(model_id=1, task_set_id=1, record_no=4, n_tokens=3, vector=b"")
        )
    with engine.connect() as conn:
        assert sum(shards.versions(conn, 1, 4)) == 1
    engine.dispose()


def _task_partitions(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "WHERE i.inhparent = 'tasks'::regclass ORDER BY 1"
            )
        ).all()
    return [r[0] for r in rows]


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_0007_moves_earlier_sets_task_ids_into_one_partition_and_back(
    db_url: str, tmp_path: Path
) -> None:
    engine = make_engine(db_url)
    upgrade(engine, "0006")
    rows = [(1, r, f"a{r}") for r in range(5)] + [(4, r, f"b{r}") for r in (0, 7, 9)]

    def insert_rows(values: list[tuple[int, int, str]]) -> None:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO tasks (task_set_id, record_no, task_id) VALUES (:s, :r, :i)"),
                [{"s": s, "r": r, "i": i} for s, r, i in values],
            )

    def all_rows() -> list[tuple[int, int, str]]:
        with engine.connect() as conn:
            found = conn.execute(text("SELECT * FROM tasks ORDER BY 1, 2")).all()
        return [tuple(r) for r in found]  # type: ignore[misc]

    insert_rows(rows)
    upgrade(engine, "0007")
    assert _task_partitions(engine) == ["tasks_before_0007_sets"]  # one, however many sets
    assert all_rows() == rows
    with pytest.raises(IntegrityError):  # the set's unique task id holds through the parent
        insert_rows([(4, 11, "b7")])
    with pytest.raises(IntegrityError):  # a set without a partition has no place for rows
        insert_rows([(9, 0, "c0")])
    # Forgetting an earlier set deletes its rows from the shared partition, the others stay
    # (forgetting is today's code: the schema goes to head first).
    upgrade(engine)
    from fabric_pipelines.lib.core.settings import FabricPaths
    from fabric_pipelines.lib.tasks.catalog import forget_task_set

    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO task_sets (id, name, source_sha256, content_sha256, path, model_id, "
                "tokenizer_sha256, max_seq_len, n_records, n_tasks, truncated, created_at) "
                "VALUES (4, 'old', '', '', :path, 'm', '', 8, 3, 3, 0, now())"
            ),
            {"path": str(tmp_path / "old.arrow")},
        )
    forget_task_set(engine, FabricPaths(tmp_path), "old")
    rows = [r for r in rows if r[0] != 4]
    assert all_rows() == rows

    downgrade(engine, "0006")
    with engine.connect() as conn:
        kind = conn.execute(text("SELECT relkind FROM pg_class WHERE relname = 'tasks'")).scalar()
    assert kind == "r" and all_rows() == rows
    with pytest.raises(IntegrityError):
        insert_rows([(1, 3, "x")])  # the primary key is back on the plain table
    upgrade(engine)
    assert all_rows() == rows
    engine.dispose()


def test_0008_gives_sets_stored_before_it_no_prompt_and_keeps_them(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine, "0007")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO task_sets (name, source_sha256, content_sha256, path, model_id, "
                "tokenizer_sha256, max_seq_len, n_records, n_tasks, truncated, created_at) "
                "VALUES ('old', 'a', 'b', '/p', 'm', 'c', 128, 3, 2, 0, CURRENT_TIMESTAMP)"
            )
        )
    upgrade(engine)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, n_tasks, prompt FROM task_sets")).all()
    assert [tuple(r) for r in rows] == [("old", 2, "")]
    downgrade(engine, "0007")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM task_sets")).scalars().all() == ["old"]
    engine.dispose()
