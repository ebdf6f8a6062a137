"""PostgreSQL's binary COPY stream of embedding rows, decoded by NumPy rather than row by row.

The stream is a header, then per row a 16-bit field count and per field a 32-bit length (-1 for
NULL) and the value in network byte order, then a 16-bit -1. The rows read here are
(id int8, vector bytea) or, where the table has a pgvector column, (id int8, vector bytea,
pgvector's binary value less its 4-byte head), with exactly one of the last two set. Either way
every row of one dimension has the same size, so a run of rows *is* a NumPy structured array:
decoding is a view and one copy, with no Python object per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
TRAILER = b"\xff\xff"
HEADER_BYTES = len(SIGNATURE) + 8  # then flags and the length of a header extension (none)
ROW_HEAD_BYTES = 22  # field count, id, and the lengths that say a row's kind and dimension
PIECE_BYTES = 8 << 20  # stream joined this much at a time: large enough to amortise, small
# enough to stay in cache-friendly, reused memory (larger pieces were slower)


class RowLayoutError(ValueError):
    """A row that does not have the first row's layout: another dimension, or no vector."""


@dataclass(frozen=True)
class _Layout:
    dim: int
    bytes_rows: np.dtype  # the row with its vector as little-endian float32 bytes (`vector`)
    pgvector_rows: np.dtype | None  # the same size, its vector from pgvector (big-endian)

    @property
    def size(self) -> int:
        return self.bytes_rows.itemsize

    @classmethod
    def of(cls, dim: int, with_pgvector: bool) -> _Layout:
        head = [("fields", ">i2"), ("id_len", ">i4"), ("id", ">i8"), ("vector_len", ">i4")]
        if not with_pgvector:
            return cls(dim, np.dtype([*head, ("vector", "<f4", (dim,))]), None)
        as_bytes = np.dtype([*head, ("vector", "<f4", (dim,)), ("pgvector_len", ">i4")])
        as_pgvector = np.dtype([*head, ("pgvector_len", ">i4"), ("pgvector", ">f4", (dim,))])
        return cls(dim, as_bytes, as_pgvector)

    def decode(self, data: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors [count, dim]) of the first `count` rows of `data`: views into it."""
        rows = np.frombuffer(data, self.bytes_rows, count=count)
        width = 4 * self.dim
        fields = 2 if self.pgvector_rows is None else 3
        valid = (rows["fields"] == fields) & (rows["id_len"] == 8)
        as_bytes = rows["vector_len"] == width
        if self.pgvector_rows is None:
            if not (valid & as_bytes).all():
                raise RowLayoutError(f"a row other than {self.dim}-dimensional")
            return rows["id"], rows["vector"]
        other = np.frombuffer(data, self.pgvector_rows, count=count)
        valid &= (as_bytes & (rows["pgvector_len"] == -1)) | (
            (rows["vector_len"] == -1) & (other["pgvector_len"] == width)
        )
        if not valid.all():
            raise RowLayoutError(f"a row other than {self.dim}-dimensional, or without a vector")
        if as_bytes.all():
            return rows["id"], rows["vector"]
        if not as_bytes.any():
            return rows["id"], other["pgvector"]
        return rows["id"], np.where(as_bytes[:, None], rows["vector"], other["pgvector"])


def _first_layout(data: bytes, with_pgvector: bool) -> _Layout:
    """The layout of the first row of `data` (which starts with it)."""
    vector_len = int.from_bytes(data[14:18], "big", signed=True)
    if vector_len == -1 and with_pgvector:
        vector_len = int.from_bytes(data[18:22], "big", signed=True)
    if vector_len < 0 or vector_len % 4:
        raise RowLayoutError(f"a row whose vector holds {vector_len} bytes")
    return _Layout.of(vector_len // 4, with_pgvector)


def _after_header(data: bytes) -> bytes:
    if not data.startswith(SIGNATURE) or len(data) < len(SIGNATURE) + 8:
        raise RowLayoutError("not a binary COPY stream")
    extension = int.from_bytes(data[len(SIGNATURE) + 4 : len(SIGNATURE) + 8], "big")
    return data[len(SIGNATURE) + 8 + extension :]


def vector_rows(
    messages: Iterable[bytes | bytearray | memoryview], with_pgvector: bool
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids int64-like, vectors float32-like [m, dim]) for each run of rows of the stream
    `messages` (as a COPY ... TO STDOUT (FORMAT BINARY) hands it out), in stream order. The arrays
    are views: copy them before the next run. Raises RowLayoutError at a row of another
    dimension or without a vector."""
    layout: _Layout | None = None
    rest = b""  # what the previous piece ended with: the start of a row (or of the stream)
    parts: list[bytes | bytearray | memoryview] = []
    size = 0
    started = False
    messages = iter(messages)
    while True:
        message = next(messages, None)
        if message is not None:
            parts.append(message)
            size += len(message)
            if size < PIECE_BYTES:
                continue
        data = b"".join([rest, *parts])
        parts, size = [], 0
        if not started and (len(data) >= HEADER_BYTES or message is None):
            data = _after_header(data)
            started = True
        if started and layout is None and len(data) >= ROW_HEAD_BYTES:
            layout = _first_layout(data, with_pgvector)
        if layout is not None and len(data) >= layout.size:
            count = len(data) // layout.size
            yield layout.decode(data, count)
            data = data[count * layout.size :]
        rest = data
        if message is None:
            break
    if rest != TRAILER:
        raise RowLayoutError("a row of another size where the stream should have ended")
