"""Workers launched through Dagster Pipes, and workers that come and go.

Real `fabric submit --run` runs (Dagster, PostgreSQL, three worker processes of the CPU engine on
a tiny model): each worker's log lines and counts are in the run's event log; a worker killed
with SIGKILL mid-set, or stopped for longer than its lease, is replaced (the event log says so)
and the set still ends with every task exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric_testing.fault_drill import worker_pids
from tests.worker_runs import (
    completed_batches,
    events,
    exactly_once,
    finish,
    start,
    workers_mid_set,
)

FABRIC = str(Path(sys.executable).parent / "fabric")
pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_three_workers_report_their_lines_and_counts_through_pipes(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str
) -> None:
    n = 400
    process = start(tmp_path, tiny_model_dir, own_postgres_database, n, lease_s=30)
    finish(process, tmp_path)
    exactly_once(own_postgres_database, n)
    messages, observations = events(tmp_path / "home")
    owners = sorted(o["worker"] for o in observations)
    assert len(owners) == 3 and all(o.endswith((":w0", ":w1", ":w2")) for o in owners), owners
    for owner in owners:  # each worker's own lines, sent from its process through Pipes
        assert any(m.startswith(f"worker {owner} started (pid ") for m in messages), owner
        assert any(m.startswith(f"worker {owner} done: ") for m in messages), owner
    batches = completed_batches(own_postgres_database)
    assert sum(int(o["batches_done"]) for o in observations) == batches
    assert sum(int(o["rows_inserted"]) for o in observations) == n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["sigkill", "stopped-past-its-lease"])
def test_a_worker_that_dies_or_is_lost_is_replaced_and_the_set_completes_exactly_once(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str, fault: str
) -> None:
    n, lease_s = 3000, 2.0
    home = tmp_path / "home"
    process = start(tmp_path, tiny_model_dir, own_postgres_database, n, lease_s)
    try:
        victim = workers_mid_set(home, own_postgres_database)[1]
        if fault == "sigkill":
            os.kill(victim, signal.SIGKILL)
        else:
            os.kill(victim, signal.SIGSTOP)
            time.sleep(3 * lease_s)  # past its lease: its batches go to the others
            if victim in worker_pids(home):  # not ended by the step yet (nor its pid reused)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGCONT)
    except BaseException:
        process.kill()
        raise
    finish(process, tmp_path)
    exactly_once(own_postgres_database, n)
    messages, observations = events(home)
    failed = [m for m in messages if " exited with " in m or " lost: " in m]
    replaced = [m for m in messages if " started in place of " in m]
    assert failed and replaced, messages[-40:]
    if fault == "stopped-past-its-lease":
        assert any(" lost: silent for " in m for m in failed), failed
    # The stand-in reported through Pipes like the others.
    stand_in = replaced[0].split()[1]
    assert stand_in.endswith(".1") and any(o["worker"] == stand_in for o in observations)
    assert not worker_pids(home)  # nothing of the run is left running


@pytest.mark.timeout(300)
def test_warm_pool_workers_report_each_job_through_pipes(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str
) -> None:
    """The default `fabric submit --run` path: the workers are the warm engine pool's, started
    before the plan and handed the job; each job's lines and counts are in the event log."""
    n = 300
    process = start(
        tmp_path, tiny_model_dir, own_postgres_database, n, lease_s=30,
        env_extra={"FABRIC_POOL_IDLE_SECONDS": "60"},
    )  # fmt: skip
    try:
        finish(process, tmp_path)
    finally:
        subprocess.run(
            [FABRIC, "workers", "stop"], env=process.fabric_env, capture_output=True, timeout=60
        )
    exactly_once(own_postgres_database, n)
    messages, observations = events(tmp_path / "home")
    owners = sorted(o["worker"] for o in observations)
    assert len(owners) == 3 and all(":pool-cpu" in o for o in owners), owners
    for owner in owners:
        assert any(m.startswith(f"worker {owner} started (pid ") for m in messages), owner
        assert any(m.startswith(f"worker {owner} done: ") for m in messages), owner
    assert sum(int(o["rows_inserted"]) for o in observations) == n
