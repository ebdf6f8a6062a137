"""Workers launched through Dagster Pipes, and workers that come and go.

Real `fabric submit --run` runs (Dagster, PostgreSQL, three worker processes of the CPU engine on
a tiny model): each worker's log lines and counts are in the run's event log; a worker killed
with SIGKILL mid-set, or stopped for longer than its lease, is replaced (the event log says so)
and the set still ends with every task exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import ProgrammingError

from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.models import Batch, Embedding
from fabric_testing.fault_drill import wait_until, worker_pids

FABRIC = str(Path(sys.executable).parent / "fabric")
pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _start(tmp_path: Path, tiny_model_dir: Path, url: str, n: int, lease_s: float) -> Any:
    engine = tmp_path / "engine.json"
    manifest = manifest_for_model(
        str(tiny_model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(128, 2, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip
    engine.write_text(json.dumps(manifest.to_mapping()))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": f"note {i} on topic {i % 13} and {i % 7}"})
                + "\n" for i in range(n))
    )  # fmt: skip
    env = {
        **os.environ,
        "FABRIC_HOME": str(tmp_path / "home"),
        "FABRIC_DATABASE_URL": url,
        "HF_HUB_OFFLINE": "1",
        "FABRIC_WARM_RUNNER": "0",
        "FABRIC_POOL_IDLE_SECONDS": "0",
    }
    env.pop("DAGSTER_HOME", None)
    command = [
        FABRIC, "submit", str(tasks), "--task-set", "s", "--run", "--manifest", str(engine),
        "--workers", "3", "--lease-seconds", str(lease_s), "--heartbeat-seconds", str(lease_s / 4),
    ]  # fmt: skip
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 - closed with the process below
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_file = log  # type: ignore[attr-defined]
    return process


def _finish(process: Any, tmp_path: Path, timeout: float = 240) -> str:
    try:
        code = process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.log_file.close()
    output = (tmp_path / "run.log").read_text(errors="replace")
    assert code == 0, output[-6000:]
    return output


def _completed_batches(url: str) -> int:
    db = make_engine(url)
    try:
        with db.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(Batch).where(Batch.state == "completed")
                ).scalar_one()
            )
    except ProgrammingError:  # the run has not made its schema yet
        return 0
    finally:
        db.dispose()


def _exactly_once(url: str, n: int) -> None:
    db = make_engine(url)
    try:
        with db.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
            distinct = conn.execute(select(func.count(func.distinct(Embedding.record_no))))
            assert rows == distinct.scalar_one() == n
    finally:
        db.dispose()


def _events(home: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The extraction run's log messages and its per-worker observations."""
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        runs = [r for r in instance.get_runs() if r.job_name == "extract_task_set"]
        assert len(runs) == 1
        entries = instance.all_logs(runs[0].run_id)
    messages = [e.user_message for e in entries if e.dagster_event is None]
    observations = []
    for entry in entries:
        event = entry.dagster_event
        if event is not None and event.event_type == dg.DagsterEventType.ASSET_OBSERVATION:
            metadata = event.asset_observation_data.asset_observation.metadata
            if "worker" in metadata:
                observations.append({k: v.value for k, v in metadata.items()})
    return messages, observations


@pytest.mark.timeout(300)
def test_three_workers_report_their_lines_and_counts_through_pipes(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str
) -> None:
    n = 400
    process = _start(tmp_path, tiny_model_dir, own_postgres_database, n, lease_s=30)
    _finish(process, tmp_path)
    _exactly_once(own_postgres_database, n)
    messages, observations = _events(tmp_path / "home")
    owners = sorted(o["worker"] for o in observations)
    assert len(owners) == 3 and all(o.endswith((":w0", ":w1", ":w2")) for o in owners), owners
    for owner in owners:  # each worker's own lines, sent from its process through Pipes
        assert any(m.startswith(f"worker {owner} started (pid ") for m in messages), owner
        assert any(m.startswith(f"worker {owner} done: ") for m in messages), owner
    batches = _completed_batches(own_postgres_database)
    assert sum(int(o["batches_done"]) for o in observations) == batches
    assert sum(int(o["rows_inserted"]) for o in observations) == n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["sigkill", "stopped-past-its-lease"])
def test_a_worker_that_dies_or_is_lost_is_replaced_and_the_set_completes_exactly_once(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str, fault: str
) -> None:
    n, lease_s = 3000, 2.0
    home = tmp_path / "home"
    process = _start(tmp_path, tiny_model_dir, own_postgres_database, n, lease_s)
    try:
        wait_until(lambda: len(worker_pids(home)) == 3, 120, "three workers")
        wait_until(
            lambda: _completed_batches(own_postgres_database) >= 20, 120, "batches completed"
        )
        victim = sorted(worker_pids(home))[1]
        if fault == "sigkill":
            os.kill(victim, signal.SIGKILL)
        else:
            os.kill(victim, signal.SIGSTOP)
            time.sleep(3 * lease_s)  # past its lease: its batches go to the others
            with contextlib.suppress(ProcessLookupError):  # the step ended it already
                os.kill(victim, signal.SIGCONT)
    except BaseException:
        process.kill()
        raise
    _finish(process, tmp_path)
    _exactly_once(own_postgres_database, n)
    messages, observations = _events(home)
    failed = [m for m in messages if " exited with " in m or " lost: " in m]
    replaced = [m for m in messages if " started in place of " in m]
    assert failed and replaced, messages[-40:]
    if fault == "stopped-past-its-lease":
        assert any(" lost: silent for " in m for m in failed), failed
    # The stand-in reported through Pipes like the others.
    stand_in = replaced[0].split()[1]
    assert stand_in.endswith(".1") and any(o["worker"] == stand_in for o in observations)
    assert not worker_pids(home)  # nothing of the run is left running
