"""The rows' counts and digests made as they arrive (index/row_summary.py) are what the index step
computes over the whole array after: the same bad-row counts, the same sha256 of all the vectors
and of each shard's, whatever order and chunks the rows arrive in; nothing before every row is
in; and they describe only the array they were made over."""

from __future__ import annotations

import numpy as np
import pytest

from fabric_pipelines.lib.index.receipt import array_sha256
from fabric_pipelines.lib.index.row_summary import RowSummary
from fabric_pipelines.lib.index.shards import shard_of
from fabric_pipelines.lib.index.vectors import count_bad_rows

pytestmark = pytest.mark.timeout(60)


def _rows(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors[rng.choice(n, 5, replace=False), 3] = np.nan
    vectors[rng.choice(n, 4, replace=False), 1] = np.inf
    vectors[rng.choice(n, 3, replace=False)] = 0.0
    ids = np.sort(rng.choice(10**9, n, replace=False)).astype(np.int64)
    return vectors, ids


@pytest.mark.parametrize("order", ["in_order", "nearly", "shuffled"])
def test_made_as_rows_arrive_equals_made_after(order: str) -> None:
    n, shards = 20_000, 8
    vectors, ids = _rows(n, 24, seed=len(order))
    owner = shard_of(ids, shards)
    shard_rows = [np.flatnonzero(owner == s) for s in range(shards)]
    rng = np.random.default_rng(5)
    if order == "in_order":
        arrival = np.arange(n)
    elif order == "nearly":  # batches finishing a little out of order, as workers ack them
        batches = np.array_split(np.arange(n), 97)
        arrival = np.concatenate([batches[i] for i in rng.permutation(len(batches))])
    else:
        arrival = rng.permutation(n)
    summary = RowSummary(vectors, shard_rows)
    arrived = np.zeros(n, dtype=bool)
    for chunk in np.array_split(arrival, 61):
        arrived[chunk] = True
        summary.count(vectors[chunk])
        summary.advance(arrived)
        if not arrived.all():
            assert summary.finish() is None
    done = summary.finish()
    assert done is not None
    assert done.counts == count_bad_rows(vectors)
    assert (done.counts.nan_rows, done.counts.inf_rows, done.counts.zero_norm_rows) == (5, 4, 3)
    assert done.vectors_sha256 == array_sha256(vectors)
    assert done.shard_vectors_sha256 == [array_sha256(vectors, rows) for rows in shard_rows]


def test_it_describes_only_the_array_it_summarised() -> None:
    vectors, _ = _rows(1000, 8, seed=1)
    summary = RowSummary(vectors, [np.arange(1000)])
    summary.count(vectors)
    summary.advance(np.ones(1000, dtype=bool))
    done = summary.finish()
    assert done is not None
    assert done.describes(vectors)
    assert done.describes(vectors[:])  # a view of the same rows
    assert not done.describes(vectors.copy())
    assert not done.describes(vectors[:999])  # fewer rows (a compacted array)
    assert not done.describes(vectors.view(np.int32))


def test_rows_counted_twice_or_not_at_all_give_no_summary() -> None:
    vectors, _ = _rows(500, 8, seed=2)
    summary = RowSummary(vectors, [np.arange(500)])
    summary.advance(np.ones(500, dtype=bool))
    assert summary.finish() is None, "hashed but never counted"
    summary.count(vectors)
    summary.count(vectors[:1])
    assert summary.finish() is None, "a row counted twice"


def test_only_float32_rows_in_c_order_are_summarised() -> None:
    vectors, _ = _rows(10, 4, seed=3)
    assert RowSummary.can_summarise(vectors)
    assert not RowSummary.can_summarise(vectors.astype(np.float16))  # an output variant's codes
    assert not RowSummary.can_summarise(np.asfortranarray(vectors))
