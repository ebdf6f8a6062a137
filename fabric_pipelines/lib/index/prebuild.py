"""The IVF index made ready while extraction runs: its quantizer trained and every row prepared
and assigned to its list as the row arrives, so that after the last acknowledgement the index
step only fills the lists, measures and writes.

A VectorTail (index/vector_tail.py) given the spec the index step will build with
(`vector_tail.follow_in_this_process(spec)`) hands each read to a Prebuild. The quantizer is
trained, here as in the index step (same rows, same code, same device), once every row its rule
picks has arrived: under the rule "first" (build.TRAIN_RULES) those are the rows of the smallest
ids, which a packed plan extracts first, so training happens early; under "sample" they are
spread over the set and training waits for the end. Each arriving row is prepared
(build.prepared: unit length under cosine) and, once there is a quantizer, assigned to its list
(build.assign computes in tiles of a fixed shape, so a row's list does not depend on the rows
assigned with it). An IVF-Flat index's shards are filled as well: each shard's rows go into its
own index in id order, as far as every row of the shard up to there is assigned (rows arrive
nearly in id order), so at the hand-over each shard takes only its last rows.

Once every row is in and every shard filled, the tail also finishes the index on a thread of
its own while the extraction step closes (its checks, the step change): the served index is
assembled from the shards, measured (quality.measure, at the index step's recall floor) and
stored. The index step takes that where no shard is kept from an earlier build and its recall
floor is the one measured at; otherwise it assembles and measures itself.

Where the index step will reuse the served index's quantizer (a set added to an indexed model),
rows are assigned with that one from the start and nothing is trained. The index step takes what
was made only where it is what it would make itself: the same spec, the same rows (every
expected row arrived: no failed task, no reused link) and the same quantizer. Otherwise it
builds as before. Either way the index and its receipt are the
same bytes (tests/test_index_prebuild.py).

The rows' bad-row counts and the sha256s the receipt records (all the vectors, each shard's) are
made as the rows arrive too (row_summary.py): after the last ack neither the tail's finish nor
the index step reads the 3 GB of a million 768-d rows again for them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from fabric_pipelines.lib.index.build import (
    BuiltIndex,
    IndexSpec,
    Rows,
    add_rows,
    append_lists,
    assign,
    choose_builder,
    compute_device,
    empty_index,
    is_ivf_flat,
    plain_ivf,
    prepared,
    recorded_builder,
    resolve_factory,
    set_nprobe,
    sized_for,
    train_rows,
    training_sample,
)
from fabric_pipelines.lib.index.index_file import StoredWhenChosen
from fabric_pipelines.lib.index.quality import Quality, measure
from fabric_pipelines.lib.index.row_summary import RowSummary, Summary, done_through
from fabric_pipelines.lib.index.shards import shard_of
from fabric_pipelines.lib.index.vectors import VectorCounts, check_vectors, refuse_bad_vectors

log = logging.getLogger(__name__)

CHUNK_ROWS = 65_536  # rows prepared and assigned per step: bounds the copies made for each
# The most GPU memory the prepared rows may take while the engine still runs beside them (1 M x
# 768 float32 rows: 2.9 GiB). A larger index is built after the extraction, as before.
DEVICE_ROWS_BYTES = 4 << 30
# The most of the rows the digests of row_summary.py may still have to hash at the hand-over.
LATE_HASHING = 0.125


@dataclass
class Finished:
    """The served index assembled from every filled shard, measured at `min_recall` (left at the
    nprobe chosen) and stored: what the index step would do after the last ack."""

    served: faiss.Index
    quality: Quality
    min_recall: float
    stored: tuple[str, Path]  # (sha256, path) of the served index's file
    seconds: dict[str, float]


@dataclass
class Prebuilt:
    """What extraction made ready for the index step: the trained (empty) index, and for every
    row in id order its prepared values (on the host, and where torch computes) and its list."""

    spec: IndexSpec  # as sized for these rows (build.sized_for)
    built: BuiltIndex
    rows: Rows
    lists: np.ndarray
    seconds: dict[str, float] = field(default_factory=dict)  # spent during extraction
    # Each shard's own index, filled with its rows in id order (IVF-Flat only; None otherwise).
    parts: list[faiss.Index] | None = None
    # The earlier build's quantizer it assigned with (its sha256), or None: trained here.
    reused_quantizer: str | None = None
    # The index finished while the extraction step closed (start_finishing), or None.
    finished: Future[Finished] | None = None
    # Every row's bad-row counts and sha256s, made as they arrived (row_summary.py), or None.
    summary: Summary | None = None

    def serves(self, spec: IndexSpec, ids: np.ndarray) -> bool:
        """Whether a build of `spec` over the rows `ids` would make exactly this."""
        return self.spec == sized_for(spec, len(ids)) and np.array_equal(self.rows.ids, ids)


class Prebuild:
    """Follows the arrivals of the rows `ids` (every id the model will hold, ascending) for an
    index of `spec`; `advance` after each read, `finish` at the hand-over. `reuse`: the served
    index's quantizer and training record where the index step will reuse it (a partial
    rebuild: quantizers.reusable_quantizer), so rows are assigned with it from the start."""

    def __init__(
        self,
        spec: IndexSpec,
        ids: np.ndarray,
        reuse: tuple[faiss.Index, dict[str, Any]] | None = None,
    ) -> None:
        self._reuse = reuse
        self.spec = sized_for(spec, len(ids))
        self.ids = ids
        self.why_not = ""  # set when it gave up: the index step builds as before
        # Seconds spent per part; "fill" only where the shards are filled ahead (IVF-Flat).
        self.seconds = {"prepare": 0.0, "train": 0.0, "assign": 0.0}
        self._sample = training_sample(len(ids), self.spec)
        self._rows: Rows | None = None
        self._built: BuiltIndex | None = None
        self._builder = ""
        self._lists = np.full(len(ids), -1, dtype=np.int64)
        self._prepared = np.zeros(len(ids), dtype=bool)
        # Each shard's rows (positions in id order), its index, and how many of them it holds.
        owner = shard_of(ids, self.spec.shards)
        self._shard_rows = [np.flatnonzero(owner == s) for s in range(self.spec.shards)]
        self._parts: list[faiss.Index] | None = None
        self._filled = [0] * self.spec.shards
        self._finishing: Future[Finished] | None = None
        # Counts and digests of the rows as stored, for the index step (row_summary.py).
        self._summary: RowSummary | None = None

    @property
    def complete(self) -> bool:
        """Every row prepared and assigned, and every shard filled (IVF-Flat)."""
        return (
            not self.why_not
            and self._built is not None
            and self._parts is not None
            and bool(self._prepared.all())
            and self._all_filled
        )

    @property
    def _all_filled(self) -> bool:
        return self._filled == [len(r) for r in self._shard_rows]

    def start_finishing(self, vectors: np.ndarray, folder: Path, min_recall: float) -> None:
        """Once complete, assemble, measure and store the served index on a thread of its own
        (Finished), at most once. `vectors`: every row, as stored, in id order; `folder`: the
        model's index folder."""
        if self._finishing is not None or not self.complete:
            return
        assert self._built is not None and self._parts is not None and self._rows is not None
        pool = ThreadPoolExecutor(1, thread_name_prefix="index-finish")
        counts = self._summary.counts if self._summary is not None else None  # every row's
        self._finishing = pool.submit(
            _finish, self._built.index, self._parts, self._rows, vectors, self.spec, folder,
            min_recall, counts,
        )  # fmt: skip
        pool.shutdown(wait=False)  # its one thread ends with the work

    def summarise(self, arrived: np.ndarray) -> None:
        """Advance the rows' digests (row_summary.py) as far as the arrivals allow; called after
        `start_finishing`, so the last rows' hashing runs beside the finish, not before it. Where
        every row is in but early ones came last, leaving most of the hashing to one thread here,
        the summary is dropped: the index step hashes on its pool instead, as before."""
        if self._summary is None or self.why_not:
            return
        if arrived.all() and self._summary.unhashed() > len(self.ids) * LATE_HASHING:
            self._summary = None
            return
        started = time.perf_counter()
        self._summary.advance(arrived)
        self.seconds["summary"] = self.seconds.get("summary", 0.0) + time.perf_counter() - started

    @property
    def trained(self) -> bool:
        return self._built is not None

    def advance(self, vectors: np.ndarray | None, arrived: np.ndarray) -> None:
        """Prepare the rows arrived since the last call, train once the sample is in, assign
        what is prepared. `vectors`: every expected row's place (float32, in id order)."""
        if self.why_not or vectors is None:
            return
        try:
            self._advance(vectors, arrived)
        except Exception as exc:  # never fails the extraction: the index step builds instead
            log.warning("index prebuild stopped: %s", exc)
            self.give_up(f"{type(exc).__name__}: {exc}")

    def finish(self, vectors: np.ndarray | None, arrived: np.ndarray) -> Prebuilt | None:
        """At the hand-over: the rest advanced, and what is ready when every row arrived."""
        self.advance(vectors, arrived)
        self.summarise(arrived)
        if not self.why_not and not arrived.all():
            self.give_up(f"{int((~arrived).sum())} expected rows did not arrive")
        if self.why_not or self._built is None or self._rows is None:
            self.give_up(self.why_not or "not trained")
            return None
        if self._parts is not None and not self._all_filled:
            self.give_up("a shard was not filled")
            return None
        reused = str(self._reuse[1]["quantizer_sha256"]) if self._reuse is not None else None
        summary = self._summary.finish() if self._summary is not None else None
        prebuilt = Prebuilt(
            self.spec, self._built, self._rows, self._lists, dict(self.seconds), self._parts,
            reused, self._finishing, summary,
        )  # fmt: skip
        self._rows = None
        self._parts = None
        self._summary = None
        return prebuilt

    def give_up(self, why: str) -> None:
        self.why_not = why
        on_gpu = self._rows is not None and self._rows.device.is_cuda
        self._rows = self._built = None
        self._parts = None
        self._summary = None
        if on_gpu:
            torch.cuda.empty_cache()

    def _advance(self, vectors: np.ndarray, arrived: np.ndarray) -> None:
        if self._rows is None:
            self._start(vectors)
        assert self._rows is not None
        new = np.flatnonzero(arrived & ~self._prepared)
        started = time.perf_counter()
        for at in range(0, len(new), CHUNK_ROWS):
            self._prepare(vectors, new[at : at + CHUNK_ROWS])
        self.seconds["prepare"] += time.perf_counter() - started
        if self._built is None and self._prepared[self._sample].all():
            started = time.perf_counter()
            self._built = train_rows(self._rows, self.spec, self._factory, n=len(self.ids))
            self.seconds["train"] += time.perf_counter() - started
        if self._built is not None:
            waiting = np.flatnonzero(self._prepared & (self._lists < 0))
            started = time.perf_counter()
            for at in range(0, len(waiting), CHUNK_ROWS):
                chunk = waiting[at : at + CHUNK_ROWS]
                lists = assign(
                    self._built.index, self._rows, chunk, self._builder, self.spec.metric,
                    gathered=self._rows.on_host(chunk),
                )  # fmt: skip
                assert lists is not None  # a plain IVF index (_start)
                self._lists[chunk] = lists
            self.seconds["assign"] += time.perf_counter() - started
            self._fill_shards()

    def _fill_shards(self) -> None:
        """Each shard's index takes its rows in id order, up to its first row not assigned yet.
        Only IVF-Flat: there adding an assigned row copies it, exactly as the index step would."""
        assert self._built is not None and self._rows is not None
        if not is_ivf_flat(self._built.index):
            return
        started = time.perf_counter()
        if self._parts is None:
            self._parts = [faiss.clone_index(self._built.index) for _ in self._shard_rows]
        for shard, rows in enumerate(self._shard_rows):
            start = self._filled[shard]
            end = self._assigned_through(rows, start)
            if end > start:
                take = rows[start:end]
                add_rows(
                    self._parts[shard], self._rows.on_host(take), self.ids[take],
                    self._lists[take],
                )  # fmt: skip
                self._filled[shard] = end
        self.seconds["fill"] = self.seconds.get("fill", 0.0) + time.perf_counter() - started

    def _assigned_through(self, rows: np.ndarray, start: int) -> int:
        """The end of the run of `rows` from `start` that is all assigned."""
        return done_through(lambda a, b: self._lists[rows[a:b]] >= 0, len(rows), start)

    def _start(self, vectors: np.ndarray) -> None:
        """With the first rows: the index's factory and builder, and room for the rows."""
        n, dim = len(self.ids), vectors.shape[1]
        if self._reuse is not None:  # assigned with the served index's quantizer, as rebuilt
            quantizer, training = self._reuse
            self._factory = str(training["factory"])
            self._builder = recorded_builder(training)
            self._built = BuiltIndex(
                quantizer, self._factory, np.arange(0), training.get("centroids_sha256"),
                self._builder, training.get("iterations"),
            )  # fmt: skip
            empty = quantizer
        else:
            self._factory = resolve_factory(self.spec, n)
            empty = empty_index(dim, self._factory, self.spec.metric)
            self._builder = choose_builder(self.spec, empty)
        if not plain_ivf(empty):
            raise ValueError(f"{self._factory} is no plain IVF index: nothing to assign ahead")
        # Under L2 the rows are used as stored: the arrivals' own array.
        host = vectors if self.spec.metric != "cosine" else np.empty((n, dim), np.float32)
        if compute_device(self.spec) == "cuda":
            if n * dim * 4 > DEVICE_ROWS_BYTES:
                raise ValueError(
                    f"{n:,} x {dim} rows would take {n * dim * 4 / 2**30:.1f} GiB of the GPU "
                    f"beside the engine (at most {DEVICE_ROWS_BYTES / 2**30:.0f} GiB)"
                )
            device = torch.empty((n, dim), dtype=torch.float32, device="cuda")
        else:
            device = torch.from_numpy(host)
        self._rows = Rows(self.ids, host, device)
        if RowSummary.can_summarise(vectors):
            self._summary = RowSummary(vectors, self._shard_rows)

    def _prepare(self, vectors: np.ndarray, positions: np.ndarray) -> None:
        assert self._rows is not None
        arrived = vectors[positions]
        if self._summary is not None:
            self._summary.count(arrived)
        x = prepared(arrived, self.spec.metric, self._builder)
        if self._rows.host is not vectors:
            self._rows.host[positions] = x
        if self._rows.device.is_cuda:
            index = torch.as_tensor(positions, device="cuda")
            self._rows.device.index_copy_(0, index, torch.from_numpy(x).to("cuda"))
        self._prepared[positions] = True


def _finish(
    trained: faiss.Index,
    parts: list[faiss.Index],
    rows: Rows,
    vectors: np.ndarray,
    spec: IndexSpec,
    folder: Path,
    min_recall: float,
    counts: VectorCounts | None = None,
) -> Finished:
    """What the index step does after the last ack with shards filled during extraction and none
    kept: the served index copies every shard's lists in shard order, is measured, and is
    stored the moment its nprobe is chosen (publish.build_and_publish, the same calls)."""
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    served = faiss.clone_index(trained)
    append_lists(served, parts)
    set_nprobe(served, spec.nprobe)
    seconds["add"] = time.perf_counter() - started
    # Counted as the rows arrived where they could be (row_summary.py): not another pass now.
    counts = (
        refuse_bad_vectors(counts, spec.metric)
        if counts is not None
        else check_vectors(vectors, spec.metric)
    )
    with StoredWhenChosen(folder, served) as stored:
        started = time.perf_counter()
        quality = measure(served, rows, vectors, counts, spec, min_recall, stored)
        seconds["quality"] = time.perf_counter() - started
        started = time.perf_counter()
        file = stored.result()
        seconds["write"] = time.perf_counter() - started
    return Finished(served, quality, min_recall, file, seconds)
