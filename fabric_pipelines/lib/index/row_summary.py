"""What the index step computes over every row before its receipt, computed as the rows arrive
instead (index/prebuild.py drives it): the bad-row counts (vectors.count_bad_rows), the sha256 of
all the vectors and of each shard's (receipt.array_sha256, rows in id order).

Each digest advances over its rows in id order as far as every one of them has arrived (a packed
plan delivers them nearly in that order), so that after the last ack only the last rows are
hashed, not the 3 GB of a million 768-d rows twice over (the whole, then shard by shard). The
index step uses the results only for the very array they were computed over (`describes`: the
same memory, shape, strides and dtype, float32 rows as stored: the tail hands that array over
when every row arrived, and holds it until then); for anything else (an output variant's
decoded values, a copy, a read of the table) it computes them itself, as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fabric_pipelines.lib.index.receipt import BLOCK_BYTES, update_digest
from fabric_pipelines.lib.index.vectors import VectorCounts, count_bad_rows

SCAN_ROWS = 65_536  # items looked at per step when finding how far a run of done items reaches


@dataclass(frozen=True)
class Summary:
    """Every row's counts and digests, and the array they describe."""

    counts: VectorCounts
    vectors_sha256: str
    shard_vectors_sha256: list[str]  # in shard order
    vectors: np.ndarray

    def describes(self, vectors: np.ndarray) -> bool:
        """Whether `vectors` is the array summarised (the same memory, as the same rows)."""
        mine = self.vectors
        return vectors is mine or (
            vectors.__array_interface__["data"][0] == mine.__array_interface__["data"][0]
            and (vectors.shape, vectors.strides, vectors.dtype)
            == (mine.shape, mine.strides, mine.dtype)
        )


class RowSummary:
    """Counts and digests of `vectors` (every expected row's place, in id order) advanced as
    rows arrive; `shard_rows`: each shard's positions, ascending."""

    def __init__(self, vectors: np.ndarray, shard_rows: list[np.ndarray]) -> None:
        self._vectors = vectors  # held, so its memory is never another array's meanwhile
        self.counts = VectorCounts(0, 0, 0, 0)
        self._counted = 0
        self._whole = hashlib.sha256()
        self._whole_through = 0
        self._shard_rows = shard_rows
        self._shards = [hashlib.sha256() for _ in shard_rows]
        self._shard_through = [0] * len(shard_rows)

    @staticmethod
    def can_summarise(vectors: np.ndarray) -> bool:
        """Rows as the index step hashes them: float32, C order (an output variant's stored
        codes are not: the step decodes them)."""
        return vectors.ndim == 2 and vectors.dtype == np.float32 and vectors.flags.c_contiguous

    def count(self, rows: np.ndarray) -> None:
        """Count rows that arrived (each row once: the caller prepares each once)."""
        self.counts += count_bad_rows(rows)
        self._counted += len(rows)

    def advance(self, arrived: np.ndarray) -> None:
        """Hash every digest's rows onwards as far as all of them have arrived."""
        end = _arrived_through(arrived, None, self._whole_through)
        step = max(1, BLOCK_BYTES // max(1, self._vectors[:1].nbytes))
        for start in range(self._whole_through, end, step):
            update_digest(self._whole, self._vectors[start : min(end, start + step)])
        self._whole_through = end
        for shard, rows in enumerate(self._shard_rows):
            start = self._shard_through[shard]
            end = _arrived_through(arrived, rows, start)
            for at in range(start, end, step):
                update_digest(self._shards[shard], self._vectors[rows[at : min(end, at + step)]])
            self._shard_through[shard] = end

    def unhashed(self) -> int:
        """Rows the whole digest has still to take (the shards' are about as many)."""
        return len(self._vectors) - self._whole_through

    def finish(self) -> Summary | None:
        """The summary once every row is counted and hashed; None before."""
        rows = len(self._vectors)
        if self._counted != rows or self._whole_through != rows:
            return None
        if self._shard_through != [len(r) for r in self._shard_rows]:
            return None
        return Summary(
            self.counts,
            self._whole.hexdigest(),
            [d.hexdigest() for d in self._shards],
            self._vectors,
        )


def done_through(done: Callable[[int, int], np.ndarray], total: int, start: int) -> int:
    """The end of the run from `start` (of `total` items) that is all done, asking `done(a, b)`
    for items [a, b) a chunk at a time: a look finds the run grown a little, not the rest."""
    end = start
    while end < total:
        chunk = done(end, min(total, end + SCAN_ROWS))
        if not chunk.all():
            return end + int(np.argmin(chunk))
        end += len(chunk)
    return end


def _arrived_through(arrived: np.ndarray, rows: np.ndarray | None, start: int) -> int:
    """How far from `start` every one of `rows` (positions; None: every row) has arrived."""
    if rows is None:
        return done_through(lambda a, b: arrived[a:b], len(arrived), start)
    return done_through(lambda a, b: arrived[rows[a:b]], len(rows), start)
