"""A BERT-family encoder over packed input: every token of a batch in one [tokens, hidden] axis.

No padding is computed: attention is variable-length (FlashAttention's varlen kernel, PyTorch's
`aten._flash_attention_forward`, on the GPU) over `cu_seqlens`. Q, K and V come from one
fused GEMM; the first FFN GEMM carries bias and GELU in cuBLASLt's epilogue; residual adds are
fused into LayerNorm (fused.py); mean pooling is one `index_add_` over the token -> item map.
On the CPU (tests) the attention runs sequence by sequence with SDPA and GELU is exact.

Weights come from a BERT-architecture checkpoint read without transformers (bert_checkpoint.py)
or from a Hugging Face `BertModel` already loaded (BERT, MiniLM and other BERT-architecture
models).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from fabric_gpu.engines.bert_checkpoint import BertShape, UnsupportedModelError
from fabric_gpu.engines.fused import add_layer_norm, embed_layer_norm
from fabric_gpu.engines.pooling import pool_packed

# The op `torch.nn.attention.varlen.varlen_attn` wraps, called directly: that wrapper is a Python
# custom op whose first call imports torch._dynamo and all it needs (5 s of a worker's start on the
# H200 machine, where packages carry no compiled bytecode), for no difference in the kernel.
HAVE_FLASH_VARLEN = hasattr(torch.ops.aten, "_flash_attention_forward")

QKV = ("query", "key", "value")
__all__ = ["PackedBert", "PackedLayer", "UnsupportedModelError"]


@dataclass(frozen=True)
class PackedLayer:
    wqkv: torch.Tensor  # [3H, H]
    bqkv: torch.Tensor
    wo: torch.Tensor
    bo: torch.Tensor
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    w1: torch.Tensor  # [4H, H]
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor


class PackedBert:
    """The packed forward of a BERT-architecture model's weights (shared, not copied, but for the
    fused Q/K/V projection)."""

    def __init__(self, shape: BertShape, tensors: Mapping[str, torch.Tensor]) -> None:
        """`tensors` by BertModel state-dict name (bert_checkpoint.bert_tensor_names)."""
        self.hidden = shape.hidden_size
        self.heads = shape.num_attention_heads
        self.head_dim = self.hidden // self.heads
        self.eps = shape.layer_norm_eps
        t = {name: tensor.detach() for name, tensor in tensors.items()}  # outside autograd
        self.word = t["embeddings.word_embeddings.weight"]
        self.position = t["embeddings.position_embeddings.weight"]
        self.token_type = t["embeddings.token_type_embeddings.weight"][0].contiguous()
        self.emb_ln = (t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"])
        self.layers: list[PackedLayer] = []
        for i in range(shape.num_hidden_layers):
            p = f"encoder.layer.{i}."
            self.layers.append(
                PackedLayer(
                    wqkv=torch.cat([t[f"{p}attention.self.{x}.weight"] for x in QKV]),
                    bqkv=torch.cat([t[f"{p}attention.self.{x}.bias"] for x in QKV]),
                    wo=t[f"{p}attention.output.dense.weight"],
                    bo=t[f"{p}attention.output.dense.bias"],
                    ln1_w=t[f"{p}attention.output.LayerNorm.weight"],
                    ln1_b=t[f"{p}attention.output.LayerNorm.bias"],
                    w1=t[f"{p}intermediate.dense.weight"],
                    b1=t[f"{p}intermediate.dense.bias"],
                    w2=t[f"{p}output.dense.weight"],
                    b2=t[f"{p}output.dense.bias"],
                    ln2_w=t[f"{p}output.LayerNorm.weight"],
                    ln2_b=t[f"{p}output.LayerNorm.bias"],
                )
            )

    @classmethod
    def from_model(cls, model: Any) -> PackedBert:
        """Over a transformers BertModel's own parameters."""
        shape = BertShape.of(model.config)
        if not hasattr(model, "embeddings"):
            raise UnsupportedModelError("packed forward needs a bare BertModel (embeddings)")
        return cls(shape, dict(model.named_parameters()))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int
    ) -> torch.Tensor:
        if q.is_cuda and HAVE_FLASH_VARLEN:
            # (output, logsumexp, philox seed, philox offset, debug mask); no dropout, no mask.
            out = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_len, max_len, 0.0, False, False
            )
            return cast(torch.Tensor, out[0])
        out = torch.zeros_like(q)
        bounds = cu.tolist()
        for start, end in itertools.pairwise(bounds):
            if end > start:
                out[start:end] = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1),
                    k[start:end].transpose(0, 1),
                    v[start:end].transpose(0, 1),
                ).transpose(0, 1)
        return out

    def _ffn_in(self, x: torch.Tensor, layer: PackedLayer) -> torch.Tensor:
        if x.is_cuda:
            # cuBLASLt epilogue: bias + GELU fused into the GEMM (tanh approximation).
            return torch._addmm_activation(layer.b1, x, layer.w1.t(), use_gelu=True)
        return F.gelu(F.linear(x, layer.w1, layer.b1))

    def forward(
        self,
        ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        seq_ids: torch.Tensor,  # int64 [T]: item of each token
        cu_seqlens: torch.Tensor,  # int32 [rows + 1]
        max_len: int,
        rows: int,  # pooled rows: items + 1 (the tail)
        hook_indices: tuple[int, ...],  # hidden_states indices, 0 = embeddings
        pooling: str,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        tokens = ids.shape[0]
        x = embed_layer_norm(
            ids, positions, self.word, self.position, self.token_type, *self.emb_ln, self.eps
        )
        states = {0: x} if 0 in hook_indices else {}
        for i, layer in enumerate(self.layers, start=1):
            qkv = F.linear(x, layer.wqkv, layer.bqkv).view(tokens, 3, self.heads, self.head_dim)
            context = self._attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_len)
            attn = F.linear(context.reshape(tokens, self.hidden), layer.wo, layer.bo)
            x = add_layer_norm(attn, x, layer.ln1_w, layer.ln1_b, self.eps)
            out = F.linear(self._ffn_in(x, layer), layer.w2, layer.b2)
            x = add_layer_norm(out, x, layer.ln2_w, layer.ln2_b, self.eps)
            if i in hook_indices:
                states[i] = x
        pooled = pool_packed(x, seq_ids, cu_seqlens, rows, pooling)
        return pooled, [states[i] for i in hook_indices]
