"""Task-set names and the inbox: unsafe names and links out of the inbox are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric_pipelines.lib.core.names import PATTERN, InvalidNameError, validate_task_set_name
from fabric_pipelines.lib.core.settings import FabricPaths, redact_url
from fabric_pipelines.lib.tasks.inbox import (
    record_first_seen,
    scan,
    submission_path,
    submit,
    submitted_sha256,
)
from fabric_pipelines.lib.tasks.ingest import SubmissionError


@pytest.mark.parametrize(
    "name",
    [
        "",
        "../etc",
        "a/b",
        "a\\b",
        "..",
        "x..y",
        "it's",
        'a"b',
        "a b",
        "a;drop table x",
        "x'; DROP TABLE tasks; --",
        "a%b",
        "a*",
        "a\x00b",
        "a\nb",
        "tab\there",
        "$(rm -rf)",
        "`x`",
        "a.jsonl/..",
        "-lead",
        ".hidden",
        "é",
        "a" * 65,
        None,
        3,
    ],
)
def test_unsafe_task_set_names_are_refused(name: object) -> None:
    with pytest.raises(InvalidNameError, match="is not allowed") as err:
        validate_task_set_name(name)
    assert repr(name)[:40] in str(err.value) and PATTERN in str(err.value)


@pytest.mark.parametrize("name", ["demo", "set-1", "2026_11_30.part.3", "A" * 64])
def test_safe_names_pass(name: str) -> None:
    assert validate_task_set_name(name) == name


def test_submit_is_atomic_idempotent_and_immutable(paths: FabricPaths, tmp_path: Path) -> None:
    source = tmp_path / "x.jsonl"
    source.write_text('{"id": 1, "text": "hello"}\n')
    first = submit(source, paths.inbox, "set")
    assert first.path == paths.inbox / "set.jsonl"
    assert submit(source, paths.inbox, "set") == first  # the same file again: nothing happens
    source.write_text('{"id": 1, "text": "changed"}\n')
    with pytest.raises(SubmissionError, match="immutable"):
        submit(source, paths.inbox, "set")
    assert submission_path(paths.inbox, "set") == first.path
    with pytest.raises(SubmissionError, match="no file in the inbox"):
        submission_path(paths.inbox, "other")
    assert submitted_sha256(paths.inbox, "set") == first.sha256


def test_submit_replaces_only_a_set_that_was_never_ingested(
    paths: FabricPaths, tmp_path: Path
) -> None:
    old = tmp_path / "old.parquet"
    old.write_bytes(b"not parquet at all")
    submit(old, paths.inbox, "s")
    new = tmp_path / "new.jsonl"
    new.write_text('{"id": 1, "text": "fixed"}\n')
    with pytest.raises(SubmissionError, match="is ingested with different content"):
        submit(new, paths.inbox, "s", ingested=lambda name: True)
    asked: list[str] = []

    def never_ingested(name: str) -> bool:
        asked.append(name)
        return False

    staged = submit(new, paths.inbox, "s", ingested=never_ingested)
    assert asked == ["s"]
    assert sorted(p.name for p in paths.inbox.iterdir()) == [".submitted", "s.jsonl"]
    assert submitted_sha256(paths.inbox, "s") == staged.sha256
    # The same file again is still a no-op, whatever `ingested` would say.
    assert submit(new, paths.inbox, "s", ingested=lambda name: True) == staged


def test_a_dropped_file_is_recorded_once_when_first_seen(paths: FabricPaths) -> None:
    (paths.inbox / "drop.jsonl").write_text('{"id": 1, "text": "x"}\n')
    accepted, _ = scan(paths.inbox)
    assert record_first_seen(paths.inbox, accepted) == accepted
    (paths.inbox / "drop.jsonl").write_text('{"id": 1, "text": "changed"}\n')
    again, _ = scan(paths.inbox)
    assert record_first_seen(paths.inbox, again) == []  # the first hash stays the record
    assert submitted_sha256(paths.inbox, "drop") == accepted[0].sha256 != again[0].sha256
    assert [a.task_set for a in again] == ["drop"]  # the record folder is not a submission


def test_a_scan_hashes_only_files_that_changed_since_the_last(
    paths: FabricPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric_pipelines.lib.core.files import sha256_file
    from fabric_pipelines.lib.tasks import inbox

    hashed: list[str] = []

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return sha256_file(path)

    monkeypatch.setattr(inbox, "sha256_file", counting)
    for name in ("a", "b"):
        (paths.inbox / f"{name}.jsonl").write_text(f'{{"id": 1, "text": "{name}"}}\n')
    first, _ = scan(paths.inbox)
    assert sorted(hashed) == ["a.jsonl", "b.jsonl"]
    hashed.clear()
    again, _ = scan(paths.inbox)
    assert hashed == [] and again == first  # unchanged: nothing read again
    (paths.inbox / "b.jsonl").write_text('{"id": 1, "text": "c"}\n')  # same size, new content
    changed, _ = scan(paths.inbox)
    assert hashed == ["b.jsonl"]
    assert changed[0] == first[0] and changed[1].sha256 == sha256_file(paths.inbox / "b.jsonl")
    assert changed[1].sha256 != first[1].sha256


def test_scan_rejects_links_out_of_the_inbox_and_bad_names(
    paths: FabricPaths, tmp_path: Path
) -> None:
    outside = tmp_path / "secret.jsonl"
    outside.write_text('{"id": 1, "text": "x"}\n')
    (paths.inbox / "escape.jsonl").symlink_to(outside)
    (paths.inbox / "fine.jsonl").write_text('{"id": 1, "text": "x"}\n')
    (paths.inbox / "has space.jsonl").write_text("{}\n")
    (paths.inbox / "notes.txt").write_text("hi")
    (paths.inbox / ".fine.jsonl.tmp-1").write_text("partial")
    accepted, rejected = scan(paths.inbox)
    assert [a.task_set for a in accepted] == ["fine"]
    reasons = {r.path.name: r.reason for r in rejected}
    assert "outside the inbox" in reasons["escape.jsonl"]
    assert "is not allowed" in reasons["has space.jsonl"]
    assert "unsupported type" in reasons["notes.txt"]
    with pytest.raises(SubmissionError, match="outside the inbox"):
        submission_path(paths.inbox, "escape")


def test_database_passwords_never_appear_in_what_is_shown() -> None:
    shown = redact_url("postgresql+psycopg://fabric:s3cret@db.example:5432/results")
    assert "s3cret" not in shown and "***" in shown
