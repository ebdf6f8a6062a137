"""The pgvector storage path on a real PostgreSQL that has the extension: the migration adds the
`embedding vector` column, the writer's binary COPY fills it (idempotently), the server reads the
values as the floats that were written, and index builds read them back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import Engine, text

from fabric_pipelines.lib.index.vectors import load_vectors
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.schema import current_revision, downgrade, stores_pgvector, upgrade
from fabric_testing.scratch_db import empty_public_schema
from tests.test_migrations import HEAD
from tests.test_writer import ITEMS, _assert_exactly_once, _ledger, _write_all

pytestmark = pytest.mark.pgvector


@pytest.fixture
def pgvector_db(pgvector_server_url: str) -> Engine:
    engine = make_engine(pgvector_server_url)
    empty_public_schema(engine)  # every test starts from no schema (and no extension) at all
    upgrade(engine)
    return engine


def test_the_migration_chooses_pgvector_and_downgrade_refuses_to_lose_vectors(
    pgvector_db: Engine,
) -> None:
    assert current_revision(pgvector_db) == HEAD
    assert stores_pgvector(pgvector_db)
    batches = _ledger(pgvector_db, 2)
    _write_all(pgvector_db, batches)
    with pytest.raises(RuntimeError, match=rf"would lose {2 * ITEMS} embeddings stored only"):
        downgrade(pgvector_db, "0001")
    with pgvector_db.begin() as conn:
        conn.execute(text("DELETE FROM embeddings"))
    downgrade(pgvector_db, "0001")
    assert not stores_pgvector(pgvector_db)
    upgrade(pgvector_db)
    assert stores_pgvector(pgvector_db)


def test_the_writer_fills_pgvector_once_and_index_builds_read_the_same_floats(
    pgvector_db: Engine,
) -> None:
    batches = _ledger(pgvector_db, 6)
    _write_all(pgvector_db, batches)
    _write_all(pgvector_db, batches)  # the same batches again (a replay): no second row
    _assert_exactly_once(pgvector_db, 6 * ITEMS)
    with pgvector_db.connect() as conn:
        stored = conn.execute(
            text(
                "select count(*) filter (where vector is null), "
                "count(*) filter (where vector_dims(embedding) = 384) from embeddings"
            )
        ).one()
        assert tuple(stored) == (6 * ITEMS, 6 * ITEMS)  # pgvector values only, 384-d each
        # The server's own reading of the binary payload (catches a wrong byte order).
        first = conn.execute(
            text("select embedding::real[] from embeddings order by record_no limit 1")
        ).scalar_one()
        assert np.array_equal(np.asarray(first, np.float32), batches[0].pooled[0])
        loaded = load_vectors(conn, "model")
    written = np.concatenate([b.pooled for b in batches])
    assert loaded.vectors.dtype == np.float32 and np.array_equal(loaded.vectors, written)
    assert np.array_equal(loaded.ids % (1 << 40), np.arange(6 * ITEMS))
    # Rows written before the server had pgvector keep float32 bytes: a mix reads back the same.
    with pgvector_db.begin() as conn:
        for record_no in (0, 7, ITEMS + 3):
            conn.execute(
                text("update embeddings set vector = :v, embedding = null where record_no = :r"),
                {"v": written[record_no].astype("<f4").tobytes(), "r": record_no},
            )
    with pgvector_db.connect() as conn:
        assert np.array_equal(load_vectors(conn, "model").vectors, written)


def test_chosen_rows_copied_as_the_tail_reads_them_are_the_floats_written(
    pgvector_db: Engine,
) -> None:
    """The vector tail's read of chosen records (index/vectors.copy_records_sql) on pgvector
    values: the rows asked for, none else, each the same floats the index's own read gives."""
    from fabric_pipelines.lib.index.copy_rows import vector_rows
    from fabric_pipelines.lib.index.vectors import ID_STRIDE, copy_records_sql

    batches = _ledger(pgvector_db, 3)
    _write_all(pgvector_db, batches)
    chosen = np.random.default_rng(3).choice(3 * ITEMS, 100, replace=False)
    with pgvector_db.connect() as conn:
        everything = load_vectors(conn, "model")
        raw = conn.connection.driver_connection
        assert raw is not None
        ids, vectors = [], []
        with raw.cursor() as cur:
            params = (chosen.tolist(), batches[0].model_id, batches[0].task_set_id)
            with cur.copy(copy_records_sql(True), params) as copy:
                for got_ids, got_vectors in vector_rows(copy, True):
                    ids.append(got_ids)
                    vectors.append(got_vectors)
    got = np.concatenate(ids)
    assert sorted(got.tolist()) == sorted((batches[0].task_set_id * ID_STRIDE + chosen).tolist())
    at = np.searchsorted(everything.ids, got)
    assert np.array_equal(np.concatenate(vectors), everything.vectors[at])
