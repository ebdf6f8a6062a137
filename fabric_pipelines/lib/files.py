"""Every file the product stores is written here, one way: a staging name unique to the call, fsync,
the sha256 of what reached the disk, rename, fsync of the folder.

A crash leaves the old file or the new one, never half of one; two threads or processes writing at
once never share a staging file (its name carries the process, the thread and a random part); the
hash a caller records is read back from the staged file, so it describes the bytes on disk, not the
bytes the writer meant to write. Readers check that hash with `verify_sha256` before trusting a file.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class CorruptFileError(IOError):
    """A stored file whose bytes no longer hash to what was recorded."""


@dataclass(frozen=True)
class StoredFile:
    path: Path
    sha256: str
    bytes: int


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def staging_path(folder: Path, name: str) -> Path:
    """A name in `folder` no other call uses: process, thread and 48 random bits.

    It starts with a dot, so folder scans (the inbox sensor, `fabric verify`) skip it."""
    unique = f"{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:12]}"
    return folder / f".{name}.staging-{unique}"


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable: the folder's entry list is flushed like a file."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stage(folder: Path, name: str, write: Callable[[Path], object]) -> tuple[Path, str, int]:
    """`write(staging)`, fsync, hash what is on disk; the caller renames or removes it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. a file where the folder should be, a read-only disk
        raise OSError(
            error.errno,
            f"cannot store files in {folder}: {error.strerror}; make it a writable folder "
            "(check that the path is a folder, its permissions and free space) and run again",
        ) from error
    staging = staging_path(folder, name)
    try:
        write(staging)
        with open(staging, "rb+") as handle:
            os.fsync(handle.fileno())
        return staging, sha256_file(staging), staging.stat().st_size
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _publish(staging: Path, final: Path, sha: str, size: int) -> StoredFile:
    """Rename a staged file onto its final name and make the rename durable."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, final)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    fsync_folder(final.parent)
    return StoredFile(final, sha, size)


def write_file(path: Path, write: Callable[[Path], object]) -> StoredFile:
    """Store at `path` what `write(tmp_path)` writes into a file, atomically and durably."""
    staging, sha, size = _stage(path.parent, path.name, write)
    return _publish(staging, path, sha, size)


def write_bytes(path: Path, data: bytes) -> StoredFile:
    return write_file(path, lambda tmp: tmp.write_bytes(data))


def write_content_addressed(
    folder: Path, suffix: str, write: Callable[[Path], object], *, fan_out: bool = False
) -> StoredFile:
    """Store what `write` writes under the name its own sha256 gives it: `<sha256><suffix>`,
    in `folder` or (fan_out) in `folder/<first two hex digits>/`. Identical content lands on one
    file; a rename over an existing copy replaces it with the same bytes."""
    staging, sha, size = _stage(folder, f"new{suffix}", write)
    final = (folder / sha[:2] if fan_out else folder) / f"{sha}{suffix}"
    return _publish(staging, final, sha, size)


def verify_sha256(path: Path, expected: str, what: str, remedy: str) -> None:
    """Refuse a missing file, or one whose sha256 is not the one recorded when it was written."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is missing; {remedy}")
    actual = sha256_file(path)
    if actual != expected:
        raise CorruptFileError(
            f"{what} {path} is corrupt: sha256 {actual} but {expected} was recorded when it "
            f"was written; {remedy}"
        )
