"""Reading one large set of rows over several connections at once, each reader one contiguous
range of keys, into arrays allocated once.

The keys are (task_set_id, record_no), the order the rows are read in. The key space is cut
into about equal ranges, each with the rows it should hold (from each task set's count and
extent: exact where a set's record numbers have no gaps). The arrays are allocated once for
all of them, and every reader, on a thread and a connection of its own, writes its rows
straight into its own slice, so they come out in key order with nothing copied twice. Where a
range holds other than the rows it was given (gaps in the record numbers, rows written or
deleted since they were counted), its rows are put together with one more copy at the end.

The readers are threads: the database's own work (the PostgreSQL server's scan, in a process of
its own) runs outside Python's GIL, and the readers (index/vectors.py) keep what must hold it
small per row.

Anything that stops a reader (a bad row, a connection refused, a lock it would wait for) gives
the read up: `read_ranges` returns None and the caller reads serially,
which also raises the error that a bad row deserves.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol

import numpy as np

from fabric_pipelines.lib.index.copy_rows import RowLayoutError

log = logging.getLogger(__name__)

MAX_READERS = 8
# Below this many rows, connections and threads cost more than they save.
PARALLEL_MIN_ROWS = 50_000
# How often the caller's connection is used while the readers work, so that a server which
# ends sessions idle in a transaction (store/db.py) does not end the caller's.
KEEPALIVE_S = 10.0

Key = tuple[int, int]  # (task_set_id, record_no)
Extent = tuple[int, int, int, int]  # task_set_id, rows, first record_no, last record_no


def reader_count(rows: int) -> int:
    """How many readers `rows` rows are read with: one per two cores (a reader keeps two busy,
    its own and its server process's; on two cores, two readers were no faster than one) up to
    MAX_READERS, and one (the caller's serial read) for small sets."""
    if rows < PARALLEL_MIN_ROWS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_READERS, (cores or 1) // 2))


@dataclass(frozen=True)
class KeyRange:
    """Keys from `lo` (included) to `hi` (excluded), None: open at that end (so rows written
    after the ranges were cut are read too); `rows`: how many rows it should hold."""

    lo: Key | None
    hi: Key | None
    rows: int = 0

    def condition(self, placeholder: str) -> tuple[str, tuple[int, ...]]:
        """SQL that holds for the keys of the range (AND-ed to a WHERE clause; an index on
        (model_id, task_set_id, record_no) serves it), and its parameters."""
        pair = f"({placeholder}, {placeholder})"
        sql, params = "", []
        if self.lo is not None:
            sql, params = f" AND (task_set_id, record_no) >= {pair}", [*self.lo]
        if self.hi is not None:
            sql, params = f"{sql} AND (task_set_id, record_no) < {pair}", [*params, *self.hi]
        return sql, tuple(params)


def key_ranges(extents: Sequence[Extent], parts: int) -> list[KeyRange]:
    """About `parts` ranges of about equal rows over the task sets' `extents`, ascending by
    task set. Within a set the rows are taken to be spread evenly over its record numbers: an
    uneven spread makes some ranges hold more than they were given, never a row read twice or
    missed."""
    total = sum(rows for _, rows, _, _ in extents)
    cuts: list[tuple[Key, int]] = []  # a range's first key, and the rows before it
    before = 0  # rows in the task sets before this one
    for task_set, rows, first, last in extents:
        span = last - first + 1  # record numbers; as many as rows where there are no gaps
        for part in range(1, parts):
            into = part * total // parts - before  # rows into this task set the cut falls
            if 0 <= into < rows:
                record = first + into * span // rows
                cut = ((task_set, record), before + (record - first) * rows // span)
                if not cuts or cut[0] > cuts[-1][0]:
                    cuts.append(cut)
        before += rows
    bounds = [(None, 0), *cuts, (None, total)]
    return [KeyRange(lo, hi, end - start) for (lo, start), (hi, end) in pairwise(bounds)]


Arrays = tuple[np.ndarray, np.ndarray]  # ids int64 [n], vectors float32 [n, dim]


class Slices:
    """The arrays for every range's rows, allocated when the first rows read tell their
    dimension, and each range's slice of them."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.ends = np.cumsum(sizes, dtype=np.int64)
        self.starts = self.ends - np.asarray(sizes, np.int64)
        self.whole: Arrays | None = None
        self.lock = threading.Lock()

    def of(self, index: int, dim: int) -> Arrays:
        """Range `index`'s slice, for vectors of `dim` values."""
        with self.lock:
            if self.whole is None:
                total = int(self.ends[-1])
                self.whole = np.empty(total, np.int64), np.empty((total, dim), np.float32)
        ids, vectors = self.whole
        if vectors.shape[1] != dim:
            raise RowLayoutError(f"ranges of {vectors.shape[1]} and of {dim} dimensions")
        start, end = self.starts[index], self.ends[index]
        return ids[start:end], vectors[start:end]


class RangeReader(Protocol):
    """One reader of one key range, run on a thread of its own."""

    range: KeyRange

    def read(self, slot: Callable[[int], Arrays], stop: threading.Event) -> tuple[Arrays, bool]:
        """The range's rows in key order, and whether they are exactly the slice `slot(dim)`
        gave (else they are arrays of their own). Raises RowLayoutError at a row that does not
        fit the others, ReadStopped once `stop` is set."""
        ...


class ReadStopped(Exception):
    """Another reader failed: this one stopped early."""


def read_ranges(
    readers: Sequence[RangeReader],
    keepalive: Callable[[], Any],
) -> Arrays | None:
    """(ids, vectors) of all `readers`' ranges in order, each reader on a thread of its own;
    None where the read was given up (see the module's note); the readers see one committed
    state by themselves (a shared snapshot). `keepalive` is called every
    KEEPALIVE_S while they read."""
    slices = Slices([reader.range.rows for reader in readers])
    stop = threading.Event()

    def run(index: int, reader: RangeReader) -> tuple[Arrays, bool]:
        try:
            return reader.read(lambda dim: slices.of(index, dim), stop)
        except BaseException:
            stop.set()  # the others stop at their next batch
            raise

    with ThreadPoolExecutor(len(readers), thread_name_prefix="vector-reader") as pool:
        futures = [pool.submit(run, i, reader) for i, reader in enumerate(readers)]
        _wait_for(futures, keepalive, stop)
    failed = [f.exception() for f in futures if f.exception() is not None]
    causes = [e for e in failed if not isinstance(e, ReadStopped)]
    if causes:
        # A bad row is the serial read's to report; anything else (a connection refused) would
        # make every read serial, which should not go unnoticed.
        level = logging.INFO if isinstance(causes[0], RowLayoutError) else logging.WARNING
        log.log(level, "reading vectors in parallel gave up (%r): reading serially", causes[0])
    if failed:
        return None
    read = [f.result() for f in futures]
    if slices.whole is not None and all(in_place for _, in_place in read):
        return slices.whole
    # Some range held other rows than it was given: its rows are arrays of their own.
    pieces = [arrays for arrays, _ in read if len(arrays[0])]
    if not pieces:
        return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
    return np.concatenate([i for i, _ in pieces]), np.concatenate([v for _, v in pieces])


def _wait_for(
    futures: list[Future[Any]], keepalive: Callable[[], Any], stop: threading.Event
) -> None:
    """Until every reader is done."""
    pending = set(futures)
    while pending:
        _, pending = wait(pending, timeout=KEEPALIVE_S, return_when=FIRST_EXCEPTION)
        if pending and not stop.is_set():
            try:
                keepalive()
            except BaseException:
                stop.set()  # the readers stop at their next batch; then this is raised
                raise
