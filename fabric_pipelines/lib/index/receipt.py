"""Index receipts: everything needed to rebuild an index, as canonical JSON.

Canonical means sorted keys, no insignificant whitespace, UTF-8: the same receipt always has the
same bytes, so its sha256 identifies it and is the index asset's data version.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from typing import Any

import faiss
import numpy as np
import torch

RECEIPT_SCHEMA = "fabric.index_receipt/2"
BLOCK_BYTES = 1 << 24  # rows gathered per hash update when hashing a selection of rows


def canonical_json(receipt: dict[str, Any]) -> bytes:
    return json.dumps(
        receipt, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def receipt_sha256(receipt: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(receipt)).hexdigest()


def array_sha256(array: np.ndarray, rows: np.ndarray | None = None) -> str:
    """sha256 of an array's little-endian bytes in C order (of `rows` of it, when given, in that
    order). Hashed in place, or a block of rows at a time: no whole copy is made."""
    digest = hashlib.sha256()
    if rows is None:
        _update(digest, array)
    else:
        step = max(1, BLOCK_BYTES // max(1, array[:1].nbytes))
        for start in range(0, len(rows), step):
            _update(digest, array[rows[start : start + step]])
    return digest.hexdigest()


def _update(digest: Any, array: np.ndarray) -> None:
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    digest.update(a.data.cast("B"))  # hashlib lets other threads run meanwhile


def library_versions() -> dict[str, str]:
    """Versions and FAISS compile options (SIMD level decides which kernels ran)."""
    return {
        "faiss": faiss.__version__,
        "faiss_compile_options": faiss.get_compile_options(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
