"""Every file the product stores is written here, one way: a staging name unique to the call,
its sha256, fsync, rename (a link for a file made only once, `write_once`), fsync of the folder.

A crash leaves the old file or the new one, never half of one; two threads or processes writing at
once never share a staging file (its name carries the process, the thread and a random part).
Readers check the recorded hash with `verify_sha256` before trusting a file.

Where the recorded hash comes from depends on how the file is written:
  - streamed (`stream_file`, `stream_content_addressed`, `write_bytes`): the writer gets a
    `HashingWriter` and each chunk is hashed as it is handed to the OS, so the hash is of the
    bytes handed to the OS, in order (a size check after fsync refuses a file written around the
    stream). The file is not read back: a read right after the write comes from the page cache,
    not the disk, so it would hash the same bytes again and check nothing more, at the price of
    another pass over the file (reading and hashing cost about half a second per GB here: more
    than writing it). Damage after the write, on the disk or by hand, is what `verify_sha256`
    finds when the file is read.
  - written by a function given the staging path (`write_file`, `write_content_addressed`, for a
    library that writes to a path itself): the staged file is read back and hashed.
  - made of pieces already in memory (`store_pieces_content_addressed`: a FAISS index's lists):
    the pieces are written at their offsets by several threads while one thread hashes them in
    file order, so a large file costs about its hashing, not a stream's one-thread write.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

CHUNK_BYTES = 8 << 20  # what a streaming writer (FAISS) should hand over at a time
BACKGROUND_HASH_BYTES = 1 << 20  # chunks this large are hashed beside the write, not after it
HASHES_IN_FLIGHT = 4  # chunks (held, not copied) hashed behind the write at most
WRITEBACK_BYTES = 64 << 20  # a stream asks the OS to start writing to disk this often
SYNC_FILE_RANGE_WRITE = 2  # Linux: start writeback of the range's dirty pages, do not wait
PIECE_WRITERS = 8  # threads writing a file's pieces at their offsets
PIECE_BYTES = 64 << 20  # a piece is written (and its writeback started) this much at a time

Chunk = bytes | bytearray | memoryview


class CorruptFileError(IOError):
    """A stored file whose bytes no longer hash to what was recorded."""


@dataclass(frozen=True)
class StoredFile:
    path: Path
    sha256: str
    bytes: int


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's sync_file_range (not in `os`), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()


class HashingWriter:
    """A staging file as a stream: every chunk goes to the OS and into the file's sha256, in order.

    Large chunks are hashed on a thread of the writer's own while the caller writes them (the
    write and hashlib both let other threads run), so a file costs about the longer of writing
    and hashing it, not their sum. Up to HASHES_IN_FLIGHT `bytes` chunks are held for hashing
    after `write` returns; any other buffer (one its owner may reuse) is hashed before `write`
    returns. Every WRITEBACK_BYTES the OS is asked to start writing what it has to the disk
    (Linux), so the fsync that closes the file waits for the last piece, not the whole file."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._digest = hashlib.sha256()
        self._size = 0
        self._hasher: ThreadPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()
        self._small = bytearray()  # small chunks gathered while large ones are hashed behind
        self._written_back = 0  # the file's first bytes, up to here, are being written to disk

    closed = False  # a writable file to those that ask (pyarrow.PythonFile)

    @property
    def bytes_written(self) -> int:
        return self._size

    def flush(self) -> None:
        """Nothing to do: every chunk went to the file's own handle, flushed before fsync."""

    def write(self, chunk: Chunk) -> int:
        size = memoryview(chunk).nbytes
        if self._hasher is None and size < BACKGROUND_HASH_BYTES:
            self._handle.write(chunk)
            self._digest.update(chunk)
        elif size < BACKGROUND_HASH_BYTES:  # in order behind the large chunks still hashing
            self._handle.write(chunk)
            self._small += chunk
            if len(self._small) >= BACKGROUND_HASH_BYTES:
                self._hash_small()
        else:
            self._hash_small()
            self._pending.append(self._hashing().submit(self._digest.update, chunk))
            self._handle.write(chunk)
            keep = HASHES_IN_FLIGHT - 1 if isinstance(chunk, bytes) else 0
            while len(self._pending) > keep:
                self._pending.popleft().result()
        self._size += size
        if self._size - self._written_back >= WRITEBACK_BYTES:
            self._start_writeback()
        return size

    def hexdigest(self) -> str:
        """The sha256 of everything written (call once, when done)."""
        self._hash_small()
        while self._pending:
            self._pending.popleft().result()
        return self._digest.hexdigest()

    def _start_writeback(self) -> None:
        """Ask the OS to start writing the bytes written since the last time to the disk, without
        waiting (a hint: refused or missing, the closing fsync does it all)."""
        if _SYNC_FILE_RANGE is not None:
            start, length = self._written_back, self._size - self._written_back
            _SYNC_FILE_RANGE(self._handle.fileno(), start, length, SYNC_FILE_RANGE_WRITE)
        self._written_back = self._size

    def _hashing(self) -> ThreadPoolExecutor:
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        return self._hasher

    def _hash_small(self) -> None:
        if self._small:
            self._pending.append(self._hashing().submit(self._digest.update, bytes(self._small)))
            self._small.clear()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True, cancel_futures=True)


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


def _stage(
    folder: Path, name: str, fill: Callable[[Path], tuple[str, int]]
) -> tuple[Path, str, int]:
    """`fill(staging)` writes, fsyncs and hashes the staged file, returning (sha256, bytes); the
    caller renames or removes it."""
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
        sha, size = fill(staging)
        return staging, sha, size
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def _read_back(write: Callable[[Path], object]) -> Callable[[Path], tuple[str, int]]:
    """`write(staging)`, fsync, then hash what is in the staged file."""

    def fill(staging: Path) -> tuple[str, int]:
        write(staging)
        with open(staging, "rb+") as handle:
            os.fsync(handle.fileno())
        return sha256_file(staging), staging.stat().st_size

    return fill


def _streamed(write: Callable[[HashingWriter], object]) -> Callable[[Path], tuple[str, int]]:
    """`write(out)` into the staged file, hashed as it goes (HashingWriter), then fsync."""

    def fill(staging: Path) -> tuple[str, int]:
        with open(staging, "xb") as handle, HashingWriter(handle) as out:
            write(out)
            sha = out.hexdigest()
            handle.flush()
            os.fsync(handle.fileno())
            on_disk = os.fstat(handle.fileno()).st_size
        if on_disk != out.bytes_written:  # written around the stream: the hash would not match
            raise OSError(
                f"{staging} holds {on_disk} bytes but {out.bytes_written} were streamed into it"
            )
        return sha, on_disk

    return fill


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
    staging, sha, size = _stage(path.parent, path.name, _read_back(write))
    return _publish(staging, path, sha, size)


def stream_file(path: Path, write: Callable[[HashingWriter], object]) -> StoredFile:
    """Store at `path` what `write(out)` writes to `out` (chunk by chunk, hashed as they go),
    atomically and durably."""
    staging, sha, size = _stage(path.parent, path.name, _streamed(write))
    return _publish(staging, path, sha, size)


def write_bytes(path: Path, data: bytes) -> StoredFile:
    return stream_file(path, lambda out: out.write(data))


def write_once(path: Path, data: bytes) -> bytes:
    """Store `data` at `path` unless a file is there already; returns the bytes in place.

    Staged and fsynced like every file here, then linked (not renamed) onto its name: a link
    fails where the name exists, so of callers racing to create it one wins and all of them
    return the winner's bytes (a data root's identity is made once, whoever uses it first)."""
    staging, _, _ = _stage(path.parent, path.name, _streamed(lambda out: out.write(data)))
    try:
        with contextlib.suppress(FileExistsError):
            os.link(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    fsync_folder(path.parent)
    return path.read_bytes()


def copy_file(source: Path, path: Path) -> StoredFile:
    """Store a copy of `source` at `path`, hashed as it is written: one read of the source, no
    read-back (a large submitted file is copied once, not copied and then read again)."""

    def copy(out: HashingWriter) -> None:
        with open(source, "rb") as handle:
            for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
                out.write(block)

    return stream_file(path, copy)


def write_content_addressed(
    folder: Path, suffix: str, write: Callable[[Path], object], *, fan_out: bool = False
) -> StoredFile:
    """Store what `write` writes under the name its own sha256 gives it: `<sha256><suffix>`,
    in `folder` or (fan_out) in `folder/<first two hex digits>/`. Identical content lands on one
    file; a rename over an existing copy replaces it with the same bytes."""
    staging, sha, size = _stage(folder, f"new{suffix}", _read_back(write))
    return _content_addressed(folder, suffix, staging, sha, size, fan_out)


def stream_content_addressed(
    folder: Path, suffix: str, write: Callable[[HashingWriter], object], *, fan_out: bool = False
) -> StoredFile:
    """write_content_addressed for a writer that streams into `out` (stream_file)."""
    staging, sha, size = _stage(folder, f"new{suffix}", _streamed(write))
    return _content_addressed(folder, suffix, staging, sha, size, fan_out)


def store_pieces_content_addressed(
    folder: Path, suffix: str, pieces: Sequence[Chunk], *, fan_out: bool = False
) -> StoredFile:
    """write_content_addressed for a file that is `pieces` (buffers in memory) one after the
    other. They are neither copied nor joined: PIECE_WRITERS threads write them at their offsets
    in PIECE_BYTES runs, taken in file order, while one thread hashes them in order. The
    pieces must not change until this returns."""
    staging, sha, size = _stage(folder, f"new{suffix}", _from_pieces(pieces))
    return _content_addressed(folder, suffix, staging, sha, size, fan_out)


def _from_pieces(pieces: Sequence[Chunk]) -> Callable[[Path], tuple[str, int]]:
    """Write `pieces` into the staged file in parallel, hash them in order, then fsync."""
    views = [memoryview(piece).cast("B") for piece in pieces]
    runs: list[tuple[int, memoryview]] = []  # (offset, bytes), in file order
    offset = 0
    for view in views:
        for start in range(0, len(view), PIECE_BYTES):
            runs.append((offset + start, view[start : start + PIECE_BYTES]))
        offset += len(view)
    total = offset

    def digest() -> str:
        sha = hashlib.sha256()
        for view in views:
            sha.update(view)  # hashlib lets the writers run meanwhile
        return sha.hexdigest()

    def fill(staging: Path) -> tuple[str, int]:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            taken = iter(runs)
            lock = threading.Lock()

            def write_runs() -> None:
                while True:
                    with lock:  # the next run in file order, so the disk is filled front to back
                        run = next(taken, None)
                    if run is None:
                        return
                    at, view = run
                    done = 0
                    while done < len(view):
                        done += os.pwrite(fd, view[done:], at + done)
                    if _SYNC_FILE_RANGE is not None:  # start its writeback: fsync waits less
                        _SYNC_FILE_RANGE(fd, at, len(view), SYNC_FILE_RANGE_WRITE)

            with ThreadPoolExecutor(PIECE_WRITERS + 1, thread_name_prefix="pieces") as pool:
                hashed = pool.submit(digest)
                writers = [pool.submit(write_runs) for _ in range(PIECE_WRITERS)]
                for writer in writers:
                    writer.result()
                sha = hashed.result()
            os.fsync(fd)
            on_disk = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if on_disk != total:
            raise OSError(f"{staging} holds {on_disk} bytes but its pieces are {total}")
        return sha, total

    return fill


def _content_addressed(
    folder: Path, suffix: str, staging: Path, sha: str, size: int, fan_out: bool
) -> StoredFile:
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
