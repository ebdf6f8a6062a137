"""Where each shard's rows lie in the served IVF index: the one stored copy of the lists.

The served index's list l holds shard 0's rows of l, then shard 1's, and so on (publish.py
appends shard after shard). So a shard is, in every list, one run of rows, and the layout — how
many rows of each list each shard holds, an int64 array [shards, lists] — is all it takes to
cut a shard back out of the served index. A receipt of schema 3 stores that layout (a few
hundred KB) instead of every shard's own index file: the lists are written once, not twice
(3 GB at 1 M x 768 float32).

A partial rebuild cuts its kept shards from the previous served index (verified against its
sha256) and appends them with the rebuilt ones, in shard order, as before.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import faiss
import numpy as np

from fabric_pipelines.lib.core.files import stream_content_addressed, verify_sha256
from fabric_pipelines.lib.index.build import list_sizes, set_nprobe

LAYOUT_SUFFIX = ".layout.npy"
LAYOUT_FOLDER = "layouts"


def layout_bytes(counts: np.ndarray) -> bytes:
    """The stored form of a layout: `counts` as a little-endian int64 .npy."""
    out = io.BytesIO()
    np.lib.format.write_array(out, np.ascontiguousarray(counts, dtype="<i8"), allow_pickle=False)
    return out.getvalue()


def layout_sha256(counts: np.ndarray) -> str:
    return hashlib.sha256(layout_bytes(counts)).hexdigest()


def store_layout(folder: Path, counts: np.ndarray) -> tuple[str, str]:
    """Store `counts` ([shards, lists]) content-addressed under folder/layouts/; returns
    (sha256, file relative to `folder`)."""
    data = layout_bytes(counts)
    (folder / LAYOUT_FOLDER).mkdir(parents=True, exist_ok=True)
    stored = stream_content_addressed(
        folder / LAYOUT_FOLDER, LAYOUT_SUFFIX, lambda out: out.write(data)
    )
    return stored.sha256, f"{LAYOUT_FOLDER}/{stored.path.name}"


def read_layout(path: Path, sha256: str) -> np.ndarray:
    """A stored layout, refused unless it hashes to what the receipt recorded."""
    verify_sha256(path, sha256, "index layout file", "fabric index rebuild --receipt writes it")
    counts: np.ndarray = np.load(path, allow_pickle=False)
    return counts


def counts_of(lists: np.ndarray, n_lists: int) -> np.ndarray:
    """How many of a shard's rows each list gets, from their assignment."""
    return np.bincount(np.asarray(lists, dtype=np.int64), minlength=n_lists).astype(np.int64)


def cut_shards(
    served: faiss.Index,
    counts: np.ndarray,
    wanted: list[int],
    trained: faiss.Index,
    nprobe: int,
) -> dict[int, faiss.Index]:
    """The shards `wanted` of `served`, each as an IVF index of its own (a copy of the empty
    `trained` one holding its runs of rows), as filling it with its rows gave at the build.
    Refuses a layout that does not describe `served`."""
    ivf = faiss.extract_index_ivf(served)
    lists = ivf.invlists
    assert lists is not None
    n_shards, n_lists = counts.shape
    if n_lists != ivf.nlist or not np.array_equal(counts.sum(axis=0), list_sizes(served)):
        raise ValueError(
            f"the index layout ({n_shards} shards x {n_lists} lists, "
            f"{int(counts.sum())} rows) does not describe the served index "
            f"({ivf.nlist} lists, {ivf.ntotal} rows)"
        )
    starts = np.cumsum(counts, axis=0) - counts  # each shard's first row in each list
    code_size = lists.code_size
    parts = {}
    for shard in wanted:
        part = faiss.clone_index(trained)
        part_ivf = faiss.extract_index_ivf(part)
        part_lists = part_ivf.invlists
        assert part_lists is not None
        for number in np.flatnonzero(counts[shard]):
            size, start = int(counts[shard, number]), int(starts[shard, number])
            total = lists.list_size(int(number))
            ids = faiss.rev_swig_ptr(lists.get_ids(int(number)), total)[start : start + size]
            codes = faiss.rev_swig_ptr(lists.get_codes(int(number)), total * code_size)
            run = np.ascontiguousarray(codes[start * code_size : (start + size) * code_size])
            ids = np.ascontiguousarray(ids)
            part_lists.add_entries(int(number), size, faiss.swig_ptr(ids), faiss.swig_ptr(run))
        part_ivf.ntotal = int(counts[shard].sum())
        part.ntotal = part_ivf.ntotal  # the same index, or the one wrapping it (a transform)
        set_nprobe(part, nprobe)
        parts[shard] = part
    return parts
