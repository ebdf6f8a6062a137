"""Build an index over a model's embeddings, measure it, and publish it with its receipt.

The rows are split into shards by a fixed hash (index/shards.py). One quantizer is trained for
all of them (IVF; Flat needs none) and stored; the served index takes each shard's rows in id
order, shard after shard, and a layout (index/layout.py) records where each shard's rows lie in
its lists: the lists are stored once. With the previous receipt at hand, only shards whose
database watermark moved are refilled; the rest are cut from the previous served index,
verified against its recorded sha256 (all are refilled where that or the layout is unusable).

The serving index searches with the nprobe it was asked for, or, where that misses the recall
target, the smallest doubling of it that meets it (index/recall.py); the receipt records both.

Order matters for "nothing half-published": files are written first (atomically, named by their
sha256), then the receipt file, then the receipt row. A failure before the row publishes nothing;
an index below its recall floor never gets the row.

Hashes of the source rows run in background threads from the start (hashlib lets other threads
run). The served index takes each shard's rows on a thread of its own, in shard order, while the
next shard is gathered and assigned. The served index is stored (index_file.py: an IVF-Flat
index's lists written on several threads while one hashes them, never read back) as soon as its
nprobe is chosen, while the rest of its quality is measured. Where the vector tail finished the
index while the extraction step closed (prebuild.Finished), the step takes it as it is.
`PublishedIndex.seconds` says where the time went, phase by phase.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch
from sqlalchemy import Engine

from fabric_gpu.engines.identity import BATCH_INVARIANCE
from fabric_pipelines.lib.broker.ledger import model_engines
from fabric_pipelines.lib.core.files import (
    CorruptFileError,
    write_bytes,
)
from fabric_pipelines.lib.core.futures import done
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.index import shards, vector_tail
from fabric_pipelines.lib.index.build import (
    TRAIN_RULES,
    IndexSpec,
    Rows,
    add_rows,
    append_lists,
    assign,
    is_ivf,
    is_ivf_flat,
    list_sizes,
    nlist,
    planned_builder,
    prepare_rows,
    recorded_builder,
    set_nprobe,
    sized_for,
    tolerance,
    train_rows,
)
from fabric_pipelines.lib.index.index_file import StoredWhenChosen, store_index
from fabric_pipelines.lib.index.layout import counts_of, cut_shards, read_layout, store_layout
from fabric_pipelines.lib.index.paths import model_index_folder
from fabric_pipelines.lib.index.prebuild import Finished, Prebuilt
from fabric_pipelines.lib.index.quality import measure, shortfall
from fabric_pipelines.lib.index.quantizers import read_verified, reusable
from fabric_pipelines.lib.index.receipt import (
    RECEIPT_SCHEMA,
    SHARD_RULE,
    Receipt,
    array_sha256,
    canonical_json,
    library_versions,
)
from fabric_pipelines.lib.index.row_summary import Summary
from fabric_pipelines.lib.index.staleness import staleness
from fabric_pipelines.lib.index.vectors import (
    VectorSet,
    check_vectors,
    load_vectors,
    refuse_bad_vectors,
)
from fabric_pipelines.lib.records.calibration import calibration_sha256
from fabric_pipelines.lib.records.vector_codec import StoredCodec
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import IndexReceipt

log = logging.getLogger(__name__)

WORKERS = 8  # threads for hashing, reading and writing files beside the build
SERVED_BEHIND = 2  # shards gathered and assigned at most ahead of the served index's appends


class EmptySourceError(ValueError):
    pass


@dataclass(frozen=True)
class PublishedIndex:
    receipt: dict[str, Any]  # as stored (canonical JSON's object); `record` reads it typed
    receipt_sha256: str
    index_path: Path
    receipt_path: Path
    rebuilt_shards: list[int] = field(default_factory=list)
    accepted: bool = True  # False: below the recall floor, so not recorded as current
    shortfall: str = ""  # when not accepted: what fell short and what to change
    # Wall seconds per phase: load, prepare, train, add, quality, write.
    seconds: dict[str, float] = field(default_factory=dict)
    # The vectors came from a tail that followed them during extraction, not from a read after.
    vectors_followed: bool = False
    # Nothing was built: no row moved since this receipt, which stays the served index.
    unchanged: bool = False
    # The quantizer was trained and the rows assigned during extraction (index/prebuild.py):
    # the seconds that took there, off the index step's clock. None: all done here.
    prebuilt_seconds: dict[str, float] | None = None
    # The quality phase's parts (quality.Quality.seconds).
    quality_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def record(self) -> Receipt:
        return Receipt.parse(self.receipt, f"receipt {self.receipt_sha256}")

    @property
    def recall_at_k(self) -> float:
        return self.record.recall_at_k


class PhaseClock:
    """Wall seconds per named phase of a build."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 3)


def stored_encoding(codec: StoredCodec) -> dict[str, Any]:
    """What a receipt records of the stored rows: nothing for float32, else the variant and the
    sha256 of the int8 calibration the rows were quantised over."""
    if codec.plain:
        return {}
    fields: dict[str, Any] = {"stored_variant": codec.variant.label}
    if codec.calibration is not None:
        fields["int8_calibration_sha256"] = calibration_sha256(codec.calibration)
    return fields


@unit_of_work("checking whether the index of {model_key} is unchanged")
def unchanged_index(
    db: Engine,
    *,
    model_key: str,
    spec: IndexSpec,
    min_recall: float,
    index_folder: Path,
    receipt_folder: Path,
    code_version: str | None = None,
) -> PublishedIndex | None:
    """The model's served index, where a build now would only make it again: no shard's rows
    moved since its receipt (the watermarks a partial rebuild trusts too), its index and receipt
    files are there, and it was built by this code to the same settings (metric, shards,
    factory, first nprobe, recall floor). None otherwise: then build. Where it was built (device,
    k-means) is not compared: `full_rebuild` asks for a build regardless."""
    with db.connect() as conn:
        current = staleness(conn, model_key, index_folder)
    if current is None or current.stale:
        return None
    receipt = current.receipt
    index = receipt["index"]
    params = index["params"]
    receipt_path = receipt_folder / f"{current.receipt_sha256}.json"
    same = (
        receipt.get("schema") == RECEIPT_SCHEMA
        and receipt_path.is_file()
        and index["metric"] == spec.metric
        and index["shards"] == spec.shards
        and spec.factory in ("auto", index["factory"])
        and params.get("nprobe_requested", params.get("nprobe")) == spec.nprobe
        and params.get("min_recall", min_recall) == min_recall  # a Flat index has no floor
        and (code_version is None or receipt.get("code", {}).get("vector_index") == code_version)
    )
    if not same:
        return None
    vector_tail.drop_tail(db, model_key)  # followed for a build that is not needed
    return PublishedIndex(
        receipt,
        current.receipt_sha256,
        model_index_folder(index_folder, model_key) / receipt["index_file"],
        receipt_path,
        unchanged=True,
    )


def build_and_publish(
    db: Engine,
    *,
    model_key: str,
    model: dict[str, Any],
    spec: IndexSpec,
    index_folder: Path,
    receipt_folder: Path,
    inputs: list[dict[str, Any]],
    previous: dict[str, Any] | None = None,
    min_recall: float = 0.0,
    code: dict[str, str] | None = None,
) -> PublishedIndex:
    """Build (or partly rebuild, given the previous receipt) and publish; `model` and `inputs`
    go into the receipt. An IVF index below `min_recall` at the spec's nprobe searches more
    lists until it meets it. If none does, the files and receipt file are kept for inspection
    but no receipt row is written (the index never becomes the model's current one) and
    `shortfall` says what to change."""
    if not 0.0 <= min_recall <= 1.0:
        raise ValueError(f"min_recall {min_recall}: a recall target lies within [0, 1]")
    clock = PhaseClock()
    with clock.phase("load"):
        encoding, versions, source, followed, prebuilt = _load_source(db, model_key, spec.shards)
        model = {**model, **encoding}
        # Counted and hashed as the rows arrived, where these are the rows summarised.
        summary = _summary_of(prebuilt, source)
        counts = (
            refuse_bad_vectors(summary.counts, spec.metric)
            if summary is not None
            else check_vectors(source.vectors, spec.metric)
        )
    spec = sized_for(spec, len(source.ids))
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="index") as pool:
        ids_sha256 = pool.submit(array_sha256, source.ids)
        vectors_sha256 = (
            done(summary.vectors_sha256)
            if summary is not None
            else pool.submit(array_sha256, source.vectors)
        )
        folder = model_index_folder(index_folder, model_key)
        with clock.phase("prepare"):
            reuse = reusable(previous, spec, model, folder, source.dim)
            # Made ready during extraction: used where it is what this build would make (the same
            # rows, and trained here or assigned with the quantizer this build reuses).
            wanted = str(reuse[1]["quantizer_sha256"]) if reuse is not None else None
            ready = (
                prebuilt
                if prebuilt is not None
                and prebuilt.serves(spec, source.ids)
                and prebuilt.reused_quantizer == wanted
                else None
            )
            if ready is not None:
                rows = ready.rows
            else:
                builder = (
                    recorded_builder(reuse[1])
                    if reuse
                    else planned_builder(spec, len(source.ids), source.dim)
                )
                rows = prepare_rows(source.vectors, source.ids, spec, builder)
        finished = _finished_ahead(ready, min_recall)
        built = _build(
            pool, clock, source, rows, versions, spec, folder, previous, reuse, ready, finished,
            summary,
        )  # fmt: skip
        # The served index is stored the moment its nprobe is chosen, on a thread of its own
        # (not queued behind the pool's hashes), while the rest of its quality is measured.
        # Where the tail finished this very index, it was measured and stored then (prebuild.py).
        ahead = finished if finished is not None and built.served is finished.served else None
        with StoredWhenChosen(built.folder, built.served) as stored:
            with clock.phase("quality"):
                if ahead is not None:
                    quality = ahead.quality
                else:
                    quality = measure(
                        built.served, rows, source.vectors, counts, spec, min_recall, stored
                    )
            on_gpu = rows.device.is_cuda
            del rows  # the device's copy of the rows is no longer needed: hand its memory back
            if on_gpu:
                torch.cuda.empty_cache()
            with clock.phase("write"):
                entries = [_resolved(e) for e in built.entries]
                layout = (
                    store_layout(built.folder, built.counts) if built.counts is not None else None
                )
                index_sha, index_path = ahead.stored if ahead is not None else stored.result()
                source_hashes = ids_sha256.result(), vectors_sha256.result()
    training = _with_source_hashes(built.training, *source_hashes)
    params: dict[str, Any] = {"nprobe": spec.nprobe}
    if is_ivf(built.served):
        params = {
            "nprobe": quality.choice.nprobe,
            "nprobe_requested": spec.nprobe,
            "nprobe_tried": {str(k): v for k, v in quality.choice.tried.items()},
            "min_recall": min_recall,
        }
    receipt: dict[str, Any] = {
        "schema": RECEIPT_SCHEMA,
        "source": {
            "table": "embeddings",
            "predicate": {"model_key": model_key},
            "rows": len(source.ids),
            "task_sets": list(source.task_sets),
            "watermark": {"n_shards": spec.shards, "versions": versions},
        },
        "ids_sha256": source_hashes[0],
        "vectors_sha256": source_hashes[1],
        "model": {**model, "model_key": model_key, "dim": source.dim},
        "index": {
            "factory": built.training["factory"],
            "metric": spec.metric,
            "params": params,
            "train_sample": spec.train_sample,
            "shards": spec.shards,
            "shard_rule": SHARD_RULE,
        },
        "training": training,
        "shards": entries,
        "libraries": library_versions(),
        "build_device": built.training["device"],
        "tolerance": tolerance(built.training["builder"]),
        "index_sha256": index_sha,
        "index_file": index_path.name,
        "index_bytes": index_path.stat().st_size,
        "quality": quality.measures,
        "inputs": inputs,
        "code": code or {},
    }
    if layout is not None:
        receipt["layout_sha256"], receipt["layout_file"] = layout
    with clock.phase("write"):
        # Read back as the rebuild will read it: a receipt it could not use is never written.
        typed = Receipt.parse(receipt, f"the receipt of {model_key}")
        sha = typed.sha256()
        receipt_path = receipt_folder / f"{sha}.json"
        write_bytes(receipt_path, typed.canonical_json())
        missed = shortfall(
            receipt["quality"], quality.choice, built.training["factory"], min_recall
        )
        if not missed:
            _record(db, sha, model_key, index_path, index_sha, receipt)
    return PublishedIndex(
        receipt,
        sha,
        index_path,
        receipt_path,
        built.rebuilt,
        accepted=not missed,
        shortfall=missed,
        seconds=dict(clock.seconds),
        vectors_followed=followed,
        prebuilt_seconds=_prebuilt_seconds(ready, ahead),
        quality_seconds=quality.seconds,
    )


@dataclass
class _Built:
    folder: Path
    served: faiss.Index
    training: dict[str, Any]
    entries: list[dict[str, Any]]
    rebuilt: list[int]
    counts: np.ndarray | None  # the layout: rows of each list per shard (IVF); None otherwise


def _build(
    pool: ThreadPoolExecutor,
    clock: PhaseClock,
    source: VectorSet,
    rows: Rows,
    versions: list[int],
    spec: IndexSpec,
    folder: Path,
    previous: dict[str, Any] | None,
    reuse: tuple[faiss.Index, dict[str, Any]] | None,
    ready: Prebuilt | None = None,
    finished: Finished | None = None,
    summary: Summary | None = None,
) -> _Built:
    """Train (or reuse the previous quantizer) and fill the served index shard after shard,
    keeping the shards whose rows did not move (cut from the previous served index)."""
    positions = shard_rows(source, spec.shards)
    (folder / "quantizers").mkdir(parents=True, exist_ok=True)
    old = {s["shard"]: s for s in previous["shards"]} if (previous and reuse is not None) else {}
    unmoved = [
        shard
        for shard, before in old.items()
        if shard < spec.shards and before["version"] == versions[shard]
    ]
    # Shards unchanged since the previous build are cut from its served index (read back,
    # verified) while the rest is gathered; if its files fail their check, they are rebuilt.
    kept_parts: Future[dict[int, faiss.Index]] | None = None
    if unmoved and previous is not None and reuse is not None:
        kept_parts = pool.submit(_kept_shards, previous, folder, unmoved, reuse[0], spec.nprobe)

    hashed = summary.shard_vectors_sha256 if summary is not None else []

    def hashes(shard: int) -> tuple[Future[str], Future[str]]:
        ids = pool.submit(array_sha256, source.ids, positions[shard])
        if len(hashed) == spec.shards:  # hashed as the rows arrived, shard by shard
            return ids, done(hashed[shard])
        return ids, pool.submit(array_sha256, source.vectors, positions[shard])

    # The rows of each shard to build are hashed beside the work, from now on.
    shard_hashes = {s: hashes(s) for s in range(spec.shards) if s not in unmoved}
    with clock.phase("train"):
        if reuse is not None:
            trained, training = reuse
        else:
            built = ready.built if ready is not None else train_rows(rows, spec)
            sha, path = store_index(folder / "quantizers", built.index)
            trained = built.index
            training = {
                "rule": TRAIN_RULES[spec.train_rule],
                "sample": len(built.train_rows),
                "seed": spec.seed,
                "max_sample": spec.train_sample,
                "factory": built.factory,
                "builder": built.builder,
                "iterations": built.iterations,
                "device": "gpu" if built.builder == "torch-cuda" else "cpu",
                "trained_on": {"rows": len(source.ids)},  # + the source hashes, once known
                "quantizer_sha256": sha,
                "quantizer_file": f"quantizers/{path.name}",
                "centroids_sha256": built.centroids_sha256,
            }
            if built.builder == "torch-cuda":
                training["gpu"] = torch.cuda.get_device_name()
    builder = recorded_builder(training)
    # The served index gets each shard's rows in shard order (each list holds shard 0's rows,
    # then shard 1's, ...): the layout records the runs, so a shard can be cut back out. Its
    # appends run on a thread of their own while the next shard is gathered and assigned here.
    served = faiss.clone_index(trained)
    ivf = is_ivf(trained)
    n_lists = nlist(trained)
    counts = np.zeros((spec.shards, n_lists), dtype=np.int64) if ivf else None
    entries: list[dict[str, Any]] = []
    rebuilt = []
    copies_only = is_ivf_flat(trained)  # adding assigned rows copies them: nothing is computed
    # Shards filled during extraction: the served index copies every shard's lists at the end,
    # kept ones and filled ones, in shard order (build.append_lists).
    filled = ready.parts if ready is not None else None
    kept = kept_parts.result() if kept_parts is not None else {}
    in_order: list[faiss.Index] = []
    with clock.phase("add"), ThreadPoolExecutor(1, thread_name_prefix="index-serve") as serving:
        appended: list[Future[None]] = []  # the served index's appends, in shard order
        for shard, rows_of_shard in enumerate(positions):
            if shard in kept:
                part = kept[shard]
                if counts is not None:
                    counts[shard] = list_sizes(part)
                if filled is not None:
                    in_order.append(part)
                else:
                    appended.append(serving.submit(served.merge_from, part, 0))
                entries.append(old[shard])
                continue
            if shard not in shard_hashes:  # an unmoved shard that could not be kept
                shard_hashes[shard] = hashes(shard)
            if filled is not None:
                # Filled during extraction: its lists are copied into the served index below,
                # with every other shard's.
                part = filled[shard]
                if counts is not None:
                    counts[shard] = list_sizes(part)
                in_order.append(part)
            else:
                if len(appended) >= SERVED_BEHIND:  # bounds the gathered rows held for appends
                    appended[-SERVED_BEHIND].result()
                x, ids = rows.on_host(rows_of_shard), source.ids[rows_of_shard]
                if ready is not None:  # assigned as they arrived, alike
                    lists: np.ndarray | None = ready.lists[rows_of_shard]
                else:
                    lists = assign(trained, rows, rows_of_shard, builder, spec.metric, gathered=x)
                if lists is not None and copies_only:
                    appended.append(serving.submit(add_rows, served, x, ids, lists))
                    if counts is not None:
                        counts[shard] = counts_of(lists, n_lists)
                else:  # FAISS encodes or assigns the rows as it adds them: one add at a time
                    _wait(appended)
                    before = list_sizes(served) if counts is not None else None
                    add_rows(served, x, ids, lists)
                    if counts is not None and before is not None:
                        counts[shard] = list_sizes(served) - before
            entries.append(
                {
                    "shard": shard,
                    "rows": len(rows_of_shard),
                    "version": versions[shard],
                    "ids_sha256": shard_hashes[shard][0],
                    "vectors_sha256": shard_hashes[shard][1],
                }
            )
            rebuilt.append(shard)
        _wait(appended)
        if finished is not None and not kept and filled is not None:
            # Every shard filled during extraction, none kept: the tail assembled (and measured)
            # this very index while the extraction step closed.
            return _Built(folder, finished.served, training, entries, rebuilt, counts)
        if in_order:  # every shard, in shard order
            append_lists(served, in_order)
        set_nprobe(served, spec.nprobe)
    return _Built(folder, served, training, entries, rebuilt, counts)


def _summary_of(prebuilt: Prebuilt | None, source: VectorSet) -> Summary | None:
    """The counts and digests made as the rows arrived, where they are of exactly these rows:
    the same array (row_summary.Summary.describes) under the same ids."""
    summary = prebuilt.summary if prebuilt is not None else None
    if summary is None or not summary.describes(source.vectors):
        return None
    assert prebuilt is not None
    return summary if np.array_equal(prebuilt.rows.ids, source.ids) else None


def _finished_ahead(ready: Prebuilt | None, min_recall: float) -> Finished | None:
    """The index the tail finished from `ready` (prebuild.Finished), where it was measured at
    this recall floor; None otherwise, or where finishing failed (then this step does it)."""
    if ready is None or ready.finished is None:
        return None
    try:
        finished = ready.finished.result()
    except Exception as exc:  # never fails the step: it assembles and measures itself
        log.warning("the index finished during extraction is not used: %s", exc)
        return None
    return finished if finished.min_recall == min_recall else None


def _prebuilt_seconds(ready: Prebuilt | None, ahead: Finished | None) -> dict[str, float] | None:
    """What extraction's prebuild spent, and where the tail finished the index, on what."""
    if ready is None:
        return None
    seconds = dict(ready.seconds)
    if ahead is not None:
        seconds.update({f"finish_{name}": round(v, 3) for name, v in ahead.seconds.items()})
        # The measuring's parts: what comes before the nprobe is chosen is after the last ack;
        # the health after it runs beside the store.
        seconds.update({f"finish_quality_{name}": v for name, v in ahead.quality.seconds.items()})
    return seconds


def _kept_shards(
    previous: dict[str, Any], folder: Path, wanted: list[int], trained: faiss.Index, nprobe: int
) -> dict[int, faiss.Index]:
    """The shards `wanted`, cut from the previous served index by its layout (both verified
    against the previous receipt); none where either file is missing or corrupt (then they are
    rebuilt from their rows)."""
    if not previous.get("layout_file") or not is_ivf(trained):
        return {}
    try:
        served = read_verified(folder / previous["index_file"], previous["index_sha256"])
        counts = read_layout(folder / previous["layout_file"], previous["layout_sha256"])
    except (FileNotFoundError, CorruptFileError):
        return {}
    return cut_shards(served, counts, wanted, trained, nprobe)


def _resolved(entry: dict[str, Any]) -> dict[str, Any]:
    """A shard's receipt entry, once its hashes are done."""
    return {k: v.result() if isinstance(v, Future) else v for k, v in entry.items()}


def _wait(futures: list[Future[None]]) -> None:
    for future in futures:
        future.result()


def _with_source_hashes(
    training: dict[str, Any], ids_sha256: str, vectors_sha256: str
) -> dict[str, Any]:
    """A new quantizer's training record names the rows it was trained on by their hashes."""
    trained_on = training["trained_on"]
    if "ids_sha256" in trained_on:  # reused: trained on earlier rows
        return training
    return {
        **training,
        "trained_on": {**trained_on, "ids_sha256": ids_sha256, "vectors_sha256": vectors_sha256},
    }


@unit_of_work("reading the vectors of {model_key}")
def _load_source(
    db: Engine, model_key: str, n_shards: int
) -> tuple[dict[str, Any], list[int], VectorSet, bool, Prebuilt | None]:
    """How the model's rows are stored, its shards' versions, its vectors, whether they were
    followed during extraction, and the index made ready as they arrived."""
    with db.begin() as conn:
        try:
            mid = model_id(conn, model_key, create=False)
        except LookupError as exc:
            raise EmptySourceError(
                f"no embeddings for model {model_key}: materialise extraction_outputs first"
            ) from exc
        shards.register(conn, mid, n_shards)
        # An output variant's rows are indexed as their values; the receipt says which.
        encoding = stored_encoding(StoredCodec.of_key(conn, model_key))
        # Every engine identity whose rows the index holds (reused rows are their sources').
        encoding["engines"] = model_engines(conn, mid)
        encoding["batch_invariance"] = BATCH_INVARIANCE  # the contract those rows were made under
    with db.connect() as conn:
        # Versions before rows: a change that lands after this read shows up as stale next time.
        versions = shards.versions(conn, mid, n_shards)
    # Followed during extraction where this process ran it (vector_tail), else read (also when
    # an earlier attempt of this unit claimed the tail). The hand-over opens its own
    # transaction: this step's must not sit idle while it runs (PostgreSQL ends a session idle
    # in a transaction for a minute).
    followed, prebuilt = vector_tail.claim_with_prebuilt(db, model_key)
    if followed is not None:
        source = followed
    else:
        with db.connect() as conn:
            source = load_vectors(conn, model_key)
    if len(source.ids) == 0:
        raise EmptySourceError(
            f"no embeddings for model {model_key}: materialise extraction_outputs first"
        )
    return encoding, versions, source, followed is not None, prebuilt


@unit_of_work("recording the receipt {sha} of {model_key}")
def _record(
    db: Engine, sha: str, model_key: str, index_path: Path, index_sha: str, receipt: dict[str, Any]
) -> None:
    with db.begin() as conn:
        conn.execute(
            insert_ignoring_duplicates(db, IndexReceipt),
            {
                "receipt_sha256": sha,
                "model_id": model_id(conn, model_key),
                "index_path": str(index_path),
                "index_sha256": index_sha,
                "n_vectors": receipt["source"]["rows"],
                "recall_at_k": receipt["quality"]["recall_at_k"],
                "receipt_json": canonical_json(receipt).decode("utf-8"),
            },
        )


def shard_rows(source: VectorSet, n_shards: int) -> list[np.ndarray]:
    """Positions in `source` of each shard's rows, in the source's id order."""
    owner = shards.shard_of(source.ids, n_shards)
    return [np.flatnonzero(owner == s) for s in range(n_shards)]


def split_shards(source: VectorSet, n_shards: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) of each shard, in the source's id order."""
    return [(source.ids[r], source.vectors[r]) for r in shard_rows(source, n_shards)]
