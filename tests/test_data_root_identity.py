"""The warm pool and runner are bound to their data root and database.

A data root's identity is made once, whoever uses it first (two processes or threads at once get
the same one); a database's is made with its schema. A pool worker given a job of another root or
database refuses it and exits; and, end to end, a data root deleted between two runs while the
pool worker and the warm runner of the first live (a fresh start) is served by new processes: the
second run completes its set exactly once and the old ones exit.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.cli import warm_client
from fabric_pipelines.lib.core.files import write_once
from fabric_pipelines.lib.core.settings import FabricPaths, database_url
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.identity import database_identity, database_identity_at
from fabric_pipelines.lib.store.models import Embedding
from fabric_pipelines.lib.store.schema import downgrade, upgrade
from fabric_pipelines.lib.worker.pool import SERVER_MODULE
from fabric_pipelines.lib.worker.pool.client import (
    PoolJob,
    manifest_sha256,
    pool_states,
    start_pool_worker,
    stop_pool,
    wait_until_serving,
)
from fabric_pipelines.lib.worker.procs import pid_alive, runs_module

FABRIC = str(Path(sys.executable).parent / "fabric")
HEX32 = re.compile(r"[0-9a-f]{32}")


def _create(path: str, data: bytes, start: Any, out: Any) -> None:
    start.wait()
    out.put(write_once(Path(path), data).decode())


@pytest.mark.timeout(60)
def test_an_identity_is_created_once_however_many_race_to_create_it(tmp_path: Path) -> None:
    path = tmp_path / "root" / "identity"
    context = multiprocessing.get_context("fork")
    start, out = context.Event(), context.Queue()
    processes = [
        context.Process(target=_create, args=(str(path), f"p{i}".encode(), start, out))
        for i in range(8)
    ]
    for process in processes:
        process.start()
    start.set()
    got = [out.get(timeout=30) for _ in processes]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    assert len(set(got)) == 1 and path.read_text() == got[0]
    # Threads of one process, racing on a new file: each staged its own, one was linked.
    other = tmp_path / "threads" / "identity"
    barrier = threading.Barrier(8)
    answers: list[str] = []

    def create(i: int) -> None:
        barrier.wait()
        answers.append(write_once(other, f"t{i}".encode()).decode())

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 8 and set(answers) == {other.read_text()}
    assert write_once(other, b"later") == other.read_bytes()  # never replaced
    leftovers = [p.name for p in [*path.parent.iterdir(), *other.parent.iterdir()]]
    assert sorted(leftovers) == ["identity", "identity"]  # no staging file is left


@pytest.mark.timeout(60)
def test_a_data_root_has_one_identity_until_it_is_deleted(tmp_path: Path) -> None:
    paths = FabricPaths(tmp_path / "root")
    assert paths.existing_identity() is None and not paths.root.exists()  # reading makes none
    first = paths.identity()
    assert HEX32.fullmatch(first) and paths.identity() == first
    assert paths.existing_identity() == first == FabricPaths(paths.root).identity()
    shutil.rmtree(paths.root)
    assert paths.existing_identity() is None
    assert paths.identity() not in (first, None)  # a fresh start is another root


@pytest.mark.timeout(120)
def test_a_database_has_one_identity_made_with_its_schema(db_url: str) -> None:
    first = database_identity_at(db_url)  # an empty database: brought to the newest schema
    engine = make_engine(db_url)
    try:
        assert HEX32.fullmatch(first) and database_identity(engine) == first
        with engine.connect() as conn:
            assert database_identity(conn) == first
        create_schema(engine)  # at the newest revision already: the same database
        assert database_identity_at(db_url) == database_identity(engine) == first
        downgrade(engine, "base")  # made again: another database at the same URL
        upgrade(engine)
        assert database_identity(engine) not in (first, None)
    finally:
        engine.dispose()


def _manifest(model_dir: Path) -> EngineManifest:
    return manifest_for_model(
        str(model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(256, 4, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("other", ["root", "database"])
def test_a_pool_worker_refuses_a_job_of_another_root_or_database_and_exits(
    paths: FabricPaths, tiny_model_dir: Path, other: str
) -> None:
    url = f"sqlite:///{paths.sqlite_path}"
    identity = {"root": paths.identity(), "database": database_identity_at(url)}
    manifest = _manifest(tiny_model_dir)
    manifest_path = paths.root / "engine.json"
    manifest_path.write_text(json.dumps(manifest.to_mapping()))
    process = start_pool_worker(paths.root, "cpu0", manifest_path, idle_seconds=60, threads=1)
    try:
        assert wait_until_serving(paths.root, "cpu0", process, 120) is not None
        job = {
            "task_set": "s", "database_url": url, "lease_seconds": 30, "owner": "test",
            "max_attempts": 3, "heartbeat_seconds": None, "go_file": None,
            "identity": {**identity, other: "0" * 32},
        }  # fmt: skip
        answer = PoolJob(paths.root, "cpu0", manifest_sha256(manifest), job).start()
        assert answer.done.wait(30)
        assert answer.state == "refused" and "0" * 32 in answer.error, answer.error
        assert process.wait(30) != 0  # it exits rather than serve on
        assert pool_states(paths.root) == [] and not (paths.root / "pool" / "cpu0.json").exists()
    finally:
        stop_pool(paths.root, grace_s=5)
        if process.poll() is None:
            process.kill()
        process.wait()


def _env(root: Path, runner: bool) -> dict[str, str]:
    env = {**os.environ, "FABRIC_HOME": str(root), "HF_HUB_OFFLINE": "1"}
    env.pop("FABRIC_DATABASE_URL", None)
    env.pop("DAGSTER_HOME", None)
    env["FABRIC_POOL_IDLE_SECONDS"] = "60"  # the pool and the runner stay between the runs
    env["FABRIC_WARM_RUNNER"] = "1" if runner else "0"
    return env


def _submit_and_run(root: Path, tasks: Path, engine: Path, report: Path, runner: bool) -> None:
    done = subprocess.run(
        [FABRIC, "submit", str(tasks), "--task-set", "s", "--run", "--manifest", str(engine),
         "--report", str(report)],
        env=_env(root, runner), cwd=root.parent, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _wait_for(what: str, check: Any, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout:.0f} s")


def _stop_if_still_ours(pid: int, module: str) -> None:
    if pid and pid_alive(pid) and runs_module(pid, module):
        os.kill(pid, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("runner", [True, False], ids=["warm-runner", "pool-only"])
def test_a_data_root_deleted_between_two_runs_with_the_pool_warm_is_served_afresh(
    tmp_path: Path, tiny_model_dir: Path, runner: bool
) -> None:
    """A fresh start: the first run leaves a pool worker (and a warm runner); its data root is
    deleted; the same command again runs on its own (the runner refuses before forking), the
    pool worker refuses the job of the new root (a worker of the run's own stands in), both
    exit, and the set is completed exactly once. Before, the runner's child failed on the
    deleted root, and without a runner the live pool worker served the old database: the new
    set's tasks stayed queued."""
    home, n = tmp_path / "home", 40
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(_manifest(tiny_model_dir).to_mapping()))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": f"note {i} on topic {i % 7}"}) + "\n"
                for i in range(n))
    )  # fmt: skip
    worker_pid = runner_pid = 0
    try:
        _submit_and_run(home, tasks, engine, tmp_path / "first.json", runner)
        (worker,) = pool_states(home)
        worker_pid = worker.pid
        if runner:
            runner_pid = _wait_for(
                "no warm runner served",
                lambda: next(
                    (int(s["pid"]) for s in warm_client.runner_states(home) if s["serving"]), 0
                ),
            )
        shutil.rmtree(home)  # a fresh start, with the pool worker (and the runner) alive

        _submit_and_run(home, tasks, engine, tmp_path / "second.json", runner)
        second = json.loads((tmp_path / "second.json").read_text())
        assert second["process"]["warm_runner"] is False  # the old runner forked nothing
        assert list(home.glob("workers/s-*/cpu0-0"))  # the pool worker refused: a stand-in ran
        status = subprocess.run(
            [FABRIC, "status", "s", "--json"], env=_env(home, runner), capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        (row,) = json.loads(status.stdout)["task_sets"]
        assert row["balanced"] and row["failed"] == 0 and row["completed"] == n, row
        db = make_engine(database_url(FabricPaths(home)))
        with db.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
            distinct = conn.execute(select(func.count(func.distinct(Embedding.record_no))))
            assert rows == distinct.scalar_one() == n
        db.dispose()
        _wait_for("the old pool worker did not exit", lambda: not pid_alive(worker_pid), 30)
        if runner:
            _wait_for("the old warm runner did not exit", lambda: not pid_alive(runner_pid), 30)
    finally:
        subprocess.run([FABRIC, "workers", "stop"], env=_env(home, runner), capture_output=True,
                       timeout=120)  # fmt: skip
        _stop_if_still_ours(worker_pid, SERVER_MODULE)  # bound to the deleted root
        _stop_if_still_ours(runner_pid, warm_client.RUNNER_MODULE)
