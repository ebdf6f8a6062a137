"""The Dagster `gpu` pool follows the hardware: one slot per visible GPU (one on a CPU machine).

The pool only counts concurrent GPU steps; which GPUs a step's workers use is decided by its
device lease (`lib/worker/devices.py`; the worker launch sets CUDA_VISIBLE_DEVICES per worker).
FABRIC_GPU_POOL_AUTO=0 leaves the pool's limit to the operator (set in the UI or with
`dagster instance concurrency set gpu N`).
"""

from __future__ import annotations

import os

import dagster as dg

from fabric_pipelines.lib.worker.devices import visible_gpus

GPU_POOL = "gpu"


def gpu_slots(visible: int) -> int:
    return max(1, visible)


def sync_gpu_pool(instance: dg.DagsterInstance, visible: int | None = None) -> int | None:
    """Set the pool's limit to one slot per GPU if it differs; returns the new limit, or None
    when nothing changed (or automatic sizing is off)."""
    if os.environ.get("FABRIC_GPU_POOL_AUTO", "1") == "0":
        return None
    wanted = gpu_slots(visible_gpus() if visible is None else visible)
    storage = instance.event_log_storage
    known = GPU_POOL in storage.get_concurrency_keys()
    if known and storage.get_concurrency_info(GPU_POOL).slot_count == wanted:
        return None
    storage.set_concurrency_slots(GPU_POOL, wanted)
    return wanted
