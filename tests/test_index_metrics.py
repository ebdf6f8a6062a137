"""Index quality metrics: the NumPy float64 twin against plain definitions, and (marked `gpu`)
every CuPy implementation against the NumPy twin on the same data."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fabric_pipelines.lib.index import metrics


def _data(n: int = 6000, dim: int = 48, clusters: int = 40, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    x = centres[rng.integers(0, clusters, n)] + 0.35 * rng.normal(size=(n, dim))
    x[10] = x[11]  # a duplicate pair
    return x.astype(np.float32)


def _centroids(x: np.ndarray, c: int = 32) -> np.ndarray:
    return x[np.random.default_rng(1).choice(len(x), c, replace=False)]


@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_numpy_knn_tiles_agree_with_a_full_sort(metric: str) -> None:
    x = metrics.prepare(_data(3000), metric, np, np.float64)
    q = x[:200]
    # The same tiles as knn computes, so every distance has the same bits; ties by position.
    full = np.concatenate(
        [metrics.pairwise(q, x[s : s + 512], metric, np) for s in range(0, len(x), 512)], axis=1
    )
    order = np.argsort(full, axis=1, kind="stable")[:, :10]
    d, i = metrics.knn(q, x, 10, metric, np, tile=512)
    assert np.array_equal(i, order)
    assert np.allclose(d, np.take_along_axis(full, order, axis=1))


def test_cluster_health_matches_its_definitions() -> None:
    x = metrics.prepare(_data(2000), "l2", np, np.float64)
    c = metrics.prepare(_centroids(x, 12), "l2", np, np.float64)
    h = metrics.cluster_health(x, c, "l2", np, tile=300)
    d = metrics.pairwise(x, c, "l2", np)
    label = d.argmin(1)
    for j in range(12):
        members = d[label == j, j]
        assert h.size[j] == members.size
        if members.size:
            assert np.isclose(h.radius[j], members.max())
            assert np.isclose(h.mean_distance[j], members.mean())
    between = metrics.pairwise(c, c, "l2", np)
    np.fill_diagonal(between, np.inf)
    assert np.allclose(h.separation, between.min(1))
    sorted_d = np.sort(d, axis=1)
    a, b = sorted_d[:, 0], sorted_d[:, 1]
    sil = (b - a) / np.maximum(a, b)
    assert np.allclose(
        h.silhouette, [sil[label == j].mean() if (label == j).any() else 0 for j in range(12)]
    )
    db = (h.mean_distance[:, None] + h.mean_distance[None, :]) / between
    assert np.allclose(h.davies_bouldin, db.max(1))
    assert np.isclose(h.imbalance, h.size.max() / h.size[h.size > 0].mean())


def test_vector_health_counts_bad_rows() -> None:
    x = _data(100)
    x[3, 0] = np.nan
    x[5, 2] = np.inf
    x[7] = 0.0
    h = metrics.vector_health(x, np)
    assert (h.rows, h.nan_rows, h.inf_rows, h.zero_norm_rows) == (100, 1, 1, 1)


def test_near_duplicates_and_density_and_recall() -> None:
    x = metrics.prepare(_data(2000), "l2", np, np.float64)
    assert metrics.near_duplicates(x[:20], x, 1e-9, "l2", np) == 2  # rows 10 and 11
    assert metrics.knn_density(x[:50], x, 10, "l2", np) > 0
    _, truth = metrics.knn(x[:50], x, 10, "l2", np)
    assert metrics.recall(truth, truth, 10, np) == 1.0
    half = truth.copy()
    half[:, 5:] = -1
    assert metrics.recall(half, truth, 10, np) == 0.5


def test_float32_twin_agrees_with_float64_on_cpu() -> None:
    """The precision gap the GPU float32 results are held to, seen on the CPU first."""
    x = _data(4000)
    x64 = metrics.prepare(x, "cosine", np, np.float64)
    x32 = metrics.prepare(x, "cosine", np, np.float32)
    d64, i64 = metrics.knn(x64[:300], x64, 10, "cosine", np)
    d32, i32 = metrics.knn(x32[:300], x32, 10, "cosine", np)
    assert metrics.recall(i32, i64, 10, np) > 0.995
    assert np.allclose(d32, d64, atol=1e-5)


# --- GPU twins ----------------------------------------------------------------------------------


def _cupy() -> Any:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
        pytest.skip(f"no GPU for CuPy: {exc}")


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("metric", ["l2", "cosine"])
@pytest.mark.parametrize("k", [1, 10, 32, 100])
def test_gpu_knn_equals_the_numpy_twin(metric: str, k: int) -> None:
    cp = _cupy()
    x = _data(20_000)
    ref_x = metrics.prepare(x, metric, np, np.float64)
    gpu_x = metrics.prepare(cp.asarray(x), metric, cp, cp.float32)
    d64, i64 = metrics.knn(ref_x[:500], ref_x, k, metric, np)
    d32, i32 = metrics.knn(gpu_x[:500], gpu_x, k, metric, cp)
    assert metrics.recall(cp.asnumpy(i32), i64, k, np) > 0.995
    assert np.allclose(cp.asnumpy(d32), d64, atol=1e-3 if metric == "l2" else 1e-5, rtol=1e-4)


@gpu
def test_gpu_topk_handles_short_rows_ties_and_nan() -> None:
    cp = _cupy()
    from fabric_testing.gpu_topk import topk_of_products

    dots = cp.asarray([[3.0, 1.0, 2.0, cp.nan, 2.0]], dtype=cp.float32)
    d, i = topk_of_products(dots, cp.zeros(5, dtype=cp.float32), 1.0, 6, col_offset=100)
    assert cp.asnumpy(i).tolist() == [[101, 102, 104, 100, -1, -1]]  # ties by column; NaN dropped
    assert np.isinf(cp.asnumpy(d)[0, 4:]).all()


@gpu
def test_gpu_tiles_merge_like_one_tile() -> None:
    cp = _cupy()
    from fabric_testing import gpu_topk

    x = cp.asarray(metrics.prepare(_data(9000), "l2", np, np.float32))
    whole = gpu_topk.knn(x[:300], x, 10, "l2")
    tiled = gpu_topk.knn(x[:300], x, 10, "l2", budget_bytes=300 * 4 * 1024)  # many tiles
    assert cp.array_equal(whole[1], tiled[1])


@gpu
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_gpu_cluster_health_equals_the_numpy_twin(metric: str) -> None:
    cp = _cupy()
    x = _data(20_000)
    c = _centroids(x, 64)
    ref = metrics.cluster_health(
        metrics.prepare(x, metric, np, np.float64), metrics.prepare(c, metric, np, np.float64),
        metric, np,
    )  # fmt: skip
    got = metrics.cluster_health(
        metrics.prepare(cp.asarray(x), metric, cp, cp.float32),
        metrics.prepare(cp.asarray(c), metric, cp, cp.float32),
        metric, cp, tile=4096,
    )  # fmt: skip
    # A row within float32 rounding of two centroids may land in either: sizes within 0.1%.
    assert np.abs(got.size - ref.size).sum() <= 0.001 * len(x)
    for name in ("radius", "mean_distance", "separation", "davies_bouldin", "silhouette"):
        assert np.allclose(getattr(got, name), getattr(ref, name), rtol=2e-3, atol=1e-4), name
    assert got.summary().keys() == ref.summary().keys()


@gpu
def test_gpu_vector_health_density_duplicates_and_recall_equal_the_twins() -> None:
    cp = _cupy()
    x = _data(20_000)
    x[3, 0], x[5, 1], x[7] = np.nan, np.inf, 0.0
    assert metrics.vector_health(cp.asarray(x), cp) == metrics.vector_health(x, np)
    clean = np.delete(x, [3, 5, 7], axis=0)
    ref = metrics.prepare(clean, "cosine", np, np.float64)
    dev = metrics.prepare(cp.asarray(clean), "cosine", cp, cp.float32)
    assert np.isclose(
        metrics.knn_density(dev[:500], dev, 10, "cosine", cp),
        metrics.knn_density(ref[:500], ref, 10, "cosine", np),
        rtol=1e-4,
    )
    assert metrics.near_duplicates(dev[:500], dev, 1e-5, "cosine", cp) == metrics.near_duplicates(
        ref[:500], ref, 1e-5, "cosine", np
    )
    _, truth = metrics.knn(ref[:200], ref, 10, "cosine", np)
    _, found = metrics.knn(dev[:200], dev, 10, "cosine", cp)
    assert metrics.recall(found, cp.asarray(truth), 10, cp) == pytest.approx(
        metrics.recall(cp.asnumpy(found), truth, 10, np)
    )
