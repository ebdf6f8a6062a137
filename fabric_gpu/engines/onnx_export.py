"""ONNX export of an engine's model, the input of the TensorRT backend.

The exported graph is this module's plain padded forward of a BERT-architecture model over the
same weights as the packed engine: inputs `input_ids` and `attention_mask` ([batch, seq], int64,
both axes dynamic), outputs `pooled` ([batch, hidden], float32) and one `hook_<k>` per hook layer
([batch, seq, hidden]). It is written without data-dependent Python control flow, so the trace
holds for every shape (Hugging Face's own masking code does not trace that way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fabric_gpu.engines.packed_bert import PackedBert
from fabric_gpu.engines.pooling import pool_padded, unit_length


class PaddedBertModule(torch.nn.Module):
    def __init__(
        self,
        packed: PackedBert,
        hook_indices: tuple[int, ...],
        pooling: str,
        normalize: bool | None = False,
    ) -> None:
        super().__init__()
        self.p = packed
        self.hook_indices = hook_indices
        self.pooling = pooling
        self.normalize = normalize

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        p = self.p
        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
        x = F.embedding(input_ids, p.word) + F.embedding(positions, p.position) + p.token_type
        x = F.layer_norm(x, (p.hidden,), *p.emb_ln, p.eps)
        # Additive mask: 0 for real keys, a large negative number for padding.
        keep = attention_mask.to(x.dtype)[:, None, None, :]
        bias = (1.0 - keep) * torch.finfo(x.dtype).min
        states = [x]
        for layer in p.layers:
            qkv = F.linear(x, layer.wqkv, layer.bqkv).view(batch, seq, 3, p.heads, p.head_dim)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            scores = torch.matmul(q, k.transpose(-1, -2)) * (p.head_dim**-0.5) + bias
            context = (
                torch.matmul(torch.softmax(scores, dim=-1), v)
                .transpose(1, 2)
                .reshape(batch, seq, p.hidden)
            )
            x = F.layer_norm(
                F.linear(context, layer.wo, layer.bo) + x,
                (p.hidden,),
                layer.ln1_w,
                layer.ln1_b,
                p.eps,
            )
            h = F.gelu(F.linear(x, layer.w1, layer.b1))
            x = F.layer_norm(
                F.linear(h, layer.w2, layer.b2) + x, (p.hidden,), layer.ln2_w, layer.ln2_b, p.eps
            )
            states.append(x)
        pooled = unit_length(pool_padded(x, attention_mask, self.pooling), self.normalize)
        return (pooled, *(states[i] for i in self.hook_indices))


def export_onnx(
    model: Any,
    hook_indices: tuple[int, ...],
    pooling: str,
    path: Path,
    opset: int = 17,
    normalize: bool | None = False,
) -> Path:
    """Export `model` (a transformers BertModel) to `path`; returns the path."""
    module = PaddedBertModule(PackedBert.from_model(model), hook_indices, pooling, normalize).eval()
    device = next(model.parameters()).device
    ids = torch.full((2, 16), 1000, dtype=torch.int64, device=device)
    mask = torch.ones_like(ids)
    outputs = ["pooled"] + [f"hook_{k}" for k in range(len(hook_indices))]
    path.parent.mkdir(parents=True, exist_ok=True)
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("seq", min=2, max=4096)
    with torch.no_grad():
        # torch.export's exporter (the TorchScript one is deprecated): batch and sequence length
        # stay dynamic, as TensorRT's optimisation profiles expect.
        program = torch.onnx.export(
            module,
            (ids, mask),
            input_names=["input_ids", "attention_mask"],
            output_names=outputs,
            dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
    assert program is not None
    program.save(str(path))
    return path
