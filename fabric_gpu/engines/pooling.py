"""Pooling: one vector per item from its tokens' last hidden states, in float32. The one home of
the modes a manifest names (manifest.POOLINGS: "mean" over real tokens, "cls" the first token,
"last" the last real token), for both input layouts."""

from __future__ import annotations

import torch

from fabric_gpu.engines.fused import segment_mean


def pool_padded(last: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """`last` [items, seq_len, hidden], `mask` [items, seq_len] (1 on real tokens)."""
    if pooling == "cls":
        return last[:, 0].float()
    if pooling == "last":
        lengths = mask.sum(1)
        items = torch.arange(last.shape[0], device=last.device)
        return last[items, (lengths - 1).clamp(min=0)].float()
    weights = mask.unsqueeze(-1).to(torch.float32)
    return (last.float() * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def pool_packed(
    x: torch.Tensor, seq_ids: torch.Tensor, cu_seqlens: torch.Tensor, rows: int, pooling: str
) -> torch.Tensor:
    """`x` [capacity, hidden]: the items' tokens back to back; `seq_ids` each token's item;
    `cu_seqlens` where each item starts; `rows` the items pooled (padding tokens belong to row
    `rows`, which is dropped). On the GPU, mean pooling sums each item's tokens in a fixed
    order (fused.segment_mean, no atomics), so an item's vector does not depend on where it sits
    in the pack or what rides with it; the CPU's index_add_ is a loop in token order already."""
    end = x.shape[0] - 1
    if pooling == "cls":
        return x[cu_seqlens[:rows].long().clamp(max=end)].float()
    if pooling == "last":
        return x[(cu_seqlens[1 : rows + 1].long() - 1).clamp(min=0, max=end)].float()
    if x.is_cuda:
        return segment_mean(x, cu_seqlens, rows)
    sums = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
    sums.index_add_(0, seq_ids, x.float())
    counts = (cu_seqlens[1 : rows + 1] - cu_seqlens[:rows]).clamp(min=1).to(torch.float32)
    return sums / counts[:, None]


def unit_length(pooled: torch.Tensor, normalize: bool | None) -> torch.Tensor:
    """The pooled vectors scaled to unit length when the model normalises (its Normalize
    module: sentence-transformers' `F.normalize(p=2, dim=1)`), else as they are."""
    return torch.nn.functional.normalize(pooled, p=2.0, dim=1) if normalize else pooled
