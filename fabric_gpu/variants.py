"""Output variants of pooled vectors: shorter (Matryoshka), unit length or not, float16, int8 and
binary, each computed two ways that must agree, with torch (on the GPU, before the copy to the
host) and with NumPy (the CPU twin).

Order: keep the first `dims` dimensions (Matryoshka), then scale to unit length if `normalize`
(a truncated vector of a normalising model is normalised again), then encode:
- `float32`, `float16`: the values (float16 rounds to nearest, as both libraries do);
- `int8`: scalar quantisation per dimension, as sentence-transformers' `quantize_embeddings`
  does: with a calibration's per-dimension `low` and `high`, `step = (high - low) / 255`,
  `q = trunc((x - low) / step - 128)` clipped to -128..127. The calibration is recorded with
  the vectors (its JSON), so that a query is quantised the same way;
- `binary`: one bit per dimension, 1 where the value is > 0, packed eight to a byte, first
  dimension in the high bit (NumPy's `packbits`, sentence-transformers' `ubinary`).

Both twins compute in float32 with the same operations in the same order, so int8 and binary
agree exactly; the norm is taken in float64 and rounded to float32 on both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

if TYPE_CHECKING:
    import torch

Encoding = Literal["float32", "float16", "int8", "binary"]
ENCODINGS: tuple[str, ...] = ("float32", "float16", "int8", "binary")


class VariantError(ValueError):
    """A variant that cannot be made; the message names the field."""


@dataclass(frozen=True)
class Int8Calibration:
    """Per-dimension range int8 maps onto -128..127, from a sample of the vectors."""

    low: np.ndarray  # float32 [dims]
    high: np.ndarray  # float32 [dims]

    @staticmethod
    def of(sample: np.ndarray) -> Int8Calibration:
        sample = np.asarray(sample, dtype=np.float32)
        if sample.ndim != 2 or len(sample) == 0:
            raise VariantError("int8 calibration: give at least one vector ([rows, dims])")
        return Int8Calibration(sample.min(axis=0), sample.max(axis=0))

    def steps(self) -> np.ndarray:
        span = (self.high - self.low).astype(np.float32)
        # A dimension with one value everywhere: any step maps it to -128.
        return np.where(span > 0, span / np.float32(255), np.float32(1)).astype(np.float32)

    def to_json(self) -> str:
        return json.dumps({"low": self.low.tolist(), "high": self.high.tolist()})

    @staticmethod
    def from_json(text: str) -> Int8Calibration:
        data = json.loads(text)
        return Int8Calibration(
            np.asarray(data["low"], dtype=np.float32), np.asarray(data["high"], dtype=np.float32)
        )


@dataclass(frozen=True)
class Variant:
    encoding: Encoding = "float32"
    dims: int | None = None  # keep the first `dims` dimensions
    normalize: bool = False  # unit length after the truncation

    @staticmethod
    def parse(text: str, normalize: bool = False) -> Variant:
        """`float16`, `int8`, `binary`, `float32`, each optionally with `:DIMS` (e.g. `int8:256`)."""
        encoding, _, dims = text.partition(":")
        if encoding not in ENCODINGS:
            raise VariantError(f"variant {text!r}: the encoding is one of {', '.join(ENCODINGS)}")
        if dims and (not dims.isdigit() or int(dims) == 0):
            raise VariantError(f"variant {text!r}: dims after ':' is a whole number above 0")
        return Variant(cast(Encoding, encoding), int(dims) if dims else None, normalize)

    @property
    def label(self) -> str:
        dims = f":{self.dims}" if self.dims else ""
        return f"{self.encoding}{dims}" + ("+normalized" if self.normalize else "")

    def out_dims(self, dim: int) -> int:
        if self.dims is not None and self.dims > dim:
            raise VariantError(f"variant {self.label}: dims {self.dims} > the model's {dim}")
        return self.dims or dim

    def row_bytes(self, dim: int) -> int:
        """Bytes one vector takes."""
        d = self.out_dims(dim)
        return {"float32": 4 * d, "float16": 2 * d, "int8": d, "binary": (d + 7) // 8}[
            self.encoding
        ]

    def needs_calibration(self) -> bool:
        return self.encoding == "int8"

    # ---- the CPU twin ----------------------------------------------------------------------------

    def apply_numpy(
        self, vectors: np.ndarray, calibration: Int8Calibration | None = None
    ) -> np.ndarray:
        x = self._prepared_numpy(vectors)
        if self.encoding == "float32":
            return x
        if self.encoding == "float16":
            return x.astype(np.float16)
        if self.encoding == "binary":
            return np.packbits(x > 0, axis=1)
        cal = self._calibration(calibration, x.shape[1])
        q = (x - cal.low) / cal.steps() - np.float32(128)
        return np.trunc(np.clip(q, -128, 127)).astype(np.int8)

    def prepared(self, vectors: np.ndarray) -> np.ndarray:
        """The float32 vectors the encoding reads (truncated, normalised): what int8 is
        calibrated on."""
        return self._prepared_numpy(vectors)

    def _prepared_numpy(self, vectors: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(vectors[:, : self.out_dims(vectors.shape[1])], dtype=np.float32)
        if self.normalize:
            norm = np.sqrt((x.astype(np.float64) ** 2).sum(axis=1, keepdims=True))
            norm32 = np.maximum(norm, 1e-12).astype(np.float32)
            x = (x / norm32).astype(np.float32)
        return x

    def _calibration(self, calibration: Int8Calibration | None, dims: int) -> Int8Calibration:
        if calibration is None:
            raise VariantError(f"variant {self.label}: int8 needs a calibration")
        if calibration.low.shape != (dims,):
            raise VariantError(
                f"variant {self.label}: the calibration has {calibration.low.shape[0]} "
                f"dimensions, the vectors {dims}"
            )
        return calibration

    # ---- the GPU twin (torch, any device) --------------------------------------------------------

    def apply_torch(
        self, vectors: torch.Tensor, calibration: Int8Calibration | None = None
    ) -> torch.Tensor:
        encoder = TorchEncoder(self, int(vectors.shape[1]), vectors.device)
        if self.needs_calibration():
            encoder.set_calibration(self._calibration(calibration, self.out_dims(encoder.dim)))
        return encoder(vectors)

    # ---- what the stored rows are ----------------------------------------------------------------

    @property
    def numpy_dtype(self) -> np.dtype:
        """The element type of one encoded row (binary: its packed bytes)."""
        return np.dtype(
            {"float32": "<f4", "float16": "<f2", "int8": "i1", "binary": "u1"}[self.encoding]
        )

    def transport_row_bytes(self, dim: int) -> int:
        """Bytes one row takes in the runtime's buffers and rings: padded to 16 (its copies move
        16-byte units)."""
        return -(-self.row_bytes(dim) // 16) * 16

    @property
    def key_suffix(self) -> str:
        """What a model key carries of the variant: nothing for full float32 rows."""
        if self.encoding == "float32" and self.dims is None:
            return ""
        return f"~{self.encoding}" + (f":{self.dims}" if self.dims else "")


FLOAT32 = Variant()  # the engines' own rows: float32, every dimension


class TorchEncoder:
    """The torch twin with its constants made once on the device: the engine captures it in its
    CUDA graphs, which read the calibration tensors at each replay, so `set_calibration` may
    come after the capture (a copy in place, never a new tensor)."""

    def __init__(self, variant: Variant, dim: int, device: torch.device) -> None:
        import torch

        self.variant, self.dim = variant, dim
        out = variant.out_dims(dim)
        self.bit_weights = torch.tensor(
            [128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device
        )
        # NaN until calibrated (the runners refuse an int8 engine without a calibration).
        self.low = torch.full((out,), float("nan"), dtype=torch.float32, device=device)
        self.steps = torch.ones(out, dtype=torch.float32, device=device)

    def set_calibration(self, calibration: Int8Calibration) -> None:
        import torch

        self.variant._calibration(calibration, self.variant.out_dims(self.dim))
        self.low.copy_(torch.from_numpy(calibration.low))
        self.steps.copy_(torch.from_numpy(calibration.steps()))

    def __call__(self, vectors: torch.Tensor) -> torch.Tensor:
        import torch

        v = self.variant
        x = vectors[:, : v.out_dims(int(vectors.shape[1]))].float()
        if v.normalize:
            norm = torch.sqrt((x.double() ** 2).sum(dim=1, keepdim=True))
            x = x / torch.clamp(norm, min=1e-12).float()
        if v.encoding == "float32":
            return x.contiguous()
        if v.encoding == "float16":
            return x.half()
        if v.encoding == "binary":
            bits = (x > 0).to(torch.uint8)
            pad = (-bits.shape[1]) % 8
            if pad:
                bits = torch.nn.functional.pad(bits, (0, pad))
            grouped = bits.view(bits.shape[0], -1, 8)
            return (grouped * self.bit_weights).sum(dim=2, dtype=torch.uint8)
        q = (x - self.low) / self.steps - 128.0
        return torch.trunc(torch.clamp(q, -128, 127)).to(torch.int8)


def variant_of_model_key(model_key: str) -> Variant:
    """The variant a model key's rows are stored in (`...~int8:256`; none: float32)."""
    _, tilde, label = model_key.partition("~")
    return Variant.parse(label if tilde else "float32", normalize="+normalized" in model_key)


def stored_rows(rows: np.ndarray) -> np.ndarray:
    """Encoded rows [n, ...] as the bytes the database keeps: uint8 [n, row_bytes], float32
    and float16 little-endian."""
    if rows.dtype.kind == "f":
        rows = rows.astype(rows.dtype.newbyteorder("<"), copy=False)
    rows = np.ascontiguousarray(rows)
    return rows.view(np.uint8).reshape(len(rows), -1)


def decode(encoded: np.ndarray, variant: Variant, calibration: Int8Calibration | None) -> Any:
    """Float32 vectors back from an encoding (for a float index over float16 or int8 vectors:
    int8 to the middle of its bucket, within one step of the value); binary stays packed bits
    (a binary index reads those)."""
    if variant.encoding in ("float32", "float16"):
        return encoded.astype(np.float32)
    if variant.encoding == "int8":
        cal = variant._calibration(calibration, encoded.shape[1])
        steps, low = cal.steps(), cal.low
        out = np.empty(encoded.shape, np.float32)
        # A 256-entry table gives each code's place in steps, then one multiply and one add,
        # a block of rows at a time (a million 768-d rows: 3 passes, not 6).
        for start in range(0, len(encoded), DECODE_ROWS):
            block = out[start : start + DECODE_ROWS]
            np.take(_INT8_MIDDLES, encoded[start : start + DECODE_ROWS].view(np.uint8), out=block)
            np.multiply(block, steps, out=block)
            np.add(block, low, out=block)
        return out
    return encoded


DECODE_ROWS = 16_384


def _int8_middles() -> np.ndarray:
    """By a code's byte (two's complement), the middle of its step counted from `low`.
    Truncation toward zero: q > 0 holds [q, q+1), q < 0 holds (q-1, q], 0 holds (-1, 1)."""
    q = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
    return (q + np.float32(0.5) * np.sign(q) + np.float32(128)).astype(np.float32)


_INT8_MIDDLES = _int8_middles()
