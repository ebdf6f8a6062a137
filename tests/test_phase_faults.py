"""A database fault at each phase of a run, in turn, and the run still exits 0 with every task
exactly once.

One `fabric submit --run` per database (the real CLI, Dagster and worker processes, the tiny
model) with fabric_testing/db_faults.py loaded into each of its processes: at the first statement
of every unit of work named below, PostgreSQL's backend of that connection is terminated; on
SQLite another connection holds the write lock past the run's busy timeout. Each fault must have
fired, every statement the run sent must have been inside a unit of work (one that retries), and
the set must be complete: one result row per task, a verified index and receipt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select

from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.models import Embedding, HiddenStateShard, IndexReceipt

REPO = Path(__file__).resolve().parents[1]
FABRIC = str(Path(sys.executable).parent / "fabric")
N_TASKS = 60
# A fragment of each unit's operation (lib/core/retry.py `unit_of_work` and the workers' retries),
# phase by phase through the run.
PHASES = (
    "bringing the database schema",  # the CLI's and the definitions' schema check
    "ingesting task set",
    "planning task set",  # with reuse on: content keys looked up and linked
    "reading the plan of task set",  # the step, and each worker as it loads its job
    "claiming batches",  # extraction: the workers' ledger calls
    "writing",  # extraction: the writer's rows and shards
    "finishing task set",  # documents combined, reused rows copied
    "recording the speed",
    "counting the tasks",  # the accounting check
    "verifying the outputs",
    "recording the run",
    "reading the served index",  # the index step
    "reading the vectors",
    "recording the receipt",  # publication
)


def _run(tmp_path: Path, tiny_model_dir: Path, db_url: str | None) -> tuple[Path, str]:
    engine = tmp_path / "engine.json"
    manifest = manifest_for_model(
        str(tiny_model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(256, 4, 64, 8), hooks=HookSpec((1,), "mean"),
    )  # fmt: skip
    engine.write_text(json.dumps(manifest.to_mapping()))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": f"note {i} on topic {i % 7}"}) + "\n"
                for i in range(N_TASKS))
    )  # fmt: skip
    home, fired = tmp_path / "home", tmp_path / "fired"
    env = {
        **os.environ,
        "FABRIC_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        # The faults' sitecustomize first, then fabric_testing itself (not installed).
        "PYTHONPATH": os.pathsep.join([str(REPO / "fabric_testing" / "faultsite"), str(REPO)]),
        "FABRIC_FAULT_UNITS": ";".join(PHASES),
        "FABRIC_FAULT_DIR": str(fired),
        "FABRIC_FAULT_UNCOVERED": str(tmp_path / "uncovered.jsonl"),
        "FABRIC_WARM_RUNNER": "0",  # every process of the run is started by this command
        "FABRIC_POOL_IDLE_SECONDS": "0",
        # SQLite: a lock held 1.5 s outlasts a 300 ms busy timeout: "database is locked".
        "FABRIC_SQLITE_BUSY_TIMEOUT_MS": "300",
        "FABRIC_FAULT_LOCK_S": "1.5",
    }
    env.pop("DAGSTER_HOME", None)
    env.pop("FABRIC_DATABASE_URL", None)
    if db_url is not None:
        env["FABRIC_DATABASE_URL"] = db_url
    done = subprocess.run(
        [FABRIC, "submit", str(tasks), "--task-set", "s", "--run", "--manifest", str(engine)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    return home, output


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_database_fault_at_each_phase_of_a_run_is_ridden_out(
    request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path, database: str
) -> None:
    url = request.getfixturevalue("own_postgres_database") if database == "postgres" else None
    home, output = _run(tmp_path, tiny_model_dir, url)

    fired = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "fired").glob("*.fired")}
    missing = [phase for phase in PHASES if phase.replace(" ", "-") not in fired]
    assert not missing, f"no fault fired in: {missing}\n{output}"
    uncovered = tmp_path / "uncovered.jsonl"
    lines = uncovered.read_text().splitlines() if uncovered.exists() else []
    assert not lines, "statements outside any unit of work (no retry):\n" + "\n".join(lines[:20])

    db = make_engine(url or f"sqlite:///{home / 'fabric.db'}")
    try:
        with db.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
            distinct = conn.execute(select(func.count(func.distinct(Embedding.record_no))))
            assert rows == distinct.scalar_one() == N_TASKS
            assert conn.execute(select(func.count()).select_from(HiddenStateShard)).scalar_one()
            assert conn.execute(select(func.count()).select_from(IndexReceipt)).scalar_one() == 1
    finally:
        db.dispose()
    env = {**os.environ, "FABRIC_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("DAGSTER_HOME", None)
    env.pop("FABRIC_DATABASE_URL", None)
    if url is not None:
        env["FABRIC_DATABASE_URL"] = url
    status = subprocess.run(
        [FABRIC, "status", "s", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    (row,) = json.loads(status.stdout)["task_sets"]
    assert row["balanced"] and row["completed"] == N_TASKS and row["failed"] == 0, row
    verify = subprocess.run(
        [FABRIC, "verify"], env=env, capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
