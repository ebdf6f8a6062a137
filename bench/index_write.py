"""Storing a served IVF-Flat index: its lists written in pieces on several threads while one
thread hashes them (`index_file.store_index`) against FAISS's own one-thread stream into the
same atomic, hashed, fsynced file (`faiss.write_index` through files.HashingWriter), alternating
in one run, with the disk's and sha256's own speeds beside them.

    python bench/index_write.py                      # 1,000,000 x 768, 1,024 lists (3 GB)
    python bench/index_write.py --rows 200000 --dir /some/disk

Both ways write the same bytes (checked by their sha256). The rows are random: what is timed is
the write, not the build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fabric_pipelines.lib.core.files import (
    CHUNK_BYTES,
    HashingWriter,
    stream_content_addressed,
)
from fabric_pipelines.lib.index.build import add_rows
from fabric_pipelines.lib.index.index_file import store_index


def build(rows: int, dim: int, nlist: int) -> faiss.Index:
    rng = np.random.default_rng(0)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.quantizer.add(rng.random((nlist, dim), dtype=np.float32))
    index.is_trained = True
    step = 100_000
    for start in range(0, rows, step):
        n = min(step, rows - start)
        x = rng.random((n, dim), dtype=np.float32)
        add_rows(index, x, np.arange(start, start + n), rng.integers(0, nlist, n))
    index.nprobe = 16
    return index


def streamed(folder: Path, index: faiss.Index) -> str:
    def write(out: HashingWriter) -> None:
        faiss.write_index(index, faiss.PyCallbackIOWriter(out.write, CHUNK_BYTES))  # type: ignore[attr-defined]

    return stream_content_addressed(folder, ".faiss", write).sha256


def in_pieces(folder: Path, index: faiss.Index) -> str:
    return store_index(folder, index)[0]


def disk_alone(folder: Path, size: int) -> None:
    """`size` bytes written on one thread and fsynced: what the disk takes, no hashing."""
    block = np.ones(64 << 20, dtype=np.uint8)
    path = folder / "disk.bin"
    with open(path, "wb") as handle:
        left = size
        while left > 0:
            left -= handle.write(block[: min(left, len(block))])
        handle.flush()
        os.fsync(handle.fileno())
    path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--lists", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", help="where to write (default: a temporary folder in /tmp)")
    args = parser.parse_args()
    index = build(args.rows, args.dim, args.lists)
    size = len(faiss.serialize_index(faiss.IndexFlat(1))) + args.rows * (args.dim * 4 + 8)
    root = Path(tempfile.mkdtemp(prefix="index-write-", dir=args.dir))
    times: dict[str, list[float]] = {"stream": [], "pieces": [], "disk": [], "sha256": []}
    shas = set()
    try:
        for _ in range(args.repeat):
            for name, way in (("stream", streamed), ("pieces", in_pieces)):
                folder = root / name
                started = time.perf_counter()
                shas.add(way(folder, index))
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(folder)
            started = time.perf_counter()
            disk_alone(root, size)
            times["disk"].append(time.perf_counter() - started)
            data = np.ones(size, dtype=np.uint8)
            started = time.perf_counter()
            hashlib.sha256(data.data).hexdigest()
            times["sha256"].append(time.perf_counter() - started)
            del data
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if len(shas) != 1:
        raise SystemExit(f"the two ways wrote different bytes: {sorted(shas)}")
    best = {name: min(values) for name, values in times.items()}
    gbps = {name: round(size / 1e9 / seconds, 2) for name, seconds in best.items()}
    ratio = round(best["pieces"] / best["stream"], 3)
    print(
        f"{args.rows:,} x {args.dim}, {args.lists} lists ({size / 1e9:.2f} GB), best of "
        f"{args.repeat}: pieces {best['pieces']:.2f} s ({gbps['pieces']} GB/s), FAISS stream "
        f"{best['stream']:.2f} s ({gbps['stream']} GB/s): {ratio}x; the disk alone (one thread, "
        f"fsync) {gbps['disk']} GB/s, sha256 alone {gbps['sha256']} GB/s"
    )
    summary = {
        "rows": args.rows,
        "dim": args.dim,
        "bytes": size,
        "seconds": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
        "gb_per_s": gbps,
        "ratio_pieces_vs_stream": ratio,
        "median_pieces_s": round(statistics.median(times["pieces"]), 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
