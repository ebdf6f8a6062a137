"""Reading a model's vectors out of the database for an index: in id order, with their ids and
task sets, in batches (SQLite) or as a binary COPY stream (PostgreSQL), one dimension only; and
read by several connections at once, which gives exactly what the serial read gives."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Connection, Engine, insert, text

from fabric_pipelines.lib.index import copy_rows, parallel_read, vectors
from fabric_pipelines.lib.index.copy_rows import SIGNATURE, TRAILER, RowLayoutError, vector_rows
from fabric_pipelines.lib.index.parallel_read import KeyRange, Slices, key_ranges
from fabric_pipelines.lib.index.vectors import ID_STRIDE, BadVectorsError, VectorSet, load_vectors
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding, TaskSet
from fabric_pipelines.lib.store.schema import stores_pgvector, upgrade
from fabric_testing.scratch_db import empty_public_schema

# The `db` fixture runs a test on both databases; these run it on one.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
POSTGRES_ONLY = pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)


def _task_set(db: Engine, name: str) -> int:
    with db.begin() as conn:
        conn.execute(
            insert(TaskSet).values(
                name=name, source_sha256="s", content_sha256="c", path="p", model_id="m",
                tokenizer_sha256="t", max_seq_len=8, n_records=1, n_tasks=1,
            )
        )  # fmt: skip
        return int(
            conn.execute(text("select id from task_sets where name = :n"), {"n": name}).scalar_one()
        )


def _write(db: Engine, model: str, rows: list[tuple[int, int, np.ndarray]]) -> None:
    with db.begin() as conn:
        key = model_id(conn, model)
        conn.execute(
            insert(Embedding),
            [
                {"model_id": key, "task_set_id": t, "record_no": r, "n_tokens": 3,
                 "vector": v.astype("<f4").tobytes()}
                for t, r, v in rows
            ],
        )  # fmt: skip


def test_vectors_come_back_in_id_order_with_their_ids_and_task_sets(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small batches and pieces: the rows cross many batch and COPY-piece boundaries.
    monkeypatch.setattr(vectors, "SQLITE_BATCH", 7)
    monkeypatch.setattr(copy_rows, "PIECE_BYTES", 100)
    beta, alpha = _task_set(db, "beta"), _task_set(db, "alpha")
    rng = np.random.default_rng(0)
    keys = [(t, r) for t in (alpha, beta) for r in range(60)]
    written = {key: rng.standard_normal(5).astype(np.float32) for key in keys}
    shuffled = [keys[i] for i in rng.permutation(len(keys))]  # written out of order
    _write(db, "m", [(t, r, written[t, r]) for t, r in shuffled])
    _write(db, "other", [(alpha, 0, np.ones(9, np.float32))])  # another model, another size
    with db.connect() as conn:
        loaded = load_vectors(conn, "m")
    order = sorted(keys)
    assert loaded.ids.dtype == np.int64
    assert loaded.ids.tolist() == [t * ID_STRIDE + r for t, r in order]
    assert loaded.vectors.dtype == np.float32 and loaded.vectors.flags.c_contiguous
    assert np.array_equal(loaded.vectors, np.stack([written[key] for key in order]))
    assert loaded.task_sets == ("alpha", "beta") and loaded.dim == 5


@SQLITE_ONLY
def test_a_sqlite_read_comes_back_in_id_order_and_leaves_the_connection_as_it_was(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows written in reverse, with gaps, read in batches smaller than the rows, come back in
    id order; vectors that end in zero bytes stay whole; the connection's memory map (set for
    the read) is set back afterwards."""
    monkeypatch.setattr(vectors, "SQLITE_BATCH", 3)
    ts = _task_set(db, "gaps")
    written = {r: np.array([0, r, 0, 0], np.float32) for r in range(40, 0, -3)}
    for r, v in written.items():  # one row per transaction: rowids follow the writes
        _write(db, "m", [(ts, r, v)])
    with db.connect() as conn:
        raw = conn.connection.driver_connection
        raw.execute("PRAGMA mmap_size = 4096")
        loaded = load_vectors(conn, "m")
        assert raw.execute("PRAGMA mmap_size").fetchone()[0] == 4096
    order = sorted(written)
    assert loaded.ids.tolist() == [ts * ID_STRIDE + r for r in order]
    assert np.array_equal(loaded.vectors, np.stack([written[r] for r in order]))


def test_a_model_without_rows_loads_as_empty(db: Engine) -> None:
    with db.begin() as conn:
        model_id(conn, "registered")
    with db.connect() as conn:
        for key in ("registered", "unknown"):
            empty = load_vectors(conn, key)
            assert empty.ids.shape == (0,) and empty.vectors.shape == (0, 0)
            assert empty.task_sets == () and empty.dim == 0


def test_vectors_of_several_dimensions_are_refused_by_name(db: Engine) -> None:
    rows = [(1, r, np.ones(4, np.float32)) for r in range(10)] + [(1, 10, np.ones(6, np.float32))]
    _write(db, "m", rows)
    with db.connect() as conn:
        with pytest.raises(
            BadVectorsError, match=r"model m: embeddings of several dimensions \[4, 6\]"
        ):
            load_vectors(conn, "m")
        assert conn.execute(text("select count(*) from embeddings")).scalar_one() == 11  # usable


@SQLITE_ONLY  # PostgreSQL's bytea column holds bytes only
def test_a_sqlite_vector_stored_as_text_is_refused(db: Engine) -> None:
    """SQLite keeps whatever type it is given: a vector written as text of the right length
    must not be read as if its characters were float32 bytes."""
    _write(db, "m", [(1, r, np.ones(4, np.float32)) for r in range(3)])
    with db.begin() as conn:
        conn.execute(text("update embeddings set vector = 'sixteen chars...' where record_no = 1"))
    with db.connect() as conn, pytest.raises(BadVectorsError, match="not stored as bytes"):
        load_vectors(conn, "m")


def test_rows_written_since_the_count_are_kept_and_rows_deleted_since_are_not_made_up() -> None:
    more = vectors._RowArrays(3)
    more.add(np.array([1, 2]), np.ones((2, 4), np.float32))
    more.add(np.array([3, 4, 5]), np.full((3, 4), 2, np.float32))
    ids, values = more.arrays()
    assert ids.tolist() == [1, 2, 3, 4, 5] and values[:, 0].tolist() == [1, 1, 2, 2, 2]
    fewer = vectors._RowArrays(5)
    fewer.add(np.array([7, 8]), np.ones((2, 4), np.float32))
    ids, values = fewer.arrays()
    assert ids.tolist() == [7, 8] and values.shape == (2, 4)
    # SQLite's rows: blobs copied straight into place, the same either way.
    blobs = [np.full(4, v, "<f4").tobytes() for v in (1, 1, 2, 2, 2)]
    more = vectors._RowArrays(3)
    more.add_bytes((1, 2), tuple(blobs[:2]), 4)
    more.add_bytes((3, 4, 5), tuple(blobs[2:]), 4)
    ids, values = more.arrays()
    assert ids.tolist() == [1, 2, 3, 4, 5] and values[:, 0].tolist() == [1, 1, 2, 2, 2]
    assert ids.dtype == np.int64 and values.dtype == np.float32 and values.shape == (5, 4)
    fewer = vectors._RowArrays(5)
    fewer.add_bytes((7, 8), tuple(blobs[:2]), 4)
    ids, values = fewer.arrays()
    assert ids.tolist() == [7, 8] and values.shape == (2, 4)
    zeros_last = vectors._RowArrays(1)  # bytes that end in zeros are kept whole
    zeros_last.add_bytes((9,), (np.array([0, 3, 0, 0], "<f4").tobytes(),), 4)
    assert zeros_last.arrays()[1].tolist() == [[0, 3, 0, 0]]


def _copy_stream(rows: list[tuple[int, np.ndarray | None, np.ndarray | None]]) -> bytes:
    """A binary COPY stream of (id int8, vector bytea, pgvector value less its head) rows."""
    out = [SIGNATURE, (0).to_bytes(4, "big"), (0).to_bytes(4, "big")]
    for row_id, as_bytes, as_pgvector in rows:
        out += [(3).to_bytes(2, "big"), (8).to_bytes(4, "big"), row_id.to_bytes(8, "big")]
        for value in (as_bytes, as_pgvector):
            if value is None:
                out.append((-1).to_bytes(4, "big", signed=True))
            else:
                out += [value.nbytes.to_bytes(4, "big"), value.tobytes()]
    return b"".join([*out, TRAILER])


def _messages(stream: bytes, seed: int) -> list[bytes]:
    cuts = np.sort(np.random.default_rng(seed).choice(len(stream), 15, replace=False))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


def test_a_copy_stream_of_bytes_and_pgvector_rows_decodes_whatever_its_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copy_rows, "PIECE_BYTES", 64)
    values = np.random.default_rng(1).standard_normal((9, 3)).astype(np.float32)
    kinds = [i % 3 == 0 for i in range(9)]  # every third row stored by pgvector (big-endian)
    stream = _copy_stream(
        [
            (100 + i, None, v.astype(">f4")) if pg else (100 + i, v.astype("<f4"), None)
            for i, (v, pg) in enumerate(zip(values, kinds, strict=True))
        ]
    )
    for seed in range(5):
        runs = [(np.array(i), np.array(v)) for i, v in vector_rows(_messages(stream, seed), True)]
        assert np.concatenate([i for i, _ in runs]).tolist() == list(range(100, 109))
        assert np.array_equal(np.concatenate([v for _, v in runs]), values)
    assert list(vector_rows([_copy_stream([])], True)) == []


@pytest.mark.parametrize(
    "bad",
    [
        (5, np.ones(4, "<f4"), None),  # another dimension
        (5, None, None),  # no vector at all
        (5, np.ones(3, "<f4"), np.ones(3, ">f4")),  # both: not a row of this layout
    ],
)
def test_a_row_off_the_first_rows_layout_is_refused(
    bad: tuple[int, np.ndarray | None, np.ndarray | None],
) -> None:
    good = [(i, np.ones(3, "<f4"), None) for i in range(4)]
    with pytest.raises(RowLayoutError):
        list(vector_rows([_copy_stream([*good, bad, *good])], True))


# Reading in parallel.


def _load(conn: Connection, readers: int) -> VectorSet:
    """load_vectors of model "m" with `readers` readers (1: the serial read)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(parallel_read, "reader_count", lambda rows: readers)
        return load_vectors(conn, "m")


@pytest.fixture
def parallel_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each parallel read was kept (True) or given up for the serial one (False). Small
    COPY pieces, so that every range crosses many of them."""
    outcomes: list[bool] = []
    read_ranges = parallel_read.read_ranges

    def recorded(*args: Any, **kwargs: Any) -> Any:
        read = read_ranges(*args, **kwargs)
        outcomes.append(read is not None)
        return read

    monkeypatch.setattr(parallel_read, "read_ranges", recorded)
    monkeypatch.setattr(copy_rows, "PIECE_BYTES", 100)
    return outcomes


def _uneven_sets(db: Engine) -> dict[tuple[int, int], np.ndarray]:
    """Three task sets, 451 rows of 8 dimensions: dense, sparse (every third record) and far-off
    record numbers; ranges cut by record number hold other rows than the counts suggest."""
    sets = [_task_set(db, name) for name in ("gamma", "alpha", "beta")]
    keys = (
        [(sets[0], r) for r in range(200)]
        + [(sets[1], r) for r in range(0, 600, 3)]
        + [(sets[2], 10**9 + r) for r in range(51)]
    )
    rng = np.random.default_rng(2)
    written = {key: rng.standard_normal(8).astype(np.float32) for key in keys}
    _write(db, "m", [(t, r, v) for (t, r), v in written.items()])
    return written


def _dense_sets(db: Engine) -> dict[tuple[int, int], np.ndarray]:
    """Two task sets without gaps in their record numbers: every range holds the rows it was
    given."""
    sets = [_task_set(db, name) for name in ("delta", "epsilon")]
    rng = np.random.default_rng(4)
    written = {(t, r): rng.standard_normal(8).astype(np.float32) for t in sets for r in range(150)}
    _write(db, "m", [(t, r, v) for (t, r), v in written.items()])
    return written


def _same(a: VectorSet, b: VectorSet) -> bool:
    return (
        a.ids.dtype == b.ids.dtype == np.int64
        and a.vectors.dtype == b.vectors.dtype == np.float32
        and a.vectors.shape == b.vectors.shape
        and a.vectors.flags.c_contiguous
        and a.ids.tobytes() == b.ids.tobytes()
        and a.vectors.tobytes() == b.vectors.tobytes()
        and a.task_sets == b.task_sets
    )


@POSTGRES_ONLY
@pytest.mark.parametrize("sets", [_dense_sets, _uneven_sets])
def test_a_parallel_read_is_the_serial_read_byte_for_byte(
    db: Engine, parallel_reads: list[bool], monkeypatch: pytest.MonkeyPatch, sets: Any
) -> None:
    monkeypatch.setattr(parallel_read, "KEEPALIVE_S", 0.001)  # the caller's connection kept busy
    allocated: list[parallel_read.Slices] = []
    monkeypatch.setattr(
        parallel_read, "Slices", lambda sizes: allocated.append(Slices(sizes)) or allocated[-1]
    )
    written = sets(db)
    in_place = []
    with db.connect() as conn:
        serial = _load(conn, 1)
        assert serial.ids.tolist() == sorted(t * ID_STRIDE + r for t, r in written)
        for readers in (2, 3, 8):
            parallel = _load(conn, readers)
            assert _same(parallel, serial)
            whole = allocated[-1].whole
            in_place.append(whole is not None and parallel.vectors is whole[1])
        conn.execute(text("select 1"))  # the caller's connection is still usable
    assert parallel_reads == [True, True, True]
    # Where every range held the rows it was given, they were written in place; where some
    # did not (gaps in the record numbers), they were put together after.
    assert all(in_place) if sets is _dense_sets else not all(in_place)


@POSTGRES_ONLY
def test_one_reader_per_two_cores_for_large_sets_and_the_serial_read_for_small_ones(
    db: Engine, parallel_reads: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    reader_count, least = parallel_read.reader_count, parallel_read.PARALLEL_MIN_ROWS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert reader_count(least - 1) == 1 and reader_count(least) == parallel_read.MAX_READERS == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert reader_count(10**6) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert reader_count(10**6) == 2
    written = _uneven_sets(db)
    with db.connect() as conn:
        serial = _load(conn, 1)
        assert _same(load_vectors(conn, "m"), serial) and parallel_reads == []
        monkeypatch.setattr(parallel_read, "PARALLEL_MIN_ROWS", len(written))
        assert _same(load_vectors(conn, "m"), serial) and parallel_reads == [True]


@SQLITE_ONLY
def test_sqlite_is_read_serially_however_large(db: Engine, parallel_reads: list[bool]) -> None:
    _uneven_sets(db)
    with db.connect() as conn:
        assert _same(_load(conn, 4), _load(conn, 1))
    assert parallel_reads == []


def _commit_before_the_first_range(
    monkeypatch: pytest.MonkeyPatch, db: Engine, reader: type
) -> int:
    """Have the first range's reader commit one more row (from a connection of its own) just
    before it reads; the new row's id."""
    real = reader.read
    with db.connect() as conn:
        task_set = int(conn.execute(text("select max(id) from task_sets")).scalar_one())

    def read(self: Any, *args: Any) -> Any:
        if self.range.lo is None:
            _write(db, "m", [(task_set, 5 * 10**9, np.full(8, 7, np.float32))])
        return real(self, *args)

    monkeypatch.setattr(reader, "read", read)
    return task_set * ID_STRIDE + 5 * 10**9


@POSTGRES_ONLY
def test_postgres_readers_read_the_callers_snapshot_not_a_later_commit(
    db: Engine, parallel_reads: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    _uneven_sets(db)
    with db.connect() as conn:
        before = _load(conn, 1)
    new = _commit_before_the_first_range(monkeypatch, db, vectors._PostgresRange)
    with db.connect() as conn:
        loaded = _load(conn, 4)
    assert parallel_reads == [True]
    assert _same(loaded, before)  # committed after the snapshot was exported
    with db.connect() as conn:
        assert new in _load(conn, 1).ids


@POSTGRES_ONLY
def test_postgres_rows_the_caller_wrote_but_did_not_commit_are_read_serially(
    db: Engine, parallel_reads: list[bool]
) -> None:
    written = _uneven_sets(db)
    task_set = max(t for t, _ in written)
    with db.connect() as conn:
        conn.execute(
            insert(Embedding).values(
                model_id=model_id(conn, "m"), task_set_id=task_set, record_no=5 * 10**9,
                n_tokens=3, vector=np.ones(8, "<f4").tobytes(),
            )
        )  # fmt: skip
        loaded = _load(conn, 4)
        conn.rollback()
    assert parallel_reads == []  # not even tried: the readers would not see that row
    assert len(loaded.ids) == len(written) + 1


@POSTGRES_ONLY
def test_postgres_readers_queued_behind_ddl_that_waits_for_the_caller_give_up(
    db: Engine, parallel_reads: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDL waits for the caller's lock on the table, the readers' locks wait behind the DDL and
    the caller waits for the readers: they give up after a lock timeout and the caller, which
    holds its lock already, reads serially."""
    monkeypatch.setattr(vectors, "READER_LOCK_TIMEOUT_MS", 100)
    _dense_sets(db)
    read_ranges = parallel_read.read_ranges
    ddl_done = threading.Event()

    def ddl() -> None:
        with db.connect() as conn:
            conn.execute(text("LOCK TABLE embeddings IN ACCESS EXCLUSIVE MODE"))
            conn.commit()
        ddl_done.set()

    def after_queued_ddl(*args: Any, **kwargs: Any) -> Any:
        threading.Thread(target=ddl, daemon=True).start()
        with db.connect() as conn:
            waiting = "select count(*) from pg_locks where not granted"
            while not conn.execute(text(waiting)).scalar_one():
                time.sleep(0.01)
        return read_ranges(*args, **kwargs)

    monkeypatch.setattr(parallel_read, "read_ranges", after_queued_ddl)
    with db.connect() as conn:
        loaded = _load(conn, 3)
        assert not ddl_done.is_set()  # still waiting for the caller's transaction
    assert ddl_done.wait(10)
    assert parallel_reads == [False]
    with db.connect() as conn:
        assert _same(loaded, _load(conn, 1))


@POSTGRES_ONLY
def test_a_reader_that_cannot_connect_leaves_the_read_to_the_callers_connection(
    db: Engine, parallel_reads: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    _dense_sets(db)
    reader = vectors._PostgresRange
    real = reader.read

    def refused(self: Any, *args: Any) -> Any:
        if self.range.lo is not None and self.range.hi is not None:  # the middle range
            raise ConnectionError("too many connections")
        return real(self, *args)

    with db.connect() as conn:
        serial = _load(conn, 1)
        monkeypatch.setattr(reader, "read", refused)
        assert _same(_load(conn, 3), serial)
    assert parallel_reads == [False]


@POSTGRES_ONLY
@pytest.mark.parametrize("bad", ["another dimension", "odd bytes"])
def test_a_bad_row_in_the_middle_range_gives_the_serial_error(
    db: Engine, parallel_reads: list[bool], bad: str
) -> None:
    _write(db, "m", [(1, r, np.ones(4, np.float32)) for r in range(300)])
    value = {
        "another dimension": np.ones(6, "<f4").tobytes(),
        "odd bytes": b"123456",
    }[bad]
    with db.begin() as conn:  # record 150: in the middle one of three ranges
        conn.execute(text("update embeddings set vector = :v where record_no = 150"), {"v": value})
    errors = []
    for readers in (1, 3):
        with db.connect() as conn, pytest.raises(BadVectorsError) as raised:
            _load(conn, readers)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    assert parallel_reads == [False]


def _in_range(key: tuple[int, int], key_range: KeyRange) -> bool:
    lo, hi = key_range.lo, key_range.hi
    return (lo is None or key >= lo) and (hi is None or key < hi)


def test_key_ranges_hold_every_key_once_in_order_and_about_evenly() -> None:
    dense = [(3, 100, 0, 99), (5, 1, 7, 7), (8, 60, 10**9, 10**9 + 59)]
    sparse = [(9, 300, 0, 897)]  # every third record number
    keys = (
        [(3, r) for r in range(100)]
        + [(5, 7)]
        + [(8, 10**9 + r) for r in range(60)]
        + [(9, r) for r in range(0, 900, 3)]
    )
    for extents in (dense, dense + sparse):
        in_sets = [key for key in keys if key[0] in {t for t, _, _, _ in extents}]
        for parts in (1, 2, 4, 7, 1000):
            ranges = key_ranges(extents, parts)
            assert ranges[0].lo is None and ranges[-1].hi is None and len(ranges) <= parts
            assert all(a.hi is not None and a.hi == b.lo for a, b in pairwise(ranges))
            assert all(a.lo < b.lo for a, b in pairwise(ranges[1:]))  # type: ignore[operator]
            held = [sum(_in_range(key, r) for key in in_sets) for r in ranges]
            assert sum(held) == sum(r.rows for r in ranges) == len(in_sets)
            if extents == dense:  # no gaps: each range holds exactly the rows it was given
                assert held == [r.rows for r in ranges]
            if parts <= 7:
                assert len(ranges) == parts and max(held) - min(held) <= 2
    # A cut that falls where a task set begins starts the range there.
    assert key_ranges([(1, 10, 0, 9), (2, 10, 0, 9)], 2)[1] == KeyRange((2, 0), None, 10)


@pytest.fixture
def pgvector_db(pgvector_server_url: str) -> Iterator[Engine]:
    engine = make_engine(pgvector_server_url)
    empty_public_schema(engine)
    upgrade(engine)
    assert stores_pgvector(engine)
    yield engine
    engine.dispose()


@pytest.mark.pgvector
def test_a_parallel_read_of_pgvector_and_byte_rows_is_the_serial_read(
    pgvector_db: Engine, parallel_reads: list[bool]
) -> None:
    task_set = _task_set(pgvector_db, "only")
    rng = np.random.default_rng(3)
    values = (rng.integers(-8, 8, (300, 5)) / 4).astype(np.float32)  # exact as text too
    with pgvector_db.begin() as conn:
        model = model_id(conn, "m")
        for r, v in enumerate(values):
            as_bytes = r % 4 == 0  # every fourth row stored as bytes, the others by pgvector
            conn.execute(
                text(
                    "insert into embeddings (model_id, task_set_id, record_no, n_tokens, vector, "
                    "embedding) values (:m, :t, :r, 3, :b, cast(:e as vector))"
                ),
                {
                    "m": model, "t": task_set, "r": r,
                    "b": v.astype("<f4").tobytes() if as_bytes else None,
                    "e": None if as_bytes else str(v.tolist()),
                },
            )  # fmt: skip
    with pgvector_db.connect() as conn:
        serial = _load(conn, 1)
        assert np.array_equal(serial.vectors, values)
        assert _same(_load(conn, 3), serial)
    with pgvector_db.begin() as conn:  # a row with neither, in the middle range
        conn.execute(
            text("update embeddings set vector = null, embedding = null where record_no = 150")
        )
    errors = []
    for readers in (1, 3):
        with pgvector_db.connect() as conn, pytest.raises(BadVectorsError) as raised:
            _load(conn, readers)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "without a vector" in errors[0]
    assert parallel_reads == [True, False]
