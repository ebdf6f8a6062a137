"""The `torch` backend: a Hugging Face encoder in fp16/bf16 on the GPU, one CUDA graph per shape.

BERT-architecture models run the packed forward (packed_bert.py): a batch is all its tokens in
one axis, the shape is the token capacity (the batch's token count rounded up to
PACKED_GRANULARITY), and nothing is computed for padding but the short tail that rounding adds.
Other encoders run the Hugging Face module itself on padded input, one graph per
[items, sequence length] shape.

The runtime drives the graphs: `capture()` records one CUDA graph per shape at warm-up (static
input buffers, outputs held by the engine), and `shapes()` describes each for the runtime's graph
stage, which launches the graph (`raw_cuda_graph_exec`) on its own stream behind the doorbell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fabric_gpu import _runtime
from fabric_gpu.engines.base import (
    EngineError,
    EngineOutput,
    InputLocation,
    PaddedBatch,
    normalise_layers,
)
from fabric_gpu.engines.bert_checkpoint import (
    BertShape,
    UnsupportedModelError,
    read_bert_checkpoint,
)
from fabric_gpu.engines.onnx_export import PaddedBertModule
from fabric_gpu.engines.packed_bert import PackedBert
from fabric_gpu.engines.pooling import pool_padded, unit_length
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import offline_environment, resolve_model_dir, weights_sha256
from fabric_gpu.profile import PACKED_GRANULARITY, ConsumerProfile
from fabric_gpu.variants import Int8Calibration, TorchEncoder

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class CapturedShape:
    epoch: int
    graph: torch.cuda.CUDAGraph | None
    pooled: torch.Tensor
    hooks: list[torch.Tensor]
    items: int
    seq_len: int  # padded: sequence length; packed: token capacity


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (rows, seq) 0/1 padding mask as the (rows, 1, 1, seq) additive mask attention adds to its
    scores. Hugging Face builds this itself from a 2-D mask, but with a host-to-device copy that
    CUDA graph capture refuses; a ready 4-D mask is used as given, and this one is all GPU ops."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class LengthCachedBias:
    """A relative position bias that depends only on the sequence length (MPNet's), computed
    once per length, outside CUDA graph capture, and replayed from that tensor. Hugging Face
    builds it from host tensors copied to the GPU on every call, which capture refuses; the
    engine's warm-up runs each shape eagerly before capturing it, which fills the cache."""

    def __init__(self, compute: Any) -> None:
        self._compute = compute
        self.by_length: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, num_buckets: int = 32
    ) -> torch.Tensor:
        if position_ids is not None:  # positions of their own: not a function of length alone
            return self._compute(x, position_ids=position_ids, num_buckets=num_buckets)
        key = (int(x.size(1)), num_buckets)
        bias = self.by_length.get(key)
        if bias is None:
            bias = self._compute(x[:1], num_buckets=num_buckets)  # [1, heads, length, length]
            self.by_length[key] = bias
        return bias.expand(x.size(0), -1, -1, -1)


def packed_capacity(tokens: int) -> int:
    return max(PACKED_GRANULARITY, -(-tokens // PACKED_GRANULARITY) * PACKED_GRANULARITY)


class TorchEngine:
    input_location = InputLocation.DEVICE
    backend = "torch"

    def __init__(
        self,
        manifest: EngineManifest,
        *,
        model: Any = None,  # a transformers model already loaded (benchmarks: random weights)
        device: str = "cuda",
        layout: str = "auto",
    ) -> None:
        if manifest.backend != "torch":
            raise EngineError(
                f"TorchEngine needs backend 'torch', the manifest says {manifest.backend!r}"
            )
        self.manifest = manifest
        self.dtype = DTYPES[manifest.dtype]
        self.device = torch.device(device)
        bert: PackedBert | None = None
        shape: BertShape | None = None
        if model is None:
            offline_environment()
            model_dir = resolve_model_dir(manifest.model_id)
            manifest.verify_weights(weights_sha256(model_dir))
            # BERT checkpoints load straight onto the device; transformers (seconds to import)
            # only for the others.
            checkpoint = read_bert_checkpoint(model_dir, self.device, self.dtype)
            if checkpoint is not None:
                shape, tensors = checkpoint
                bert = PackedBert(shape, tensors)
            else:
                from transformers import AutoModel

                model = AutoModel.from_pretrained(str(model_dir))
        # The Hugging Face module, where one was loaded (the padded forward of other encoders).
        self.model: Any = None
        config: Any = shape  # BertShape names its numbers as Hugging Face configs do
        if model is not None:
            self.model = model.to(self.device, self.dtype).eval()
            config = self.model.config
            try:
                bert = PackedBert.from_model(self.model)
            except UnsupportedModelError:
                if layout == "packed":
                    raise
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.pad_token_id = int(getattr(config, "pad_token_id", 0) or 0)
        self.hook_indices = normalise_layers(manifest.hooks.layers, self.num_layers)
        # The output variant, made on the GPU inside each shape's graph, before the copy out.
        variant = manifest.hooks.output_variant()
        self.encoder = (
            TorchEncoder(variant, self.hidden_size, self.device) if variant.key_suffix else None
        )
        self.pooled_row_bytes = variant.transport_row_bytes(self.hidden_size)
        self.int8_calibration: Int8Calibration | None = None
        self.packed = bert if layout in ("auto", "packed") else None
        self.layout = "packed" if self.packed is not None else "padded"
        if self.packed is not None and self.device.type == "cuda" and self.dtype == torch.float32:
            # FlashAttention's varlen kernel (packed_bert.py) takes half precision only.
            raise EngineError(
                "dtype 'float32': the torch engine's packed attention runs float16 or bfloat16 "
                "on the GPU; set dtype to float16 (its vectors match float32's to cosine "
                "0.99999, README 'Parity'), or use backend 'cpu' for float32"
            )
        encoder: Any = getattr(self.model, "encoder", None)
        if bert is None and hasattr(encoder, "compute_position_bias"):  # MPNet
            encoder.compute_position_bias = LengthCachedBias(encoder.compute_position_bias)
        # Padded BERT runs this module's own forward: no data-dependent Python, so it captures
        # into a CUDA graph; other encoders run the Hugging Face module (it must be capturable).
        self._padded_bert = (
            PaddedBertModule(
                bert, self.hook_indices, manifest.hooks.pooling, manifest.hooks.normalize
            )
            if bert is not None
            else None
        )
        profile = manifest.profile
        self.max_len = max(profile.max_seq_len, PACKED_GRANULARITY)
        capacity = profile.max_batch_tokens
        # Static inputs, shared by every shape (views of the first elements).
        i64, dev = torch.int64, self.device
        self.ids = torch.full((capacity,), self.pad_token_id, dtype=i64, device=dev)
        self.mask_or_positions = torch.zeros(
            capacity, dtype=i64, device=dev
        )  # packed: positions; padded: attention mask
        self.seq_ids = torch.full((capacity,), profile.max_batch_items, dtype=i64, device=dev)
        self.cu_seqlens = torch.full(
            (profile.max_batch_items + 2,), capacity, dtype=torch.int32, device=self.device
        )
        self.captured: dict[int, CapturedShape] = {}
        self._pool: Any = None

    @property
    def profile(self) -> ConsumerProfile:
        return self.manifest.profile

    @property
    def hook_dtype(self) -> str:
        return (
            "bfloat16"
            if self.dtype == torch.bfloat16
            else "float16"
            if self.dtype == torch.float16
            else "float32"
        )

    # ---- one forward, eagerly ------------------------------------------------------------------
    def _forward_packed(self, capacity: int, rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        assert self.packed is not None
        pooled, hooks = self.packed.forward(
            self.ids[:capacity], self.mask_or_positions[:capacity], self.seq_ids[:capacity], self.cu_seqlens,
            self.max_len, rows, self.hook_indices, self.manifest.hooks.pooling,
        )  # fmt: skip
        return unit_length(pooled, self.manifest.hooks.normalize), hooks

    def _forward_padded(self, items: int, seq_len: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ids = self.ids[: items * seq_len].view(items, seq_len)
        mask = self.mask_or_positions[: items * seq_len].view(items, seq_len)
        normalize = self.manifest.hooks.normalize
        if self._padded_bert is not None:  # it normalises itself
            pooled, *states = self._padded_bert(ids, mask)
            return pooled, states
        out = self.model(
            input_ids=ids, attention_mask=additive_mask(mask, self.dtype), output_hidden_states=True
        )
        pooled = pool_padded(out.last_hidden_state, mask, self.manifest.hooks.pooling)
        hooks = [out.hidden_states[i].contiguous() for i in self.hook_indices]
        return unit_length(pooled, normalize), hooks

    # ---- graphs --------------------------------------------------------------------------------
    def shapes_for(self, plan_shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(epoch, rows) to capture for a plan's (shape, most items) pairs: packed shapes hold up
        to max_batch_items sequences; padded shapes as many rows as the plan's largest batch."""
        if self.layout == "packed":
            return sorted({(shape, self.profile.max_batch_items) for shape, _ in plan_shapes})
        return sorted(plan_shapes)

    @torch.inference_mode()
    def capture(self, shapes: list[tuple[int, int]]) -> None:
        """Capture one CUDA graph per (epoch, rows), largest first so the shared pool is sized
        once. Inputs are dummies that exercise every path; real batches overwrite them."""
        if self.device.type != "cuda":
            raise EngineError("CUDA graphs need a CUDA device")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for epoch, rows in sorted(shapes, key=lambda s: -s[0] * s[1]):
            if epoch in self.captured:
                continue
            self._dummy_inputs(epoch, rows)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: Triton compiles, cuBLAS plans
                    self._run(epoch, rows)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=side):
                pooled, hooks = self._run(epoch, rows)
            self.captured[epoch] = CapturedShape(epoch, graph, pooled, hooks, rows, epoch)
        torch.cuda.synchronize(self.device)

    def _run(self, epoch: int, rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One shape as its graph runs it: pooled rows in the output variant's bytes."""
        if self.layout == "packed":
            pooled, hooks = self._forward_packed(epoch, rows + 1)
        else:
            pooled, hooks = self._forward_padded(rows, epoch)
        return self._encoded(pooled), hooks

    def _encoded(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.encoder is None:
            return pooled
        rows = self.encoder(pooled).contiguous().view(torch.uint8).view(pooled.shape[0], -1)
        pad = self.pooled_row_bytes - rows.shape[1]  # rows travel padded to 16 bytes
        return torch.nn.functional.pad(rows, (0, pad)) if pad else rows

    def set_int8_calibration(self, calibration: Int8Calibration) -> None:
        """Copied into the tensors the captured graphs read: valid before or after capture."""
        if self.encoder is not None:
            self.encoder.set_calibration(calibration)
        self.int8_calibration = calibration

    def _dummy_inputs(self, epoch: int, rows: int) -> None:
        if self.layout == "packed":
            lengths = [
                min(self.max_len, epoch - i * self.max_len)
                for i in range(-(-epoch // self.max_len))
            ]
            lengths = lengths[: self.profile.max_batch_items]
            cu = np.full(self.profile.max_batch_items + 2, epoch, dtype=np.int32)
            cu[: len(lengths) + 1] = np.concatenate([[0], np.cumsum(lengths)])
            self.cu_seqlens.copy_(torch.from_numpy(cu))
            positions = np.concatenate([np.arange(n) for n in lengths])
            seq = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
            self.mask_or_positions[:epoch].copy_(torch.from_numpy(positions))
            self.seq_ids[:epoch].copy_(torch.from_numpy(seq))
            self.ids[:epoch].fill_(1000)
        else:
            self.ids[: rows * epoch].fill_(1000)
            self.mask_or_positions[: rows * epoch].fill_(1)

    def shapes(self) -> list[_runtime.ShapeGraph]:
        """Each captured shape as the runtime's graph stage takes it."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        inputs: _runtime.PackedInputs | _runtime.PaddedInputs
        if self.layout == "packed":
            inputs = _runtime.PackedInputs(
                input_ids=self.ids.data_ptr(),
                positions=self.mask_or_positions.data_ptr(),
                seq_ids=self.seq_ids.data_ptr(),
                cu_seqlens=self.cu_seqlens.data_ptr(),
            )
        else:
            inputs = _runtime.PaddedInputs(
                input_ids=self.ids.data_ptr(), attention_mask=self.mask_or_positions.data_ptr()
            )
        out = []
        for s in self.captured.values():
            assert s.graph is not None
            out.append(
                _runtime.ShapeGraph(
                    epoch=s.epoch,
                    items=s.items,
                    seq_len=s.seq_len,
                    inputs=inputs,
                    pooled=s.pooled.data_ptr(),
                    pooled_row_bytes=self.pooled_row_bytes,
                    hooks=[h.data_ptr() for h in s.hooks],
                    hook_row_bytes=self.hidden_size * elem,
                    pad_id=self.pad_token_id,
                    graph_exec=s.graph.raw_cuda_graph_exec(),
                )
            )
        return out

    # ---- the Engine interface (eager; tests and small jobs) -------------------------------------
    @torch.inference_mode()
    def forward(self, batch: PaddedBatch) -> EngineOutput:
        lengths = [int(n) for n in batch.lengths]
        real = np.arange(batch.seq_len)[None, :] < batch.lengths[:, None]
        if self.layout == "packed":
            capacity = packed_capacity(sum(lengths))
            tokens = torch.from_numpy(batch.input_ids[real]).to(self.device)
            self.ids[: tokens.shape[0]].copy_(tokens)
            self.ids[tokens.shape[0] : capacity].fill_(self.pad_token_id)
            cu = np.full(self.profile.max_batch_items + 2, capacity, dtype=np.int32)
            cu[: len(lengths) + 1] = np.concatenate([[0], np.cumsum(lengths)])
            self.cu_seqlens.copy_(torch.from_numpy(cu))
            self.mask_or_positions[: sum(lengths)].copy_(
                torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
            )
            self.mask_or_positions[sum(lengths) : capacity].zero_()
            seq = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
            self.seq_ids[: sum(lengths)].copy_(torch.from_numpy(seq))
            self.seq_ids[sum(lengths) : capacity].fill_(self.profile.max_batch_items)
            pooled, hooks = self._forward_packed(capacity, self.profile.max_batch_items + 1)
            n, r = len(lengths), sum(lengths)
            return EngineOutput(
                pooled=pooled[:n].float().cpu().numpy(),
                hooks={
                    k: h[:r].float().cpu().numpy().astype(np.float16)
                    for k, h in zip(self.manifest.hooks.layers, hooks, strict=True)
                },
            )
        items, seq_len = batch.input_ids.shape
        self.ids[: items * seq_len].copy_(torch.from_numpy(batch.input_ids.reshape(-1)))
        self.mask_or_positions[: items * seq_len].copy_(
            torch.from_numpy(real.reshape(-1).astype(np.int64))
        )
        pooled, hooks = self._forward_padded(items, seq_len)
        mask = torch.from_numpy(real).to(self.device)
        return EngineOutput(
            pooled=pooled.cpu().numpy(),
            hooks={
                k: h[mask].float().cpu().numpy().astype(np.float16)
                for k, h in zip(self.manifest.hooks.layers, hooks, strict=True)
            },
        )

    def close(self) -> None:
        self.captured.clear()
        self.model = self.packed = self._padded_bert = None
