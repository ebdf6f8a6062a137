"""PostgreSQL's binary COPY format, built for a whole batch at once.

A binary COPY stream is a header, then per row a 16-bit field count and per field a 32-bit
length and the value in network byte order, then a trailer. When every field has a fixed width
(the embeddings table), all rows share one layout: a NumPy structured array with big-endian
fields *is* the payload, filled column by column with no per-row Python.
"""

from __future__ import annotations

import numpy as np

HEADER = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
TRAILER = (-1).to_bytes(2, "big", signed=True)


def embeddings_payload(
    task_set_id: np.ndarray,
    record_no: np.ndarray,
    model_id: np.ndarray,
    n_tokens: np.ndarray,
    vectors: np.ndarray,
) -> bytes:
    """Rows for `COPY embeddings (task_set_id, record_no, model_id, n_tokens, vector) FROM STDIN
    (FORMAT BINARY)`; `vectors` is float32 [rows, dim], stored as little-endian bytes."""
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    rows, dim = vectors.shape
    vector_bytes = dim * 4
    layout = np.dtype(
        [
            ("fields", ">i2"),
            ("len_set", ">i4"), ("task_set_id", ">i4"),
            ("len_record", ">i4"), ("record_no", ">i8"),
            ("len_model", ">i4"), ("model_id", ">i4"),
            ("len_tokens", ">i4"), ("n_tokens", ">i4"),
            ("len_vector", ">i4"), ("vector", f"V{vector_bytes}"),
        ]
    )  # fmt: skip
    out = np.empty(rows, dtype=layout)
    out["fields"] = 5
    out["len_set"] = 4
    out["task_set_id"] = task_set_id
    out["len_record"] = 8
    out["record_no"] = record_no
    out["len_model"] = 4
    out["model_id"] = model_id
    out["len_tokens"] = 4
    out["n_tokens"] = n_tokens
    out["len_vector"] = vector_bytes
    out["vector"] = vectors.view(f"V{vector_bytes}").reshape(rows)
    return HEADER + out.tobytes() + TRAILER
