"""Exact nearest-neighbour search in torch, in tiles of bounded size: the same code on "cuda" and
on "cpu". It assigns rows to IVF lists (the nearest centroid) and finds the exact neighbours that
recall is measured against.

Scores follow FAISS: the inner product under cosine (rows are unit length; larger is nearer), the
squared L2 distance otherwise (smaller is nearer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

TILE_ELEMENTS = 1 << 27  # entries of one score tile: 512 MiB of float32
# Rows of every tile that assigns rows to lists, the last one padded: each row's scores then
# come from a matrix product of one shape wherever the row sits, so its list does not depend
# on which rows it was assigned with (rows assigned as they arrive get the lists a build of
# all of them gives).
ASSIGN_TILE_ROWS = 4096


@contextmanager
def full_float32() -> Iterator[None]:
    """Matrix products in full float32 inside (no TF32 or bfloat16 shortcuts, whatever the
    process set): near-equal distances must be told apart the same way every time."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def nearest(
    rows: torch.Tensor, centroids: torch.Tensor, metric: str, tile_rows: int | None = None
) -> torch.Tensor:
    """The nearest centroid of each row (int64); among equals the lowest number. With
    `tile_rows`, every product has that many rows (the last tile padded with zeros), so a row's
    result does not depend on the rows beside it (ASSIGN_TILE_ROWS)."""
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    tile = tile_rows or max(1, TILE_ELEMENTS // max(1, centroids.shape[0]))
    squares = None if metric == "cosine" else (centroids * centroids).sum(1)
    with full_float32():
        for start in range(0, n, tile):
            block = rows[start : start + tile]
            if tile_rows is not None and block.shape[0] < tile:
                block = torch.nn.functional.pad(block, (0, 0, 0, tile - block.shape[0]))
            dots = block @ centroids.T
            # Under L2, |x|^2 is the same for every centroid of a row: left out.
            found = dots.argmax(1) if squares is None else dots.mul_(-2.0).add_(squares).argmin(1)
            out[start : start + tile] = found[: min(tile, n - start)]
    return out


def top_k(
    queries: torch.Tensor, base: torch.Tensor, k: int, metric: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest rows of `base` to each query: (scores, positions in base), nearest first."""
    largest = metric == "cosine"
    k = min(k, base.shape[0])
    tile = max(k, TILE_ELEMENTS // max(1, queries.shape[0]))
    query_squares = None if largest else (queries * queries).sum(1, keepdim=True)
    best: tuple[torch.Tensor, torch.Tensor] | None = None
    with full_float32():
        for start in range(0, base.shape[0], tile):
            block = base[start : start + tile]
            scores = queries @ block.T
            if query_squares is not None:
                scores = scores.mul_(-2.0).add_(query_squares).add_((block * block).sum(1))
            found, at = torch.topk(scores, min(k, block.shape[0]), dim=1, largest=largest)
            at += start
            if best is not None:
                found, at = torch.cat([best[0], found], 1), torch.cat([best[1], at], 1)
                found, keep = torch.topk(found, k, dim=1, largest=largest)
                at = at.gather(1, keep)
            best = (found, at)
    assert best is not None, "top_k needs at least one base row"
    return best
