"""Workers started before their plan exists, so the engine's start-up hides behind ingest.

A worker's start (Python, torch, the CUDA context, the weights) takes seconds that a run spends
otherwise idle while the task set is ingested and planned. `prestart_workers` starts the run's
workers at the very beginning, with a go file they wait for once their engine is loaded; the
extraction step (`run_extraction.extract_task_set`, in the same process) takes the pool over with
`take_prestarted` when it matches the step's settings (task set, manifest, database, worker
count), writes the go file, and supervises them as usual. A pool nobody takes (ingest failed, the
step's settings differ, the step runs in another process) is stopped when its block ends.

GPU workers hold their devices' leases from the start: the pool takes them when it starts (or
starts no workers when they are not free at once: the step then leases and launches as usual),
and gives them back when its block ends, after its workers are stopped.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.worker.devices import DevicesBusy, lease_devices
from fabric_pipelines.lib.worker.launch import (
    LaunchSettings,
    WorkerProcess,
    launch_settings,
    launch_workers,
    stop_workers,
)
from fabric_pipelines.lib.worker.pool.run import PoolRun, free_devices, open_pool_run


@dataclass
class PrestartedWorkers:
    settings: LaunchSettings
    manifest: dict[str, Any]
    count: int
    devices: list[int] | None
    workers: list[WorkerProcess] = field(default_factory=list)
    taken: bool = False
    pool_run: PoolRun | None = None  # the job handed to the warm engine pool, if it serves

    def alive(self) -> bool:
        """Every worker of the run's own still waits for the go (a pool run's supervision
        stands in for any pool worker that did not take the job, or was lost)."""
        return all(w.process.poll() is None for w in self.workers)

    @property
    def go_file(self) -> Path:
        return self.settings.folder / "go"

    def matches(
        self,
        manifest: Any,
        count: int,
        database_url: str,
        lease_seconds: float,
        heartbeat_seconds: float | None,
    ) -> bool:
        """Started for exactly these settings (the step would otherwise run other workers)."""
        mine = self.settings
        return (mine.database_url, mine.lease_seconds, mine.heartbeat_seconds, self.count) == (
            database_url, lease_seconds, heartbeat_seconds, count,
        ) and self.manifest == _plain(manifest)  # fmt: skip

    def go(self) -> list[WorkerProcess]:
        """Let the workers read the plan and run it."""
        write_bytes(self.go_file, b"go\n")
        return self.workers

    def __enter__(self) -> PrestartedWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_workers(self.workers)
        if self.pool_run is not None:
            self.pool_run.close()


_prestarted: dict[
    str, PrestartedWorkers
] = {}  # task set -> the pool started for it, until taken or ended
_lock = threading.Lock()


@contextlib.contextmanager
def prestart_workers(
    paths: Any,
    task_set: str,
    manifest: Any,
    *,
    database_url: str,
    count: int,
    visible_gpus: int,
    lease_seconds: float,
    heartbeat_seconds: float | None = None,
    pool_idle_seconds: float = 0.0,
) -> Iterator[PrestartedWorkers | None]:
    """Start `count` workers for `task_set` now (with `pool_idle_seconds` > 0: hand the job to
    the warm engine pool, starting its missing workers); on leaving the block, stop any of the
    run's own still running and give their devices back. Yields None (and starts nothing) for
    in-process runs (count 0) or when the GPUs are not all free at once."""
    if count < 1:
        yield None
        return
    gpu = manifest.backend != "cpu"
    with contextlib.ExitStack() as stack:
        devices = None
        if gpu:
            try:
                devices = stack.enter_context(
                    lease_devices(paths.device_leases, count, visible_gpus, wait=False)
                )
            except (DevicesBusy, ValueError):
                # Busy: the step waits for them itself. Too few: the step says so, once.
                yield None
                return
        settings = launch_settings(
            paths, task_set, manifest, database_url, lease_seconds, heartbeat_seconds
        )
        pool = PrestartedWorkers(settings, _plain(manifest), count, devices)
        stack.callback(stop_workers, pool.workers)  # runs before the lease is given back
        if pool_idle_seconds > 0:
            pool.pool_run = open_pool_run(
                settings, manifest, count, devices, pool_idle_seconds, go_file=pool.go_file
            )
            stack.callback(pool.pool_run.close)
        else:
            free_devices(paths.root, devices)
            pool.workers.extend(
                launch_workers(settings, count, settings.folder, devices, go_file=pool.go_file)
            )
        with _lock:
            _prestarted[task_set] = pool
        try:
            yield pool
        finally:
            with _lock:
                if _prestarted.get(task_set) is pool:
                    del _prestarted[task_set]


def prestarted_devices(task_set: str) -> list[int] | None:
    """The devices a waiting pool of `task_set` holds (its step need not lease them again)."""
    with _lock:
        pool = _prestarted.get(task_set)
        return None if pool is None or pool.taken else pool.devices


def take_prestarted(
    task_set: str,
    manifest: Any,
    count: int,
    *,
    database_url: str,
    lease_seconds: float,
    heartbeat_seconds: float | None,
) -> PrestartedWorkers | None:
    """The waiting pool of `task_set` if it was started with these settings and all its workers
    live; one that does not match is stopped (its devices stay leased until its block ends)."""
    with _lock:
        pool = _prestarted.get(task_set)
        if pool is None or pool.taken:
            return None
        pool.taken = True
    if pool.alive() and pool.matches(
        manifest, count, database_url, lease_seconds, heartbeat_seconds
    ):
        return pool
    stop_workers(pool.workers)
    if pool.pool_run is not None:
        pool.pool_run.close()
    return None


def _plain(manifest: Any) -> dict[str, Any]:
    """The manifest as plain JSON values, so that two equal manifests compare equal."""
    mapping: dict[str, Any] = json.loads(json.dumps(manifest.to_mapping()))
    return mapping
