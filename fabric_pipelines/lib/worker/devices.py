"""Which GPUs a step's workers run on: an exclusive lease per device.

The Dagster `gpu` pool (defs/gpu_pool.py) only counts how many GPU steps run at once; the lease picks
the devices, so two concurrent steps never share a GPU. A lease is an `flock` on
`<folder>/gpu<i>.lock`: the kernel drops it when its holder exits, however it exits, so a crashed
step never strands a device. A step that cannot get all the devices it wants holds none of them
while it waits (no two steps can each hold half of what the other needs).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class DevicesBusy(RuntimeError):
    """Not all the wanted devices were free, and the caller asked not to wait."""


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextmanager
def lease_devices(
    folder: Path,
    wanted: int,
    available: int,
    *,
    poll_s: float = 2.0,
    on_wait: Callable[[], None] | None = None,
    wait: bool = True,
) -> Iterator[list[int]]:
    """Hold `wanted` of the devices 0..available-1 for the duration of the block; waits (calling
    `on_wait` each round) while other steps hold too many of them, or with `wait=False` raises
    DevicesBusy at once."""
    if wanted > available:
        raise ValueError(
            f"workers={wanted} but this machine has {available} GPU(s): one worker per GPU; "
            "lower `workers` in the engine resource"
        )
    if wanted == 0:  # the CPU engine, or a step that runs its engine in its own process
        yield []
        return
    folder.mkdir(parents=True, exist_ok=True)
    held: dict[int, int] = {}  # device -> locked descriptor
    try:
        while True:
            for device in range(available):
                fd = _try_lock(folder / f"gpu{device}.lock")
                if fd is not None:
                    held[device] = fd
                    if len(held) == wanted:
                        break
            if len(held) == wanted:
                break
            for fd in held.values():  # give back a partial lease before waiting
                os.close(fd)
            held.clear()
            if not wait:
                raise DevicesBusy(f"fewer than {wanted} of {available} GPU(s) are free")
            if on_wait is not None:
                on_wait()
            time.sleep(poll_s)
        yield sorted(held)
    finally:
        for fd in held.values():  # closing the descriptor drops its lock
            os.close(fd)


def visible_gpus() -> int:
    """How many GPUs this process sees (0 without a driver)."""
    from fabric_gpu import probe_gpu

    status = probe_gpu()
    return len(status.devices) if status.available else 0
