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
    pgvector: bool = False,
) -> bytearray:
    """Rows for `COPY embeddings (task_set_id, record_no, model_id, n_tokens, <vector column>)
    FROM STDIN (FORMAT BINARY)`. The last field is bytea of each row's stored bytes (`vectors`
    uint8 [rows, row bytes]: little-endian float32, or an output variant's encoding), or with
    `pgvector` the extension's binary `vector` value of `vectors` float32 [rows, dim]: 16-bit
    dimension, 16-bit zero, float32 in network order (`embedding`)."""
    rows, dim = vectors.shape
    if pgvector:  # the vector value: its own 4-byte head, then big-endian float32
        value = [("dim", ">i2"), ("unused", ">i2"), ("vector", ">f4", (dim,))]
        vector_bytes = 4 + 4 * dim
    else:  # bytea: the stored bytes as they are
        value = [("vector", "u1", (dim,))]
        vector_bytes = dim
    layout = np.dtype(
        [
            ("fields", ">i2"),
            ("len_set", ">i4"), ("task_set_id", ">i4"),
            ("len_record", ">i4"), ("record_no", ">i8"),
            ("len_model", ">i4"), ("model_id", ">i4"),
            ("len_tokens", ">i4"), ("n_tokens", ">i4"),
            ("len_vector", ">i4"), *value,
        ]
    )  # fmt: skip
    # One buffer: header, rows, trailer. The rows are a structured view into it, so the payload
    # is written once, in place (no concatenation copies of a payload of hundreds of MB).
    buffer = bytearray(len(HEADER) + rows * layout.itemsize + len(TRAILER))
    buffer[: len(HEADER)] = HEADER
    buffer[len(buffer) - len(TRAILER) :] = TRAILER
    out = np.ndarray(rows, dtype=layout, buffer=buffer, offset=len(HEADER))
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
    if pgvector:
        out["dim"] = dim
        out["unused"] = 0
    out["vector"] = vectors  # converted to the field's byte order in this one copy
    return buffer
