"""Stored files: atomic writes, and corruption caught by the recorded sha256."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from fabric_pipelines.lib.core.files import CorruptFileError, write_file
from fabric_pipelines.lib.tasks.arrow_files import (
    flat_tokens,
    read_table,
    to_table,
    write_table,
)
from fabric_pipelines.lib.tasks.ingest import TokenisedTasks


def _tasks() -> TokenisedTasks:
    lengths = np.array([3, 1, 4, 1, 5], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenisedTasks(
        n_records=6,
        record_no=np.array([0, 1, 2, 4, 5]),
        task_ids=["a", "b", "c", "d", "e"],
        tokens=np.arange(int(lengths.sum()), dtype=np.int32),
        offsets=offsets,
    )


def test_round_trip_keeps_tokens_and_offsets(tmp_path: Path) -> None:
    tasks = _tasks()
    path = tmp_path / "set.arrow"
    sha = write_table(path, to_table(tasks), {"fabric.task_set": "set"})
    table = read_table(path, sha)
    tokens, offsets = flat_tokens(table)
    assert np.array_equal(offsets, tasks.offsets)
    assert np.array_equal(tokens, tasks.tokens)
    assert table.column("id").to_pylist() == tasks.task_ids
    assert table.schema.metadata[b"fabric.task_set"] == b"set"


def test_a_write_that_dies_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "set.arrow"
    old_sha = write_table(path, to_table(_tasks()))

    def dies_half_way(tmp: Path) -> None:
        tmp.write_bytes(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file(path, dies_half_way)
    assert read_table(path, old_sha).num_rows == 5
    assert [p.name for p in tmp_path.iterdir()] == ["set.arrow"]


@pytest.mark.parametrize("damage", ["truncate", "append", "flip"])
def test_damaged_files_are_detected_by_checksum(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "set.arrow"
    sha = write_table(path, to_table(_tasks()))
    data = bytearray(path.read_bytes())
    rng = random.Random(damage)
    for _ in range(5):
        damaged = bytearray(data)
        if damage == "truncate":
            damaged = damaged[: rng.randrange(len(data))]
        elif damage == "append":
            damaged += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            pos = rng.randrange(len(data))
            damaged[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptFileError, match=f"{path.name} is corrupt"):
            read_table(path, sha)


def test_a_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="re-materialise"):
        read_table(tmp_path / "gone.arrow", "0" * 64)


def test_sliced_tables_still_give_absolute_offsets(tmp_path: Path) -> None:
    table = to_table(_tasks()).slice(2, 2)
    tokens, offsets = flat_tokens(pa.concat_tables([table]))
    lengths = np.diff(offsets)
    assert list(lengths) == [4, 1]
    assert list(tokens[offsets[0] : offsets[1]]) == [4, 5, 6, 7]
