"""What a model key's stored vectors are, and the one way to read and make them.

An embedding row's `vector` holds little-endian float32 (pgvector's `embedding` where the
schema has one), or, for a model key made with an output variant (`...~int8:256`;
fabric_gpu/variants.py), that variant's encoding: float16, int8 quantised over the key's recorded
calibration (lib/records/calibration.py), or packed sign bits. Everything that reads rows to compute with
them (combining documents, indexes, export) goes through `StoredCodec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Connection, select

from fabric_gpu.variants import FLOAT32, Int8Calibration, Variant, decode, variant_of_model_key
from fabric_pipelines.lib.records.calibration import recorded_calibration
from fabric_pipelines.lib.store.models import Model

# By a byte of packed bits, its eight bits as -1 / +1, the high bit first.
_BYTE_SIGNS = (
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32) * 2 - 1
)


class MissingCalibrationError(LookupError):
    """Int8 rows whose calibration is not recorded: they cannot be read as values."""


@dataclass(frozen=True)
class StoredCodec:
    variant: Variant = FLOAT32
    calibration: Int8Calibration | None = None

    @staticmethod
    def of_key(conn: Connection, model_key: str) -> StoredCodec:
        variant = variant_of_model_key(model_key)
        if not variant.needs_calibration():
            return StoredCodec(variant)
        calibration = recorded_calibration(conn, model_key)
        if calibration is None:
            raise MissingCalibrationError(
                f"model {model_key}: its int8 calibration is not recorded (int8_calibrations); "
                "its vectors cannot be read as values. Extract the set again under this key."
            )
        return StoredCodec(variant, calibration)

    @staticmethod
    def of_model_id(conn: Connection, model_id: int) -> StoredCodec:
        key = conn.execute(select(Model.model_key).where(Model.id == model_id)).scalar_one()
        return StoredCodec.of_key(conn, str(key))

    @property
    def plain(self) -> bool:
        """Full float32 rows, as every engine made before variants."""
        return self.variant.key_suffix == ""

    def rows(self, blobs: Sequence[bytes]) -> np.ndarray:
        """Stored bytes -> the encoded rows [n, elements] (float32, float16, int8 or packed
        uint8)."""
        joined = np.frombuffer(b"".join(blobs), dtype=self.variant.numpy_dtype)
        return joined.reshape(len(blobs), -1)

    def values(self, encoded: np.ndarray) -> np.ndarray:
        """Float32 values of encoded rows, for computing with: float16 exactly, int8 at the
        middle of its step, binary bits as -1 / +1."""
        if self.variant.encoding == "binary":
            # One gather from a table of each byte's eight signs, first bit high (packbits').
            packed = np.ascontiguousarray(encoded, dtype=np.uint8)
            signs = _BYTE_SIGNS[packed].reshape(len(packed), -1)
            dims = self.variant.dims
            return np.ascontiguousarray(signs[:, :dims]) if dims else signs
        return np.asarray(decode(encoded, self.variant, self.calibration), dtype=np.float32)

    def encode(self, vectors: np.ndarray) -> np.ndarray:
        """Float32 vectors of the stored width -> their rows as stored (the CPU twin)."""
        if self.plain:
            return np.ascontiguousarray(vectors, dtype=np.float32)
        return self.variant.apply_numpy(vectors, self.calibration)
