"""Which column of `embeddings` holds a row's vector, and its stored bytes read back from any.

Every row has exactly one of:
- `vector` bytea: the stored bytes (little-endian float32, or an output variant's encoding;
  fabric_gpu/variants.py). Always there; the only one on SQLite and without pgvector.
- `embedding` vector: float32 rows, where pgvector is installed (migration 0002).
- `embedding_half` halfvec: `float16` rows, and `embedding_bits` bit varying: `binary` rows'
  packed sign bits, where pgvector is 0.7 or newer (migration 0013).
Int8 rows are always bytes (pgvector has no int8 type). Readers select `select_sql()` and turn
the fields into the stored bytes with `stored_bytes`, so nothing else needs to know the columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, Engine, text

BYTES = "vector"
FLOAT32 = "embedding"
HALF = "embedding_half"
BITS = "embedding_bits"


@dataclass(frozen=True)
class VectorColumns:
    """The pgvector columns this schema has (none on SQLite)."""

    float32: bool = False
    half: bool = False
    bits: bool = False

    @staticmethod
    def of(conn: Connection) -> VectorColumns:
        if conn.dialect.name != "postgresql":
            return VectorColumns()
        # Asked of the catalogue, not the inspector, which does not know pgvector's types.
        names = set(
            conn.execute(
                text(
                    "select column_name from information_schema.columns "
                    "where table_schema = current_schema() and table_name = 'embeddings' "
                    "and column_name in (:a, :b, :c)"
                ),
                {"a": FLOAT32, "b": HALF, "c": BITS},
            ).scalars()
        )
        return VectorColumns(FLOAT32 in names, HALF in names, BITS in names)

    @staticmethod
    def of_engine(engine: Engine) -> VectorColumns:
        if engine.dialect.name != "postgresql":
            return VectorColumns()
        with engine.connect() as conn:
            return VectorColumns.of(conn)

    def column_for(self, rows: np.ndarray) -> str:
        """The column rows of this dtype go to: float32 -> `embedding`, float16 ->
        `embedding_half`, packed bits (uint8) -> `embedding_bits` where the schema has them;
        `vector` (bytes) otherwise."""
        if rows.dtype == np.float32 and self.float32:
            return FLOAT32
        if rows.dtype == np.float16 and self.half:
            return HALF
        if rows.dtype == np.uint8 and self.bits:
            return BITS
        return BYTES

    def select_sql(self) -> str:
        """`fields()` as a select list."""
        return ", ".join(self.fields())

    def fields(self) -> list[str]:
        """SQL of a row's vector fields, `vector` first, then each pgvector column's binary
        value less its head (vector and halfvec: 16-bit dimension and 16-bit zero; bit varying:
        32-bit bit length)."""
        fields = [BYTES]
        if self.float32:
            fields.append(f"substring(vector_send({FLOAT32}) from 5)")
        if self.half:
            fields.append(f"substring(halfvec_send({HALF}) from 5)")
        if self.bits:
            fields.append(f"substring(varbit_send({BITS}) from 5)")
        return fields

    @property
    def width(self) -> int:
        """How many fields `select_sql` gives."""
        return 1 + self.float32 + self.half + self.bits

    def stored_bytes(self, fields: Sequence[Any]) -> bytes:
        """`select_sql`'s fields of one row -> its stored bytes (the little-endian encoding a
        `vector` bytea would hold)."""
        if fields[0] is not None:
            return bytes(fields[0])
        place = 1
        for present, big_endian in ((self.float32, ">f4"), (self.half, ">f2"), (self.bits, None)):
            if not present:
                continue
            value = fields[place]
            place += 1
            if value is None:
                continue
            raw = bytes(value)
            if big_endian is None:
                return raw  # packed bits, the first bit high: as np.packbits writes them
            return (
                np.frombuffer(raw, dtype=big_endian).astype(big_endian.replace(">", "<")).tobytes()
            )
        raise ValueError("an embeddings row with no vector in any column")


NO_PGVECTOR = VectorColumns()  # SQLite, or PostgreSQL without the extension: bytes only
