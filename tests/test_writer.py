"""The write-behind writer against the real databases: idempotent writes, a killed backend and a
restarted server mid-run. After each: every row present exactly once, the accounting balanced."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, exc, insert, select, text

from fabric_gpu.batching import BatchPlan
from fabric_pipelines.lib.broker.ledger import accounting, claim_many, register_plan
from fabric_pipelines.lib.results.writer import (
    BatchRows,
    GroupOutcome,
    RejectBatch,
    WriteBehind,
    WriterGaveUp,
)
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.keys import model_id, set_id_of
from fabric_pipelines.lib.store.models import Batch, BatchPlanRow, TaskSet
from fabric_testing.scratch_db import empty_public_schema
from tests.flaky_db import FlakyDatabase, database_locked, lost_connection, undefined_table
from tests.pipeline_helpers import embedding_counts

ITEMS = 256


def _ledger(db: Engine, batches: int) -> list[BatchRows]:
    """A task set of `batches` x ITEMS tasks, its plan in the ledger, every batch leased."""
    plan = BatchPlan(
        order=np.arange(batches * ITEMS),
        seq_len=np.full(batches, 64),
        item_start=np.arange(batches) * ITEMS,
        item_count=np.full(batches, ITEMS),
        real_tokens=np.full(batches, ITEMS * 50),
        padded_tokens=np.full(batches, ITEMS * 64),
    )
    with db.begin() as conn:
        set_id = conn.execute(
            insert(TaskSet).returning(TaskSet.id),
            {
                "name": "w", "source_sha256": "s", "content_sha256": "c", "path": "p",
                "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 64,
                "n_records": batches * ITEMS, "n_tasks": batches * ITEMS, "truncated": 0,
                "current_plan_id": "plan",
            },
        ).scalar_one()  # fmt: skip
        conn.execute(
            insert(BatchPlanRow).values(
                task_set_id=set_id_of("w"), model_id=model_id(conn, "model")
            ),
            {
                "plan_id": "plan", "profile_json": "{}",
                "n_batches": batches, "n_items": batches * ITEMS, "real_tokens": 0,
                "padded_tokens": 0, "path": "p", "sha256": "x",
            },
        )  # fmt: skip
        model = model_id(conn, "model")
        register_plan(conn, "plan", "w", plan)
    leases = sorted(claim_many(db, "plan", "me", 3600, batches), key=lambda lease: lease.batch_no)
    vectors = np.random.default_rng(0).standard_normal((ITEMS, 384)).astype(np.float32)
    return [
        BatchRows(
            lease=lease, task_set="w", task_set_id=set_id, model_key="model", model_id=model,
            record_no=np.arange(lease.batch_no * ITEMS, (lease.batch_no + 1) * ITEMS),
            n_tokens=np.full(ITEMS, 50), pooled=vectors + lease.batch_no,
        )
        for lease in leases
    ]  # fmt: skip


def _write_all(
    db: Engine, batches: list[BatchRows], **kw: float
) -> tuple[list[GroupOutcome], WriteBehind]:
    outcomes: list[GroupOutcome] = []
    writer = WriteBehind(db, outcomes.append, **kw)  # type: ignore[arg-type]
    for batch in batches:
        writer.put(batch)
    writer.close()
    return outcomes, writer


def _assert_exactly_once(db: Engine, n: int) -> None:
    assert embedding_counts(db) == (n, n)
    with db.connect() as conn:
        a = accounting(conn, "w", "model")
    assert a.finished and a.completed == n, a


def test_writing_the_same_batch_twice_leaves_one_row_per_task(db: Engine) -> None:
    batches = _ledger(db, 4)
    first, _ = _write_all(db, batches)
    again, _ = _write_all(db, batches)  # a replay: same leases, same rows
    assert sum(o.inserted for o in first) == 4 * ITEMS
    assert sum(o.inserted for o in again) == 0
    assert sum(len(o.acked) for o in again) == 4  # the holder's acks are idempotent
    _assert_exactly_once(db, 4 * ITEMS)


def test_a_full_queue_blocks_the_producer_and_drops_nothing(db: Engine) -> None:
    batches = _ledger(db, 12)
    gate = threading.Event()
    outcomes: list[GroupOutcome] = []
    writer = WriteBehind(
        db, outcomes.append, max_batches=2, group_batches=1, before_write=lambda b: gate.wait()
    )
    producer = threading.Thread(target=lambda: [writer.put(b) for b in batches])
    producer.start()
    time.sleep(0.5)
    assert producer.is_alive(), "a full queue must block the producer"
    gate.set()
    producer.join(timeout=60)
    writer.close()
    assert sum(o.inserted for o in outcomes) == 12 * ITEMS
    _assert_exactly_once(db, 12 * ITEMS)


@pytest.mark.parametrize("error", [lost_connection, database_locked])
def test_transient_errors_are_retried_and_nothing_is_lost_or_doubled(db: Engine, error) -> None:  # type: ignore[no-untyped-def]
    batches = _ledger(db, 6)
    flaky = FlakyDatabase(db, error, times=2)
    _, writer = _write_all(flaky, batches, group_batches=2, first_backoff_s=0.01)  # type: ignore[arg-type]
    assert flaky.injected["write_group"] == 2
    assert writer.retries == sum(flaky.injected.values())
    _assert_exactly_once(db, 6 * ITEMS)


def test_a_programming_error_is_not_retried(db: Engine) -> None:
    batches = _ledger(db, 2)
    flaky = FlakyDatabase(db, undefined_table, times=1, sites={"write_group"})
    writer = WriteBehind(flaky, lambda outcome: None, first_backoff_s=0.01)  # type: ignore[arg-type]
    writer.put(batches[0])
    with pytest.raises(exc.ProgrammingError, match="nowhere"):
        writer.close()
    assert flaky.injected["write_group"] == 1 and writer.retries == 0


def test_a_batch_rejected_before_its_write_is_neither_written_nor_acked(db: Engine) -> None:
    batches = _ledger(db, 4)

    def check(batch: BatchRows) -> None:
        if batch.lease.batch_no == 2:
            raise RejectBatch("its shard did not verify")

    outcomes: list[GroupOutcome] = []
    writer = WriteBehind(db, outcomes.append, before_write=check)
    for batch in batches:
        writer.put(batch)
    writer.close()
    rejected = [(b.lease.batch_no, why) for o in outcomes for b, why in o.rejected]
    assert rejected == [(2, "its shard did not verify")]
    assert sorted(b.lease.batch_no for o in outcomes for b in o.acked) == [0, 1, 3]
    assert embedding_counts(db) == (3 * ITEMS, 3 * ITEMS)
    with db.connect() as conn:
        state = conn.execute(select(Batch.state).where(Batch.batch_no == 2)).scalar_one()
    assert state == "leased"  # still its holder's, to fail back to the ledger


def _kill_writer_backends(
    url: str, locked: threading.Event, stop: threading.Event, killed: list[int]
) -> None:
    """Cut the writer's connection mid-write, then keep cutting it until told to stop.

    The first cut is certain: this thread holds a lock on `embeddings`, so the writer's first
    transaction acks its batches and then waits at the COPY; that backend is terminated in the
    middle of its transaction and only then is the lock released. Later cuts land wherever the
    writer happens to be (active or inside a transaction), a few times a second."""
    admin = make_engine(url)
    writer_backends = (
        "select pg_terminate_backend(pid) from pg_stat_activity where "
        "datname = current_database() and application_name = 'fabric' "
        "and pid <> pg_backend_pid() and {}"
    )
    with admin.connect() as holder:
        holder.execute(text("lock table embeddings in access exclusive mode"))
        locked.set()
        with admin.connect() as conn:
            deadline = time.monotonic() + 30
            while not killed and not stop.is_set() and time.monotonic() < deadline:
                waiting = writer_backends.format("wait_event_type = 'Lock'")
                killed.extend(1 for ok in conn.execute(text(waiting)).scalars() if ok)
                time.sleep(0.01)
        holder.rollback()  # release the lock: the writer's retry goes through
    while not stop.is_set():
        with admin.connect() as conn:
            anywhere = writer_backends.format("state in ('active', 'idle in transaction')")
            killed.extend(1 for ok in conn.execute(text(anywhere)).scalars() if ok)
        time.sleep(0.25)  # sparse enough that the writer's retries get through
    admin.dispose()


@pytest.mark.postgres
def test_terminating_the_writer_backend_mid_write_loses_and_doubles_nothing(
    postgres_server_url: str,
) -> None:
    db = _fresh(postgres_server_url)
    batches = _ledger(db, 60)
    locked, stop, killed = threading.Event(), threading.Event(), []
    killer = threading.Thread(
        target=_kill_writer_backends, args=(postgres_server_url, locked, stop, killed)
    )
    killer.start()
    assert locked.wait(10), "the killer could not lock the embeddings table"
    try:
        _, writer = _write_all(db, batches, group_batches=2, first_backoff_s=0.05)
    finally:
        stop.set()
        killer.join()
    assert killed and writer.retries > 0, "the test must have cut connections mid-write"
    _assert_exactly_once(db, 60 * ITEMS)


@pytest.mark.postgres
@pytest.mark.restarts_postgres
@pytest.mark.skipif(shutil.which("pg_ctlcluster") is None, reason="pg_ctlcluster is not installed")
def test_restarting_the_server_mid_run_loses_and_doubles_nothing(postgres_server_url: str) -> None:
    db = _fresh(postgres_server_url)
    batches = _ledger(db, 80)
    version = sorted(p.name for p in Path("/etc/postgresql").iterdir())[0]
    restarted = threading.Event()

    def restart() -> None:
        time.sleep(0.5)
        subprocess.run(
            [
                "pg_ctlcluster",
                "--skip-systemctl-redirect",
                version,
                "main",
                "restart",
                "-m",
                "fast",
            ],
            check=True,
        )
        restarted.set()

    thread = threading.Thread(target=restart)
    thread.start()
    outcomes: list[GroupOutcome] = []
    # Writes spread over ~4 s, so the restart lands in the middle of them.
    writer = WriteBehind(
        db, outcomes.append, group_batches=1, first_backoff_s=0.25, max_backoff_s=2.0,
        before_write=lambda batch: time.sleep(0.05),
    )  # fmt: skip
    for batch in batches:
        writer.put(batch)
    writer.close()
    thread.join()
    assert restarted.is_set() and writer.retries > 0, "the server restart must have hit the writer"
    _assert_exactly_once(db, 80 * ITEMS)


def test_the_writer_gives_up_with_a_clear_error() -> None:
    db = make_engine("postgresql+psycopg://postgres@127.0.0.1:9/nowhere")  # nothing listens here
    batch = BatchRows(
        lease=None, task_set="w", task_set_id=1, model_key="m", model_id=1,  # type: ignore[arg-type]
        record_no=np.arange(2), n_tokens=np.ones(2), pooled=np.ones((2, 4), np.float32),
    )  # fmt: skip
    writer = WriteBehind(db, lambda outcome: None, attempts=3, first_backoff_s=0.01)
    writer.put(batch)
    with pytest.raises(WriterGaveUp, match=r"gave up writing 1 batch\(es\) after 3 attempts"):
        writer.close()


def _fresh(url: str) -> Engine:
    from fabric_pipelines.lib.store.db import create_schema

    db = make_engine(url)
    empty_public_schema(db)
    create_schema(db)
    return db


def test_a_new_sqlite_database_gets_large_pages_and_an_existing_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    """Large pages make the single writer faster; a database made before keeps its page size
    (SQLite cannot change it under WAL) and is still written to."""
    import sqlite3

    from fabric_pipelines.lib.store.db import SQLITE_PAGE_BYTES, create_schema

    new = make_engine(f"sqlite:///{tmp_path / 'new.db'}")
    create_schema(new)
    with new.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA page_size").scalar_one() == SQLITE_PAGE_BYTES

    old_path = tmp_path / "old.db"
    made_before = sqlite3.connect(old_path)
    made_before.execute("PRAGMA page_size=4096")
    made_before.execute("PRAGMA journal_mode=WAL")
    made_before.execute("CREATE TABLE earlier (x INTEGER)")
    made_before.close()
    old = make_engine(f"sqlite:///{old_path}")
    create_schema(old)
    with old.begin() as conn:
        assert conn.exec_driver_sql("PRAGMA page_size").scalar_one() == 4096
        conn.exec_driver_sql("INSERT INTO earlier VALUES (1)")
    with old.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM earlier").scalar_one() == 1


@pytest.mark.parametrize("huge_token_count", [False, True], ids=["one-step", "row-by-row"])
def test_every_row_is_stored_as_given(
    db: Engine, huge_token_count: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Record numbers out of order, token counts, and every vector's bytes come back as written;
    a token count too large for SQLite's one-step insert takes the row-by-row path."""
    from fabric_pipelines.lib.results import writer as writer_module

    one_step = writer_module._insert_sqlite_in_one_step
    one_step_rows: list[int] = []

    def counted(cursor: Any, columns: dict[str, np.ndarray]) -> int:
        one_step_rows.append(len(columns["record_no"]))
        return one_step(cursor, columns)

    monkeypatch.setattr(writer_module, "_insert_sqlite_in_one_step", counted)
    batches = _ledger(db, 3)
    rng = np.random.default_rng(5)
    for batch in batches:
        batch.record_no = rng.permutation(batch.record_no)
        batch.n_tokens = rng.integers(1, 512, len(batch.record_no))
        batch.pooled = rng.standard_normal(batch.pooled.shape).astype(np.float32)
    if huge_token_count:
        batches[1].n_tokens[7] = 1 << 30
    outcomes, _ = _write_all(db, batches)
    assert sum(o.inserted for o in outcomes) == 3 * ITEMS
    with db.connect() as conn:
        stored = {
            int(r.record_no): (int(r.n_tokens), bytes(r.vector))
            for r in conn.execute(text("SELECT record_no, n_tokens, vector FROM embeddings"))
        }
    expected = {
        int(no): (int(n), vector.astype("<f4").tobytes())
        for batch in batches
        for no, n, vector in zip(batch.record_no, batch.n_tokens, batch.pooled, strict=True)
    }
    assert stored == expected
    _assert_exactly_once(db, 3 * ITEMS)
    one_step_expected = db.dialect.name == "sqlite" and not huge_token_count
    assert (sum(one_step_rows) == 3 * ITEMS) if one_step_expected else one_step_rows == []


def test_the_one_step_insert_fills_the_watermarks_and_ignores_rows_already_there(
    tmp_path: Path,
) -> None:
    """SQLite's one-statement insert moves the watermarks by the rows it inserted (no trigger
    counts them), and a replay inserts nothing and moves no watermark."""
    from fabric_pipelines.lib.store.db import create_schema

    db = make_engine(f"sqlite:///{tmp_path / 'one-step.db'}")
    create_schema(db)
    batches = _ledger(db, 2)
    with db.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO shard_watermarks (model_id, n_shards, shard, version) "
            f"VALUES ({batches[0].model_id}, 4, 0, 0), ({batches[0].model_id}, 4, 1, 0), "
            f"({batches[0].model_id}, 4, 2, 0), ({batches[0].model_id}, 4, 3, 0)"
        )

    def versions() -> int:
        with db.connect() as conn:
            return int(
                conn.exec_driver_sql("SELECT sum(version) FROM shard_watermarks").scalar_one()
            )

    _write_all(db, batches)
    assert versions() == 2 * ITEMS
    _write_all(db, batches)
    assert versions() == 2 * ITEMS


def test_a_group_of_several_task_sets_and_models_is_stored_as_given(tmp_path: Path) -> None:
    """SQLite's one-step insert runs once per (task set, model) of a group, batches interleaved."""
    from fabric_pipelines.lib.results.writer import insert_rows
    from fabric_pipelines.lib.store.db import create_schema

    db = make_engine(f"sqlite:///{tmp_path / 'mixed.db'}")
    create_schema(db)
    rng = np.random.default_rng(9)
    batches = [
        BatchRows(
            lease=None,  # type: ignore[arg-type]  # only the rows are written here
            task_set="x", task_set_id=set_id, model_key="m", model_id=model,
            record_no=rng.permutation(50) + 100 * n, n_tokens=rng.integers(1, 9, 50),
            pooled=rng.standard_normal((50, 4)).astype(np.float32),
        )
        for n, (set_id, model) in enumerate([(1, 7), (2, 7), (1, 8), (1, 7)])
    ]  # fmt: skip
    with db.begin() as conn:
        assert insert_rows(conn, batches) == 200
    with db.connect() as conn:
        stored = {
            (int(r.task_set_id), int(r.model_id), int(r.record_no)): (int(r.n_tokens), r.vector)
            for r in conn.execute(text("SELECT * FROM embeddings"))
        }
    assert stored == {
        (b.task_set_id, b.model_id, int(no)): (int(n), v.astype("<f4").tobytes())
        for b in batches
        for no, n, v in zip(b.record_no, b.n_tokens, b.pooled, strict=True)
    }
