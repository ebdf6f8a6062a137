"""Engines: one interface (base.Engine), several backends. `create_engine` picks by manifest."""

from __future__ import annotations

from fabric_gpu.engines.base import Engine, EngineError, EngineOutput, InputLocation, PaddedBatch
from fabric_gpu.manifest import EngineManifest


def create_engine(manifest: EngineManifest) -> Engine:
    if manifest.backend == "cpu":
        from fabric_gpu.engines.cpu import CpuEngine

        return CpuEngine(manifest)
    raise EngineError(
        f"backend {manifest.backend!r} is not available in this build; use backend 'cpu'"
    )


__all__ = [
    "Engine",
    "EngineError",
    "EngineOutput",
    "InputLocation",
    "PaddedBatch",
    "create_engine",
]
