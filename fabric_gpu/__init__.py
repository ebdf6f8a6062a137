"""Inference Fabric's GPU side: the compiled runtime, the engines and their manifest.

Nothing here imports Dagster; `fabric_pipelines` drives these classes.
"""

from typing import Any

from fabric_gpu.device import GpuStatus, probe_gpu, runtime_summary
from fabric_gpu.profile import ConsumerProfile, ProfileError

__all__ = [
    "ConsumerProfile",
    "EncodeError",
    "Encoded",
    "GpuStatus",
    "ProfileError",
    "encode",
    "probe_gpu",
    "runtime_summary",
]


def __getattr__(name: str) -> Any:
    # encode() brings the tokenizer, the engines and the runtime: imported on first use only.
    if name in ("encode", "Encoded", "EncodeError"):
        from fabric_gpu import encoding

        return getattr(encoding, name)
    raise AttributeError(f"module 'fabric_gpu' has no attribute {name!r}")
