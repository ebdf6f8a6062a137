"""What GPU this process has, asked of the compiled runtime (which dlopens the driver).

On a machine without an NVIDIA driver the answer is "no GPU" with the reason, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import fabric_gpu._runtime as _runtime


@dataclass(frozen=True)
class DeviceDescription:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    stream_mem_ops_64: bool
    can_map_host_memory: bool


@dataclass(frozen=True)
class GpuStatus:
    available: bool
    reason: str
    driver_version: int = 0
    devices: tuple[DeviceDescription, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        if not self.available:
            return f"no GPU: {self.reason}"
        names = ", ".join(
            f"{d.ordinal}: {d.name} (sm_{d.compute_capability[0]}{d.compute_capability[1]})"
            for d in self.devices
        )
        return f"{len(self.devices)} GPU(s), driver {self.driver_version}: {names}"


def probe_gpu() -> GpuStatus:
    """Ask the runtime for the devices; `reason` says why there are none."""
    probe = _runtime.probe_driver()
    devices = tuple(
        DeviceDescription(
            ordinal=d.ordinal,
            name=d.name,
            compute_capability=(d.cc_major, d.cc_minor),
            stream_mem_ops_64=d.stream_mem_ops_64,
            can_map_host_memory=d.can_map_host_memory,
        )
        for d in probe.devices
    )
    return GpuStatus(probe.available, probe.reason, probe.driver_version, devices)


def kernels_compiled() -> bool:
    """True when the runtime was built with nvcc and carries its CUDA kernels."""
    return bool(_runtime.kernel_image_size() > 0)


def runtime_summary() -> str:
    kernels = (
        f"kernels {_runtime.kernel_archs()} ({_runtime.kernel_image_size():,} bytes)"
        if kernels_compiled()
        else "built without CUDA kernels (no nvcc at build time)"
    )
    return f"fabric_gpu runtime: {kernels}; {probe_gpu().describe()}"
