"""Hidden states too large for rows: one content-addressed Arrow file per batch.

A shard holds one row per item: its task id and, per hook layer, the hidden states of its real
tokens (float16, `[tokens, hidden]`). The file is named by its sha256 and verified on every read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from fabric_pipelines.lib.core.files import StoredFile, verify_sha256, write_content_addressed

# A stored shard: its path, sha256 and size, as the file helper reports them.
ShardFile = StoredFile


def _column(name: str) -> str:
    return f"layer_{name}"


def write_shard(
    folder: Path,
    task_ids: Sequence[str] | pa.Array,
    lengths: np.ndarray,
    hooks: dict[int, np.ndarray],
    hidden_size: int,
) -> ShardFile:
    offsets = np.zeros(len(task_ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    arrays: list[pa.Array] = [pa.array(task_ids, type=pa.string())]
    names = ["task_id"]
    for layer, states in hooks.items():
        flat = pa.array(np.ascontiguousarray(states, dtype=np.float16).reshape(-1))
        tokens = pa.FixedSizeListArray.from_arrays(flat, hidden_size)
        arrays.append(pa.ListArray.from_arrays(pa.array(offsets), tokens))
        names.append(_column(str(layer)))
    table = pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(
        {"fabric.layers": json.dumps(list(hooks)), "fabric.hidden_size": str(hidden_size)}
    )

    def write(tmp: Path) -> None:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    # Named by its own hash; the writer threads of one worker call this at once (lib/core/files.py).
    stored = write_content_addressed(folder, ".arrow", write, fan_out=True)
    return stored


def read_shard(path: Path, expected_sha256: str) -> dict[str, list[np.ndarray] | list[str]]:
    """{'task_id': [...], 'layer_<k>': [array[tokens, hidden] per item]}; checks the hash first."""
    verify_sha256(
        path, expected_sha256, "hidden-state shard", "re-extract its batch to write it again"
    )
    with pa.memory_map(str(path), "r") as source:
        table = pa.ipc.open_file(source).read_all()
    hidden = int(table.schema.metadata[b"fabric.hidden_size"])
    out: dict[str, list[np.ndarray] | list[str]] = {"task_id": table.column("task_id").to_pylist()}
    for name in table.column_names[1:]:
        column = table.column(name).combine_chunks()
        flat = column.values.values.to_numpy(zero_copy_only=False).reshape(-1, hidden)
        offsets = column.offsets.to_numpy()
        out[name] = [flat[offsets[i] : offsets[i + 1]] for i in range(len(column))]
    return out


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
