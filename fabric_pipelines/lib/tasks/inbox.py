"""The inbox: where submitted files wait, one per task set, named `<task set>.<jsonl|parquet>`.

`fabric submit` copies a file in atomically; the inbox sensor registers each file it finds. Files
are checked before they are trusted: the name must be a valid task-set name, and a symlink must
point inside the inbox.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from fabric_pipelines.lib.names import InvalidNameError, validate_task_set_name
from fabric_pipelines.lib.tasks.ingest import SUPPORTED_SUFFIXES, SubmissionError
from fabric_pipelines.lib.files import sha256_file, write_file


@dataclass(frozen=True)
class InboxFile:
    task_set: str
    path: Path
    sha256: str


@dataclass(frozen=True)
class Rejected:
    path: Path
    reason: str


def submission_path(inbox: Path, task_set: str) -> Path:
    """The inbox file of `task_set`; SubmissionError if there is none (or more than one)."""
    validate_task_set_name(task_set)
    found = [inbox / f"{task_set}{suffix}" for suffix in SUPPORTED_SUFFIXES]
    found = [p for p in found if p.exists()]
    if not found:
        raise SubmissionError(
            f"task set {task_set!r} has no file in the inbox {inbox}; submit it with "
            f"`fabric submit FILE --task-set {task_set}`"
        )
    if len(found) > 1:
        raise SubmissionError(f"task set {task_set!r} has several inbox files: {found}; keep one")
    _check_inside(inbox, found[0])
    return found[0]


def scan(inbox: Path) -> tuple[list[InboxFile], list[Rejected]]:
    """Every acceptable inbox file, and every rejected one with the reason."""
    accepted: list[InboxFile] = []
    rejected: list[Rejected] = []
    if not inbox.is_dir():
        return accepted, rejected
    for path in sorted(inbox.iterdir()):
        if path.name.startswith(".") or path.is_dir():
            continue  # temporary files of an atomic copy, or folders
        if path.suffix.lower() not in SUPPORTED_SUFFIXES:
            rejected.append(
                Rejected(path, f"unsupported type; use {' or '.join(SUPPORTED_SUFFIXES)}")
            )
            continue
        try:
            name = validate_task_set_name(path.stem)
            _check_inside(inbox, path)
        except (InvalidNameError, SubmissionError) as exc:
            rejected.append(Rejected(path, str(exc)))
            continue
        accepted.append(InboxFile(name, path, sha256_file(path)))
    return accepted, rejected


def submit(source: Path, inbox: Path, task_set: str) -> InboxFile:
    """Copy `source` into the inbox as `task_set` (atomically); idempotent for identical files."""
    validate_task_set_name(task_set)
    suffix = source.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise SubmissionError(
            f"{source}: unsupported file type {suffix!r}; submit {' or '.join(SUPPORTED_SUFFIXES)}"
        )
    if not source.is_file():
        raise SubmissionError(f"{source}: no such file")
    inbox.mkdir(parents=True, exist_ok=True)
    target = inbox / f"{task_set}{suffix}"
    source_sha = sha256_file(source)
    for other in SUPPORTED_SUFFIXES:
        existing = inbox / f"{task_set}{other}"
        if existing.exists():
            if existing == target and sha256_file(existing) == source_sha:
                return InboxFile(task_set, target, source_sha)  # same file again: nothing to do
            raise SubmissionError(
                f"task set {task_set!r} was already submitted with different content "
                f"({existing.name}); task sets are immutable, submit under a new name"
            )
    stored = write_file(target, lambda tmp: shutil.copyfile(source, tmp))
    return InboxFile(task_set, target, stored.sha256)


def _check_inside(inbox: Path, path: Path) -> None:
    resolved = path.resolve()
    if inbox.resolve() not in resolved.parents:
        raise SubmissionError(
            f"{path.name} is a link to {resolved}, outside the inbox; copy the file in instead"
        )
