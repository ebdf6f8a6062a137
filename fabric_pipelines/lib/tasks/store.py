"""Task sets and plans on disk: Arrow IPC files, written through lib/files.py, checked on read.

The file's sha256 is kept by the caller (the database) and checked on every open.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from fabric_pipelines.lib.files import CorruptFileError, verify_sha256, write_file
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

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    return write_file(path, write).sha256


def read_table(path: Path, expected_sha256: str | None) -> pa.Table:
    """Memory-map an Arrow IPC file, first checking its sha256 against the recorded one."""
    remedy = "re-materialise the asset that wrote it"
    if expected_sha256 is not None:
        verify_sha256(path, expected_sha256, "stored file", remedy)
    elif not path.is_file():
        raise FileNotFoundError(f"stored file {path} is missing; {remedy}")
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as exc:
        raise CorruptFileError(f"{path} is not a readable Arrow IPC file: {exc}") from exc


def flat_tokens(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32, offsets int64) of a task-set table, without copying the token buffer."""
    column = table.column("token_ids").combine_chunks()
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)
    return values, offsets
