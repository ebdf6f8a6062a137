"""Index receipts: everything needed to rebuild an index, as canonical JSON.

Canonical means sorted keys, no insignificant whitespace, UTF-8: the same receipt always has the
same bytes, so its sha256 identifies it and is the index asset's data version.

`Receipt` is the one reading of that JSON: every part the product reads is a typed field, and a
receipt that lacks one (or names a shard rule this version does not compute) is refused with the
field named, before anything is rebuilt from it. Parts that are records, not inputs (quality
measures, library versions, the code and runs behind the inputs), stay free-form, and every part
round-trips: `Receipt.parse(r).as_dict() == r`, so the sha256 of a stored receipt never moves.
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fabric_pipelines.lib.store.watermarks import SHARD_PRIME

RECEIPT_SCHEMA = "fabric.index_receipt/3"
# Receipts this version reads. Schema 2 stored each shard's own index file beside the served
# index (the lists twice); schema 3 stores the served index once and a layout file saying how
# many of each list's rows each shard holds, so a shard is a run of rows in every list.
READABLE_SCHEMAS = ("fabric.index_receipt/2", RECEIPT_SCHEMA)
BLOCK_BYTES = 1 << 24  # rows gathered per hash update when hashing a selection of rows
# Which shard a row is in; index/shards.py and the database's triggers compute exactly this.
SHARD_RULE = f"(task_set_id * {SHARD_PRIME} + record_no) mod shards"


class ReceiptError(ValueError):
    """A receipt this version cannot read or rebuild from (the message names the field)."""


class _Part(BaseModel):
    # strict: a value is kept as written (no "3" -> 3), so the bytes round-trip exactly.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _OpenPart(BaseModel):
    """A part whose named fields are read; other fields are kept as recorded."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class Watermark(_Part):
    n_shards: int
    versions: list[int]


class Source(_Part):
    table: str
    predicate: dict[str, str]
    rows: int
    task_sets: list[str]
    watermark: Watermark


class IndexSection(_Part):
    factory: str
    metric: str
    params: dict[str, Any]
    train_sample: int
    shards: int
    shard_rule: str

    @field_validator("shard_rule")
    @classmethod
    def _known_rule(cls, rule: str) -> str:
        if rule != SHARD_RULE:
            raise ValueError(f"this version shards rows by {SHARD_RULE!r}, not {rule!r}")
        return rule


class ModelSection(_OpenPart):
    model_key: str
    dim: int


class Training(_OpenPart):
    factory: str
    quantizer_file: str
    quantizer_sha256: str
    trained_on: dict[str, Any]
    max_sample: int
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ShardEntry(_OpenPart):
    # Schema 2 only: the shard's own index file. Schema 3 cuts a shard from the served index.
    index_file: str | None = None
    index_sha256: str | None = None


class Receipt(_Part):
    schema_: str = Field(alias="schema")
    source: Source
    ids_sha256: str
    vectors_sha256: str
    model: ModelSection
    index: IndexSection
    training: Training
    shards: list[ShardEntry]
    libraries: dict[str, Any]
    build_device: str
    tolerance: dict[str, Any]
    index_sha256: str
    index_file: str
    index_bytes: int
    quality: dict[str, Any]
    inputs: list[dict[str, Any]]
    code: dict[str, Any]
    # Schema 3, IVF: rows of each list per shard (layout.py), an int64 array [shards, lists].
    layout_file: str | None = None
    layout_sha256: str | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    @model_validator(mode="after")
    def _files_of_schema(self) -> Receipt:
        if self.schema_ == RECEIPT_SCHEMA:
            stray = [s for s in self.shards if s.index_file is not None]
            if stray:
                raise ValueError("a schema 3 receipt names no shard index files")
            if (self.layout_file is None) != (self.layout_sha256 is None):
                raise ValueError("layout_file and layout_sha256 come together")
            if "IVF" in self.index.factory and self.layout_file is None:
                raise ValueError(f"an {self.index.factory} index needs its layout_file")
        else:
            if self.layout_file is not None:
                raise ValueError(f"{self.schema_} has no layout_file")
            for number, shard in enumerate(self.shards):
                if shard.index_file is None or shard.index_sha256 is None:
                    raise ValueError(f"shards.{number}.index_file: {self.schema_} needs it")
        return self

    @classmethod
    def parse(cls, receipt: dict[str, Any], where: str = "receipt") -> Receipt:
        """The typed receipt; ReceiptError naming `where` and each field that is wrong."""
        if receipt.get("schema") not in READABLE_SCHEMAS:
            raise ReceiptError(
                f"{where}: schema {receipt.get('schema')!r}, this version reads "
                f"{' and '.join(READABLE_SCHEMAS)}"
            )
        try:
            return cls.model_validate(receipt)
        except ValidationError as error:
            fields = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()
            )
            raise ReceiptError(f"{where} cannot be read: {fields}") from None

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "receipt") -> Receipt:
        try:
            loaded = json.loads(text)
        except ValueError as error:
            raise ReceiptError(f"{where} is not JSON: {error}") from None
        if not isinstance(loaded, dict):
            raise ReceiptError(f"{where} is not a JSON object")
        return cls.parse(loaded, where)

    def as_dict(self) -> dict[str, Any]:
        # exclude_unset: a field the receipt does not hold (one of another schema) stays out.
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def canonical_json(self) -> bytes:
        return canonical_json(self.as_dict())

    def sha256(self) -> str:
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @property
    def model_key(self) -> str:
        return self.model.model_key

    @property
    def recall_at_k(self) -> float:
        return float(self.quality["recall_at_k"])

    def files(self) -> list[tuple[str, str]]:
        """(file, sha256) of every file the receipt names, relative to the model's folder: the
        served index, the quantizer, and the layout (schema 3) or each shard's file (schema 2)."""
        named = [(self.index_file, self.index_sha256)]
        named.append((self.training.quantizer_file, self.training.quantizer_sha256))
        if self.layout_file is not None and self.layout_sha256 is not None:
            named.append((self.layout_file, self.layout_sha256))
        return named + [
            (s.index_file, s.index_sha256)
            for s in self.shards
            if s.index_file is not None and s.index_sha256 is not None
        ]


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
        update_digest(digest, array)
    else:
        step = max(1, BLOCK_BYTES // max(1, array[:1].nbytes))
        for start in range(0, len(rows), step):
            update_digest(digest, array[rows[start : start + step]])
    return digest.hexdigest()


def update_digest(digest: Any, array: np.ndarray) -> None:
    """Feed `array`'s little-endian bytes in C order to `digest` (array_sha256's unit)."""
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
