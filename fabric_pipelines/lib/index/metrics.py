"""Index quality metrics, written once over an array module: NumPy (float64, the reference
twin) or CuPy (float32 on the GPU, tiled). `xp` is the module; every function takes it.

Distances are squared L2 for metric "l2" and 1 - inner product for "cosine" (vectors are
normalised first), so smaller is closer for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

TILE = 8192  # database rows per distance tile: bounds memory at queries x TILE


def prepare(x: Any, metric: str, xp: Any, dtype: Any) -> Any:
    x = xp.asarray(x, dtype=dtype)
    if metric == "cosine":
        norms = xp.linalg.norm(x, axis=1, keepdims=True)
        x = x / xp.where(norms == 0, 1, norms)
    return x


def pairwise(a: Any, b: Any, metric: str, xp: Any) -> Any:
    """Distances [len(a), len(b)]."""
    if metric == "cosine":
        return 1.0 - a @ b.T
    return (a * a).sum(1)[:, None] - 2.0 * (a @ b.T) + (b * b).sum(1)[None, :]


def knn(queries: Any, base: Any, k: int, metric: str, xp: Any, tile: int = TILE) -> tuple[Any, Any]:
    """Exact k nearest neighbours: (distances, positions) [len(queries), k], nearest first.

    Tiles of the distance matrix, each reduced with argpartition and merged into the running
    best k. (The benchmarks' fused GEMM + top-k CuPy kernel is `fabric_testing/gpu_topk.py`.)"""
    best_d = xp.full((queries.shape[0], 0), xp.inf, dtype=queries.dtype)
    best_i = xp.zeros((queries.shape[0], 0), dtype=xp.int64)
    for start in range(0, base.shape[0], tile):
        d = pairwise(queries, base[start : start + tile], metric, xp)
        take = min(k, d.shape[1])
        part = xp.argpartition(d, take - 1, axis=1)[:, :take]
        d = xp.concatenate([best_d, xp.take_along_axis(d, part, axis=1)], axis=1)
        i = xp.concatenate([best_i, part + start], axis=1)
        # Nearest first, ties by position (as the GPU kernel breaks them).
        keep = np.lexsort((i, d), axis=1)[:, :k] if xp is np else xp.argsort(d, axis=1)[:, :k]
        best_d, best_i = xp.take_along_axis(d, keep, axis=1), xp.take_along_axis(i, keep, axis=1)
    return best_d, best_i


@dataclass(frozen=True)
class VectorHealth:
    rows: int
    nan_rows: int
    inf_rows: int
    zero_norm_rows: int


def vector_health(x: Any, xp: Any) -> VectorHealth:
    x = xp.asarray(x)
    finite = xp.where(xp.isfinite(x), x, 0)
    return VectorHealth(
        rows=int(x.shape[0]),
        nan_rows=int(xp.isnan(x).any(axis=1).sum()),
        inf_rows=int(xp.isinf(x).any(axis=1).sum()),
        zero_norm_rows=int((xp.linalg.norm(finite, axis=1) == 0).sum()),
    )


@dataclass(frozen=True)
class ClusterHealth:
    """Per cluster (index = cluster number) unless said otherwise."""

    size: np.ndarray
    radius: np.ndarray  # largest member distance to the centroid
    mean_distance: np.ndarray  # mean member distance to the centroid
    separation: np.ndarray  # distance to the nearest other centroid
    davies_bouldin: np.ndarray  # max over j of (mean_i + mean_j) / d(c_i, c_j)
    silhouette: np.ndarray  # mean over members of (b - a) / max(a, b), against centroids
    imbalance: float  # largest list / mean list size
    size_cv: float  # coefficient of variation of list sizes

    def summary(self) -> dict[str, float]:
        used = self.size > 0
        return {
            "clusters": int(self.size.size),
            "empty_clusters": int((~used).sum()),
            "imbalance": round(float(self.imbalance), 4),
            "size_cv": round(float(self.size_cv), 4),
            "mean_radius": round(float(self.radius[used].mean()), 6) if used.any() else 0.0,
            "mean_silhouette": round(float(self.silhouette[used].mean()), 6) if used.any() else 0.0,
            "davies_bouldin": round(float(self.davies_bouldin[used].mean()), 6)
            if used.any()
            else 0.0,
            "min_separation": round(float(self.separation.min()), 6),
        }


def cluster_health(x: Any, centroids: Any, metric: str, xp: Any, tile: int = TILE) -> ClusterHealth:
    """Assign each row to its nearest centroid and measure every cluster."""
    n, c = x.shape[0], centroids.shape[0]
    own = xp.empty(n, dtype=x.dtype)
    other = xp.empty(n, dtype=x.dtype)
    label = xp.empty(n, dtype=xp.int64)
    for start in range(0, n, tile):
        d = pairwise(x[start : start + tile], centroids, metric, xp)
        rows = xp.arange(d.shape[0])
        nearest = xp.argmin(d, axis=1)
        label[start : start + tile] = nearest
        own[start : start + tile] = d[rows, nearest]
        d[rows, nearest] = xp.inf  # the second nearest is the nearest of the rest
        other[start : start + tile] = d.min(axis=1) if c > 1 else xp.inf
    size = xp.bincount(label, minlength=c).astype(x.dtype)
    total = xp.bincount(label, weights=own, minlength=c)
    mean = total / xp.maximum(size, 1)
    radius = xp.zeros(c, dtype=x.dtype)
    xp.maximum.at(radius, label, own)  # scatter max: NumPy and CuPy alike
    a, b = own, other
    sil = xp.where(xp.maximum(a, b) > 0, (b - a) / xp.maximum(xp.maximum(a, b), 1e-30), 0)
    silhouette = xp.bincount(label, weights=sil, minlength=c) / xp.maximum(size, 1)
    between = pairwise(centroids, centroids, metric, xp)
    between = between + xp.diag(xp.full(c, xp.inf, dtype=x.dtype))
    separation = between.min(axis=1) if c > 1 else xp.full(c, xp.inf, dtype=x.dtype)
    db = (
        ((mean[:, None] + mean[None, :]) / xp.maximum(between, 1e-30)).max(axis=1)
        if c > 1
        else xp.zeros(c)
    )
    used = size > 0
    mean_size = size[used].mean() if bool(used.any()) else 1.0
    return ClusterHealth(
        size=_host(size, xp).astype(np.int64),
        radius=_host(radius, xp),
        mean_distance=_host(mean, xp),
        separation=_host(separation, xp),
        davies_bouldin=_host(db, xp),
        silhouette=_host(silhouette, xp),
        imbalance=float(size.max() / mean_size),
        size_cv=float(size[used].std() / mean_size) if bool(used.any()) else 0.0,
    )


def knn_density(sample: Any, base: Any, k: int, metric: str, xp: Any) -> float:
    """Mean distance from sampled rows to their k nearest other rows (a local-density scale)."""
    d, _ = knn(sample, base, k + 1, metric, xp)
    return float(d[:, 1:].mean())


def near_duplicates(sample: Any, base: Any, threshold: float, metric: str, xp: Any) -> int:
    """Sampled rows with another row closer than `threshold` (the row itself excluded)."""
    d, _ = knn(sample, base, 2, metric, xp)
    return int((d[:, 1] < threshold).sum())


def _host(a: Any, xp: Any) -> np.ndarray:
    return np.asarray(a.get() if hasattr(a, "get") and xp is not np else a, dtype=np.float64)


def recall(found: Any, truth: Any, k: int, xp: Any) -> float:
    """Share of each row's true k nearest (truth[:, :k]) that `found[:, :k]` holds."""
    hits = (found[:, :k, None] == truth[:, None, :k]).any(axis=2)
    return float(hits.sum()) / max(int(truth.shape[0]) * k, 1)
