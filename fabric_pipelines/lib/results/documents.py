"""Chunked documents: once every window of a document is stored, its own vector is written.

A document split into windows (tasks/windows.py) has no task of its own: its windows are the
tasks. When all of them have a stored row, the document's row goes at its own record number with
the token-weighted mean of the windows' vectors (unit length if the model normalises) and the
document's own token count. The rows go in through the writer's `insert_rows`, so that they are
counted by the shard watermarks like any row, skipping rows already there: combining again, or
two runs combining at once, store each document once, with the same bytes (the mean is computed
in float64 from the same stored vectors, in window order).

A document with a failed window is not combined; `fabric requeue` runs the window again and the
next extraction run combines it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, delete, select

from fabric_gpu.variants import stored_rows
from fabric_pipelines.lib.core.retry import retry
from fabric_pipelines.lib.records.vector_codec import StoredCodec
from fabric_pipelines.lib.results.writer import insert_rows
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import WINDOW_BASE, DocumentWindow, Embedding, TaskSet
from fabric_pipelines.lib.store.vector_columns import VectorColumns
from fabric_pipelines.lib.tasks.windows import weighted_mean

BLOCK_DOCUMENTS = 2_000  # documents combined per transaction


@dataclass
class DocumentRows:
    """Combined documents, in the shape `insert_rows` takes."""

    task_set_id: int
    model_id: int
    record_no: np.ndarray  # int64 [documents]
    n_tokens: np.ndarray  # int64 [documents]
    pooled: np.ndarray  # [documents, ...]: float32, or the key's output variant


@dataclass(frozen=True)
class Combined:
    documents: int  # chunked documents of the set
    written: int  # rows this call stored
    waiting: int  # documents some of whose windows are not stored (failed or not yet run)


def combine_task_set(db: Engine, task_set: str, manifest: Any) -> int:
    """`combine_documents` for a set and a manifest's model, after an extraction run: the
    number of document rows written (none for a set without chunked documents)."""
    with db.connect() as conn:
        chunked = conn.execute(
            select(TaskSet.id, TaskSet.n_chunked).where(TaskSet.name == task_set)
        ).first()
        if chunked is None or not chunked[1]:
            return 0
        try:
            model = model_id(conn, manifest.model_key, create=False)
        except LookupError:  # nothing of this model was stored: nothing to combine
            return 0
    normalize = bool(manifest.hooks.normalize)
    return combine_documents(db, int(chunked[0]), model, normalize=normalize).written


def combine_documents(db: Engine, task_set_id: int, model_id: int, *, normalize: bool) -> Combined:
    """Store the vector of every chunked document of the set whose windows are all stored and
    which has none yet (see the module's doc)."""
    with db.connect() as conn:
        documents = _documents(conn, task_set_id)
    written = waiting = 0
    for start in range(0, len(documents), BLOCK_DOCUMENTS):
        block = documents[start : start + BLOCK_DOCUMENTS]

        def attempt(block: Sequence[Any] = block) -> tuple[int, int]:
            with db.begin() as conn:
                return _combine_block(conn, task_set_id, model_id, block, normalize)

        w, missing = retry(f"combining the documents of task set {task_set_id}", attempt)
        written += w
        waiting += missing
    return Combined(len(documents), written, waiting)


def _combine_block(
    conn: Connection,
    task_set_id: int,
    model_id: int,
    block: Sequence[Any],
    normalize: bool,
) -> tuple[int, int]:
    record_no = np.array([d[0] for d in block], dtype=np.int64)
    have = set(
        conn.execute(
            select(Embedding.record_no).where(
                Embedding.task_set_id == task_set_id,
                Embedding.model_id == model_id,
                Embedding.record_no.in_(record_no.tolist()),
            )
        ).scalars()
    )
    todo = [d for d in block if d[0] not in have]
    if not todo:
        return 0, 0
    low = min(int(d[1]) for d in todo)
    high = max(int(d[1]) + int(d[2]) for d in todo)
    codec = StoredCodec.of_model_id(conn, model_id)
    windows = _window_rows(conn, codec, task_set_id, model_id, low, high)
    rows: list[tuple[int, int, np.ndarray]] = []
    waiting = 0
    for doc, first, n_windows, n_tokens in todo:
        vector = _mean_of_windows(codec, windows, int(first), int(n_windows), normalize)
        if vector is None:
            waiting += 1
            continue
        rows.append((int(doc), int(n_tokens), vector))
    if rows:
        combined = DocumentRows(
            task_set_id,
            model_id,
            np.array([r[0] for r in rows], dtype=np.int64),
            np.array([r[1] for r in rows], dtype=np.int64),
            np.stack([r[2] for r in rows]),
        )
        insert_rows(conn, [combined], upsert=True, vector_columns=VectorColumns.of(conn))
    return len(rows), waiting


def mismatched_documents(
    conn: Connection, task_set_id: int, model_id: int, *, normalize: bool
) -> list[int]:
    """Record numbers of the set's stored document rows that are not what combining their
    stored windows gives now, byte for byte: the row was changed, or a window of it is gone or
    changed (`fabric verify` reports them; `recombine_documents` repairs them)."""
    documents = _documents(conn, task_set_id)
    codec = StoredCodec.of_model_id(conn, model_id)
    wrong: list[int] = []
    for start in range(0, len(documents), BLOCK_DOCUMENTS):
        block = documents[start : start + BLOCK_DOCUMENTS]
        first, last = int(block[0][0]), int(block[-1][0])
        stored = _stored_rows(conn, codec, task_set_id, model_id, first, last + 1)
        low = min(int(d[1]) for d in block)
        windows = _stored_rows(
            conn, codec, task_set_id, model_id, low, max(int(d[1]) + int(d[2]) for d in block)
        )
        for doc, first_window, n_windows, n_tokens in block:
            row = stored.get(int(doc))
            if row is None:
                continue  # not combined yet: the accounting counts it as waiting or failed
            expected = _mean_of_windows(
                codec, windows, int(first_window), int(n_windows), normalize
            )
            if expected is None:  # a window of it is gone
                wrong.append(int(doc))
                continue
            if row[0] != int(n_tokens) or _bytes(row[1]) != _bytes(expected):
                wrong.append(int(doc))
    return wrong


def recombine_documents(db: Engine, task_set_id: int, model_id: int, *, normalize: bool) -> int:
    """Replace the document rows `mismatched_documents` names with what their windows give
    (a document with a window gone stays out until its window runs again); how many went."""
    with db.begin() as conn:
        wrong = mismatched_documents(conn, task_set_id, model_id, normalize=normalize)
        for start in range(0, len(wrong), BLOCK_DOCUMENTS):
            conn.execute(
                delete(Embedding).where(
                    Embedding.task_set_id == task_set_id,
                    Embedding.model_id == model_id,
                    Embedding.record_no.in_(wrong[start : start + BLOCK_DOCUMENTS]),
                )
            )
    combine_documents(db, task_set_id, model_id, normalize=normalize)
    return len(wrong)


def _documents(conn: Connection, task_set_id: int) -> Sequence[Any]:
    """(record_no, first_window, n_windows, n_tokens) of the set's chunked documents."""
    return conn.execute(
        select(
            DocumentWindow.record_no,
            DocumentWindow.first_window,
            DocumentWindow.n_windows,
            DocumentWindow.n_tokens,
        )
        .where(DocumentWindow.task_set_id == task_set_id)
        .order_by(DocumentWindow.record_no)
    ).all()


def _mean_of_windows(
    codec: StoredCodec,
    windows: dict[int, tuple[int, np.ndarray]],
    first: int,
    n_windows: int,
    normalize: bool,
) -> np.ndarray | None:
    """A document's row from its stored windows (`windows`: record number -> (n_tokens, row)),
    in the key's stored encoding (an output variant: the mean of the windows' values, encoded
    again); None while any of its windows is missing."""
    found = [windows.get(w) for w in range(first, first + n_windows)]
    if any(f is None for f in found):
        return None
    present = [f for f in found if f is not None]
    weights = np.array([f[0] for f in present], dtype=np.float64)
    values = codec.values(np.stack([f[1] for f in present]))
    return codec.encode(weighted_mean(values, weights, normalize)[None])[0]


def _bytes(row: np.ndarray) -> bytes:
    return stored_rows(row[None]).tobytes()


def _window_rows(
    conn: Connection, codec: StoredCodec, task_set_id: int, model_id: int, low: int, high: int
) -> dict[int, tuple[int, np.ndarray]]:
    """(n_tokens, row) of the set's stored windows with record numbers in [low, high)."""
    return _stored_rows(conn, codec, task_set_id, model_id, max(low, WINDOW_BASE), high)


def _stored_rows(
    conn: Connection, codec: StoredCodec, task_set_id: int, model_id: int, low: int, high: int
) -> dict[int, tuple[int, np.ndarray]]:
    """(n_tokens, row) of the set's stored rows with record numbers in [low, high)."""
    stored = VectorColumns.of(conn)
    columns = f"record_no, n_tokens, {stored.select_sql()}"
    mark = "%s" if conn.dialect.name == "postgresql" else "?"
    raw = conn.connection.driver_connection
    assert raw is not None
    cursor = raw.cursor()
    try:
        cursor.execute(
            f"SELECT {columns} FROM embeddings WHERE task_set_id = {mark} AND model_id = {mark} "
            f"AND record_no >= {mark} AND record_no < {mark}",
            (task_set_id, model_id, low, high),
        )
        found: dict[int, tuple[int, np.ndarray]] = {}
        for row in cursor.fetchall():
            vector = codec.rows([stored.stored_bytes(row[2:])])[0]
            found[int(row[0])] = (int(row[1]), vector)
        return found
    finally:
        cursor.close()
