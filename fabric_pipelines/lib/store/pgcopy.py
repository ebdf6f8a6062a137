"""PostgreSQL's binary COPY format, built for a whole batch at once.

A binary COPY stream is a header, then per row a 16-bit field count and per field a 32-bit
length and the value in network byte order, then a trailer. When every field has a fixed width
(the embeddings table), all rows share one layout: a NumPy structured array with big-endian
fields *is* the payload, filled column by column with no per-row Python.
"""

from __future__ import annotations

import numpy as np

from fabric_pipelines.lib.store.vector_columns import BITS, BYTES, FLOAT32, HALF

HEADER = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
TRAILER = (-1).to_bytes(2, "big", signed=True)


def embeddings_payload(
    task_set_id: np.ndarray,
    record_no: np.ndarray,
    model_id: np.ndarray,
    n_tokens: np.ndarray,
    vectors: np.ndarray,
    column: str = BYTES,
) -> bytearray:
    """Rows for `COPY embeddings (task_set_id, record_no, model_id, n_tokens, <column>)
    FROM STDIN (FORMAT BINARY)` (store/vector_columns.py names the columns). For `vector`, bytea
    of each row's stored bytes (`vectors` uint8 [rows, row bytes]); for pgvector's columns their
    binary values of `vectors` [rows, width]: `embedding` (float32) and `embedding_half`
    (float16) a 16-bit dimension, a 16-bit zero and the values in network order;
    `embedding_bits` (packed bits, uint8) a 32-bit bit length, then the bytes."""
    rows, width = vectors.shape
    value: list[tuple[str, str] | tuple[str, str, tuple[int]]]
    if column in (FLOAT32, HALF):
        kind = ">f4" if column == FLOAT32 else ">f2"
        value = [("dim", ">i2"), ("unused", ">i2"), ("vector", kind, (width,))]
        vector_bytes = 4 + np.dtype(kind).itemsize * width
    elif column == BITS:
        value = [("bit_length", ">i4"), ("vector", "u1", (width,))]
        vector_bytes = 4 + width
    elif column == BYTES:  # bytea: the stored bytes as they are
        value = [("vector", "u1", (width,))]
        vector_bytes = width
    else:
        raise ValueError(f"embeddings has no vector column {column!r}")
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
    if column in (FLOAT32, HALF):
        out["dim"] = width
        out["unused"] = 0
    elif column == BITS:
        out["bit_length"] = 8 * width
    out["vector"] = vectors  # converted to the field's byte order in this one copy
    return buffer
