"""Planning reads the task set while its hash is checked: what it plans is that of the set as
stored, and from a damaged file nothing is planned, written or recorded. Prefix keys, computed
a block of items at a time, are the keys of their definition."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from fabric_gpu import batching as planner
from fabric_gpu.batching import plan_batches, prefix_keys
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.plans import load_plan_order, plan_task_set
from fabric_pipelines.lib.core.files import CorruptFileError
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.models import Batch, BatchPlanRow
from fabric_pipelines.lib.tasks.arrow_files import (
    checked_meanwhile,
    flat_tokens,
    read_table,
    to_table,
    write_table,
)
from fabric_pipelines.lib.tasks.catalog import get_task_set, ingest_task_set, task_lengths
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.tasks.ingest import TokenisedTasks


def _defined_keys(
    tokens: np.ndarray, offsets: np.ndarray, rows: np.ndarray | None, prefix: int
) -> np.ndarray:
    """The keys as first written: all items' first `prefix` tokens as one [items, prefix] array."""
    rows = np.arange(offsets.size - 1) if rows is None else rows
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    positions = np.arange(prefix)[None, :]
    inside = positions < lengths[:, None]
    index = np.minimum(starts[:, None] + positions, max(tokens.size - 1, 0))
    values = np.where(inside, tokens[index].astype(np.int64) + 1, 0).astype(np.uint64)
    key = np.zeros(rows.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(prefix):
            key = key * np.uint64(0x100000001B3) + values[:, j]
    return key


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(
        st.lists(st.integers(-3, 2**31 - 1), min_size=1, max_size=24), min_size=1, max_size=60
    ),
    prefix=st.integers(1, 20),
    block=st.sampled_from([1, 3, 7, 1 << 14]),
    subset=st.none() | st.lists(st.integers(0, 59), max_size=60, unique=True),
)
def test_prefix_keys_are_those_of_their_definition(
    items: list[list[int]], prefix: int, block: int, subset: list[int] | None
) -> None:
    lengths = np.array([len(t) for t in items], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate([np.array(t, dtype=np.int32) for t in items])
    rows = None if subset is None else np.array([r for r in subset if r < len(items)], np.int64)
    previous = planner.PREFIX_BLOCK
    planner.PREFIX_BLOCK = block
    try:
        keys = prefix_keys(tokens, offsets, rows, prefix=prefix)
    finally:
        planner.PREFIX_BLOCK = previous
    expected = _defined_keys(tokens, offsets, rows, prefix)
    assert keys.dtype == np.uint64 and np.array_equal(keys, expected)


def _tasks(n: int = 50) -> TokenisedTasks:
    lengths = np.arange(n) % 7 + 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenisedTasks(
        n_records=n,
        record_no=np.arange(n),
        task_ids=[f"t{i}" for i in range(n)],
        tokens=np.arange(int(offsets[-1]), dtype=np.int32) + 1000,
        offsets=offsets,
    )


def test_a_sound_file_is_read_as_read_table_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "set.arrow"
    sha = write_table(path, to_table(_tasks()), {"fabric.task_set": "s"})
    with checked_meanwhile(path, sha) as table:
        assert table.equals(read_table(path, sha))
        _, offsets = flat_tokens(table)
        assert np.array_equal(np.diff(offsets), task_lengths(table))
    with pytest.raises(ValueError, match="the block's own"), checked_meanwhile(path, sha):
        raise ValueError("the block's own error")


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_a_damaged_file_is_refused_whatever_the_block_made_of_it(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "set.arrow"
    sha = write_table(path, to_table(_tasks()))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40  # a token: the file still reads
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    expected = (
        (FileNotFoundError, "missing; re-materialise")
        if damage == "missing"
        else (CorruptFileError, "is corrupt: sha256")
    )
    with pytest.raises(expected[0], match=expected[1]), checked_meanwhile(path, sha) as table:
        flat_tokens(table)
    with pytest.raises(expected[0], match=expected[1]), checked_meanwhile(path, sha):
        raise ValueError("what the block made of the damage")


def test_nothing_is_planned_from_a_damaged_task_set(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    source = tmp_path / "s.parquet"
    lists = [[101, *range(1000, 1000 + i % 20), 102] for i in range(300)]
    pq.write_table(pa.table({"id": [f"t{i}" for i in range(300)], "token_ids": lists}), source)
    submit(source, paths.inbox, "s")
    max_seq_len = manifest.profile.max_seq_len
    ingest_task_set(db, paths, "s", model_id=manifest.model_id, max_seq_len=max_seq_len)
    stored = get_task_set(db, "s")
    path = Path(stored.path)
    good = path.read_bytes()

    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptFileError, match="is corrupt"):
        plan_task_set(db, paths, "s", manifest)
    with Session(db) as session:
        assert session.scalar(select(func.count()).select_from(BatchPlanRow)) == 0
        assert session.scalar(select(func.count()).select_from(Batch)) == 0
    assert not (paths.plans / "s").exists() or list((paths.plans / "s").iterdir()) == []
    assert get_task_set(db, "s").current_plan_id is None

    path.write_bytes(good)
    # Reuse off: the plan holds every task (the lists repeat every 20; reuse would link those).
    summary = plan_task_set(db, paths, "s", manifest, reuse=False)
    table = read_table(path, stored.content_sha256)
    tokens, offsets = flat_tokens(table)
    expected = plan_batches(
        task_lengths(table),
        manifest.profile.with_layout("padded"),
        np.arange(table.num_rows),
        keys=_defined_keys(tokens, offsets, None, planner.PREFIX_TOKENS),
    )
    assert np.array_equal(load_plan_order(summary.path, summary.sha256), expected.order)
    assert np.array_equal(summary.plan.item_count, expected.item_count)
    assert get_task_set(db, "s").current_plan_id == summary.plan_id
