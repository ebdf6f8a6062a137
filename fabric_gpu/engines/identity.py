"""Which engine computed a result: what decides its bits beyond the model key.

The model key (manifest.py) names the model, weights, pooling, normalisation and output
variant. The same model run by another backend, in another dtype, on another kind of device or
by another version of an engine's numerics gives other bits (fp16 cuBLAS against fp32 CPU
GEMMs). A stored result records its engine identity, reuse matches it (it is part of a task's
content key, lib/broker/reuse.py), and a receipt names every identity whose rows it indexed.

    torch/float16/NVIDIA H200/n2        cpu/float32/cpu/n3

An engine's numerics version (`ENGINE_NUMERICS`, per backend) moves whenever its arithmetic
changes (a kernel, a reduction order): results of the old numerics are then computed again, not
reused.
"""

from __future__ import annotations

from typing import Any

from fabric_gpu.manifest import EngineManifest

# Per backend. torch 2: packed mean pooling sums each item's tokens in a fixed order
# (fused.segment_mean). cpu 3: MKL in strict reproducibility mode (fabric_gpu/__init__.py).
ENGINE_NUMERICS = {"cpu": 3}
DEFAULT_NUMERICS = 2

# The contract rows are made under, as a receipt records it: on one engine identity, the same
# token ids give the same bytes whatever batch, position, bucket, set or run they come in (the CPU
# engine computes each item at its bucket's length, tests/test_batch_invariance.py; the torch
# engine packs and pools in a fixed order, tests/test_batch_invariance_gpu.py). Reuse rests on it.
BATCH_INVARIANCE = "per-identity: same token ids, same bytes in any batch, bucket, set or run"


def device_class(backend: str, device_name: str | None = None) -> str:
    """The kind of device an engine runs on: "cpu" for the CPU engine; a GPU's product name
    (its SM count and cuBLAS's kernel choices come with it), or "gpu" where it is not known."""
    if backend == "cpu":
        return "cpu"
    return device_name.strip() if device_name and device_name.strip() else "gpu"


def engine_identity(manifest: EngineManifest, device_name: str | None = None) -> str:
    """backend/dtype/device class/numerics version, as results record it."""
    backend = manifest.backend
    numerics = ENGINE_NUMERICS.get(backend, DEFAULT_NUMERICS)
    return f"{backend}/{manifest.dtype}/{device_class(backend, device_name)}/n{numerics}"


def planned_identity(manifest: EngineManifest) -> str:
    """The identity the workers of a run will have, as the planning step sees it: this host's
    first GPU for GPU backends (the workers' own on another host may differ: their results then
    record theirs, and reuse keyed by this one finds none of them)."""
    if manifest.backend == "cpu":
        return engine_identity(manifest)
    from fabric_gpu.device import probe_gpu

    status = probe_gpu()
    name = status.devices[0].name if status.available and status.devices else None
    return engine_identity(manifest, name)


def identity_of(engine: Any) -> str:
    """A loaded engine's identity: its manifest, and the GPU it runs on (torch engines keep
    their `device`)."""
    manifest: EngineManifest = engine.manifest
    if manifest.backend == "cpu":
        return engine_identity(manifest)
    name = None
    try:
        import torch

        device = getattr(engine, "device", None)
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(device)
    except Exception:  # no torch, no device: the class stays "gpu"
        name = None
    return engine_identity(manifest, name)
