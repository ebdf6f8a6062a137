"""Build an index over a model's embeddings, measure it, and publish it with its receipt.

Order matters for "nothing half-published": the index file is written (atomically, named by its
sha256), then the receipt file, then the receipt row. A failure before the row leaves no receipt
that points at a missing or partial index.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from fabric_pipelines.lib.index.build import (
    IndexSpec,
    build_index,
    recall_at_k,
    serialize,
)
from fabric_pipelines.lib.index.receipt import (
    RECEIPT_SCHEMA,
    array_sha256,
    canonical_json,
    library_versions,
    receipt_sha256,
)
from fabric_pipelines.lib.index.vectors import load_vectors
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.models import IndexReceipt
from fabric_pipelines.lib.tasks.store import atomic_write


class EmptySourceError(ValueError):
    pass


@dataclass(frozen=True)
class PublishedIndex:
    receipt: dict[str, Any]
    receipt_sha256: str
    index_path: Path
    receipt_path: Path

    @property
    def recall_at_k(self) -> float:
        return float(self.receipt["quality"]["recall_at_k"])


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def build_and_publish(
    db: Engine,
    *,
    model_key: str,
    model: dict[str, Any],
    spec: IndexSpec,
    index_folder: Path,
    receipt_folder: Path,
    inputs: list[dict[str, Any]],
) -> PublishedIndex:
    """Build over every embedding of `model_key`; `model` and `inputs` go into the receipt."""
    with db.connect() as conn:
        source = load_vectors(conn, model_key)
    if len(source.ids) == 0:
        raise EmptySourceError(
            f"no embeddings for model {model_key}: materialise extraction_outputs first"
        )
    built = build_index(source.vectors, source.ids, spec)
    recall, n_queries = recall_at_k(built.index, source.vectors, source.ids, spec)
    data = serialize(built.index)

    folder = index_folder / _safe(model_key)
    staging = folder / ".staging.faiss"
    index_sha = atomic_write(staging, lambda tmp: tmp.write_bytes(data))
    index_path = folder / f"{index_sha}.faiss"
    staging.replace(index_path)

    receipt: dict[str, Any] = {
        "schema": RECEIPT_SCHEMA,
        "source": {
            "table": "embeddings",
            "predicate": {"model_key": model_key},
            "watermark": {"rows": len(source.ids), "max_index_id": int(source.ids.max())},
            "task_sets": list(source.task_sets),
        },
        "ids_sha256": array_sha256(source.ids.astype("<i8")),
        "vectors_sha256": array_sha256(source.vectors.astype("<f4")),
        "model": {**model, "model_key": model_key, "dim": source.dim},
        "index": {
            "factory": built.factory,
            "metric": spec.metric,
            "params": {"nprobe": spec.nprobe},
        },
        "training": {
            "rule": "seeded sample without replacement of rows in id order",
            "sample": len(built.train_rows),
            "seed": spec.seed,
            "max_sample": spec.train_sample,
        },
        "centroids_sha256": built.centroids_sha256,
        "libraries": library_versions(),
        "build_device": "cpu",
        "index_sha256": index_sha,
        "index_bytes": len(data),
        "quality": {
            "k": spec.k,
            "recall_at_k": round(recall, 6),
            "queries": n_queries,
            "query_rule": "seeded sample of indexed rows, each query's own row left out",
            "query_seed": spec.seed + 1,
        },
        "inputs": inputs,
    }
    sha = receipt_sha256(receipt)
    receipt_path = receipt_folder / f"{sha}.json"
    atomic_write(receipt_path, lambda tmp: tmp.write_bytes(canonical_json(receipt)))
    with db.begin() as conn:
        conn.execute(
            insert_ignoring_duplicates(db, IndexReceipt),
            {
                "receipt_sha256": sha,
                "model_key": model_key,
                "index_path": str(index_path),
                "index_sha256": index_sha,
                "n_vectors": len(source.ids),
                "recall_at_k": recall,
                "receipt_json": canonical_json(receipt).decode("utf-8"),
            },
        )
    return PublishedIndex(receipt, sha, index_path, receipt_path)


def load_receipt(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data
