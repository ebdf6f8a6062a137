"""Build an index over a model's embeddings, measure it, and publish it with its receipt.

The rows are split into shards by a fixed hash (index/shards.py). One quantizer is trained for
all of them (IVF; Flat needs none) and stored; each shard is filled from it with its rows in id
order and stored; the shards are merged into the serving index. With the previous receipt at
hand, only shards whose database watermark moved (or whose file is missing or corrupt) are
rebuilt; the rest are reused, verified against their recorded sha256.

Order matters for "nothing half-published": files are written first (atomically, named by their
sha256), then the receipt file, then the receipt row. A failure before the row publishes nothing;
an index below its recall floor never gets the row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from sqlalchemy import Engine

from fabric_pipelines.lib.charts import bar_table
from fabric_pipelines.lib.files import (
    CorruptFileError,
    verify_sha256,
    write_bytes,
    write_content_addressed,
)
from fabric_pipelines.lib.index import metrics, shards
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    RecallProbe,
    build_device,
    centroids,
    deserialize,
    fill,
    is_ivf,
    list_sizes,
    merge,
    nprobe_curve,
    serialize,
    tolerance,
    train,
)
from fabric_pipelines.lib.index.receipt import (
    RECEIPT_SCHEMA,
    array_sha256,
    canonical_json,
    library_versions,
    receipt_sha256,
)
from fabric_pipelines.lib.index.vectors import VectorSet, check_vectors, load_vectors
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import IndexReceipt

HEALTH_SAMPLE = 20_000  # rows the cluster-health metrics look at


class EmptySourceError(ValueError):
    pass


@dataclass(frozen=True)
class PublishedIndex:
    receipt: dict[str, Any]
    receipt_sha256: str
    index_path: Path
    receipt_path: Path
    rebuilt_shards: list[int] = field(default_factory=list)
    accepted: bool = True  # False: below the recall floor, so not recorded as current

    @property
    def recall_at_k(self) -> float:
        return float(self.receipt["quality"]["recall_at_k"])


def model_folder(index_folder: Path, model_key: str) -> Path:
    return index_folder / re.sub(r"[^A-Za-z0-9._-]", "_", model_key)


def write_faiss_file(folder: Path, data: bytes) -> tuple[str, Path]:
    """Store `data` as <folder>/<sha256>.faiss (atomically); returns (sha256, path)."""
    stored = write_content_addressed(folder, ".faiss", lambda tmp: tmp.write_bytes(data))
    return stored.sha256, stored.path


def read_verified(path: Path, sha256: str) -> faiss.Index:
    """An index file, refused unless it hashes to what the receipt recorded."""
    verify_sha256(path, sha256, "index file", "fabric index rebuild --receipt writes it again")
    return deserialize(path.read_bytes())


def build_and_publish(
    db: Engine,
    *,
    model_key: str,
    model: dict[str, Any],
    spec: IndexSpec,
    index_folder: Path,
    receipt_folder: Path,
    inputs: list[dict[str, Any]],
    previous: dict[str, Any] | None = None,
    min_recall: float = 0.0,
    code: dict[str, str] | None = None,
) -> PublishedIndex:
    """Build (or partly rebuild, given the previous receipt) and publish; `model` and `inputs`
    go into the receipt. Below `min_recall` the files and receipt file are kept for inspection
    but no receipt row is written: the index never becomes the model's current one."""
    with db.begin() as conn:
        try:
            mid = model_id(conn, model_key, create=False)
        except LookupError as exc:
            raise EmptySourceError(
                f"no embeddings for model {model_key}: materialise extraction_outputs first"
            ) from exc
        shards.register(conn, mid, spec.shards)
    with db.connect() as conn:
        # Versions before rows: a change that lands after this read shows up as stale next time.
        versions = shards.versions(conn, mid, spec.shards)
        source = load_vectors(conn, model_key)
    if len(source.ids) == 0:
        raise EmptySourceError(
            f"no embeddings for model {model_key}: materialise extraction_outputs first"
        )
    check_vectors(source.vectors, spec.metric)
    ids_sha256 = array_sha256(source.ids.astype("<i8"))
    vectors_sha256 = array_sha256(source.vectors.astype("<f4"))
    folder = model_folder(index_folder, model_key)
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    (folder / "quantizers").mkdir(parents=True, exist_ok=True)

    device = build_device(spec)
    reuse = _reusable(previous, spec, model, folder)
    if reuse is not None:
        trained, training = reuse
    else:
        built = train(source.vectors, spec)
        sha, path = write_faiss_file(folder / "quantizers", serialize(built.index))
        trained = built.index
        training = {
            "rule": "seeded sample without replacement of rows in id order",
            "sample": len(built.train_rows),
            "seed": spec.seed,
            "max_sample": spec.train_sample,
            "factory": built.factory,
            "device": device,
            "trained_on": {
                "rows": len(source.ids),
                "ids_sha256": ids_sha256,
                "vectors_sha256": vectors_sha256,
            },
            "quantizer_sha256": sha,
            "quantizer_file": f"quantizers/{path.name}",
            "centroids_sha256": built.centroids_sha256,
        }
    old = {s["shard"]: s for s in previous["shards"]} if (previous and reuse is not None) else {}
    parts, entries, rebuilt = [], [], []
    for shard, rows in enumerate(shard_rows(source, spec.shards)):
        ids = source.ids[rows]
        before = old.get(shard)
        index = None
        if before is not None and before["version"] == versions[shard]:
            try:
                index = read_verified(folder / before["index_file"], before["index_sha256"])
                entries.append(before)
            except (FileNotFoundError, CorruptFileError):
                index = None  # rebuilt below from the same quantizer
        if index is None:
            vectors = source.vectors[rows]  # gathered only for the shards being rebuilt
            index = fill(trained, vectors, ids, spec)
            sha, path = write_faiss_file(folder / "shards", serialize(index))
            entries.append(
                {
                    "shard": shard,
                    "rows": len(ids),
                    "version": versions[shard],
                    "ids_sha256": array_sha256(ids.astype("<i8")),
                    "vectors_sha256": array_sha256(vectors.astype("<f4")),
                    "index_sha256": sha,
                    "index_file": f"shards/{path.name}",
                }
            )
            rebuilt.append(shard)
        parts.append(index)
    served = merge(parts, spec)
    data = serialize(served)
    index_sha, index_path = write_faiss_file(folder, data)
    receipt: dict[str, Any] = {
        "schema": RECEIPT_SCHEMA,
        "source": {
            "table": "embeddings",
            "predicate": {"model_key": model_key},
            "rows": len(source.ids),
            "task_sets": list(source.task_sets),
            "watermark": {"n_shards": spec.shards, "versions": versions},
        },
        "ids_sha256": ids_sha256,
        "vectors_sha256": vectors_sha256,
        "model": {**model, "model_key": model_key, "dim": source.dim},
        "index": {
            "factory": training["factory"],
            "metric": spec.metric,
            "params": {"nprobe": spec.nprobe},
            "train_sample": spec.train_sample,
            "shards": spec.shards,
            "shard_rule": "(task_set_id * 7919 + record_no) mod shards",
        },
        "training": training,
        "shards": entries,
        "libraries": library_versions(),
        "build_device": training["device"],
        "tolerance": tolerance(training["device"]),
        "index_sha256": index_sha,
        "index_file": index_path.name,
        "index_bytes": len(data),
        "quality": quality(served, source, spec),
        "inputs": inputs,
        "code": code or {},
    }
    sha = receipt_sha256(receipt)
    receipt_path = receipt_folder / f"{sha}.json"
    write_bytes(receipt_path, canonical_json(receipt))
    if receipt["quality"]["recall_at_k"] < min_recall:
        return PublishedIndex(receipt, sha, index_path, receipt_path, rebuilt, accepted=False)
    with db.begin() as conn:
        conn.execute(
            insert_ignoring_duplicates(db, IndexReceipt),
            {
                "receipt_sha256": sha,
                "model_key": model_key,
                "index_path": str(index_path),
                "index_sha256": index_sha,
                "n_vectors": len(source.ids),
                "recall_at_k": receipt["quality"]["recall_at_k"],
                "receipt_json": canonical_json(receipt).decode("utf-8"),
            },
        )
    return PublishedIndex(receipt, sha, index_path, receipt_path, rebuilt)


def shard_rows(source: VectorSet, n_shards: int) -> list[np.ndarray]:
    """Positions in `source` of each shard's rows, in the source's id order."""
    owner = shards.shard_of(source.ids, n_shards)
    return [np.flatnonzero(owner == s) for s in range(n_shards)]


def split_shards(source: VectorSet, n_shards: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) of each shard, in the source's id order."""
    return [(source.ids[r], source.vectors[r]) for r in shard_rows(source, n_shards)]


def _reusable(
    previous: dict[str, Any] | None, spec: IndexSpec, model: dict[str, Any], folder: Path
) -> tuple[faiss.Index, dict[str, Any]] | None:
    """The previous build's trained quantizer, when the previous receipt describes the same
    index (model, factory, metric, shards) and its quantizer file is intact."""
    if not previous or previous.get("schema") != RECEIPT_SCHEMA:
        return None
    if "trained_on" not in previous.get("training", {}):
        return None
    same = (
        previous["index"]["metric"] == spec.metric
        and previous["index"]["shards"] == spec.shards
        and previous["model"].get("weights_sha256") == model.get("weights_sha256")
        and (spec.factory == "auto" or previous["training"]["factory"] == spec.factory)
    )
    if not same:
        return None
    training = previous["training"]
    try:
        quantizer = read_verified(folder / training["quantizer_file"], training["quantizer_sha256"])
    except (FileNotFoundError, CorruptFileError):
        return None
    return quantizer, training


def quality(index: faiss.Index, source: VectorSet, spec: IndexSpec) -> dict[str, Any]:
    """Recall against exact search, the nprobe curve, list balance and cluster health (NumPy)."""
    probe = RecallProbe(source.vectors, source.ids, spec, max_k=max(100, spec.k))
    recall = {k: round(probe.recall(index, k)[0], 6) for k in sorted({1, 10, 100, spec.k})}
    out: dict[str, Any] = {
        "k": spec.k,
        "recall_at_k": recall[spec.k],
        **{f"recall_at_{k}": recall[k] for k in (1, 10, 100)},
        "queries": min(spec.recall_queries, len(source.ids)),
        "query_rule": (
            "seeded sample of indexed rows, each query's own row left out; a returned neighbour "
            "counts when it is as close as the k-th exact one (ties count alike)"
        ),
        "query_seed": spec.seed + 1,
    }
    health = metrics.vector_health(source.vectors, np)
    out["vectors"] = {
        "rows": health.rows,
        "nan": health.nan_rows,
        "inf": health.inf_rows,
        "zero_norm": health.zero_norm_rows,
    }
    if is_ivf(index):
        out["nprobe_curve"] = {str(k): v for k, v in nprobe_curve(index, probe, spec).items()}
        sizes = list_sizes(index)
        out["lists"] = {
            "count": int(sizes.size),
            "imbalance": round(float(sizes.max() / max(sizes.mean(), 1e-12)), 4),
        }
        rng = np.random.default_rng(spec.seed + 2)
        sample = rng.choice(
            len(source.ids), size=min(HEALTH_SAMPLE, len(source.ids)), replace=False
        )
        x = metrics.prepare(source.vectors[sample], spec.metric, np, np.float64)
        c = metrics.prepare(centroids(index), spec.metric, np, np.float64)
        out["cluster_health"] = metrics.cluster_health(x, c, spec.metric, np).summary()
        probe = x[: min(500, len(x))]
        out["knn_density_10"] = round(metrics.knn_density(probe, x, 10, spec.metric, np), 6)
        out["near_duplicates"] = metrics.near_duplicates(probe, x, 1e-6, spec.metric, np)
    return out


def recall_curve_chart(quality: dict[str, Any]) -> str:
    """recall@k per nprobe (IVF), and recall@1/10/100, as Markdown bars."""
    curve = quality.get("nprobe_curve", {})
    at = {k: quality[f"recall_at_{k}"] for k in (1, 10, 100) if f"recall_at_{k}" in quality}
    parts = [bar_table([f"recall@{k}" for k in at], list(at.values()), ("", "recall"), "{:.4f}")]
    if curve:
        parts.append(
            bar_table(
                [f"nprobe {n}" for n in curve],
                list(curve.values()),
                ("", f"recall@{quality['k']}"),
                "{:.4f}",
            )
        )
    return "\n\n".join(parts)


def cluster_health_table(quality: dict[str, Any]) -> str:
    """The cluster-health summary and vector counts as a Markdown table."""
    rows = {
        **quality.get("cluster_health", {}),
        **{f"vectors_{k}": v for k, v in quality["vectors"].items()},
    }
    for key in ("lists", "knn_density_10", "near_duplicates"):
        if key in quality:
            value = quality[key]
            rows.update(
                {f"lists_{k}": v for k, v in value.items()}
                if isinstance(value, dict)
                else {key: value}
            )
    return "| measure | value |\n|---|---:|\n" + "\n".join(
        f"| {k} | {v} |" for k, v in rows.items()
    )
