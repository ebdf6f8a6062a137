"""`fabric export`: a task set's pooled embeddings as one Parquet file, for other tools.

Rows are read in record order, a block at a time (the whole set is never in memory), and written
as they come through the file helper (staging name, fsync, sha256, rename): a reader never sees
a half-written file. Columns: `id` (the task id as submitted), `record_no` (its place in the
submitted file, from 0), `n_tokens` (tokens the model read) and `vector` (float32, fixed size);
with hook layers asked for, `layer_<k>` per layer: the task's hidden states, [tokens, hidden]
float16, read from its shard file (rows then come batch by batch); a task that reuses another
task's result has that task's hidden states, read from the source's shard file.

With a variant (fabric_gpu/variants.py: `float16`, `int8`, `binary`, optionally `:DIMS`), the
`vector` column holds that encoding (float16 or int8 lists, binary as fixed-size bytes), computed
from the stored float32 vectors by the variant's CPU twin; the file's metadata names the variant
(`fabric.variant`) and, for int8, the calibration (`fabric.int8_calibration`, JSON of the per-
dimension low and high, taken from the first block of up to BLOCK_ROWS vectors) that a query must
be quantised with.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Connection, Engine, Select, literal_column, select

from fabric_gpu.variants import Int8Calibration, Variant
from fabric_pipelines.lib.core.files import HashingWriter, stream_file
from fabric_pipelines.lib.records.vector_codec import StoredCodec
from fabric_pipelines.lib.results.hidden_states import read_shard
from fabric_pipelines.lib.store.models import (
    WINDOW_BASE,
    BatchPlanRow,
    DocumentWindow,
    Embedding,
    HiddenStateShard,
    Model,
    ReusedResult,
    Task,
    TaskSet,
    task_embeddings,
)
from fabric_pipelines.lib.store.vector_columns import VectorColumns

BLOCK_ROWS = 50_000  # rows read and written at a time


class ExportError(ValueError):
    """Nothing was written; the message names what is missing and what to do."""


@dataclass(frozen=True)
class Exported:
    path: Path
    sha256: str
    rows: int
    dim: int
    model_key: str
    variant: str = "float32"
    bytes_per_vector: int = 0


def export_task_set(
    db: Engine,
    task_set: str,
    out: Path,
    *,
    model_key: str | None = None,
    layers: Sequence[int] = (),
    variant: str | None = None,
    windows: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Exported:
    """Write `task_set`'s embeddings of `model_key` (default: the model of its current plan) to
    `out`; `progress(rows)` after each block. With `layers`, each row also holds those hook
    layers' hidden states (`layer_<k>`: one [tokens, hidden] float16 list per task), read from
    the set's shard files (each checked against its sha256), and rows come batch by batch."""
    set_id, model, model_key = _set_and_model(db, task_set, model_key)
    # A normalising model's shortened vectors are made unit length again.
    chosen = Variant.parse(variant, normalize="+normalized" in model_key) if variant else None
    with db.connect() as conn:
        codec = StoredCodec.of_key(conn, model_key)
    if not codec.plain and chosen is not None:
        raise ExportError(
            f"model {model_key} stores {codec.variant.label} vectors, made by the engine: they "
            "are exported as stored; --variant makes a variant of float32 vectors only"
        )
    blocks: Iterator[pa.Table] = (
        _hidden_state_blocks(db, task_set, set_id, model, model_key, list(layers), codec)
        if layers
        else _record_order_blocks(db, set_id, model, codec)
    )
    if windows:
        if layers:
            raise ExportError("--windows and --layers: export one of them at a time")
        blocks = _with_windows(blocks, db, set_id, model, codec)
    counted = {"rows": 0, "dim": 0}
    calibration: list[Int8Calibration] = []  # set from the first block, for int8

    def write(sink: HashingWriter) -> None:
        writer: pq.ParquetWriter | None = None
        for table in blocks:
            if writer is None:
                counted["dim"] = _dims(table, codec)
            if chosen is not None:
                table = _encoded(table, chosen, calibration)
            elif not codec.plain:
                table = table.replace_schema_metadata(
                    _variant_metadata(codec.variant, codec.calibration)
                )
            if writer is None:
                writer = pq.ParquetWriter(pa.PythonFile(sink, mode="w"), table.schema)
            writer.write_table(table)
            counted["rows"] += table.num_rows
            if progress is not None:
                progress(counted["rows"])
        if writer is None:
            raise ExportError(
                f"task set {task_set!r} has no embeddings of {model_key}: fabric status "
                f"{task_set} shows what happened to its tasks"
            )
        writer.close()

    stored = stream_file(out, write)
    made = chosen or codec.variant
    label = made.label if chosen is not None or not codec.plain else "float32"
    per_vector = made.row_bytes(counted["dim"]) if counted["dim"] else 0
    return Exported(
        out, stored.sha256, counted["rows"], counted["dim"], model_key, label, per_vector
    )


def _encoded(table: pa.Table, variant: Variant, calibration: list[Int8Calibration]) -> pa.Table:
    """`table` with its float32 `vector` column in `variant`'s encoding, the variant (and the
    int8 calibration, made from this block if it is the first) in the schema's metadata."""
    column = table.column("vector").combine_chunks()
    dim = column.type.list_size
    vectors = column.values.to_numpy(zero_copy_only=False).reshape(-1, dim)
    if variant.needs_calibration() and not calibration:
        calibration.append(Int8Calibration.of(variant.prepared(vectors)))
    cal = calibration[0] if calibration else None
    values = _vector_column(variant.apply_numpy(vectors, cal), variant)
    table = table.set_column(table.schema.get_field_index("vector"), "vector", values)
    return table.replace_schema_metadata(_variant_metadata(variant, cal))


def _variant_metadata(variant: Variant, calibration: Int8Calibration | None) -> dict[str, str]:
    metadata = {"fabric.variant": variant.label}
    if calibration is not None:
        metadata["fabric.int8_calibration"] = calibration.to_json()
    return metadata


def _vector_column(encoded: np.ndarray, variant: Variant) -> pa.Array:
    """Encoded rows as a column: packed bits as fixed-size binary, numbers as fixed-size lists."""
    if variant.encoding == "binary":
        return pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(encoded.shape[1]), len(encoded), [None, pa.py_buffer(encoded.tobytes())]
        )
    return pa.FixedSizeListArray.from_arrays(pa.array(encoded.reshape(-1)), encoded.shape[1])


def _dims(table: pa.Table, codec: StoredCodec) -> int:
    """Dimensions of the vectors (binary: eight to a byte, or the variant's own count)."""
    kind = table.schema.field("vector").type
    if codec.variant.encoding == "binary":
        return codec.variant.dims or 8 * int(kind.byte_width)
    return int(kind.list_size)


def _set_and_model(db: Engine, task_set: str, model_key: str | None) -> tuple[int, int, str]:
    with db.connect() as conn:
        found = conn.execute(
            select(TaskSet.id, TaskSet.current_plan_id).where(TaskSet.name == task_set)
        ).first()
        if found is None:
            raise ExportError(f"no task set named {task_set!r} (fabric status lists them)")
        set_id, plan_id = found
        if model_key is None:
            if plan_id is None:
                raise ExportError(
                    f"task set {task_set!r} has not been extracted yet: fabric run {task_set}"
                )
            model_key = conn.execute(
                select(Model.model_key)
                .join(BatchPlanRow, BatchPlanRow.model_id == Model.id)
                .where(BatchPlanRow.plan_id == plan_id)
            ).scalar_one()
        model = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    if model is None:
        raise ExportError(f"no embeddings of model {model_key!r} in this database")
    return set_id, model, model_key


def _embeddings(set_id: int, model: int, stored: VectorColumns) -> Select[Any]:
    """Rows (task id, record_no, n_tokens, the vector's fields: store/vector_columns.py), one
    per task: its own row or the one it reused (the view `task_embeddings`)."""
    rows = task_embeddings.c
    vector: list[Any] = [literal_column(field) for field in stored.fields()]
    return (
        select(Task.task_id, rows.record_no, rows.n_tokens, *vector)
        .select_from(task_embeddings)
        .join(
            Task,
            (Task.task_set_id == rows.task_set_id) & (Task.record_no == rows.record_no),
        )
        .where(rows.task_set_id == set_id, rows.model_id == model)
    )


def _record_order_blocks(
    db: Engine, set_id: int, model: int, codec: StoredCodec
) -> Iterator[pa.Table]:
    with db.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=BLOCK_ROWS)
        stored = VectorColumns.of(conn)
        query = _embeddings(set_id, model, stored).order_by(task_embeddings.c.record_no)
        for block in result.execute(query).partitions(BLOCK_ROWS):
            yield _block_table(block, codec, stored)


def _with_windows(
    documents: Iterator[pa.Table], db: Engine, set_id: int, model: int, codec: StoredCodec
) -> Iterator[pa.Table]:
    """The document rows (`window` null), then every stored window of the set's chunked
    documents: its document's id and record number, and `window`, its place among them from 0."""
    for table in documents:
        yield table.append_column("window", pa.nulls(table.num_rows, pa.int32()))
    with db.connect() as conn:
        chunked = conn.execute(
            select(Task.task_id, DocumentWindow.record_no, DocumentWindow.first_window)
            .join(
                Task,
                (Task.task_set_id == DocumentWindow.task_set_id)
                & (Task.record_no == DocumentWindow.record_no),
            )
            .where(DocumentWindow.task_set_id == set_id)
            .order_by(DocumentWindow.first_window)
        ).all()
        if not chunked:
            return
        firsts = np.array([c.first_window for c in chunked], dtype=np.int64)
        result = conn.execution_options(stream_results=True, yield_per=BLOCK_ROWS)
        stored = VectorColumns.of(conn)
        vector: list[Any] = [literal_column(field) for field in stored.fields()]
        query = (
            select(Embedding.record_no, Embedding.n_tokens, *vector)
            .where(
                Embedding.task_set_id == set_id,
                Embedding.model_id == model,
                Embedding.record_no >= WINDOW_BASE,
            )
            .order_by(Embedding.record_no)
        )
        for block in result.execute(query).partitions(BLOCK_ROWS):
            window_no = np.array([row[0] for row in block], dtype=np.int64)
            owner = np.searchsorted(firsts, window_no, side="right") - 1
            rows = [
                (chunked[d].task_id, chunked[d].record_no, *row[1:])
                for d, row in zip(owner.tolist(), block, strict=True)
            ]
            table = _block_table(rows, codec, stored)
            yield table.append_column(
                "window", pa.array((window_no - firsts[owner]).astype(np.int32), pa.int32())
            )


def _hidden_state_blocks(
    db: Engine,
    task_set: str,
    set_id: int,
    model: int,
    model_key: str,
    layers: list[int],
    codec: StoredCodec,
) -> Iterator[pa.Table]:
    """One table per shard file: its tasks' rows, vectors and the asked layers' states; then the
    tasks that reuse another task's result, whose hidden states are that task's (`_linked`)."""
    with db.connect() as conn:
        shards = _shards_of(conn, set_id, model)
        linked = _linked_sources(conn, set_id, model)
    if not shards and not linked:
        raise ExportError(
            f"task set {task_set!r} kept no hidden states of {model_key}: run it with "
            "--hook-layers to keep some"
        )
    for shard in shards:
        _check_layers(task_set, shard, layers)
        content = read_shard(Path(shard.path), shard.sha256)
        task_ids = [str(task_id) for task_id in content["task_id"]]
        with db.connect() as conn:
            stored = VectorColumns.of(conn)
            rows = {
                row[0]: row
                for row in conn.execute(
                    _embeddings(set_id, model, stored).where(Task.task_id.in_(task_ids))
                ).all()
            }
        table = _block_table([rows[task_id] for task_id in task_ids], codec, stored)
        for k in layers:
            states = [np.asarray(s) for s in content[f"layer_{k}"]]
            table = table.append_column(f"layer_{k}", _states_column(states))
        yield table
    if linked:
        yield from _linked(db, task_set, set_id, model, layers, codec, linked)


def _shards_of(conn: Connection, set_id: int, model: int) -> list[Any]:
    return list(
        conn.execute(
            select(HiddenStateShard)
            .where(HiddenStateShard.task_set_id == set_id, HiddenStateShard.model_id == model)
            .order_by(HiddenStateShard.plan_id, HiddenStateShard.batch_no)
        ).all()
    )


def _check_layers(task_set: str, shard: Any, layers: list[int]) -> None:
    kept = json.loads(shard.layers)
    missing = [k for k in layers if k not in kept]
    if missing:
        raise ExportError(
            f"task set {task_set!r} kept hidden states of layers {kept}, not {missing}: "
            "export some of those, or run it again with them in --hook-layers"
        )


def _linked_sources(conn: Connection, set_id: int, model: int) -> dict[int, dict[str, list[int]]]:
    """The set's tasks that read another task's result (lib/broker/reuse.py) and have no row of
    their own: source set id -> source task id -> the record numbers of the tasks reading it."""
    own_row = (
        select(Embedding.record_no)
        .where(
            Embedding.model_id == ReusedResult.model_id,
            Embedding.task_set_id == ReusedResult.task_set_id,
            Embedding.record_no == ReusedResult.record_no,
        )
        .exists()
    )
    found: dict[int, dict[str, list[int]]] = {}
    for record, source_set, source_id in conn.execute(
        select(ReusedResult.record_no, ReusedResult.from_task_set_id, Task.task_id)
        .join(
            Task,
            (Task.task_set_id == ReusedResult.from_task_set_id)
            & (Task.record_no == ReusedResult.from_record_no),
        )
        .where(ReusedResult.task_set_id == set_id, ReusedResult.model_id == model, ~own_row)
    ).all():
        found.setdefault(int(source_set), {}).setdefault(str(source_id), []).append(int(record))
    return found


def _linked(
    db: Engine,
    task_set: str,
    set_id: int,
    model: int,
    layers: list[int],
    codec: StoredCodec,
    linked: dict[int, dict[str, list[int]]],
) -> Iterator[pa.Table]:
    """Hidden states by reference: each reusing task's states are its source's, read from the
    source's shard file (checked against its sha256) and written under the reusing task's id.
    One table per source shard that holds any of them; only their task ids are read first."""
    for source_set, wanted in linked.items():
        with db.connect() as conn:
            shards = _shards_of(conn, source_set, model)
        left = dict(wanted)
        for shard in shards:
            with pa.memory_map(str(shard.path), "r") as source:
                ids = pa.ipc.open_file(source).read_all().column("task_id").to_pylist()
            hits = [(i, str(task_id)) for i, task_id in enumerate(ids) if str(task_id) in left]
            if not hits:
                continue
            _check_layers(task_set, shard, layers)
            content = read_shard(Path(shard.path), shard.sha256)
            records = [(i, record) for i, task_id in hits for record in left.pop(task_id)]
            with db.connect() as conn:
                stored = VectorColumns.of(conn)
                rows = {
                    row[1]: row
                    for row in conn.execute(
                        _embeddings(set_id, model, stored).where(
                            task_embeddings.c.record_no.in_([r for _, r in records])
                        )
                    ).all()
                }
            table = _block_table([rows[r] for _, r in records], codec, stored)
            for k in layers:
                states = content[f"layer_{k}"]
                table = table.append_column(
                    f"layer_{k}", _states_column([np.asarray(states[i]) for i, _ in records])
                )
            yield table
        if left:
            some = next(iter(left))
            raise ExportError(
                f"task set {task_set!r}: {sum(len(r) for r in left.values())} tasks reuse "
                f"results of task set id {source_set} (task {some!r} among them) whose hidden "
                "states are in no shard file: run fabric verify, then run the set again with "
                "--no-reuse"
            )


def _states_column(states: list[np.ndarray]) -> pa.Array:
    """[tokens, hidden] float16 per task, as a list of fixed-size lists."""
    hidden = states[0].shape[1] if states else 0
    flat = np.concatenate([s.reshape(-1) for s in states]).astype(np.float16, copy=False)
    offsets = np.zeros(len(states) + 1, np.int32)
    np.cumsum([s.shape[0] for s in states], out=offsets[1:])
    rows = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float16()), hidden)
    return pa.ListArray.from_arrays(pa.array(offsets), rows)


def _block_table(rows: Sequence[Any], codec: StoredCodec, stored: VectorColumns) -> pa.Table:
    """Rows (id, record_no, n_tokens, the vector's fields) as a table, vectors as stored."""
    ids = [row[0] for row in rows]
    encoded = codec.rows([stored.stored_bytes(row[3:]) for row in rows])
    return pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "record_no": pa.array([row[1] for row in rows], type=pa.int64()),
            "n_tokens": pa.array([row[2] for row in rows], type=pa.int32()),
            "vector": _vector_column(encoded, codec.variant),
        }
    )
