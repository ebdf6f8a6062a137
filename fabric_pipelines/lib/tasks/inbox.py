"""The inbox: where submitted files wait, one per task set, named `<task set>.<jsonl|parquet>`.

`fabric submit` copies a file in atomically; the inbox sensor registers each file it finds. Files
are checked before they are trusted: the name must be a valid task-set name, and a symlink must
point inside the inbox.

The sha256 of each submitted file is recorded beside it, in `.submitted/<task set>.sha256` (by
`submit`, or by the sensor when it first sees a dropped file), so that ingest can refuse a file that
changed after it was submitted instead of reading it silently; beside it, `<task set>.stat` keeps
the file's size, times and inode when it was last hashed, so a scan hashes only files that
changed. Dot-folders are not scanned.

Once its task set is stored, a file leaves the inbox: ingest moves it (one rename) to
`.submitted/<task set>.<suffix>`, beside its recorded sha256. The inbox then holds only what is
waiting, so a scan costs what is waiting, not everything ever submitted; the file is kept, as
submitted, for a task-set file that must be written again (`fabric verify` names the repair).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from fabric_pipelines.lib.core.files import copy_file, fsync_folder, sha256_file, write_bytes
from fabric_pipelines.lib.core.names import InvalidNameError, validate_task_set_name
from fabric_pipelines.lib.tasks.ingest import SUPPORTED_SUFFIXES, SubmissionError

SUBMITTED = ".submitted"
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class InboxFile:
    task_set: str
    path: Path
    sha256: str


@dataclass(frozen=True)
class Rejected:
    path: Path
    reason: str


def set_aside_path(inbox: Path, task_set: str, suffix: str) -> Path:
    """Where the file of a stored task set is kept once it has left the inbox."""
    return inbox / SUBMITTED / f"{validate_task_set_name(task_set)}{suffix}"


def submitted_files(inbox: Path, task_set: str) -> list[Path]:
    """The set's files: waiting in the inbox, else set aside after ingest."""
    waiting = [inbox / f"{task_set}{suffix}" for suffix in SUPPORTED_SUFFIXES]
    waiting = [p for p in waiting if p.exists() or p.is_symlink()]
    if waiting:
        return waiting
    aside = [set_aside_path(inbox, task_set, suffix) for suffix in SUPPORTED_SUFFIXES]
    return [p for p in aside if p.is_file()]


def set_aside(inbox: Path, task_set: str) -> None:
    """Move the stored set's inbox file out of the inbox (kept in `.submitted/`); a file already
    moved, or moved by another run meanwhile, is left as it is."""
    for suffix in SUPPORTED_SUFFIXES:
        waiting = inbox / f"{task_set}{suffix}"
        if waiting.is_file() and not waiting.is_symlink():
            target = set_aside_path(inbox, task_set, suffix)
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                waiting.replace(target)  # one rename: the file is in one place or the other
                fsync_folder(target.parent)
                fsync_folder(inbox)


def submission_path(inbox: Path, task_set: str) -> Path:
    """The file of `task_set` (in the inbox, or set aside once stored); SubmissionError if there
    is none (or more than one)."""
    validate_task_set_name(task_set)
    found = submitted_files(inbox, task_set)
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
        accepted.append(InboxFile(name, path, _known_sha256(inbox, name, path)))
    return accepted, rejected


def _known_sha256(inbox: Path, task_set: str, path: Path) -> str:
    """The file's sha256, hashed again only when the file changed since it was last hashed:
    the sensor scans every 15 s and files stay in the inbox, so re-reading each one every scan
    would cost ever more. A change of content changes the file's ctime (which no user call
    can set back), a replacement its inode."""
    stat = path.stat()
    seen = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns,
            "ino": stat.st_ino}  # fmt: skip
    record = inbox / SUBMITTED / f"{task_set}.stat"
    with contextlib.suppress(OSError, ValueError, TypeError):
        cached = json.loads(record.read_text())
        if {k: cached.get(k) for k in seen} == seen and _SHA256.fullmatch(cached["sha256"]):
            return str(cached["sha256"])
    sha = sha256_file(path)
    write_bytes(record, json.dumps({**seen, "sha256": sha}).encode())
    return sha


def submit(
    source: Path,
    inbox: Path,
    task_set: str,
    *,
    ingested: Callable[[str], bool] | None = None,
) -> InboxFile:
    """Copy `source` into the inbox as `task_set` (atomically) and record its sha256.

    The same file again is a no-op. Other content under the same name is refused, unless
    `ingested` says the set was never ingested: then the new file replaces the old one (a file
    that could not be read at all can be fixed and submitted again). Without `ingested` nothing
    is replaced.
    """
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
    recorded = submitted_sha256(inbox, task_set)
    aside = set_aside_path(inbox, task_set, suffix)
    if recorded == source_sha and aside.is_file():
        return InboxFile(task_set, aside, source_sha)  # stored already, from this very file
    present = [inbox / f"{task_set}{s}" for s in SUPPORTED_SUFFIXES]
    present = [p for p in present if p.exists() or p.is_symlink()]
    if present == [target] and recorded in (None, source_sha) and sha256_file(target) == source_sha:
        if recorded is None:
            record_submitted(inbox, task_set, source_sha)
        return InboxFile(task_set, target, source_sha)  # same file again: nothing to do
    if present or recorded not in (None, source_sha):
        was_ingested = True if ingested is None else ingested(task_set)
        if was_ingested:
            what = "is ingested" if ingested is not None else "was already submitted"
            raise SubmissionError(
                f"task set {task_set!r} {what} with different content "
                f"({', '.join(p.name for p in present) or f'sha256 {recorded}'}); task sets are "
                "immutable, submit the new file under a new name"
            )
        for old in present:  # never ingested: the new file replaces the old one
            if old != target:
                old.unlink()
    stored = copy_file(source, target)
    record_submitted(inbox, task_set, stored.sha256)
    return InboxFile(task_set, target, stored.sha256)


def submitted_path(inbox: Path, task_set: str) -> Path:
    return inbox / SUBMITTED / f"{validate_task_set_name(task_set)}.sha256"


def submitted_sha256(inbox: Path, task_set: str) -> str | None:
    """The sha256 recorded when `task_set`'s file was submitted; None if none was recorded."""
    path = submitted_path(inbox, task_set)
    if not path.is_file():
        return None
    recorded = path.read_text(encoding="ascii", errors="replace").strip()
    return recorded if _SHA256.fullmatch(recorded) else None


def record_submitted(inbox: Path, task_set: str, sha256: str) -> None:
    write_bytes(submitted_path(inbox, task_set), f"{sha256}\n".encode())


def record_first_seen(inbox: Path, files: Iterable[InboxFile]) -> list[InboxFile]:
    """Record the sha256 of every dropped file that has none yet (files not staged by `submit`);
    return those just recorded."""
    recorded = []
    for found in files:
        if submitted_sha256(inbox, found.task_set) is None:
            record_submitted(inbox, found.task_set, found.sha256)
            recorded.append(found)
    return recorded


def forget_submitted(inbox: Path, task_set: str) -> None:
    submitted_path(inbox, task_set).unlink(missing_ok=True)
    (inbox / SUBMITTED / f"{task_set}.stat").unlink(missing_ok=True)
    for suffix in SUPPORTED_SUFFIXES:
        set_aside_path(inbox, task_set, suffix).unlink(missing_ok=True)


def _check_inside(inbox: Path, path: Path) -> None:
    resolved = path.resolve()
    if inbox.resolve() not in resolved.parents:
        raise SubmissionError(
            f"{path.name} is a link to {resolved}, outside the inbox; copy the file in instead"
        )
