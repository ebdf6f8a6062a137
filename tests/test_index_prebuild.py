"""The index made ready during extraction (lib/index/prebuild.py): the quantizer trained and the
rows assigned as they arrive give the same index, bit for bit, as the build after the
extraction, and where it cannot (a task that failed, a rule that needs every row) the index
step builds as before."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sqlalchemy import Engine, delete, insert

from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import vector_tail
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    assign,
    fill_assigned,
    prepare_rows,
    serialize,
    set_nprobe,
    train,
)
from fabric_pipelines.lib.index.prebuild import Prebuild
from fabric_pipelines.lib.index.publish import PublishedIndex, build_and_publish
from fabric_pipelines.lib.index.shards import shard_of
from fabric_pipelines.lib.index.vectors import ID_STRIDE
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import ReusedResult, Task
from fabric_pipelines.lib.store.watermarks import count_inserted
from fabric_pipelines.lib.worker.loop import run_worker
from tests.gpu_marks import TORCH_GPU
from tests.test_vector_tail import (
    SQLITE_ONLY,
    _caught_up,
    _drop_tails,
    _planned,
    _task_set,
    _write,
)

# Small enough to run in seconds, big enough that "first" picks a part of the rows and that
# rows cross many assignment tiles.
SPEC = IndexSpec(factory="IVF16,Flat", train_sample=500, shards=3, nprobe=4, device="cpu")


@pytest.fixture(autouse=True)
def quick_tails(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(vector_tail, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(vector_tail, "_in_this_process", True)
    monkeypatch.setattr(vector_tail, "_min_recall", 0.0)  # _publish's floor: finished ahead
    _drop_tails()
    yield
    _drop_tails()


def _settings(spec: IndexSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def _publish(db: Engine, root: Path, spec: IndexSpec, model: str = "m") -> PublishedIndex:
    (root / "indexes").mkdir(parents=True, exist_ok=True)
    (root / "receipts").mkdir(parents=True, exist_ok=True)
    return build_and_publish(
        db, model_key=model, model={"model_id": "test"}, spec=spec,
        index_folder=root / "indexes", receipt_folder=root / "receipts", inputs=[],
    )  # fmt: skip


def _same_index(during: PublishedIndex, after: PublishedIndex) -> None:
    assert during.receipt["index_sha256"] == after.receipt["index_sha256"]
    assert during.receipt["training"] == after.receipt["training"]
    assert during.receipt["shards"] == after.receipt["shards"]
    assert during.receipt_sha256 == after.receipt_sha256  # the whole receipt, byte for byte


def _followed_then_after(
    db: Engine, tmp_path: Path, spec: IndexSpec, monkeypatch: pytest.MonkeyPatch, failed: int = 0
) -> tuple[PublishedIndex, PublishedIndex]:
    """A model with 1,200 rows of an earlier set, then 2,400 tasks of a new one written out of
    order while a tail follows them (less `failed` that never write a row); published from the
    tail, then built again from the table alone."""
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(spec))
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    set_id = _task_set(db, "s", 2400)
    rng = np.random.default_rng(7)
    written = [int(r) for r in rng.permutation(2400)[failed:]]
    # The index folder the step publishes to: where the tail stores the index it finishes.
    _follow(db, set_id, written, index_folder=tmp_path / "during" / "indexes")
    during = _publish(db, tmp_path / "during", spec)
    assert during.vectors_followed
    after = _publish(db, tmp_path / "after", spec)  # no tail: read and built after
    assert not after.vectors_followed and after.prebuilt_seconds is None
    return during, after


def _follow(
    db: Engine,
    set_id: int,
    written: list[int],
    meanwhile: Any = None,
    index_folder: Path | None = None,
) -> None:
    """Set "s" followed by a tail (finishing into `index_folder`) while `written` rows arrive
    from another thread, `meanwhile` done first; returns once the tail saw every row."""
    with vector_tail.following(db, "m", "s", index_folder=index_folder) as tail:
        assert tail is not None and tail.wait_until_following(30)
        if meanwhile is not None:
            meanwhile()
        writer = _writer_of(db, set_id, written)
        writer.start()
        writer.join()
    _caught_up(tail, len(written))


def _writer_of(db: Engine, set_id: int, records: list[int]) -> Any:
    """As test_vector_tail's writer, with 24-dimensional rows."""

    def write() -> None:
        for group in np.array_split(np.array(records), 16):
            _write(db, "m", set_id, [int(r) for r in group], dim=24)

    import threading

    return threading.Thread(target=write)


@SQLITE_ONLY
@pytest.mark.parametrize("kmeans", ["faiss", "torch"])
def test_an_index_made_ready_during_extraction_is_the_index_built_after(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kmeans: str
) -> None:
    spec = dataclasses.replace(SPEC, kmeans=kmeans)
    during, after = _followed_then_after(db, tmp_path, spec, monkeypatch)
    assert during.prebuilt_seconds is not None, "the tail made nothing ready"
    assert during.prebuilt_seconds["fill"] > 0  # the shards were filled as rows arrived
    assert "finish_quality" in during.prebuilt_seconds  # assembled and measured there too
    _same_index(during, after)
    assert during.receipt["training"]["rule"] == "the first rows in id order"
    assert during.receipt["training"]["sample"] == 500


@SQLITE_ONLY
def test_the_rows_counted_and_hashed_as_they_arrived_are_not_read_again_after(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the hand-over neither the tail's finish nor the index step passes over every row
    for the counts or the sha256s (index/row_summary.py); the receipt is the one the table's
    build, which does, writes."""
    from fabric_pipelines.lib.index import prebuild, publish

    monkeypatch.setattr(vector_tail, "_index_settings", _settings(SPEC))
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    set_id = _task_set(db, "s", 2400)
    passes: list[str] = []
    real_hash, real_check = publish.array_sha256, publish.check_vectors

    def hash_seen(array: np.ndarray, rows: np.ndarray | None = None) -> str:
        if array.ndim == 2:  # vectors (ids are 1-D)
            passes.append("sha256 of every row" if rows is None else "sha256 of a shard's rows")
        return real_hash(array, rows)

    def check_seen(vectors: np.ndarray, metric: str) -> Any:
        passes.append("bad-row counts")
        return real_check(vectors, metric)

    monkeypatch.setattr(publish, "array_sha256", hash_seen)
    monkeypatch.setattr(publish, "check_vectors", check_seen)
    monkeypatch.setattr(prebuild, "check_vectors", check_seen)
    # In record order as a packed plan extracts, two neighbouring batches at a time swapped,
    # each seen by the tail before the next is written (as a run's acks come over its polls).
    batches = np.array_split(np.arange(2400), 16)
    with vector_tail.following(db, "m", "s", index_folder=tmp_path / "during" / "indexes") as tail:
        assert tail is not None and tail.wait_until_following(30)
        seen = 0
        for i in [i ^ 1 for i in range(16)]:
            _write(db, "m", set_id, [int(r) for r in batches[i]], dim=24)
            seen += len(batches[i])
            _caught_up(tail, seen)
    during = _publish(db, tmp_path / "during", SPEC)
    assert during.vectors_followed and during.prebuilt_seconds is not None
    assert "summary" in during.prebuilt_seconds and "finish_quality" in during.prebuilt_seconds
    assert passes == [], passes
    after = _publish(db, tmp_path / "after", SPEC)  # from the table: every pass, as before
    assert "bad-row counts" in passes and "sha256 of every row" in passes
    assert passes.count("sha256 of a shard's rows") == SPEC.shards
    _same_index(during, after)


@SQLITE_ONLY
def test_rows_that_came_far_out_of_order_are_hashed_by_the_index_step_as_before(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Early rows arriving last would leave most of the hashing to the tail's one thread at the
    end: the summary is dropped then, and the step hashes on its pool; the same receipt."""
    from fabric_pipelines.lib.index import publish

    hashed: list[bool] = []
    real_hash = publish.array_sha256

    def hash_seen(array: np.ndarray, rows: np.ndarray | None = None) -> str:
        hashed.append(array.ndim == 2)
        return real_hash(array, rows)

    monkeypatch.setattr(publish, "array_sha256", hash_seen)
    during, after = _followed_then_after(db, tmp_path, SPEC, monkeypatch)  # a random order
    assert during.prebuilt_seconds is not None and "finish_quality" in during.prebuilt_seconds
    assert hashed.count(True) == 2 * (1 + SPEC.shards), "both builds hashed every row"
    _same_index(during, after)


def _link(db: Engine, set_id: int, pairs: list[tuple[int, int, int]], model: str = "m") -> None:
    """Tasks of `set_id` reusing results, as planning links them: (record, source set, source
    record); the links move the watermarks as planning's do."""
    with db.begin() as conn:
        key = model_id(conn, model)
        rows = [
            {"model_id": key, "task_set_id": set_id, "record_no": r,
             "from_task_set_id": s, "from_record_no": f}
            for r, s, f in pairs
        ]  # fmt: skip
        conn.execute(insert(ReusedResult), rows)
        records = np.array([r for r, _, _ in pairs], np.int64)
        count_inserted(
            conn.connection.driver_connection.cursor(),  # type: ignore[union-attr]
            np.full(len(pairs), set_id, np.int64), np.full(len(pairs), key, np.int64), records,
        )  # fmt: skip


@SQLITE_ONLY
def test_a_set_with_reused_results_is_made_ready_during_extraction_as_built_after(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 tasks reuse an earlier set's stored results and 100 repeat tasks of their own set that
    run later: each takes its source's vector in its place as the source is there, every place
    fills, and the index made ready is the one built after from the table (which reads the
    links)."""
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(SPEC))
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    set_id = _task_set(db, "s", 2400)
    _link(db, set_id, [(r, earlier, 3 * r) for r in range(300)])
    _link(db, set_id, [(r, set_id, r + 2000) for r in range(300, 400)])  # run later, in the set
    rng = np.random.default_rng(7)
    written = [int(r) for r in rng.permutation(np.arange(400, 2400))]
    _follow(db, set_id, written)
    during = _publish(db, tmp_path / "during", SPEC)
    assert during.vectors_followed
    assert during.prebuilt_seconds is not None, "the tail made nothing ready"
    after = _publish(db, tmp_path / "after", SPEC)
    assert during.receipt["source"]["rows"] == 1200 + 2400
    _same_index(during, after)


@SQLITE_ONLY
@pytest.mark.parametrize("change", ["made", "dropped"])
def test_a_link_made_or_dropped_after_the_first_read_sends_the_index_step_to_the_table(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The places hold the links of the first read: one made later (a wait settled into a
    link) or dropped (SQLite counts no deletes) and the tail is not used; the index is the
    table's, as built after."""
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(SPEC))
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    set_id = _task_set(db, "s", 2400)
    _link(db, set_id, [(r, earlier, r) for r in range(200)])
    written = list(range(300, 2400))

    def change_links() -> None:
        if change == "made":
            _link(db, set_id, [(r, earlier, r) for r in range(200, 300)])
        else:
            with db.begin() as conn:
                conn.execute(delete(ReusedResult).where(ReusedResult.record_no < 10))

    _follow(db, set_id, written, change_links)
    during = _publish(db, tmp_path / "during", SPEC)
    assert not during.vectors_followed and during.prebuilt_seconds is None
    after = _publish(db, tmp_path / "after", SPEC)
    _same_index(during, after)


@SQLITE_ONLY
def test_a_slow_first_prebuild_step_neither_delays_following_nor_loses_the_hand_over(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preparing the rows already there (a rerun's reused results: most of a set) may take
    longer than a short extraction: the tail follows as soon as it has read them, and a
    hand-over that comes meanwhile waits for the prebuild rather than give the tail up."""
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(SPEC))
    real_advance = Prebuild.advance
    calls = 0

    def slow_first(self: Prebuild, vectors: Any, arrived: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(3.0)
        real_advance(self, vectors, arrived)

    monkeypatch.setattr(Prebuild, "advance", slow_first)
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    set_id = _task_set(db, "s", 300)
    with vector_tail.following(db, "m", "s") as tail:
        assert tail is not None and tail.wait_until_following(1.5), "the first read waited"
        _write(db, "m", set_id, list(range(300)), dim=24)
    during = _publish(db, tmp_path / "during", SPEC)  # within the slow step: waits for it
    assert during.vectors_followed and during.prebuilt_seconds is not None
    _same_index(during, _publish(db, tmp_path / "after", SPEC))


@SQLITE_ONLY
def test_a_hand_over_that_comes_while_a_poll_reads_takes_what_it_read(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-over's stop, set while a poll of the tail reads its rows, lets that read end:
    the tail still stands for the table (it gave up, before)."""
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(SPEC))
    monkeypatch.setattr(vector_tail, "FETCH_ROWS", 16)  # a poll's read in many fetches
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    set_id = _task_set(db, "s", 300)
    with vector_tail.following(db, "m", "s") as tail:
        assert tail is not None and tail.wait_until_following(30)
        real_place = vector_tail._Arrivals.place_blobs

        def stopped_meanwhile(self: Any, ids: np.ndarray, blobs: list[Any]) -> None:
            tail._stop.set()  # what the hand-over does first, here amid the poll's read
            real_place(self, ids, blobs)

        monkeypatch.setattr(vector_tail._Arrivals, "place_blobs", stopped_meanwhile)
        _write(db, "m", set_id, list(range(300)), dim=24)
        deadline = time.monotonic() + 30
        while tail._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)  # the poll reads, then the loop ends on the stop
        assert tail.why == "following", tail.why
    during = _publish(db, tmp_path / "during", SPEC)
    assert during.vectors_followed
    after = _publish(db, tmp_path / "after", SPEC)
    _same_index(during, after)


@SQLITE_ONLY
def test_an_index_finished_at_another_recall_floor_is_measured_again_to_the_same_bytes(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tail finishes the index at the floor it was told; the step, asked for another,
    measures the assembled shards itself: the same index and receipt as a build after."""
    monkeypatch.setattr(vector_tail, "_min_recall", 0.5)
    during, after = _followed_then_after(db, tmp_path, SPEC, monkeypatch)
    assert during.prebuilt_seconds is not None and "fill" in during.prebuilt_seconds
    assert not any(k.startswith("finish_") for k in during.prebuilt_seconds)
    _same_index(during, after)


@SQLITE_ONLY
def test_an_index_of_encoded_rows_made_ready_during_extraction_is_the_index_built_after(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scalar-quantised lists: trained and assigned ahead, the shards filled by the index step
    (FAISS encodes as it adds)."""
    spec = dataclasses.replace(SPEC, factory="IVF16,SQ8")
    during, after = _followed_then_after(db, tmp_path, spec, monkeypatch)
    assert during.prebuilt_seconds is not None and "fill" not in during.prebuilt_seconds
    _same_index(during, after)


@SQLITE_ONLY
@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,SQ8"])
def test_a_set_added_to_an_indexed_model_is_assigned_with_the_served_quantizer(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, factory: str
) -> None:
    """A second set on a model whose index stands: the index step reuses the served quantizer
    and keeps the shards no row of the set lands in; made ready during extraction with that
    quantizer, it gives the same index as the partial rebuild after."""
    spec = dataclasses.replace(SPEC, factory=factory)
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(spec))
    earlier = _task_set(db, "earlier", 1200)
    _write(db, "m", earlier, list(range(1200)), dim=24)
    first = _publish(db, tmp_path, spec)  # no tail: built after
    set_id = _task_set(db, "s", 2400)
    # The set's tasks of shard 0 are gone before it runs: that shard is kept, not rebuilt.
    records = np.arange(2400)
    in_shard_0 = shard_of(set_id * ID_STRIDE + records, spec.shards) == 0
    with db.begin() as conn:
        conn.execute(
            delete(Task).where(
                Task.task_set_id == set_id, Task.record_no.in_(records[in_shard_0].tolist())
            )
        )
    written = [int(r) for r in np.random.default_rng(3).permutation(records[~in_shard_0])]
    folder = tmp_path / "indexes"
    with vector_tail.following(
        db, "m", "s", index_folder=folder, receipt_model={"model_id": "test"}
    ) as tail:
        assert tail is not None and tail.wait_until_following(30)
        writer = _writer_of(db, set_id, written)
        writer.start()
        writer.join()
    _caught_up(tail, len(written))

    def again() -> PublishedIndex:
        return build_and_publish(
            db, model_key="m", model={"model_id": "test"}, spec=spec, index_folder=folder,
            receipt_folder=tmp_path / "receipts", inputs=[], previous=first.receipt,
        )  # fmt: skip

    during = again()
    assert during.prebuilt_seconds is not None, "the tail made nothing ready"
    assert during.prebuilt_seconds["train"] == 0  # the served quantizer, not a new one
    assert during.rebuilt_shards == [1, 2]
    after = again()  # the vectors read from the table, the same partial rebuild
    assert after.prebuilt_seconds is None
    _same_index(during, after)
    assert during.receipt["training"] == first.receipt["training"]


@SQLITE_ONLY
def test_a_rule_that_needs_every_row_trains_at_the_hand_over_and_gives_the_same_index(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = dataclasses.replace(SPEC, train_rule="sample")
    during, after = _followed_then_after(db, tmp_path, spec, monkeypatch)
    assert during.prebuilt_seconds is not None
    _same_index(during, after)
    assert during.receipt["training"]["rule"].startswith("seeded sample")


@SQLITE_ONLY
def test_tasks_without_a_row_leave_the_build_to_the_index_step_with_the_same_result(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    during, after = _followed_then_after(db, tmp_path, SPEC, monkeypatch, failed=5)
    assert during.prebuilt_seconds is None  # the rows moved up over the failed tasks' places
    _same_index(during, after)
    assert during.receipt["source"]["rows"] == 1200 + 2400 - 5


@pytest.mark.slow
def test_a_worker_extracting_with_the_real_path_gets_its_index_made_ready(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine: Any,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both databases: the product's worker writes the rows (PostgreSQL's tail reads them by
    the batches acknowledged); the index made ready equals the one built after."""
    spec = IndexSpec(factory="IVF4,Flat", train_sample=40, shards=2, nprobe=2, device="cpu")
    monkeypatch.setattr(vector_tail, "_index_settings", _settings(spec))
    texts = [f"a line about {' '.join(['stones'] * (i % 9))} and {i}" for i in range(120)]
    job = _planned(db, paths, tmp_path, manifest, texts)
    with vector_tail.following(db, manifest.model_key, "s") as tail:
        assert tail is not None and tail.wait_until_following(30)
        run_worker(db, cpu_engine, job, owner="test")
    _caught_up(tail, 120)
    during = _publish(db, tmp_path / "during", spec, manifest.model_key)
    after = _publish(db, tmp_path / "after", spec, manifest.model_key)
    assert during.prebuilt_seconds is not None
    _same_index(during, after)


@pytest.mark.parametrize("kmeans", ["faiss", "torch"])
def test_a_rows_list_does_not_depend_on_the_rows_assigned_with_it(kmeans: str) -> None:
    """Rows assigned in pieces of any size, in any order, get the lists of one assignment of all
    of them (build.assign computes in tiles of one shape)."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((9000, 32)).astype(np.float32)
    spec = dataclasses.replace(SPEC, factory="IVF64,Flat", kmeans=kmeans, train_sample=3000)
    built = train(vectors, spec)
    rows = prepare_rows(vectors, np.arange(len(vectors)), spec, built.builder)
    every = np.arange(len(vectors))
    whole = assign(built.index, rows, every, built.builder, spec.metric)
    assert whole is not None
    pieces = np.empty_like(whole)
    order, at = rng.permutation(len(vectors)), 0
    for size in [1, 7, 19, 20, 21, 4095, 4097, 740]:
        chunk = order[at : at + size]
        found = assign(built.index, rows, chunk, built.builder, spec.metric)
        assert found is not None
        pieces[chunk] = found
        at += size
    assert at == len(vectors)
    assert np.array_equal(pieces, whole)


def test_a_prebuild_gives_up_for_an_index_that_assigns_as_it_adds() -> None:
    ids = np.arange(3000, dtype=np.int64)
    prebuild = Prebuild(dataclasses.replace(SPEC, factory="PCA8,IVF16,Flat"), ids)
    vectors = np.random.default_rng(0).standard_normal((3000, 16)).astype(np.float32)
    prebuild.advance(vectors, np.ones(3000, bool))
    assert prebuild.finish(vectors, np.ones(3000, bool)) is None
    assert "no plain IVF" in prebuild.why_not


@pytest.mark.parametrize("kmeans", ["faiss", "torch"])
def test_a_prebuild_fed_in_pieces_holds_the_lists_and_quantizer_of_a_build_of_all(
    kmeans: str,
) -> None:
    spec = dataclasses.replace(SPEC, kmeans=kmeans)
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((5000, 24)).astype(np.float32)
    ids = np.arange(5000, dtype=np.int64) + 10_000
    prebuild = Prebuild(spec, ids)
    arrived = np.zeros(5000, bool)
    for piece in np.array_split(rng.permutation(5000), 9):
        arrived[piece] = True
        prebuild.advance(vectors, arrived)
        assert prebuild.trained == arrived[:500].all()  # trained once the first 500 are in
    ready = prebuild.finish(vectors, arrived)
    assert ready is not None
    built = train(vectors, spec)
    assert ready.built.centroids_sha256 == built.centroids_sha256
    rows = prepare_rows(vectors, ids, spec, built.builder)
    assert np.array_equal(ready.rows.host, rows.host)
    whole = assign(built.index, rows, np.arange(5000), built.builder, spec.metric)
    assert np.array_equal(ready.lists, whole)
    # Each shard's index, filled piece by piece as rows were assigned, is the one filled at once.
    assert ready.parts is not None and len(ready.parts) == spec.shards
    owner = shard_of(ids, spec.shards)
    for shard, part in enumerate(ready.parts):
        at = np.flatnonzero(owner == shard)
        once = fill_assigned(built.index, rows.host[at], ids[at], whole[at], spec.nprobe)
        set_nprobe(part, spec.nprobe)
        assert serialize(part) == serialize(once)


@pytest.mark.parametrize("mark", [pytest.param(0, marks=TORCH_GPU)])
def test_on_the_gpu_a_rows_list_does_not_depend_on_the_rows_assigned_with_it(mark: int) -> None:
    """cuBLAS picks its kernel by shape: fixed tiles make each row's list the same however the
    rows are grouped, on the GPU too."""
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((20_000, 768)).astype(np.float32)
    spec = IndexSpec(factory="IVF256,Flat", device="gpu", kmeans="torch", train_sample=20_000)
    built = train(vectors, spec)
    assert built.builder == "torch-cuda"
    rows = prepare_rows(vectors, np.arange(len(vectors)), spec, built.builder)
    whole = assign(built.index, rows, np.arange(len(vectors)), built.builder, spec.metric)
    assert whole is not None
    pieces = np.empty_like(whole)
    order, at = rng.permutation(len(vectors)), 0
    for size in [3, 333, 4096, 5000, 10_568]:
        chunk = order[at : at + size]
        found = assign(built.index, rows, chunk, built.builder, spec.metric)
        assert found is not None
        pieces[chunk] = found
        at += size
    assert np.array_equal(pieces, whole)
    torch.cuda.empty_cache()
