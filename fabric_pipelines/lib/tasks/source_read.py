"""Reading an inbox file for its ingest: once, into memory, hashed while it is parsed; and read
ahead, in the process that submitted it, while that process waits for Dagster.

A Parquet file is read into memory once: a thread hashes its bytes while another parses its
columns from them (`plain_parquet`; hashlib and Arrow let go of the GIL). Any other file is only
hashed here; ingest reads it itself and checks the hash again after.

`fabric submit --run` has the file the moment it is submitted, but its ingest step starts only
once Dagster's definitions and instance are made (1-2 s). `read_ahead` starts the same read then,
on threads of its own, and the ingest step in that process takes it over (`take_read_ahead`)
instead of reading the file again. What ingest then uses is the bytes read ahead and their own
sha256, which it checks against the submission record exactly as it checks a file it reads
itself; a read-ahead is taken once, and only for the same path, size, mtime and inode. In any
other process (a run the UI launched, a sensor's) there is none and the file is read as before.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from fabric_pipelines.lib.core.files import sha256_file
from fabric_pipelines.lib.core.futures import done
from fabric_pipelines.lib.tasks.ingest import plain_parquet


@dataclass
class SourceRead:
    """The inbox file as read: the hashing of its bytes, and the parsing of its columns (by
    `plain_parquet`, from the same bytes)."""

    hashing: Future[str]
    parsing: Future[pa.Table | None] | None = None

    def sha256(self) -> str:
        return self.hashing.result()

    def columns(self) -> pa.Table | None:
        return None if self.parsing is None else self.parsing.result()


def read_source(pool: ThreadPoolExecutor, source: Path, *, parse: bool) -> SourceRead:
    """`source` read (a Parquet file to ingest: into memory, hashed and parsed on `pool`)."""
    if not parse or source.suffix.lower() != ".parquet":
        return SourceRead(done(sha256_file(source)))
    with pa.OSFile(str(source), "rb") as handle:
        data = handle.read_buffer()
    return SourceRead(
        hashing=pool.submit(lambda: hashlib.sha256(memoryview(data)).hexdigest()),
        parsing=pool.submit(plain_parquet, data),
    )


# ---- read ahead -------------------------------------------------------------------------------

_Identity = tuple[str, int, int, int]  # resolved path, size, mtime_ns, inode
_ahead: dict[_Identity, Future[SourceRead]] = {}
_lock = threading.Lock()


def _identity(path: Path) -> _Identity:
    stat = path.stat()
    return (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)


def read_ahead(path: Path) -> None:
    """Start reading `path` for its ingest in this process (see the module's doc). A failure
    here is left for the ingest, which then reads the file itself and reports it."""
    try:
        key = _identity(path)
    except OSError:
        return
    pool = ThreadPoolExecutor(2, thread_name_prefix="read-ahead")
    reading: Future[SourceRead] = Future()

    def read() -> None:
        try:
            reading.set_result(read_source(pool, path, parse=True))
        except BaseException as exc:
            reading.set_exception(exc)
        finally:
            pool.shutdown(wait=False)  # the threads end once the hash and the parse are done

    with _lock:
        _ahead[key] = reading
    threading.Thread(target=read, name="read-ahead", daemon=True).start()


def take_read_ahead(path: Path) -> SourceRead | None:
    """The read of `path` started ahead in this process, if the file is still the one it read
    (path, size, mtime, inode) and the read did not fail; None otherwise. Taken once."""
    try:
        key = _identity(path)
    except OSError:
        return None
    with _lock:
        stale = [k for k in _ahead if k[0] == key[0] and k != key]
        for k in stale:  # a read of an earlier version of the file: of no use now
            del _ahead[k]
        reading = _ahead.pop(key, None)
    if reading is None:
        return None
    try:
        found = reading.result()
        found.sha256()  # a read that failed part way is not taken: ingest reads the file again
    except Exception:
        return None
    return found
