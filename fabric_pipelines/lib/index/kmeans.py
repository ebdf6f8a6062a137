"""Lloyd's k-means in torch, the IVF quantizer's training: one algorithm on "cuda" and on "cpu",
so a build made on a GPU can be made again on a machine without one.

It follows FAISS's IVF training where that decides the outcome: the initial centroids are a seeded
sample of the training rows, 10 iterations (FAISS trains IVF quantizers with 10), centroids put
back on the unit sphere under cosine (spherical k-means, as FAISS does for inner product), and an
empty cluster takes over half of another one, nudged apart by 1/1024. FAISS picks that other
cluster at random; here it is the largest (the lowest number among equals), so the seed alone
decides the result.
"""

from __future__ import annotations

import numpy as np
import torch

from fabric_pipelines.lib.index.torch_search import TILE_ELEMENTS, full_float32, nearest

ITERATIONS = 10
SPLIT_NUDGE = 1.0 / 1024


def kmeans(
    x: torch.Tensor, k: int, metric: str, seed: int, iterations: int = ITERATIONS
) -> torch.Tensor:
    """k centroids [k, dim] of the rows of `x` (float32; unit length under cosine)."""
    n = x.shape[0]
    if n < k:
        raise ValueError(
            f"{n} training rows for {k} lists: an IVF index needs at least one row per list; "
            "use fewer lists (e.g. factory 'auto') or factory 'Flat'"
        )
    start = np.random.default_rng(seed).choice(n, size=k, replace=False)
    centroids = x[torch.as_tensor(start, device=x.device)].clone()
    for _ in range(iterations):
        sums, counts = cluster_sums(x, nearest(x, centroids, metric), k)
        centroids = sums / counts.clamp(min=1).to(sums.dtype)[:, None]
        centroids = split_empty(centroids, counts)
        if metric == "cosine":
            centroids = torch.nn.functional.normalize(centroids, dim=1)
    return centroids


def cluster_sums(
    x: torch.Tensor, labels: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of each cluster's rows [k, dim], row count of each cluster [k])."""
    counts = torch.bincount(labels, minlength=k)
    sums = torch.zeros(k, x.shape[1], dtype=x.dtype, device=x.device)
    if x.device.type == "cpu":
        sums.index_add_(0, labels, x)  # one row after another: a fixed order
        return sums, counts
    # Atomic adds on the GPU would sum in a varying order; a one-hot product sums in a fixed one.
    tile = max(1, TILE_ELEMENTS // k)
    with full_float32():
        for start in range(0, x.shape[0], tile):
            part = labels[start : start + tile]
            one_hot = torch.zeros(part.shape[0], k, dtype=x.dtype, device=x.device)
            one_hot.scatter_(1, part[:, None], 1.0)
            sums.addmm_(one_hot.T, x[start : start + tile])
    return sums, counts


def split_empty(centroids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each empty cluster, in ascending order, takes over half of the largest cluster: both get
    its centroid, scaled by 1 +- 1/1024 in alternating directions per dimension."""
    sizes = counts.cpu().numpy().astype(np.int64)
    empty = np.flatnonzero(sizes == 0)
    if empty.size == 0:
        return centroids
    sign = torch.ones(centroids.shape[1], dtype=centroids.dtype, device=centroids.device)
    sign[1::2] = -1.0
    for ci in empty:
        cj = int(np.argmax(sizes))
        source = centroids[cj].clone()
        centroids[ci] = source * (1.0 + SPLIT_NUDGE * sign)
        centroids[cj] = source * (1.0 - SPLIT_NUDGE * sign)
        sizes[ci] = sizes[cj] // 2
        sizes[cj] -= sizes[ci]
    return centroids
