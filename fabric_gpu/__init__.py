"""Inference Fabric's GPU side: the compiled runtime, the engines and their manifest.

Nothing here imports Dagster; `fabric_pipelines` drives these classes.
"""

from fabric_gpu.device import GpuStatus, probe_gpu, runtime_summary
from fabric_gpu.profile import ConsumerProfile, ProfileError

__all__ = ["ConsumerProfile", "GpuStatus", "ProfileError", "probe_gpu", "runtime_summary"]
