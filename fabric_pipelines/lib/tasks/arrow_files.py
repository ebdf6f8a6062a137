"""Task sets and plans on disk: Arrow IPC files, written through lib/core/files.py, checked on read.

The file's sha256 is kept by the caller (the database) and checked on every open.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa

from fabric_pipelines.lib.core.files import (
    CorruptFileError,
    HashingWriter,
    stream_file,
    verify_sha256,
)
from fabric_pipelines.lib.tasks.ingest import TokenisedTasks

SCHEMA = pa.schema(
    [
        pa.field("record_no", pa.int64(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    ]
)


def to_table(tasks: TokenisedTasks) -> pa.Table:
    if tasks.offsets[-1] >= 2**31:
        raise ValueError(
            f"task set holds {int(tasks.offsets[-1]):,} tokens, over the 2**31 an Arrow list column "
            "addresses; split it into several task sets"
        )
    token_ids = pa.ListArray.from_arrays(
        pa.array(tasks.offsets.astype(np.int32)), pa.array(tasks.tokens, type=pa.int32())
    )
    columns = [
        pa.array(tasks.record_no, type=pa.int64()),
        pa.array(tasks.task_ids, type=pa.string()),
        token_ids,
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def write_table(path: Path, table: pa.Table, metadata: dict[str, str] | None = None) -> str:
    """Write `table` as an Arrow IPC file atomically; return the file's sha256."""
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    return stream_file(path, lambda out: write_ipc(out, table)).sha256


def write_ipc(out: HashingWriter, table: pa.Table) -> None:
    """`table` as an Arrow IPC file into `out`, each buffer handed over as it is (not copied),
    so that it is hashed while it is written."""
    with pa.ipc.new_file(pa.PythonFile(out, mode="w"), table.schema) as writer:
        writer.write_table(table)


REMEDY = "re-materialise the asset that wrote it"


def read_table(path: Path, expected_sha256: str | None) -> pa.Table:
    """Memory-map an Arrow IPC file, first checking its sha256 against the recorded one."""
    if expected_sha256 is not None:
        verify_sha256(path, expected_sha256, "stored file", REMEDY)
    elif not path.is_file():
        raise FileNotFoundError(f"stored file {path} is missing; {REMEDY}")
    return _open(path)


@contextmanager
def checked_meanwhile(path: Path, expected_sha256: str) -> Iterator[pa.Table]:
    """`read_table(path, expected_sha256)` for a block that only computes from the table: the
    file is hashed in a thread while the block runs. When the block ends, however it ends, the
    hash must be the recorded one, else CorruptFileError (read_table's) replaces what it gave
    or raised; so nothing computed from a damaged file leaves the block. The table is
    structurally validated first, so that damaged offsets fail here, not as stray reads."""
    if not path.is_file():
        raise FileNotFoundError(f"stored file {path} is missing; {REMEDY}")
    with ThreadPoolExecutor(1, thread_name_prefix="verify") as pool:
        checking = pool.submit(verify_sha256, path, expected_sha256, "stored file", REMEDY)
        try:
            table = _open(path)
            try:
                table.validate(full=True)
            except pa.ArrowInvalid as exc:
                raise CorruptFileError(f"{path} is not a valid Arrow table: {exc}") from exc
            yield table
        except BaseException:
            checking.result()  # a damaged file is the reason, whatever the block made of it
            raise
        checking.result()


def _open(path: Path) -> pa.Table:
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as exc:
        raise CorruptFileError(f"{path} is not a readable Arrow IPC file: {exc}") from exc


def flat_tokens(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32, offsets int64) of a task-set table, without copying the token buffer: row
    i's tokens are tokens[offsets[i]:offsets[i + 1]]."""
    column = single_chunk(table.column("token_ids"))
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)
    return values, offsets


def single_chunk(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array: its only chunk as it is (combine_chunks would copy it)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
