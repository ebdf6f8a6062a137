"""FAISS index builds: factory string, training, adding rows in id order, recall against exact."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import faiss
import numpy as np

from fabric_pipelines.lib.index.vectors import check_vectors

METRICS = ("cosine", "l2")


@dataclass(frozen=True)
class IndexSpec:
    factory: str = "auto"  # a FAISS factory string, or "auto" (Flat when small, else IVF-Flat)
    metric: str = "cosine"
    nprobe: int = 16
    train_sample: int = 100_000  # at most this many rows train the quantizer
    seed: int = 1234
    recall_queries: int = 500
    k: int = 10

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric {self.metric!r}: expected one of {METRICS}")
        if self.nprobe < 1 or self.k < 1 or self.recall_queries < 1 or self.train_sample < 1:
            raise ValueError("nprobe, k, recall_queries and train_sample must be positive")


def resolve_factory(spec: IndexSpec, n: int) -> str:
    """'auto': exact Flat below 2,000 rows, else IVF-Flat with about sqrt(n) lists."""
    if spec.factory != "auto":
        return spec.factory
    if n < 2000:
        return "Flat"
    nlist = 2 ** round(math.log2(math.sqrt(n)))
    return f"IVF{nlist},Flat"


@dataclass
class BuiltIndex:
    index: faiss.Index
    factory: str
    train_rows: np.ndarray  # positions (in id order) that trained the quantizer
    centroids_sha256: str | None


def prepared(vectors: np.ndarray, metric: str) -> np.ndarray:
    """What FAISS sees: float32, C-contiguous, unit length under cosine (inner product)."""
    x = np.ascontiguousarray(vectors, dtype=np.float32).copy()
    if metric == "cosine":
        faiss.normalize_L2(x)
    return x


def build_index(vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec) -> BuiltIndex:
    check_vectors(vectors, spec.metric)
    n, dim = vectors.shape
    x = prepared(vectors, spec.metric)
    factory = resolve_factory(spec, n)
    metric = faiss.METRIC_INNER_PRODUCT if spec.metric == "cosine" else faiss.METRIC_L2
    index = faiss.index_factory(dim, factory, metric)
    if not isinstance(index, faiss.IndexIDMap) and not _is_ivf(index):
        index = faiss.IndexIDMap2(index)
    train_rows = np.arange(0)
    centroids_sha = None
    if not index.is_trained:
        rng = np.random.default_rng(spec.seed)
        take = min(n, spec.train_sample)
        train_rows = np.sort(rng.choice(n, size=take, replace=False)) if take < n else np.arange(n)
        ivf = faiss.extract_index_ivf(index) if _is_ivf(index) else None
        if ivf is not None:
            ivf.cp.seed = spec.seed
        index.train(x[train_rows])
        if ivf is not None:
            centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
            centroids_sha = hashlib.sha256(np.ascontiguousarray(centroids).tobytes()).hexdigest()
    order = np.argsort(ids, kind="stable")  # rows go in by ascending id
    index.add_with_ids(x[order], np.ascontiguousarray(ids[order], dtype=np.int64))
    set_search_params(index, spec)
    return BuiltIndex(index, factory, train_rows, centroids_sha)


def set_search_params(index: faiss.Index, spec: IndexSpec) -> None:
    if _is_ivf(index):
        faiss.extract_index_ivf(index).nprobe = spec.nprobe


def _is_ivf(index: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:
        return False
    return True


def recall_at_k(
    index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec
) -> tuple[float, int]:
    """Recall@k of `index` against exact search, over a seeded sample of the rows as queries.

    Each query's own row is left out of both answers, so recall measures its neighbours.
    """
    n = len(ids)
    if n <= spec.k:
        return 1.0, 0
    x = prepared(vectors, spec.metric)
    rng = np.random.default_rng(spec.seed + 1)
    q = np.sort(rng.choice(n, size=min(spec.recall_queries, n), replace=False))
    exact = (
        faiss.IndexFlatIP(x.shape[1]) if spec.metric == "cosine" else faiss.IndexFlatL2(x.shape[1])
    )
    exact.add(x)
    _, truth_pos = exact.search(x[q], spec.k + 1)
    _, found = index.search(x[q], spec.k + 1)
    hits = 0
    for row, truth_row, found_row in zip(q, ids[truth_pos], found, strict=True):
        truth = [i for i in truth_row if i != ids[row]][: spec.k]
        got = {i for i in found_row if i != ids[row] and i >= 0}
        hits += len(got.intersection(truth))
    return hits / (len(q) * spec.k), len(q)


def serialize(index: faiss.Index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def deserialize(data: bytes) -> faiss.Index:
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
