"""Ingest: every record becomes a task or a failure with a reason; nothing aborts the set."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.core.files import sha256_file
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import Task, TaskFailure, TaskSet
from fabric_pipelines.lib.tasks import catalog
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import (
    ImmutableTaskSetError,
    IngestSummary,
    UnrecoverableTaskSetError,
    ingest_task_set,
    is_ingested,
)
from fabric_pipelines.lib.tasks.inbox import (
    forget_submitted,
    record_first_seen,
    record_submitted,
    scan,
    set_aside_path,
    submit,
    submitted_sha256,
)
from fabric_pipelines.lib.tasks.ingest import SubmissionError, TokenisedTasks, ingest

MAX = 16


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))


def _jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bad_records_fail_back_with_reasons(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows: list[object] = [
        {"id": "ok-1", "text": "a good sentence"},
        {"id": "empty", "text": ""},
        {"id": "blank", "text": "  \t\n "},
        {"id": "long", "text": "word " * 100},
        {"id": "ok-1", "text": "same id again"},
        {"text": "no id"},
        {"id": True, "text": "bool id"},
        {"id": "num-text", "text": 3.5},
        {"id": "both", "text": "x", "token_ids": [101, 102]},
        {"id": "tok-ok", "token_ids": [101, 7592, 102]},
        {"id": "tok-bad", "token_ids": [101, 999999, 102]},
        {"id": "tok-neg", "token_ids": [-1]},
        {"id": "tok-empty", "token_ids": []},
        ["not", "an", "object"],
        {"id": 7, "text": "integer ids are fine"},
    ]
    path = _jsonl(tmp_path / "set.jsonl", rows)
    with open(path, "ab") as f:
        f.write(b'{"id": "latin1", "text": "caf\xe9"}\n')  # not UTF-8
        f.write(b'{"id": "broken", "text": \n')  # not JSON
        f.write(b"\n")  # blank lines are not records
    tasks = ingest(path, tokenizer, max_seq_len=MAX)
    assert tasks.n_records == len(rows) + 2
    assert tasks.task_ids == ["ok-1", "tok-ok", "7"]
    reasons = {f.record_no: f.reason for f in tasks.failures}
    assert len(tasks.failures) + len(tasks.task_ids) == tasks.n_records
    assert reasons[1] == "line 2: empty text"
    assert reasons[2] == "line 3: text is only whitespace"
    assert reasons[3].startswith("line 4: over-long:") and f"max_seq_len {MAX}" in reasons[3]
    assert "--long-inputs chunk" in reasons[3]
    assert "duplicate id 'ok-1' (first at line 1)" in reasons[4]
    assert "missing 'id'" in reasons[5]
    assert "'id' must be a string or an integer, got a boolean" in reasons[6]
    assert "'text' must be a string, got a fractional number" in reasons[7]
    assert "exactly one of 'text' or 'token_ids': both are given" in reasons[8]
    assert "token id 999999 at position 1 of 'token_ids' is outside the vocabulary" in reasons[10]
    assert "token id -1" in reasons[11]
    assert reasons[12] == "line 13: empty token_ids"
    assert "expected an object" in reasons[13] and "an array" in reasons[13]
    assert reasons[15].startswith("line 16: not valid UTF-8")
    assert reasons[16].startswith("line 17: not valid JSON")
    assert list(tasks.lengths) == [5, 3, 7]  # [CLS] a good sentence [SEP]; given ids kept as is


def test_lengths_at_the_limit_pass_and_one_over_fails(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"id": "at", "token_ids": [101] + [1000] * (MAX - 2) + [102]},
        {"id": "over", "token_ids": [101] + [1000] * (MAX - 1) + [102]},
        {"id": "under", "token_ids": [101] + [1000] * (MAX - 3) + [102]},
    ]
    tasks = ingest(_jsonl(tmp_path / "edges.jsonl", rows), tokenizer, max_seq_len=MAX)
    assert tasks.task_ids == ["at", "under"]
    assert list(tasks.lengths) == [MAX, MAX - 1]
    assert tasks.failures[0].task_id == "over" and f"{MAX + 1} tokens" in tasks.failures[0].reason


def test_truncation_only_when_asked_and_counted(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "long", "text": "word " * 100}])
    tasks = ingest(path, tokenizer, max_seq_len=MAX, truncate=True)
    assert tasks.truncated == 1 and not tasks.failures
    assert tasks.lengths[0] == MAX
    assert tasks.tokens[MAX - 1] == 102  # the closing [SEP] is kept


def test_parquet_input_with_nulls(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "set.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c"], "text": ["hello world", "x", None]}), path)
    tasks = ingest(path, tokenizer, max_seq_len=MAX)
    assert tasks.task_ids == ["a"]
    assert [f.record_no for f in tasks.failures] == [1, 2]


def test_a_file_of_the_wrong_kind_is_refused_as_a_whole(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "set.csv"
    path.write_text("id,text\n1,hello\n")
    with pytest.raises(SubmissionError, match=r"unsupported file type '\.csv'"):
        ingest(path, tokenizer, max_seq_len=MAX)
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"key": ["a"], "body": ["b"]}), bad)
    with pytest.raises(SubmissionError, match="needs an 'id' column"):
        ingest(bad, tokenizer, max_seq_len=MAX)


@pytest.mark.parametrize(
    ("column", "values", "reason"),
    [
        ("id", pa.array([1.5, 2.5]), "'id' must be a string or an integer, got a fractional"),
        ("id", pa.array([b"x", b"y"]), "'id' must be a string or an integer, got a bytes"),
        ("id", pa.array([[1], [2]]), "'id' must be a string or an integer, got an array"),
        ("id", pa.array([{"a": 1}, {"a": 2}]), "'id' must be a string or an integer, got an obj"),
        ("id", pa.array([None, None], pa.null()), "missing 'id'"),
        ("text", pa.array([b"a", b"b"]), "'text' must be a string, got a bytes value"),
        ("text", pa.array([1, 2]), "'text' must be a string, got an integer"),
        ("text", pa.array([None, None], pa.string()), "neither is given (or it is null)"),
        ("token_ids", pa.array([[1.0], [2.0]]), "position 0 holds a fractional number"),
        ("token_ids", pa.array([["1"], ["2"]]), "position 0 holds a string"),
        ("token_ids", pa.array([[[101]], [[102]]]), "position 0 holds an array"),
        (
            "token_ids",
            pa.array([[2**64 - 1], [2**63]], pa.list_(pa.uint64())),
            "outside the vocabulary",
        ),
        ("token_ids", pa.array([[101, None], [None]], pa.list_(pa.int64())), "holds null"),
        # a timestamp beyond Python's datetime range cannot even be read as a value
        ("text", pa.array([2**62, 2**62], pa.timestamp("us")), "cannot be read"),
    ],
)
def test_hostile_parquet_types_fail_record_by_record(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, column: str, values: pa.Array, reason: str
) -> None:
    """Two hostile rows between two good ones: the good ones become tasks, each bad one a failure
    naming its row and the field. A column has one type, so the good rows leave the hostile column
    null and use the other one (a hostile 'id' column has no good rows)."""
    hostile = pa.concat_arrays([pa.nulls(1, values.type), values, pa.nulls(1, values.type)])
    ids = pa.array(["g0", "b1", "b2", "g3"])
    good_text = pa.array(["good text", None, None, "more text"])
    good_tokens = pa.array([[101, 7592, 102], None, None, [101, 102]], pa.list_(pa.int64()))
    if column == "id":
        table = pa.table({"id": hostile, "text": pa.array(["a", "b", "c", "d"])})
    elif column == "text":
        table = pa.table({"id": ids, "text": hostile, "token_ids": good_tokens})
    else:
        table = pa.table({"id": ids, "text": good_text, "token_ids": hostile})
    path = tmp_path / "hostile.parquet"
    pq.write_table(table, path)
    tasks = ingest(path, tokenizer, max_seq_len=MAX)
    assert tasks.n_records == 4
    assert len(tasks.task_ids) + len(tasks.failures) == 4
    assert tasks.task_ids == ([] if column == "id" else ["g0", "g3"])
    bad = [f for f in tasks.failures if f.record_no in (1, 2)]
    assert len(bad) == 2
    for failure in bad:
        assert failure.reason.startswith(f"row {failure.record_no}: ")
        assert reason in failure.reason, failure.reason


# ---- through the catalog, on both databases ------------------------------------------------------


def stored_records(db: Engine, task_set: str) -> tuple[TaskSet, list[Task], list[TaskFailure]]:
    """The set's row, its task rows and its failure rows, as the database holds them."""
    with Session(db, expire_on_commit=False) as session:
        row = session.scalars(select(TaskSet).where(TaskSet.name == task_set)).one()
        tasks = list(
            session.scalars(select(Task).where(Task.task_set_id == row.id).order_by(Task.record_no))
        )
        failures = list(
            session.scalars(
                select(TaskFailure)
                .where(TaskFailure.task_set_id == set_id_of(task_set))
                .order_by(TaskFailure.record_no)
            )
        )
    return row, tasks, failures


def assert_every_record_once(db: Engine, task_set: str, n_records: int) -> list[TaskFailure]:
    """Each record is exactly one task row or one failure row, and the accounting agrees."""
    row, tasks, failures = stored_records(db, task_set)
    assert row.n_records == n_records and row.n_tasks == len(tasks)
    numbers = [t.record_no for t in tasks] + [f.record_no for f in failures]
    assert sorted(numbers) == list(range(n_records))
    with db.connect() as conn:
        a = accounting(conn, task_set)
    # Before a plan: nothing completed or queued; the set's tasks are the records not failed.
    assert (a.tasks, a.failed, a.completed, a.in_flight, a.queued) == (
        n_records, len(failures), 0, 0, 0
    )  # fmt: skip
    assert a.tasks - a.failed == len(tasks)
    return failures


def _ingest(db: Engine, paths: FabricPaths, task_set: str, **kwargs: Any) -> IngestSummary:
    return ingest_task_set(
        db, paths, task_set, model_id=DEFAULT_MODEL_ID, max_seq_len=MAX, **kwargs
    )


HOSTILE_LINES = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "digits": '{"id": 1' + "0" * 4999 + ', "text": "a 5,000-digit id"}',
    "surrogate-text": '{"id": "surrogate-text", "text": "half a pair \\ud800 here"}',
    "surrogate-id": '{"id": "\\ud800", "text": "an id that is half a pair"}',
    "huge-token": '{"id": "huge-token", "token_ids": [101, ' + str(2**70) + ", 102]}",
    "nul-id": '{"id": "nul\\u0000id", "text": "an id with NUL"}',
}


def test_records_that_used_to_abort_the_ingest_fail_one_by_one(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    lines = []
    for i, hostile in enumerate(HOSTILE_LINES.values()):
        lines += [json.dumps({"id": f"good-{i}", "text": f"good record {i}"}), hostile]
    source = tmp_path / "hostile.jsonl"
    source.write_text("\n".join(lines) + "\n")
    submit(source, paths.inbox, "hostile")
    summary = _ingest(db, paths, "hostile")
    assert (summary.n_records, summary.n_tasks, summary.n_failed) == (12, 6, 6)
    failures = assert_every_record_once(db, "hostile", 12)
    _, tasks, _ = stored_records(db, "hostile")
    assert [t.task_id for t in tasks] == [f"good-{i}" for i in range(6)]
    by_kind = dict(zip(HOSTILE_LINES, failures, strict=True))
    assert by_kind["deep"].reason.startswith("line 2: JSON nested too deeply")
    assert by_kind["digits"].reason.startswith("line 4: holds a number of more than")
    assert "write long ids as strings" in by_kind["digits"].reason
    assert "'text' holds a lone surrogate U+D800" in by_kind["surrogate-text"].reason
    assert "'id' holds a lone surrogate U+D800" in by_kind["surrogate-id"].reason
    assert f"token id {2**70} at position 1 of 'token_ids'" in by_kind["huge-token"].reason
    assert "'id' holds a NUL character" in by_kind["nul-id"].reason
    # What cannot be stored is stored escaped.
    assert by_kind["surrogate-id"].task_id == "\\ud800"
    assert by_kind["nul-id"].task_id == "nul\\x00id"
    assert all(f.stage == "ingest" for f in failures)


def test_a_file_that_cannot_be_read_registers_nothing_and_can_be_fixed(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    def ingested(name: str) -> bool:
        return is_ingested(db, name)

    broken = tmp_path / "data.parquet"
    broken.write_bytes(b"PAR1 this is not really parquet")
    submit(broken, paths.inbox, "fixme")
    with pytest.raises(SubmissionError, match="not a readable Parquet file") as err:
        _ingest(db, paths, "fixme")
    assert "\n" not in str(err.value)
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"key": ["a"], "body": ["b"]}), wrong)
    submit(wrong, paths.inbox, "fixme", ingested=ingested)  # never ingested: replaced
    with pytest.raises(SubmissionError, match="needs an 'id' column"):
        _ingest(db, paths, "fixme")
    with Session(db) as session:
        assert session.scalars(select(TaskSet)).all() == []
        assert session.scalars(select(TaskFailure)).all() == []
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text('{"id": "a", "text": "hello"}\n{"id": "b", "text": ""}\n')
    staged = submit(fixed, paths.inbox, "fixme", ingested=ingested)
    assert [p.name for p in paths.inbox.glob("fixme.*")] == ["fixme.jsonl"]
    summary = _ingest(db, paths, "fixme")
    assert (summary.n_tasks, summary.n_failed, summary.source_sha256) == (1, 1, staged.sha256)
    assert_every_record_once(db, "fixme", 2)
    fixed.write_text('{"id": "a", "text": "other content"}\n')
    with pytest.raises(SubmissionError, match="is ingested with different content"):
        submit(fixed, paths.inbox, "fixme", ingested=ingested)


def test_an_inbox_file_changed_after_submit_is_refused(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    source = tmp_path / "s.jsonl"
    source.write_text(
        "".join(json.dumps({"id": i, "text": f"record {i}"}) + "\n" for i in range(50))
    )
    staged = submit(source, paths.inbox, "changed")
    data = staged.path.read_bytes()
    staged.path.write_bytes(data[: len(data) // 2])  # truncated to half behind our back
    now = sha256_file(staged.path)
    with pytest.raises(SubmissionError, match="changed after it was submitted") as err:
        _ingest(db, paths, "changed")
    assert staged.sha256 in str(err.value) and now in str(err.value)
    assert "fabric submit" in str(err.value)  # never ingested: it may be replaced
    with Session(db) as session:
        assert session.scalars(select(TaskSet)).all() == []
        assert session.scalars(select(TaskFailure)).all() == []
    # A file dropped into the inbox by hand is protected from when the sensor first sees it.
    (paths.inbox / "dropped.jsonl").write_bytes(data)
    accepted, _ = scan(paths.inbox)
    assert [f.task_set for f in record_first_seen(paths.inbox, accepted)] == ["dropped"]
    (paths.inbox / "dropped.jsonl").write_bytes(data + b'{"id": "late", "text": "added"}\n')
    with pytest.raises(SubmissionError, match="changed after it was submitted"):
        _ingest(db, paths, "dropped")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])  # Parquet: read once, from memory
def test_two_first_ingests_at_once_register_the_set_once(
    db: Engine, paths: FabricPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Both runs tokenise before either registers (a barrier holds them): one inserts the row,
    the other meets the unique name and reuses it (same settings) or is refused (other ones)."""
    rows = [{"id": str(i), "text": f"item {i}"} for i in range(40)] + [{"id": "bad", "text": ""}]
    source = tmp_path / f"s.{kind}"
    if kind == "jsonl":
        _jsonl(source, rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), source)
    barrier = threading.Barrier(2)
    real_ingest = catalog.ingest

    def ingest_then_wait(*args: Any, **kwargs: Any) -> TokenisedTasks:
        tasks = real_ingest(*args, **kwargs)
        barrier.wait(timeout=60)
        return tasks

    monkeypatch.setattr(catalog, "ingest", ingest_then_wait)

    def at_once(task_set: str, max_seq_lens: tuple[int, int]) -> list[object]:
        submit(source, paths.inbox, task_set)
        results: list[object] = [None, None]

        def run(i: int) -> None:
            try:
                results[i] = ingest_task_set(
                    db, paths, task_set, model_id=DEFAULT_MODEL_ID, max_seq_len=max_seq_lens[i]
                )
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return results

    results = at_once("race", (MAX, MAX))
    same = [r for r in results if isinstance(r, IngestSummary)]
    assert len(same) == 2, results
    assert sorted(r.reused for r in same) == [False, True]
    assert len({r.content_sha256 for r in same}) == 1
    # The loser's stored file is gone: only the winner's is left.
    assert [p.name for p in (paths.task_sets / "race").glob("*.arrow")] == [same[0].path.name]
    assert_every_record_once(db, "race", 41)

    other = at_once("race2", (MAX, MAX + 8))
    won = [r for r in other if isinstance(r, IngestSummary)]
    lost = [r for r in other if isinstance(r, ImmutableTaskSetError)]
    assert len(won) == len(lost) == 1, other
    assert "another tokenizer or max_seq_len" in str(lost[0])
    row, _, _ = stored_records(db, "race2")
    assert row.content_sha256 == won[0].content_sha256
    assert read_table(Path(row.path), row.content_sha256).num_rows == row.n_tasks
    assert [p.name for p in (paths.task_sets / "race2").iterdir()] == [Path(row.path).name]
    assert_every_record_once(db, "race2", 41)


def test_a_corrupt_stored_file_is_rebuilt_from_the_inbox_file(
    db: Engine, paths: FabricPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _jsonl(tmp_path / "s.jsonl", [{"id": i, "text": f"text {i}"} for i in range(30)])
    submit(source, paths.inbox, "heal")
    first = _ingest(db, paths, "heal")
    damaged = bytearray(first.path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    first.path.write_bytes(bytes(damaged))
    healed = _ingest(db, paths, "heal")
    assert healed.reused and healed.path == first.path
    assert sha256_file(first.path) == first.content_sha256
    assert list(healed.lengths) == list(first.lengths)

    # Rebuilding that does not give the recorded bytes back is refused, and leaves no file.
    first.path.unlink()
    real_ingest = catalog.ingest

    def one_record_short(*args: Any, **kwargs: Any) -> TokenisedTasks:
        tasks = real_ingest(*args, **kwargs)
        tasks.task_ids[0] = "not what was ingested"
        return tasks

    monkeypatch.setattr(catalog, "ingest", one_record_short)
    with pytest.raises(UnrecoverableTaskSetError, match="resubmit the data under a new name"):
        _ingest(db, paths, "heal")
    assert list((paths.task_sets / "heal").glob("*.arrow")) == []
    monkeypatch.undo()

    # A changed inbox file cannot rebuild it. A set submitted before submissions were recorded
    # is held to the file it was ingested from.
    forget_submitted(paths.inbox, "heal")
    (paths.inbox / "heal.jsonl").write_text('{"id": "x", "text": "other content"}\n')
    with pytest.raises(SubmissionError, match="changed after it was submitted") as err:
        _ingest(db, paths, "heal")
    assert first.source_sha256 in str(err.value) and "under a new name" in str(err.value)
    # Even were the record to agree with the changed file (written by hand), the database does not.
    record_submitted(paths.inbox, "heal", sha256_file(paths.inbox / "heal.jsonl"))
    with pytest.raises(UnrecoverableTaskSetError, match="no longer is the one ingested") as err:
        _ingest(db, paths, "heal")
    assert "under a new name" in str(err.value) and first.source_sha256 in str(err.value)


def test_a_corrupt_file_stored_under_the_old_name_is_rebuilt_under_its_hash(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    submit(_jsonl(tmp_path / "s.jsonl", [{"id": 1, "text": "one"}]), paths.inbox, "old")
    first = _ingest(db, paths, "old")
    legacy = paths.task_sets / "old.arrow"  # where sets were stored before files had hash names
    first.path.rename(legacy)
    with db.begin() as conn:
        conn.execute(update(TaskSet).where(TaskSet.name == "old").values(path=str(legacy)))
    legacy.write_bytes(legacy.read_bytes()[:-3])
    healed = _ingest(db, paths, "old")
    assert healed.path == first.path and not legacy.exists()
    row, _, _ = stored_records(db, "old")
    assert Path(row.path) == first.path and sha256_file(first.path) == row.content_sha256


def test_a_stored_sets_file_leaves_the_inbox_and_stays_usable(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    """Ingest moves the file out of the inbox (a scan no longer sees it) into `.submitted/`;
    ingesting again reuses the stored set from it; the same file submitted again is a no-op,
    other content under the name is refused; forgetting the set removes the kept file."""
    source = _jsonl(tmp_path / "a.jsonl", [{"id": f"r{i}", "text": f"text {i}"} for i in range(5)])
    submit(source, paths.inbox, "kept")
    first = _ingest(db, paths, "kept")
    assert not first.reused
    kept = set_aside_path(paths.inbox, "kept", ".jsonl")
    assert not (paths.inbox / "kept.jsonl").exists() and kept.is_file()
    assert sha256_file(kept) == sha256_file(source) == submitted_sha256(paths.inbox, "kept")
    assert scan(paths.inbox) == ([], [])
    again = _ingest(db, paths, "kept")  # a second materialisation reads the kept file
    assert again.reused and again.content_sha256 == first.content_sha256
    assert submit(source, paths.inbox, "kept").path == kept
    assert not (paths.inbox / "kept.jsonl").exists()
    other = _jsonl(tmp_path / "b.jsonl", [{"id": "x", "text": "other"}])
    with pytest.raises(SubmissionError, match="immutable"):
        submit(other, paths.inbox, "kept", ingested=lambda _: True)
    catalog.forget_task_set(db, paths, "kept")
    assert not kept.exists() and submitted_sha256(paths.inbox, "kept") is None
