"""Real `fabric submit --run` runs with worker processes, for the tests of how workers are
launched and report (tests/test_worker_pipes.py, tests/test_worker_launchers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import ProgrammingError

from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.models import Batch, Embedding

FABRIC = str(Path(sys.executable).parent / "fabric")


def start(
    tmp_path: Path,
    tiny_model_dir: Path,
    url: str,
    n: int,
    lease_s: float,
    extra: list[str] | None = None,
    env_extra: dict[str, str] | None = None,
) -> Any:
    """`fabric submit --run` of `n` tasks on 3 workers of the CPU engine, in the background."""
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
        **(env_extra or {}),
    }
    env.pop("DAGSTER_HOME", None)
    command = [
        FABRIC, "submit", str(tasks), "--task-set", "s", "--run", "--manifest", str(engine),
        "--workers", "3", "--lease-seconds", str(lease_s), "--heartbeat-seconds", str(lease_s / 4),
        *(extra or []),
    ]  # fmt: skip
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 - closed with the process below
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.log_file = log  # type: ignore[attr-defined]
    process.fabric_env = env  # type: ignore[attr-defined]
    return process


def finish(process: Any, tmp_path: Path, timeout: float = 240) -> str:
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


def completed_batches(url: str) -> int:
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


def exactly_once(url: str, n: int) -> None:
    db = make_engine(url)
    try:
        with db.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
            distinct = conn.execute(select(func.count(func.distinct(Embedding.record_no))))
            assert rows == distinct.scalar_one() == n
    finally:
        db.dispose()


def events(home: Path) -> tuple[list[str], list[dict[str, Any]]]:
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


def workers_mid_set(home: Path, url: str, workers: int = 3) -> list[int]:
    """Wait until the run's `workers` worker processes are up and 20 batches are done (a fault
    then lands mid-set); their pids, in order."""
    from fabric_testing.fault_drill import wait_until, worker_pids

    wait_until(lambda: len(worker_pids(home)) == workers, 120, f"{workers} workers")
    wait_until(lambda: completed_batches(url) >= 20, 120, "batches completed")
    return sorted(worker_pids(home))
