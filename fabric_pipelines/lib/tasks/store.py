"""Task sets on disk: Arrow IPC files (token lists + ids), written atomically, checked on read.

A crash while writing leaves the old file or the new one, never half of one: the bytes go to a
temporary name in the same folder, are fsynced, renamed over the target, and the folder is fsynced.
The file's sha256 is kept by the caller (the database) and checked on every open.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from fabric_pipelines.lib.tasks.ingest import TokenisedTasks

SCHEMA = pa.schema(
    [
        pa.field("record_no", pa.int64(), nullable=False),
        pa.field("id", pa.string(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    ]
)


class CorruptFileError(IOError):
    """A stored file whose bytes no longer hash to what was recorded."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], object]) -> str:
    """Run `write(tmp_path)`, fsync, rename onto `path`, fsync the folder; return the sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        sha = sha256_file(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return sha


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

    return atomic_write(path, write)


def verify_sha256(path: Path, expected: str, what: str, remedy: str) -> None:
    """Refuse a missing file, or one whose sha256 is not the one recorded when it was written."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is missing; {remedy}")
    actual = sha256_file(path)
    if actual != expected:
        raise CorruptFileError(
            f"{what} {path} is corrupt: sha256 {actual} but {expected} was recorded when it "
            f"was written; {remedy}"
        )


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
