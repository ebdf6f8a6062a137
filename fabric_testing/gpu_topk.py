"""Exact k-NN on the GPU with CuPy: one GEMM per tile, then a fused distance + top-k kernel.

The distance matrix is never materialised: the kernel reads the GEMM's inner products and forms
each distance on the fly (colterm[j] + alpha * dot), so a tile costs one GEMM plus one read of
its product. Sorting the product instead (cupy.argpartition sorts) costs far more than the GEMM.

Per query row one block: every thread keeps a sorted top-k of its strided columns in registers,
then the block merges the per-thread lists k times by a block-wide argmin on (distance, column).
"""

from __future__ import annotations

from typing import Any

K_MAX = 32
SHARED_LIMIT = 48 * 1024  # dynamic shared memory a launch gets without opting in

_SOURCE = r"""
#define K_MAX 32
extern "C" __global__ void topk_rows(
    const float* __restrict__ dots, long long ld, int cols,
    const float* __restrict__ colterm, float alpha, int k, long long col_offset,
    float* __restrict__ out_d, long long* __restrict__ out_i)
{
    extern __shared__ unsigned char smem[];
    float* cand_d = (float*)smem;                       // [blockDim.x * k]
    int* cand_j = (int*)(cand_d + blockDim.x * k);      // [blockDim.x * k]
    __shared__ float warp_d[32];
    __shared__ int warp_j[32];
    __shared__ int warp_owner[32];
    __shared__ int winner;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    const float* row = dots + (long long)blockIdx.x * ld;

    float best_d[K_MAX];
    int best_j[K_MAX];
    for (int t = 0; t < K_MAX; ++t) { best_d[t] = __int_as_float(0x7f800000); best_j[t] = -1; }
    float worst = __int_as_float(0x7f800000);
    for (int j = tid; j < cols; j += blockDim.x) {
        float d = colterm[j] + alpha * row[j];
        if (d < worst) {  // rare after the first few hundred columns: insertion sort is fine
            int p = k - 1;
            while (p > 0 && best_d[p - 1] > d) { best_d[p] = best_d[p - 1]; best_j[p] = best_j[p - 1]; --p; }
            best_d[p] = d; best_j[p] = j;
            worst = best_d[k - 1];
        }
    }
    for (int t = 0; t < k; ++t) { cand_d[tid * k + t] = best_d[t]; cand_j[tid * k + t] = best_j[t]; }
    __syncthreads();

    int head = 0;  // this thread's next unmerged candidate
    for (int round = 0; round < k; ++round) {
        float d = head < k ? cand_d[tid * k + head] : __int_as_float(0x7f800000);
        int j = head < k ? cand_j[tid * k + head] : 0x7fffffff;
        if (j < 0) j = 0x7fffffff;
        int owner = tid;
        for (int off = 16; off > 0; off >>= 1) {
            float d2 = __shfl_down_sync(0xffffffffu, d, off);
            int j2 = __shfl_down_sync(0xffffffffu, j, off);
            int o2 = __shfl_down_sync(0xffffffffu, owner, off);
            if (d2 < d || (d2 == d && j2 < j)) { d = d2; j = j2; owner = o2; }
        }
        if (lane == 0) { warp_d[warp] = d; warp_j[warp] = j; warp_owner[warp] = owner; }
        __syncthreads();
        if (warp == 0) {
            d = lane < nwarps ? warp_d[lane] : __int_as_float(0x7f800000);
            j = lane < nwarps ? warp_j[lane] : 0x7fffffff;
            owner = lane < nwarps ? warp_owner[lane] : -1;
            for (int off = 16; off > 0; off >>= 1) {
                float d2 = __shfl_down_sync(0xffffffffu, d, off);
                int j2 = __shfl_down_sync(0xffffffffu, j, off);
                int o2 = __shfl_down_sync(0xffffffffu, owner, off);
                if (d2 < d || (d2 == d && j2 < j)) { d = d2; j = j2; owner = o2; }
            }
            if (lane == 0) {
                long long out = (long long)blockIdx.x * k + round;
                out_d[out] = d;
                out_i[out] = j == 0x7fffffff ? -1 : (long long)j + col_offset;
                winner = owner;
            }
        }
        __syncthreads();
        if (tid == winner) ++head;
        __syncthreads();
    }
}
"""

_kernel: Any = None


def _topk_kernel() -> Any:
    global _kernel
    if _kernel is None:
        import cupy

        _kernel = cupy.RawKernel(_SOURCE, "topk_rows")
    return _kernel


def topk_of_products(
    dots: Any, colterm: Any, alpha: float, k: int, col_offset: int = 0
) -> tuple[Any, Any]:
    """Per row of `dots` [rows, cols] (float32, C order): the k smallest colterm + alpha * dot,
    as (distances, column + col_offset), nearest first; missing entries are (inf, -1)."""
    import cupy

    if not 1 <= k <= K_MAX:
        raise ValueError(f"k={k}: the GPU top-k handles 1..{K_MAX}")
    rows, cols = dots.shape
    threads = 256 if 256 * k * 8 <= SHARED_LIMIT else 128  # one (distance, column) per slot
    out_d = cupy.empty((rows, k), dtype=cupy.float32)
    out_i = cupy.empty((rows, k), dtype=cupy.int64)
    if rows == 0:
        return out_d, out_i
    _topk_kernel()(
        (rows,),
        (threads,),
        (
            dots,
            cupy.int64(dots.strides[0] // 4),
            cupy.int32(cols),
            colterm,
            cupy.float32(alpha),
            cupy.int32(k),
            cupy.int64(col_offset),
            out_d,
            out_i,
        ),
        shared_mem=threads * k * 8,
    )
    return out_d, out_i


def knn(
    queries: Any, base: Any, k: int, metric: str, budget_bytes: int = 4 << 30
) -> tuple[Any, Any]:
    """Exact k-NN on the GPU (float32). Distances as metrics.pairwise defines them.

    Tiled so one product tile holds at most `budget_bytes`: queries in row tiles, the base in
    column tiles; per-tile top-k lists are merged at the end.
    """
    import cupy

    queries = cupy.ascontiguousarray(queries, dtype=cupy.float32)
    base = cupy.ascontiguousarray(base, dtype=cupy.float32)
    n = base.shape[0]
    if metric == "cosine":
        colterm, alpha, rowterm = cupy.ones(n, dtype=cupy.float32), -1.0, None
    else:
        colterm, alpha = (base * base).sum(1), -2.0
        rowterm = (queries * queries).sum(1)[:, None]
    col_tile = max(1, min(n, budget_bytes // (4 * 1024)))
    row_tile = max(1, budget_bytes // (4 * col_tile))
    out_d = cupy.empty((queries.shape[0], k), dtype=cupy.float32)
    out_i = cupy.empty((queries.shape[0], k), dtype=cupy.int64)
    for r0 in range(0, queries.shape[0], row_tile):
        q = queries[r0 : r0 + row_tile]
        parts_d, parts_i = [], []
        for c0 in range(0, n, col_tile):
            dots = q @ base[c0 : c0 + col_tile].T
            d, i = topk_of_products(dots, colterm[c0 : c0 + col_tile], alpha, k, c0)
            parts_d.append(d)
            parts_i.append(i)
            del dots
        d, i = parts_d[0], parts_i[0]
        if len(parts_d) > 1:
            d, i = cupy.concatenate(parts_d, axis=1), cupy.concatenate(parts_i, axis=1)
            keep = cupy.argsort(d, axis=1)[:, :k]
            d, i = cupy.take_along_axis(d, keep, axis=1), cupy.take_along_axis(i, keep, axis=1)
        if rowterm is not None:
            d = d + rowterm[r0 : r0 + row_tile]
        out_d[r0 : r0 + row_tile], out_i[r0 : r0 + row_tile] = d, i
    return out_d, out_i
