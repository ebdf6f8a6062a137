"""Reading a model's vectors out of the database for an index: in id order, with their ids and
task sets, in batches (SQLite) or as a binary COPY stream (PostgreSQL), one dimension only."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import Engine, insert, text

from fabric_pipelines.lib.index import copy_rows, vectors
from fabric_pipelines.lib.index.copy_rows import SIGNATURE, TRAILER, RowLayoutError, vector_rows
from fabric_pipelines.lib.index.vectors import ID_STRIDE, BadVectorsError, load_vectors
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding, TaskSet


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


def test_a_sqlite_vector_stored_as_text_is_refused(db: Engine) -> None:
    """SQLite keeps whatever type it is given: a vector written as text of the right length
    must not be read as if its characters were float32 bytes."""
    if db.dialect.name != "sqlite":
        pytest.skip("PostgreSQL's bytea column holds bytes only")
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
