"""Fused element-wise kernels of the packed encoder, in Triton where it is available.

Each has a plain PyTorch twin (the fallback on the CPU and where Triton is missing) and a test
that holds the two together. Measured on BERT-base: LayerNorm and the residual adds were 18% of
the forward as separate kernels; fused, each row is read and written once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch; CPU machines use the twins.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def add_layer_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    return F.layer_norm(x + residual, (x.shape[-1],), weight, bias, eps)


def embed_layer_norm_reference(
    ids: torch.Tensor,
    positions: torch.Tensor,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    x = F.embedding(ids, word) + F.embedding(positions, position) + token_type
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


if HAVE_TRITON:

    @triton.jit
    def _layer_norm_store(h, Y, W, B, row, cols, mask, n_cols, eps):
        """LayerNorm of one row `h` (float32, masked columns zero) in float32, stored to Y."""
        mean = tl.sum(h, axis=0) / n_cols
        d = tl.where(mask, h - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / n_cols + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * n_cols + cols, (d * rstd * w + b).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_layer_norm_kernel(X, R, Y, W, B, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        h = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        h += tl.load(R + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        _layer_norm_store(h, Y, W, B, row, cols, mask, n_cols, eps)

    @triton.jit
    def _embed_layer_norm_kernel(
        IDS, POS, WORD, POSITION, TYPE0, Y, W, B, n_cols, eps, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        token = tl.load(IDS + row).to(tl.int64)
        pos = tl.load(POS + row).to(tl.int64)
        h = tl.load(WORD + token * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        h += tl.load(POSITION + pos * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        h += tl.load(TYPE0 + cols, mask=mask, other=0.0).to(tl.float32)
        _layer_norm_store(h, Y, W, B, row, cols, mask, n_cols, eps)

    @triton.jit
    def _segment_mean_kernel(X, CU, Y, n_cols, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """Mean of one item's tokens over one block of columns, in float32. The tiles start at
        the item's first token and are summed one after another, so an item's sum is added in
        the same order wherever it sits in the pack (what makes its vector batch-invariant)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < n_cols
        start = tl.load(CU + row).to(tl.int64)
        end = tl.load(CU + row + 1).to(tl.int64)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for first in range(start, end, BLOCK_T):
            tokens = first + tl.arange(0, BLOCK_T)
            ok = (tokens < end)[:, None] & col_ok[None, :]
            tile = tl.load(X + tokens[:, None] * n_cols + cols[None, :], mask=ok, other=0.0)
            acc += tl.sum(tile.to(tl.float32), axis=0)
        count = tl.maximum(end - start, 1).to(tl.float32)
        tl.store(Y + row * n_cols + cols, acc / count, mask=col_ok)


def _use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and t.is_cuda


def _launch_shape(n_cols: int) -> tuple[int, int]:
    block = 1 << (n_cols - 1).bit_length()
    return block, 4 if block <= 512 else 8


def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm(x + residual) over the last axis of [rows, cols] tensors, one pass per row."""
    if not _use_triton(x):
        return add_layer_norm_reference(x, residual, weight, bias, eps)
    rows, cols = x.shape
    y = torch.empty_like(x)
    block, warps = _launch_shape(cols)
    _add_layer_norm_kernel[(rows,)](
        x, residual, y, weight, bias, cols, eps, BLOCK=block, num_warps=warps
    )
    return y


def embed_layer_norm(
    ids: torch.Tensor,
    positions: torch.Tensor,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """LayerNorm(word[ids] + position[positions] + token_type), one pass per token."""
    if not _use_triton(word):
        return embed_layer_norm_reference(
            ids, positions, word, position, token_type, weight, bias, eps
        )
    cols = word.shape[1]
    y = torch.empty((ids.shape[0], cols), dtype=word.dtype, device=word.device)
    block, warps = _launch_shape(cols)
    _embed_layer_norm_kernel[(ids.shape[0],)](
        ids, positions, word, position, token_type, y, weight, bias, cols, eps,
        BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return y


def segment_mean_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Each item's tokens summed one by one in order (index_add_ on the CPU is a loop in token
    order), then divided by its length; float32."""
    lengths = (cu_seqlens[1 : rows + 1] - cu_seqlens[:rows]).long()
    seq_ids = torch.repeat_interleave(torch.arange(rows, device=x.device), lengths)
    sums = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
    sums.index_add_(0, seq_ids, x[: seq_ids.shape[0]].float())
    return sums / lengths.clamp(min=1).to(torch.float32)[:, None]


def segment_mean(x: torch.Tensor, cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """The mean of x[cu[i]:cu[i+1]] for each of `rows` items of a [tokens, hidden] pack, summed
    in a fixed order per item (no atomics): the same bits for an item at any offset, in any
    batch. No host sync, so it runs inside a captured CUDA graph."""
    if not _use_triton(x):
        return segment_mean_reference(x, cu_seqlens, rows)
    cols = x.shape[1]
    y = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    block_h = 128
    _segment_mean_kernel[(rows, triton.cdiv(cols, block_h))](
        x, cu_seqlens, y, cols, BLOCK_T=32, BLOCK_H=block_h, num_warps=4
    )
    return y
