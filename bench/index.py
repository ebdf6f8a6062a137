"""Exact k-NN and cluster metrics on the GPU, against the NumPy float64 twin and faiss-cpu.

Data: a clustered float32 set (1,000 centres + noise), 1,000,000 x 384 rows, 10,000 queries
drawn from it, k = 10, L2. The same host arrays feed every side.
  - GPU: fabric_testing.gpu_topk.knn on CuPy (GEMM per tile + fused top-k kernel), timed with CUDA events after
    one warm-up; the GEMM floor is the same FLOPs at the matrix rate measured in this run on a
    product of the tile's shape (q_tile x 384 @ 384 x N, float32).
  - NumPy twin (float64, tiled, argpartition) and faiss-cpu (IndexFlatL2, float32) search a
    subset of the queries (--numpy-queries, --faiss-queries); queries are independent, so the
    ratios compare time per query.
  - Cluster metrics (vector health, cluster health against 1,024 centroids, k-NN density, near
    duplicates) on --metric-rows rows, GPU against the NumPy twin on the same rows.

    python bench/index.py                 # on a GPU machine
    .venv/bin/python bench/index.py --cpu --rows 200000 --queries 1000   # the CPU parts alone

The last line is one JSON object: knn_seconds, knn_floor_seconds, ratio_vs_numpy,
ratio_vs_faiss_cpu, metrics_ratio_vs_numpy (GPU fields null under --cpu).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fabric_pipelines.lib.index import metrics
from fabric_testing import gpu_topk


def clustered(rows: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim), dtype=np.float32)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    x *= 0.4
    x += centres[rng.integers(0, 1000, rows)]
    return x


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def gpu_timed(cp: Any, fn: Any) -> tuple[float, Any]:
    fn()  # warm-up: kernel compilation, cuBLAS handles, pool growth
    cp.cuda.Device().synchronize()
    begin, end = cp.cuda.Event(), cp.cuda.Event()
    begin.record()
    out = fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(begin, end) / 1000.0, out


def all_metrics(x: Any, c: Any, xp: Any) -> dict[str, Any]:
    probe = x[:1000]
    return {
        "health": metrics.vector_health(x, xp),
        "clusters": metrics.cluster_health(x, c, "l2", xp).summary(),
        "density": metrics.knn_density(probe, x, 10, "l2", xp),
        "duplicates": metrics.near_duplicates(probe, x, 1e-6, "l2", xp),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--numpy-queries", type=int, default=200)
    parser.add_argument("--faiss-queries", type=int, default=2000)
    parser.add_argument("--metric-rows", type=int, default=200_000)
    parser.add_argument("--cpu", action="store_true", help="the CPU parts alone")
    args = parser.parse_args()

    t, base = timed(lambda: clustered(args.rows, args.dim))
    queries = base[np.random.default_rng(1).choice(args.rows, args.queries, replace=False)]
    print(
        f"data: {args.rows:,} x {args.dim} rows, {args.queries:,} queries, k={args.k} ({t:.1f} s)"
    )
    flops_per_query = 2.0 * args.rows * args.dim

    # NumPy float64 twin, on a subset of the queries.
    nq = min(args.numpy_queries, args.queries)
    base64 = base.astype(np.float64)
    t_np, (_, np_ids) = timed(
        lambda: metrics.knn(queries[:nq].astype(np.float64), base64, args.k, "l2", np)
    )
    np_per_query = t_np / nq
    print(f"numpy float64 twin: {nq} queries in {t_np:.2f} s = {np_per_query * 1e3:.2f} ms/query")

    # faiss-cpu, on a subset of the queries.
    fq = min(args.faiss_queries, args.queries)
    faiss_per_query = None
    faiss_ids = None
    try:
        import faiss

        flat = faiss.IndexFlatL2(args.dim)
        flat.add(base)
        t_faiss, (_, faiss_ids) = timed(lambda: flat.search(queries[:fq], args.k))
        faiss_per_query = t_faiss / fq
        print(
            f"faiss-cpu {faiss.__version__} IndexFlatL2 ({faiss.omp_get_max_threads()} threads): "
            f"{fq} queries in {t_faiss:.2f} s = {faiss_per_query * 1e3:.3f} ms/query"
        )
        print(
            f"faiss-cpu vs numpy twin recall@{args.k}: {metrics.recall(faiss_ids[:nq], np_ids, args.k, np):.4f}"
        )
    except ImportError as exc:
        print(f"faiss-cpu not installed ({exc}): no faiss ratio")

    m_rows = min(args.metric_rows, args.rows)
    rng = np.random.default_rng(2)
    centroid_rows = base[rng.choice(args.rows, 1024, replace=False)]
    t_np_metrics, np_metrics = timed(
        lambda: all_metrics(base[:m_rows].astype(np.float64), centroid_rows.astype(np.float64), np)
    )
    print(f"numpy float64 metrics on {m_rows:,} rows x 1,024 centroids: {t_np_metrics:.2f} s")

    result: dict[str, Any] = {
        "knn_seconds": None,
        "knn_floor_seconds": None,
        "ratio_vs_numpy": None,
        "ratio_vs_faiss_cpu": None,
        "metrics_ratio_vs_numpy": None,
    }
    if not args.cpu:
        import cupy as cp

        name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        d_base = cp.asarray(base)
        d_queries = cp.asarray(queries)
        t_knn, (_, gpu_ids) = gpu_timed(cp, lambda: gpu_topk.knn(d_queries, d_base, args.k, "l2"))
        gpu_ids = cp.asnumpy(gpu_ids)
        # The matrix rate: one product of the shape knn tiles with, timed alone.
        budget = 4 << 30
        col_tile = max(1, min(args.rows, budget // (4 * 1024)))
        row_tile = min(args.queries, max(1, budget // (4 * col_tile)))
        q_tile = d_queries[:row_tile]
        t_gemm, _ = gpu_timed(cp, lambda: q_tile @ d_base[:col_tile].T)
        rate = 2.0 * row_tile * min(col_tile, args.rows) * args.dim / t_gemm
        floor = flops_per_query * args.queries / rate
        print(
            f"GPU ({name}): {args.queries:,} queries in {t_knn:.3f} s = "
            f"{args.queries / t_knn:,.0f} queries/s; GEMM rate {rate / 1e12:.1f} TFLOP/s, "
            f"floor {floor:.3f} s, knn / floor = {t_knn / floor:.2f}"
        )
        print(
            f"GPU vs numpy twin recall@{args.k}: {metrics.recall(gpu_ids[:nq], np_ids, args.k, np):.4f}"
        )
        if faiss_ids is not None:
            print(
                f"GPU vs faiss-cpu recall@{args.k}: {metrics.recall(gpu_ids[:fq], faiss_ids, args.k, np):.4f}"
            )
        gpu_per_query = t_knn / args.queries
        d_c = cp.asarray(centroid_rows)
        t_gpu_metrics, gpu_metrics = gpu_timed(cp, lambda: all_metrics(d_base[:m_rows], d_c, cp))
        print(f"GPU metrics on the same rows: {t_gpu_metrics:.3f} s")
        for key in ("clusters", "density", "duplicates"):
            print(f"  {key}: gpu {gpu_metrics[key]} | numpy {np_metrics[key]}")
        result.update(
            knn_seconds=round(t_knn, 4),
            knn_floor_seconds=round(floor, 4),
            ratio_vs_numpy=round(np_per_query / gpu_per_query, 1),
            ratio_vs_faiss_cpu=round(faiss_per_query / gpu_per_query, 1)
            if faiss_per_query
            else None,
            metrics_ratio_vs_numpy=round(t_np_metrics / t_gpu_metrics, 1),
        )
        print(
            f"GPU speed-up per query: {result['ratio_vs_numpy']}x the numpy twin, "
            f"{result['ratio_vs_faiss_cpu']}x faiss-cpu; metrics {result['metrics_ratio_vs_numpy']}x"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
