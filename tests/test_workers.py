"""Faults with real worker processes, on both databases (RELIABILITY.md items 1, 2, 3, 9), and
several workers sharing one plan. After each: no lost task, no duplicate row, accounting balances.

Workers are `python -m fabric_pipelines.lib.workers` processes running the real engine code (the
CPU engine) on a small random BERT with the real tokenizer, so forwards are quick. A worker is
caught holding a lease deterministically: it is stopped (SIGSTOP), the ledger is read, and if it
holds no lease it is let go (SIGCONT) and tried again a moment later.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, select, text

from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.settings import FabricPaths
from fabric_pipelines.lib.store.models import Batch
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from tests.pipeline_helpers import embedding_counts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Enough batches (4 tasks each) that a worker is still busy when a fault is injected.
FAULT_TASKS = 6000


def _manifest(model_dir: Path, items: int) -> EngineManifest:
    return manifest_for_model(
        str(model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(items * 64, items, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip


def _prepare(db: Engine, paths: FabricPaths, manifest: EngineManifest, n: int, tmp: Path) -> Path:
    source = tmp / "set.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "text": f"task {i} says {i % 97} things"}) + "\n"
            for i in range(n)
        )
    )
    submit(source, paths.inbox, "set")
    ingest_task_set(db, paths, "set", model_id=manifest.model_id, max_seq_len=64)
    plan_task_set(db, paths, "set", manifest)
    path = tmp / "engine.json"
    path.write_text(json.dumps(manifest.to_mapping()))
    return path


STARTED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test() -> Iterator[None]:
    """A failed test must not leave a stopped worker holding locks that block the next test."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()


class Worker:
    def __init__(
        self, paths: FabricPaths, db_url: str, manifest: Path, owner: str, lease: float, tmp: Path
    ) -> None:
        self.owner = owner
        self.report = tmp / f"{owner}.json"
        self.log = tmp / f"{owner}.log"
        env = {**os.environ, "FABRIC_DATABASE_URL": db_url, "FABRIC_HOME": str(paths.root)}
        command = [
            sys.executable, "-m", "fabric_pipelines.lib.workers", "set", "--manifest", str(manifest),
            "--owner", owner, "--lease-seconds", str(lease), "--report", str(self.report),
            "--threads", "1",
        ]  # fmt: skip
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        STARTED.append(self.process)

    def wait(self, timeout: float = 300) -> dict:
        assert self.process.wait(timeout=timeout) == 0, self.log.read_text()[-3000:]
        return json.loads(self.report.read_text())


def _leased_by(db: Engine, owner: str) -> list[int]:
    with db.connect() as conn:
        return list(
            conn.execute(
                select(Batch.batch_no).where(Batch.lease_owner == owner, Batch.state == "leased")
            ).scalars()
        )


def _inside_a_transaction(db: Engine) -> bool:
    """Is some other session of this database in the middle of a transaction?"""
    if db.dialect.name == "sqlite":
        probe = sqlite3.connect(db.url.database, timeout=0.05, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:  # locked: a writer holds the database
            return True
        finally:
            probe.close()
    with db.connect() as conn:
        return bool(
            conn.execute(
                text(  # an open transaction: idle in it, or active (e.g. streaming a COPY)
                    "select count(*) from pg_stat_activity where datname = current_database() "
                    "and xact_start is not null and pid <> pg_backend_pid()"
                )
            ).scalar_one()
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGSTOP the process and return once it has stopped: kill() returns before the signal is
    delivered, and a worker still running could open a transaction after the probe has looked."""
    assert process.poll() is None, "the worker finished before it could be caught"
    os.kill(process.pid, signal.SIGSTOP)
    _, status = os.waitpid(process.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):  # it exited in between; keep its status for Popen
        process.returncode = os.waitstatus_to_exitcode(status)
        raise AssertionError("the worker finished before it could be caught")


def _stop_holding_a_lease(worker: Worker, db: Engine, timeout: float = 120) -> list[int]:
    """SIGSTOP the worker at a moment it holds a lease and is between transactions (stopped
    inside one, it would hold the database's locks: the server would end the session, or with
    SQLite every other writer would wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _stop(worker.process)
        if not _inside_a_transaction(db):
            held = _leased_by(db, worker.owner)
            if held:
                return held
        os.kill(worker.process.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("never caught the worker holding a lease")


def _wait_until(condition: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _assert_nothing_lost_or_doubled(db: Engine, n: int) -> None:
    rows, distinct = embedding_counts(db)
    with db.connect() as conn:
        a = accounting(conn, "set")
    assert rows == distinct == n, f"{rows} rows, {distinct} distinct, {n} tasks"
    assert a.finished and a.completed == n and a.failed == 0, a


def _states(db: Engine) -> dict[int, tuple[str, int, int, str | None]]:
    with db.connect() as conn:
        return {
            r.batch_no: (r.state, r.attempts, r.lease_epoch, r.lease_owner)
            for r in conn.execute(
                select(
                    Batch.batch_no,
                    Batch.state,
                    Batch.attempts,
                    Batch.lease_epoch,
                    Batch.lease_owner,
                )
            )
        }


def test_sigkill_mid_batch_requeues_after_the_lease_and_completes_once(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _prepare(db, paths, _manifest(tiny_model_dir, 4), FAULT_TASKS, tmp_path)
    victim = Worker(paths, db_url, manifest, "victim", 2.0, tmp_path)
    held = _stop_holding_a_lease(victim, db)
    victim.process.kill()  # SIGKILL while holding the lease(s)
    victim.process.wait()
    survivor = Worker(paths, db_url, manifest, "survivor", 60.0, tmp_path).wait()
    states = _states(db)
    for batch in held:
        state, attempts, epoch, owner = states[batch]
        assert (state, owner) == ("completed", "survivor") and attempts == 2 and epoch == 2
    assert survivor["stale_acks"] == 0
    _assert_nothing_lost_or_doubled(db, FAULT_TASKS)


def test_sigstop_past_the_lease_then_sigcont_has_its_late_ack_refused(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _prepare(db, paths, _manifest(tiny_model_dir, 4), FAULT_TASKS, tmp_path)
    sleeper = Worker(paths, db_url, manifest, "sleeper", 2.0, tmp_path)
    held = _stop_holding_a_lease(sleeper, db)
    other = Worker(paths, db_url, manifest, "other", 60.0, tmp_path)
    _wait_until(
        lambda: all(_states(db)[b][3] == "other" and _states(db)[b][0] == "completed" for b in held)
    )
    os.kill(sleeper.process.pid, signal.SIGCONT)
    late = sleeper.wait()
    other.wait()
    assert late["stale_acks"] >= 1, late  # its acks carried the old epoch and were refused
    assert any("no longer current" in e for e in late["errors"])
    _assert_nothing_lost_or_doubled(db, FAULT_TASKS)


def test_kill_the_whole_run_and_restart_runs_only_unacknowledged_batches(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _prepare(db, paths, _manifest(tiny_model_dir, 4), FAULT_TASKS, tmp_path)
    total = len(_states(db))
    first = Worker(paths, db_url, manifest, "first", 2.0, tmp_path)
    _wait_until(lambda: sum(s[0] == "completed" for s in _states(db).values()) >= total // 10)
    _stop_holding_a_lease(first, db)
    first.process.kill()
    first.process.wait()
    before = _states(db)
    acknowledged = {b for b, s in before.items() if s[0] == "completed"}
    assert 0 < len(acknowledged) < total
    second = Worker(paths, db_url, manifest, "second", 60.0, tmp_path).wait()
    after = _states(db)
    assert second["batches_done"] == total - len(acknowledged), (
        "only unacknowledged batches ran again"
    )
    for batch in acknowledged:
        assert after[batch] == before[batch], "an acknowledged batch was run again"
    _assert_nothing_lost_or_doubled(db, FAULT_TASKS)


def test_duplicate_submit_is_counted_once(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine_manifest = _manifest(tiny_model_dir, 8)
    manifest = _prepare(db, paths, engine_manifest, 200, tmp_path)
    # The same file again, ingested and planned again: nothing new.
    submit(tmp_path / "set.jsonl", paths.inbox, "set")
    assert ingest_task_set(
        db, paths, "set", model_id=engine_manifest.model_id, max_seq_len=64
    ).reused
    Worker(paths, db_url, manifest, "one", 60.0, tmp_path).wait()
    plan_task_set(db, paths, "set", engine_manifest)
    again = Worker(paths, db_url, manifest, "two", 60.0, tmp_path).wait()
    assert again["batches_done"] == 0 and again["rows_inserted"] == 0
    _assert_nothing_lost_or_doubled(db, 200)


def test_two_workers_share_ten_thousand_batches_each_done_once(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _prepare(db, paths, _manifest(tiny_model_dir, 1), 10_000, tmp_path)
    workers = [Worker(paths, db_url, manifest, f"w{i}", 600.0, tmp_path) for i in range(2)]
    reports = [w.wait(timeout=500) for w in workers]
    states = _states(db)
    assert len(states) == 10_000
    assert all(s[0] == "completed" and s[1] == 1 for s in states.values()), "each batch run once"
    assert sum(r["batches_done"] for r in reports) == 10_000
    assert all(r["batches_done"] > 0 for r in reports), "both workers pulled batches"
    _assert_nothing_lost_or_doubled(db, 10_000)
