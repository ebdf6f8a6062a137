"""Following a model's vectors during extraction (lib/index/vector_tail.py): what the index step
takes is exactly what the table holds, or nothing (it reads the table then)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, insert, text

from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.plans import load_plan_order, plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import vector_tail
from fabric_pipelines.lib.index.vectors import ID_STRIDE, VectorSet, load_vectors
from fabric_pipelines.lib.results.writer import BatchRows, insert_rows
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding, Task, TaskSet
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.worker.loop import ExtractionJob, run_worker

SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
POSTGRES_ONLY = pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
TASKS = 300


@pytest.fixture(autouse=True)
def quick_polls_and_no_tails_of_other_tests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(vector_tail, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(vector_tail, "FETCH_ROWS", 7)  # rows cross many fetch boundaries
    monkeypatch.setattr(vector_tail, "_in_this_process", True)  # as `fabric run` says
    _drop_tails()  # extractions of earlier tests in this process keep theirs
    yield
    _drop_tails()


def _drop_tails() -> None:
    with vector_tail._tails_lock:
        tails = list(vector_tail._tails.values())
        vector_tail._tails.clear()
    for tail in tails:
        tail.close()


def _task_set(db: Engine, name: str, tasks: int) -> int:
    with db.begin() as conn:
        set_id = int(
            conn.execute(
                insert(TaskSet).returning(TaskSet.id),
                {"name": name, "source_sha256": "s", "content_sha256": "c", "path": "p",
                 "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 8, "n_records": tasks,
                 "n_tasks": tasks},
            ).scalar_one()
        )  # fmt: skip
        conn.execute(
            insert(Task),
            [{"task_set_id": set_id, "record_no": r, "task_id": f"t{r}"} for r in range(tasks)],
        )
    return set_id


def _vector(set_id: int, record_no: int, dim: int = 6) -> np.ndarray:
    return np.random.default_rng(set_id * 100_000 + record_no).standard_normal(dim).astype("<f4")


def _write(db: Engine, model: str, set_id: int, records: list[int], dim: int = 6) -> None:
    """Rows written as the extraction's writer writes them (which moves their watermarks)."""
    with db.begin() as conn:
        key = model_id(conn, model)
        insert_rows(
            conn,
            [BatchRows(
                lease=None,  # type: ignore[arg-type]  # only the rows are written here
                task_set="", task_set_id=set_id, model_key=model, model_id=key,
                record_no=np.array(records, dtype=np.int64),
                n_tokens=np.full(len(records), 3),
                pooled=np.array([_vector(set_id, r, dim) for r in records]).reshape(-1, dim),
            )],
        )  # fmt: skip


def _writer(db: Engine, set_id: int, records: list[int], groups: int = 12) -> threading.Thread:
    """Rows written in groups, out of order, each its own transaction, a little apart: as the
    extraction's writer commits them."""

    def write() -> None:
        for group in np.array_split(np.array(records), groups):
            _write(db, "m", set_id, [int(r) for r in group])
            time.sleep(0.02)

    return threading.Thread(target=write)


def _followed(db: Engine, set_id: int, written: list[int], during: Callable[[], None]) -> None:
    """Follow set `set_id` while `written` rows arrive from another thread, then `during`."""
    with vector_tail.following(db, "m", "s") as tail:
        assert tail is not None and tail.wait_until_following(30)  # before the first row
        writer = _writer(db, set_id, written)
        writer.start()
        writer.join()
        during()


def _caught_up(tail: vector_tail.VectorTail | None, rows: int) -> None:
    """The tail has seen `rows` rows arrive (waiting out a busy machine's late looks)."""
    assert tail is not None
    deadline = time.monotonic() + 30
    while tail._arrived_since < rows and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tail._arrived_since == rows


def _claim_and_read(db: Engine) -> tuple[VectorSet | None, VectorSet]:
    claimed = vector_tail.claim(db, "m")
    with db.connect() as conn:
        return claimed, load_vectors(conn, "m")


def _same(a: VectorSet, b: VectorSet) -> None:
    assert a.ids.tolist() == b.ids.tolist()
    assert a.vectors.dtype == np.float32 and np.array_equal(a.vectors, b.vectors)
    assert a.task_sets == b.task_sets


@SQLITE_ONLY
def test_rows_written_while_followed_are_handed_over_exactly_as_the_table_holds_them(
    db: Engine,
) -> None:
    earlier = _task_set(db, "earlier", 40)
    _write(db, "m", earlier, list(range(40)))  # the model's rows of an earlier set
    _write(db, "other", earlier, list(range(5)), dim=3)  # another model's
    set_id = _task_set(db, "s", TASKS)
    rng = np.random.default_rng(1)
    failed = set(rng.choice(TASKS, 9, replace=False).tolist())  # tasks without a row
    written = [int(r) for r in rng.permutation(TASKS) if r not in failed]
    with vector_tail.following(db, "m", "s") as tail:
        assert tail is not None and tail.wait_until_following(30)  # before the first row
        writer = _writer(db, set_id, written)
        writer.start()
        writer.join()
    _caught_up(next(iter(vector_tail._tails.values())), len(written))
    _write(db, "other", set_id, [0], dim=3)  # another model's rows do not count
    claimed, read = _claim_and_read(db)
    assert claimed is not None
    _same(claimed, read)
    assert len(claimed.ids) == 40 + len(written)
    assert set(claimed.ids.tolist()).isdisjoint({set_id * ID_STRIDE + r for r in failed})
    assert vector_tail._tails == {}  # claimed once
    assert vector_tail.claim(db, "m") is None


@SQLITE_ONLY
@pytest.mark.parametrize(
    "change",
    [
        "DELETE FROM embeddings WHERE record_no = 7",
        "UPDATE embeddings SET vector = zeroblob(24) WHERE record_no = 8",
    ],
    ids=["delete", "update"],
)
def test_a_row_deleted_or_changed_after_it_was_followed_makes_the_index_read_the_table(
    db: Engine, change: str
) -> None:
    set_id = _task_set(db, "s", TASKS)
    _followed(db, set_id, list(range(TASKS)), lambda: time.sleep(0.1))
    with db.begin() as conn:
        conn.execute(text(change))
    claimed, read = _claim_and_read(db)
    assert claimed is None
    assert len(read.ids) == TASKS - (1 if change.startswith("DELETE") else 0)


@SQLITE_ONLY
def test_a_row_that_takes_a_deleted_rows_rowid_is_not_missed(db: Engine) -> None:
    """SQLite gives a new row the largest rowid + 1: after the last row is deleted, the next one
    takes its rowid, below the last one the tail saw. The counts notice."""
    set_id = _task_set(db, "s", TASKS)
    written = list(range(TASKS - 1))

    def delete_last_then_write_another() -> None:
        time.sleep(0.1)
        with db.begin() as conn:
            conn.execute(
                text("DELETE FROM embeddings WHERE rowid = (SELECT max(rowid) FROM embeddings)")
            )
        _write(db, "m", set_id, [TASKS - 1])

    _followed(db, set_id, written, delete_last_then_write_another)
    claimed, read = _claim_and_read(db)
    assert claimed is None
    assert len(read.ids) == TASKS - 1


@SQLITE_ONLY
def test_a_row_inserted_by_hand_makes_the_index_read_the_table(db: Engine) -> None:
    """On SQLite only the writer counts the rows it inserts (store/watermarks.py): a row put in
    by hand moves no watermark, and the tail, which sees it arrive, does not hand over."""
    set_id = _task_set(db, "s", TASKS)

    def insert_by_hand() -> None:
        with db.begin() as conn:
            conn.execute(
                insert(Embedding),
                {"model_id": model_id(conn, "m"), "task_set_id": set_id, "record_no": TASKS - 1,
                 "n_tokens": 3, "vector": _vector(set_id, TASKS - 1).tobytes()},
            )  # fmt: skip

    _followed(db, set_id, list(range(TASKS - 1)), insert_by_hand)
    claimed, read = _claim_and_read(db)
    assert claimed is None
    assert len(read.ids) == TASKS


@SQLITE_ONLY
def test_a_row_of_another_task_set_arriving_makes_the_index_read_the_table(db: Engine) -> None:
    set_id = _task_set(db, "s", TASKS)
    other = _task_set(db, "concurrent", 10)
    _followed(db, set_id, list(range(TASKS)), lambda: _write(db, "m", other, [3]))
    claimed, read = _claim_and_read(db)
    assert claimed is None
    assert len(read.ids) == TASKS + 1


@SQLITE_ONLY
def test_rows_committed_after_the_last_poll_are_read_at_the_hand_over(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_tail, "POLL_SECONDS", 3600)  # the tail reads only once at start
    set_id = _task_set(db, "s", TASKS)
    _followed(db, set_id, list(range(TASKS)), lambda: None)
    claimed, read = _claim_and_read(db)
    assert claimed is not None
    _same(claimed, read)


@SQLITE_ONLY
def test_a_failed_extraction_leaves_no_tail(db: Engine) -> None:
    set_id = _task_set(db, "s", TASKS)
    with pytest.raises(RuntimeError, match="worker died"), vector_tail.following(db, "m", "s"):
        _write(db, "m", set_id, [1, 2])
        raise RuntimeError("worker died")
    assert vector_tail._tails == {}
    claimed, read = _claim_and_read(db)
    assert claimed is None and len(read.ids) == 2


@SQLITE_ONLY
def test_a_tail_that_cannot_start_gives_way_to_the_read(db: Engine) -> None:
    """No task set of that name: the tail's thread stops, the extraction is not disturbed."""
    _task_set(db, "s", 3)
    with vector_tail.following(db, "m", "no-such-set"):
        pass
    assert vector_tail.claim(db, "m") is None


@SQLITE_ONLY
def test_a_tail_still_on_its_first_read_is_not_waited_for(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index step claims while holding SQLite's write lock; a tail whose first read (which
    registers watermarks, a write) has not finished is given up, not joined: no deadlock."""
    release = threading.Event()
    first_read = vector_tail.VectorTail._first_read

    def slow_first_read(self: vector_tail.VectorTail, cursor: object) -> None:
        release.wait(30)
        first_read(self, cursor)

    monkeypatch.setattr(vector_tail.VectorTail, "_first_read", slow_first_read)
    set_id = _task_set(db, "s", 3)
    with vector_tail.following(db, "m", "s"):
        _write(db, "m", set_id, [0])
    started = time.monotonic()
    try:
        claimed, read = _claim_and_read(db)
    finally:
        release.set()
    assert claimed is None and len(read.ids) == 1
    assert time.monotonic() - started < 20  # far below SQLite's 60 s busy timeout


def _planned(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest, texts: list[str]
) -> ExtractionJob:
    """A task set "s" submitted, ingested and planned by the product's own functions (one more
    record, empty, fails at ingest); the job a worker would run."""
    source = tmp_path / "set.jsonl"
    rows = [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)] + [{"id": "e", "text": ""}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    submit(source, paths.inbox, "s")
    stored = ingest_task_set(
        db, paths, "s", model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    plan = plan_task_set(db, paths, "s", manifest)
    return ExtractionJob(
        task_set="s", plan_id=plan.plan_id, model_key=manifest.model_key,
        tasks=read_table(stored.path, stored.content_sha256),
        order=load_plan_order(plan.path, plan.sha256), shard_folder=paths.shards,
    )  # fmt: skip


@POSTGRES_ONLY
def test_a_write_under_way_when_the_tail_starts_is_counted_or_waited_for(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """PostgreSQL: a write whose watermark update ran before the tail registered its watermarks
    would not count its rows. The registration waits for writes under way, so that row is one
    the tail finds already there, and the hand-over holds."""
    job = _planned(db, paths, tmp_path, manifest, ["one", "two", "three"])
    with db.begin() as conn:  # the model is known: only the write itself is under way
        model_id(conn, manifest.model_key)
    inserted, commit = threading.Event(), threading.Event()

    def write_slowly() -> None:
        with db.begin() as conn:
            key = model_id(conn, manifest.model_key)
            conn.execute(
                insert(Embedding),
                {"model_id": key, "task_set_id": _set_id(db, "s"), "record_no": 0,
                 "n_tokens": 3, "vector": np.ones(4, "<f4").tobytes()},
            )  # fmt: skip
            inserted.set()
            commit.wait(30)

    writer = threading.Thread(target=write_slowly)
    writer.start()
    try:
        assert inserted.wait(30)
        with vector_tail.following(db, manifest.model_key, job.task_set) as tail:
            time.sleep(0.5)  # the tail's registration is now waiting for the write
            assert tail is not None and not tail.wait_until_following(0.01)
            commit.set()
            assert tail.wait_until_following(30)
    finally:
        commit.set()
        writer.join()
    claimed = vector_tail.claim(db, manifest.model_key)
    with db.connect() as conn:
        read = load_vectors(conn, manifest.model_key)
    assert claimed is not None and len(read.ids) == 1
    _same(claimed, read)


def _set_id(db: Engine, name: str) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(text("SELECT id FROM task_sets WHERE name = :n"), {"n": name}).scalar_one()
        )


@pytest.mark.slow
@pytest.mark.parametrize("deleted_after", [False, True], ids=["as-written", "row-deleted"])
def test_a_real_extraction_is_followed_on_both_databases(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine: Any,
    manifest: EngineManifest,
    deleted_after: bool,
) -> None:
    """The product's own ingest, plan and worker (the real model on the CPU engine; its writer
    acknowledges each batch with its rows) while the tail follows: the index step gets exactly
    the table's rows, some of them seen arriving batch by batch, one failed task without a row;
    or, when a row was deleted after the tail saw it, nothing (it reads the table)."""
    texts = [f"sentence number {i} about {' '.join(['things'] * (i % 17))}" for i in range(150)]
    job = _planned(db, paths, tmp_path, manifest, texts)
    assert len(np.unique(job.order)) == 150  # the failed record is not planned
    with vector_tail.following(db, manifest.model_key, "s") as tail:
        assert tail is not None and tail.wait_until_following(30)  # before any row arrives
        run_worker(db, cpu_engine, job, owner="test")
    _caught_up(tail, 150)  # followed during the extraction, not read at the hand-over
    if deleted_after:
        with db.begin() as conn:
            conn.execute(text("DELETE FROM embeddings WHERE record_no = 3"))
    claimed = vector_tail.claim(db, manifest.model_key)
    with db.connect() as conn:
        read = load_vectors(conn, manifest.model_key)
    if deleted_after:
        assert claimed is None and len(read.ids) == 149
        return
    assert claimed is not None and len(read.ids) == 150
    _same(claimed, read)


@SQLITE_ONLY
@pytest.mark.parametrize("label", ["int8", "float16", "binary:256"])
def test_an_output_variants_rows_are_followed_and_handed_over_as_the_table_read_decodes_them(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest, label: str
) -> None:
    """A variant key's rows are kept as their bytes while they arrive (an int8 key's first run
    records its calibration meanwhile) and decoded at the hand-over: the same values, bit for
    bit, as the index's own read of the table."""
    from fabric_gpu.engines import create_engine
    from tests.test_stored_variants import _with_variant

    variant = _with_variant(manifest, label)
    texts = [f"sentence number {i} about {' '.join(['things'] * (i % 17))}" for i in range(120)]
    job = _planned(db, paths, tmp_path, variant, texts)
    engine = create_engine(variant)
    with vector_tail.following(db, variant.model_key, "s") as tail:
        assert tail is not None and tail.wait_until_following(30)  # before any row arrives
        run_worker(db, engine, job, owner="test")
    _caught_up(tail, 120)  # followed during the extraction, not read at the hand-over
    claimed = vector_tail.claim(db, variant.model_key)
    with db.connect() as conn:
        read = load_vectors(conn, variant.model_key)
    assert claimed is not None and len(read.ids) == 120
    _same(claimed, read)
    dims = variant.hooks.output_variant().out_dims(384)
    assert claimed.vectors.shape == (120, dims)


@POSTGRES_ONLY
def test_on_postgresql_an_output_variant_is_read_from_the_table(db: Engine) -> None:
    """PostgreSQL's tail decodes float32 from its COPY: a variant key is not followed there."""
    with vector_tail.following(db, "m~int8", "s") as tail:
        assert tail is None
    with vector_tail.following(db, "m", "s") as tail:  # a float32 key is
        assert tail is not None
        tail.close()


@SQLITE_ONLY
def test_an_unclaimed_tail_lets_its_arrays_go_after_the_extraction_ended(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long extraction keeps its tail (the wait counts from its end); a tail nobody claims
    within UNCLAIMED_SECONDS of it stops and lets go of its arrays."""
    monkeypatch.setattr(vector_tail, "UNCLAIMED_SECONDS", 1.0)
    set_id = _task_set(db, "s", 3)
    with vector_tail.following(db, "m", "s") as tail:
        assert tail is not None and tail.wait_until_following(30)
        time.sleep(1.5)  # longer than UNCLAIMED_SECONDS: still followed
        _write(db, "m", set_id, [0, 1])
        assert vector_tail._tails == {}  # kept only once the block ends
    assert next(iter(vector_tail._tails.values())) is tail
    _caught_up(tail, 2)  # rows written after UNCLAIMED_SECONDS were still seen arriving
    time.sleep(3.0)
    assert isinstance(tail._error, vector_tail.TailGaveUp) and tail._arrivals is None
    claimed, read = _claim_and_read(db)
    assert claimed is None and len(read.ids) == 2


@SQLITE_ONLY
def test_a_process_that_does_not_run_the_index_step_follows_nothing(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Dagster's multiprocess or Kubernetes executors the extraction step's process never
    runs the index step: no tail there (no arrays nobody takes, no watermarks registered)."""
    monkeypatch.setattr(vector_tail, "_in_this_process", False)
    set_id = _task_set(db, "s", 3)
    with vector_tail.following(db, "m", "s") as tail:
        _write(db, "m", set_id, [0])
    assert tail is None and vector_tail._tails == {}
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM shard_watermarks")).scalar_one() == 0


@SQLITE_ONLY
def test_failed_tasks_leave_no_gap_in_the_handed_over_arrays(db: Engine) -> None:
    """Every other task fails (no row): the rows that came move up over the gaps, in place."""
    set_id = _task_set(db, "s", TASKS)
    _followed(db, set_id, list(range(0, TASKS, 2)), lambda: None)
    claimed, read = _claim_and_read(db)
    assert claimed is not None and len(claimed.ids) == TASKS // 2
    _same(claimed, read)


@POSTGRES_ONLY
@pytest.mark.slow
def test_a_hand_over_slower_than_the_idle_transaction_limit_still_publishes(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine: Any,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The index step's own transaction must not sit idle while the tail hands over: the server
    ends a session idle in a transaction (60 s in the product; 1 s here, against a 2.5 s
    hand-over), and the build must still publish from the followed vectors."""
    from fabric_pipelines.lib.index.build import IndexSpec
    from fabric_pipelines.lib.index.publish import build_and_publish
    from fabric_pipelines.lib.store import db as db_module

    texts = [f"a sentence about {' '.join(['things'] * (i % 11))} number {i}" for i in range(80)]
    job = _planned(db, paths, tmp_path, manifest, texts)
    with vector_tail.following(db, manifest.model_key, "s") as tail:
        assert tail is not None and tail.wait_until_following(30)
        run_worker(db, cpu_engine, job, owner="test")
    _caught_up(tail, 80)

    catch_up = vector_tail._PostgresTail._catch_up

    def slow_at_the_hand_over(self: Any, cursor: Any) -> None:
        if self._stop.is_set():
            time.sleep(2.5)
        catch_up(self, cursor)

    monkeypatch.setattr(vector_tail._PostgresTail, "_catch_up", slow_at_the_hand_over)
    monkeypatch.setattr(db_module, "IDLE_IN_TRANSACTION_MS", 1000)
    strict = db_module.make_engine(db_url)
    try:
        published = build_and_publish(
            strict, model_key=manifest.model_key, model={"model_id": "test"}, spec=IndexSpec(),
            index_folder=paths.indexes, receipt_folder=paths.receipts, inputs=[],
        )  # fmt: skip
    finally:
        strict.dispose()
    assert published.vectors_followed
    assert published.receipt["source"]["rows"] == 80


@SQLITE_ONLY
def test_a_hand_over_that_cannot_begin_stops_the_tail_and_gives_way_to_the_read(
    db: Engine,
) -> None:
    """No transaction for the hand-over (a lock held past the busy timeout, a lost server): the
    tail stops and lets its arrays go, and the caller reads the table."""
    set_id = _task_set(db, "s", TASKS)
    with vector_tail.following(db, "m", "s") as tail:
        assert tail is not None and tail.wait_until_following(30)
        _write(db, "m", set_id, list(range(10)))
    _caught_up(tail, 10)

    class NoTransaction:
        url = db.url

        def begin(self) -> Any:
            raise RuntimeError("database is locked")

    assert vector_tail.claim(NoTransaction(), "m") is None  # type: ignore[arg-type]
    assert tail is not None
    tail._thread.join(10)
    assert not tail._thread.is_alive() and tail._arrivals is None
    assert vector_tail._tails == {}
