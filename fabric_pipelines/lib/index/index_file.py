"""An index stored as FAISS writes it, named by its sha256 — an IVF-Flat index without FAISS's
one-thread stream.

`faiss.write_index` streams an index through one thread: at 1 M x 768 that is 3 GB written and
hashed at about 1 GB/s after the last row is in. An IVF-Flat index over FAISS's own array lists
is, byte for byte, a short header followed by each list's codes and then its ids, all already in
memory; `ivf_flat_pieces` names those bytes where they lie (the header from FAISS itself, the
lists as views of the index's memory), and files.store_pieces_content_addressed writes them at
their offsets on several threads while one hashes them in order. The file is the same bytes
`faiss.write_index` writes; a check against FAISS on a small index, once per process, keeps it
so (any difference, and every index is streamed by FAISS as before).
"""

from __future__ import annotations

import functools
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import faiss
import numpy as np

from fabric_pipelines.lib.core.files import (
    CHUNK_BYTES,
    Chunk,
    HashingWriter,
    store_pieces_content_addressed,
    stream_content_addressed,
)

# FAISS's record of an index's array lists, when it holds none (index_write.cpp): the fourcc
# "ilar", nlist, code_size, the fourcc "sprs" and an empty vector of (list, size) pairs.
EMPTY_LISTS_BYTES = 4 + 8 + 8 + 4 + 8


def store_index(folder: Path, index: faiss.Index) -> tuple[str, Path]:
    """Store `index` as <folder>/<sha256>.faiss, the bytes `faiss.write_index` writes, hashed
    on the way (never read back); returns (sha256, path). The index must not change meanwhile."""
    pieces = ivf_flat_pieces(index) if _pieces_match_faiss() else None
    if pieces is not None:
        stored = store_pieces_content_addressed(folder, ".faiss", pieces)
        return stored.sha256, stored.path

    def write(out: HashingWriter) -> None:
        writer = faiss.PyCallbackIOWriter(out.write, CHUNK_BYTES)  # type: ignore[attr-defined]
        faiss.write_index(index, writer)

    stored = stream_content_addressed(folder, ".faiss", write)
    return stored.sha256, stored.path


class StoredWhenChosen:
    """quality.measure's `chosen` hook: stores `index` in `folder` (store_index) on a thread of
    its own the moment it is final, while the rest of its quality is measured; `result()`
    waits for the file. A context: leaving it waits for the thread."""

    def __init__(self, folder: Path, index: faiss.Index) -> None:
        self._folder, self._index = folder, index
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="index-store")
        self._stored: Future[tuple[str, Path]] | None = None

    def __call__(self, _: object) -> None:
        self._stored = self._pool.submit(store_index, self._folder, self._index)

    def result(self) -> tuple[str, Path]:
        """(sha256, path) of the stored file."""
        if self._stored is None:
            raise RuntimeError("the index was never chosen, so never stored")
        return self._stored.result()

    def __enter__(self) -> StoredWhenChosen:
        return self

    def __exit__(self, *_: object) -> None:
        self._pool.shutdown(wait=True)


def ivf_flat_pieces(index: faiss.Index) -> list[Chunk] | None:
    """The bytes `faiss.write_index(index)` writes, in order, as pieces (views of the index's own
    memory for the lists): for a plain IndexIVFFlat over ArrayInvertedLists with no direct map;
    None for any other index."""
    ivf = faiss.downcast_index(index)
    if type(ivf) is not faiss.IndexIVFFlat:
        return None
    if ivf.invlists is None or not ivf.direct_map.no():  # no lists, or ids mapped beside them
        return None
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    if not isinstance(lists, faiss.ArrayInvertedLists):
        return None
    # The header: what FAISS writes for the same index holding no rows, less its empty lists.
    empty = faiss.IndexIVFFlat(ivf.quantizer, ivf.d, ivf.nlist, ivf.metric_type)
    empty.metric_arg = ivf.metric_arg
    empty.is_trained = ivf.is_trained
    empty.ntotal = ivf.ntotal
    empty.nprobe = ivf.nprobe
    header = faiss.serialize_index(empty).tobytes()
    nlist, code_size = int(lists.nlist), int(lists.code_size)
    if header[-EMPTY_LISTS_BYTES:] != _lists_record(nlist, code_size, np.zeros(nlist, np.int64)):
        return None  # not the layout this reads: let FAISS write it
    sizes = np.array([lists.list_size(i) for i in range(nlist)], dtype=np.int64)
    pieces: list[Chunk] = [header[:-EMPTY_LISTS_BYTES], _lists_record(nlist, code_size, sizes)]
    for number in np.flatnonzero(sizes):
        size = int(sizes[number])
        codes = faiss.rev_swig_ptr(lists.get_codes(int(number)), size * code_size)
        pieces.append(codes.data)
        pieces.append(faiss.rev_swig_ptr(lists.get_ids(int(number)), size).data)
    return pieces


def _lists_record(nlist: int, code_size: int, sizes: np.ndarray) -> bytes:
    """What FAISS writes of array lists before their contents: every list's size where more than
    half hold rows ("full"), else (list, size) of those that do ("sprs")."""
    held = np.flatnonzero(sizes)
    if len(held) > nlist // 2:
        kind, numbers = b"full", sizes.astype("<u8")
    else:
        kind = b"sprs"
        numbers = np.stack([held, sizes[held]], axis=1).ravel().astype("<u8")
    head = b"ilar" + struct.pack("<QQ", nlist, code_size) + kind
    return head + struct.pack("<Q", len(numbers)) + numbers.tobytes()


@functools.cache
def _pieces_match_faiss() -> bool:
    """Whether this FAISS writes IVF-Flat indexes as `ivf_flat_pieces` reads them: small
    indexes with lists full and sparse, inner product and L2, checked byte for byte."""
    rng = np.random.default_rng(0)
    for metric, rows in ((faiss.METRIC_INNER_PRODUCT, 64), (faiss.METRIC_L2, 2)):
        x = rng.standard_normal((64, 8)).astype(np.float32)
        index = faiss.IndexIVFFlat(faiss.IndexFlat(8, metric), 8, 8, metric)
        index.quantizer.add(x[:8])  # eight rows as the centroids: no training to wait for
        index.is_trained = True
        index.add_with_ids(x[:rows], np.arange(rows, dtype=np.int64) * 7)
        index.nprobe = 3
        pieces = ivf_flat_pieces(index)
        if pieces is None:
            return False
        joined = b"".join(memoryview(p).cast("B").tobytes() for p in pieces)
        if joined != faiss.serialize_index(index).tobytes():
            return False
    return True
