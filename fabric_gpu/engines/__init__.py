"""Engines: one interface (base.Engine), several backends. `create_engine` picks by manifest."""

from __future__ import annotations

from fabric_gpu.engines.base import Engine, EngineError, EngineOutput, InputLocation, PaddedBatch
from fabric_gpu.manifest import EngineManifest


def create_engine(manifest: EngineManifest) -> Engine:
    if manifest.backend == "cpu":
        from fabric_gpu.engines.cpu import CpuEngine

        return CpuEngine(manifest)
    if manifest.backend == "torch":
        import torch

        if not torch.cuda.is_available():
            raise EngineError(
                "backend 'torch' runs on a CUDA GPU and this process sees none; use backend 'cpu'"
            )
        from fabric_gpu.engines.torch_engine import TorchEngine

        return TorchEngine(manifest)
    if manifest.backend == "tensorrt":
        from fabric_gpu.engines.tensorrt_engine import TensorRTEngine

        return TensorRTEngine(manifest)
    raise EngineError(f"unknown backend {manifest.backend!r}")


def input_layout(manifest: EngineManifest) -> str:
    """The layout the manifest's engine takes, decided without loading it: the torch backend
    runs BERT-architecture models packed, every other engine padded."""
    if manifest.backend != "torch":
        return "padded"
    import json

    from fabric_gpu.model import resolve_model_dir

    config = json.loads((resolve_model_dir(manifest.model_id) / "config.json").read_text())
    return "packed" if config.get("model_type") == "bert" else "padded"


__all__ = [
    "Engine",
    "EngineError",
    "EngineOutput",
    "InputLocation",
    "PaddedBatch",
    "create_engine",
    "input_layout",
]
