"""The `tensorrt` backend: the same model exported to ONNX (onnx_export.py) and built by
TensorRT with one optimisation profile per padded bucket shape; each profile's execution is
captured into a CUDA graph (enqueueV3 on a capturing stream) that the runtime's graph stage
launches like any other engine's.

What runs where: the ONNX export and everything around the build (profiles, static buffers,
graph registration) are exercised in CI; the TensorRT build and enqueue themselves need
TensorRT's builder libraries, which are not installable in this project's environments
(README, "Engine backends"), so that path is written against the TensorRT 10 API but has not
been run here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from fabric_gpu.engines.base import EngineError
from fabric_gpu.engines.onnx_export import export_onnx
from fabric_gpu.engines.torch_engine import CapturedShape, TorchEngine
from fabric_gpu.manifest import EngineManifest


def load_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise EngineError(
            "backend 'tensorrt' needs NVIDIA TensorRT 10 (the Python package `tensorrt` with its "
            "builder libraries), which is not installed in this environment; use backend 'torch' "
            "(the packed CUDA-graph engine) or install TensorRT from NVIDIA's package index"
        ) from exc
    return tensorrt


def optimization_profiles(
    shapes: list[tuple[int, int]],
) -> list[dict[str, tuple[tuple[int, int], ...]]]:
    """One profile per padded shape (seq_len, items): min = opt = max, so each builds kernels
    for exactly the shape its CUDA graph replays."""
    profiles = []
    for seq_len, items in sorted(shapes):
        if seq_len <= 0 or items <= 0:
            raise ValueError(f"shape ({seq_len}, {items}) is empty")
        dims: tuple[tuple[int, int], ...] = ((items, seq_len),) * 3
        profiles.append({"input_ids": dims, "attention_mask": dims})
    return profiles


class TensorRTEngine(TorchEngine):
    backend = "tensorrt"

    def __init__(
        self, manifest: EngineManifest, *, model: Any = None, device: str = "cuda"
    ) -> None:
        self.trt = load_tensorrt()
        super().__init__(manifest, model=model, device=device, layout="padded")
        if self._padded_bert is None:
            raise EngineError("the TensorRT backend exports BERT-architecture models only")
        self._workdir = Path(tempfile.mkdtemp(prefix="fabric-trt-"))
        self._engine: Any = None
        self._contexts: list[Any] = []

    @torch.inference_mode()
    def capture(self, shapes: list[tuple[int, int]]) -> None:
        trt = self.trt
        logger = trt.Logger(trt.Logger.WARNING)
        onnx_path = export_onnx(
            self.model, self.hook_indices, self.manifest.hooks.pooling,
            self._workdir / "model.onnx", normalize=self.manifest.hooks.normalize,
        )  # fmt: skip
        builder = trt.Builder(logger)
        network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(onnx_path.read_bytes()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EngineError(f"TensorRT could not parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        if self.dtype == torch.float16:
            config.set_flag(trt.BuilderFlag.FP16)
        elif self.dtype == torch.bfloat16:
            config.set_flag(trt.BuilderFlag.BF16)
        ordered = sorted(shapes)
        for spec in optimization_profiles(ordered):
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in spec.items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise EngineError("TensorRT failed to build the engine (see its log above)")
        self._engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
        stream = torch.cuda.Stream(self.device)
        outputs = ["pooled"] + [f"hook_{k}" for k in range(len(self.hook_indices))]
        for index, (seq_len, items) in enumerate(ordered):
            context = self._engine.create_execution_context()
            context.set_optimization_profile_async(index, stream.cuda_stream)
            n = items * seq_len
            ids = self.ids[:n].view(items, seq_len)
            mask = self.mask_or_positions[:n].view(items, seq_len)
            pooled = torch.empty((items, self.hidden_size), dtype=torch.float32, device=self.device)
            hooks = [
                torch.empty(
                    (items, seq_len, self.hidden_size), dtype=self.dtype, device=self.device
                )
                for _ in self.hook_indices
            ]
            context.set_input_shape("input_ids", (items, seq_len))
            context.set_input_shape("attention_mask", (items, seq_len))
            context.set_tensor_address("input_ids", ids.data_ptr())
            context.set_tensor_address("attention_mask", mask.data_ptr())
            for name, tensor in zip(outputs, [pooled, *hooks], strict=True):
                context.set_tensor_address(name, tensor.data_ptr())
            self._dummy_inputs(seq_len, items)
            with torch.cuda.stream(stream):
                context.execute_async_v3(stream.cuda_stream)  # warm-up outside the graph
                self._encoded(pooled)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                context.execute_async_v3(stream.cuda_stream)
                rows = self._encoded(pooled)  # the output variant, in the same graph
            self._contexts.append(context)
            self.captured[seq_len] = CapturedShape(seq_len, graph, rows, hooks, items, seq_len)
        torch.cuda.synchronize(self.device)
