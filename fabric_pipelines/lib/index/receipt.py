"""Index receipts: everything needed to rebuild an index, as canonical JSON.

Canonical means sorted keys, no insignificant whitespace, UTF-8: the same receipt always has the
same bytes, so its sha256 identifies it and is the index asset's data version.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

import faiss
import numpy as np

RECEIPT_SCHEMA = "fabric.index_receipt/2"


def canonical_json(receipt: dict[str, Any]) -> bytes:
    return json.dumps(
        receipt, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def receipt_sha256(receipt: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(receipt)).hexdigest()


def array_sha256(array: np.ndarray) -> str:
    """sha256 of an array's little-endian bytes in C order."""
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.byteswap().view(a.dtype.newbyteorder("<"))
    return hashlib.sha256(a.tobytes()).hexdigest()


def library_versions() -> dict[str, str]:
    """Versions and FAISS compile options (SIMD level decides which kernels ran)."""
    return {
        "faiss": faiss.__version__,
        "faiss_compile_options": faiss.get_compile_options(),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
