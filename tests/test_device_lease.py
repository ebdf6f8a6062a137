"""Device leases: concurrent steps get disjoint GPUs, wait while none is free, and a holder that
dies gives its devices back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fabric_pipelines.lib.worker.devices import lease_devices


def test_concurrent_leases_get_disjoint_devices(tmp_path: Path) -> None:
    with lease_devices(tmp_path, 1, 3) as first, lease_devices(tmp_path, 2, 3) as second:
        assert len(first) == 1 and len(second) == 2
        assert not set(first) & set(second)
    with lease_devices(tmp_path, 3, 3) as everything:  # all given back
        assert everything == [0, 1, 2]


def test_a_step_waits_holding_nothing_until_enough_devices_are_free(tmp_path: Path) -> None:
    outer = lease_devices(tmp_path, 1, 2)
    held = outer.__enter__()
    waits: list[int] = []
    got: list[list[int]] = []

    def other_step() -> None:
        with lease_devices(tmp_path, 2, 2, poll_s=0.01, on_wait=lambda: waits.append(1)) as d:
            got.append(d)

    thread = threading.Thread(target=other_step)
    thread.start()
    while len(waits) < 3:  # it keeps waiting while one of the two is held ...
        assert thread.is_alive()
        time.sleep(0.01)
    # ... and holds none meanwhile: the free device can still be leased by a third step.
    free = {0, 1} - set(held)
    with lease_devices(tmp_path, 1, 2, poll_s=0.01) as third:
        assert set(third) == free
    outer.__exit__(None, None, None)
    thread.join(timeout=30)
    assert got == [[0, 1]]


def test_a_dead_holder_gives_its_device_back(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            "import sys, pathlib\n"
            "from fabric_pipelines.lib.worker.devices import lease_devices\n"
            f"with lease_devices(pathlib.Path({str(tmp_path)!r}), 1, 1) as d:\n"
            "    print(d, flush=True); sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "[0]"
    waits: list[int] = []
    give_up = lease_devices(tmp_path, 1, 1, poll_s=0.01, on_wait=lambda: _give_up(waits))
    with pytest.raises(TimeoutError), give_up:
        pass
    holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
    holder.wait()
    with lease_devices(tmp_path, 1, 1) as devices:
        assert devices == [0]


def _give_up(waits: list[int]) -> None:
    waits.append(1)
    if len(waits) > 5:
        raise TimeoutError


def test_more_workers_than_gpus_is_refused_with_the_fix(tmp_path: Path) -> None:
    too_many = lease_devices(tmp_path, 3, 2)
    with pytest.raises(ValueError, match=r"workers=3 but this machine has 2 GPU\(s\)"), too_many:
        pass


def test_no_gpu_workers_lease_nothing(tmp_path: Path) -> None:
    with lease_devices(tmp_path / "unused", 0, 0) as devices:
        assert devices == []
    assert not (tmp_path / "unused").exists()
