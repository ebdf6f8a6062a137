"""Inference Fabric's GPU side: the compiled runtime, the engines and their manifest.

Nothing here imports Dagster; `fabric_pipelines` drives these classes.
"""

import os
from typing import Any

# The CPU engine's vectors must not depend on the batch they ride in (engines/identity.py's
# BATCH_INVARIANCE). MKL picks its GEMM kernels and how it splits their sums by the product's
# shape and the thread count: on an AVX-512 machine 119 of 200 texts came out different alone and
# in a batch of 32. Its strict Conditional Numerical Reproducibility mode fixes them (about 3 %
# on the CPU engine). MKL reads this once, at its first call: set here, before anything of ours
# multiplies (every module of the project imports this package first). A value the user set
# stays, and the CPU engine warns that its vectors may then depend on the batch.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

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
