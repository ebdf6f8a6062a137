"""Faults with real worker processes, on both databases (the worker faults of docs/guarantees.md), and
several workers sharing one plan. After each: no lost task, no duplicate row, accounting balances.

Workers are `python -m fabric_pipelines.lib.worker.launch` processes running the real engine code (the
CPU engine) on a small random BERT with the real tokenizer, so forwards are quick. A worker is
caught holding a lease deterministically: it is stopped (SIGSTOP), the ledger is read, and if it
holds no lease it is let go (SIGCONT) and tried again a moment later.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, select, text

from fabric_gpu.engines import create_engine
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import Accounting, accounting
from fabric_pipelines.lib.broker.plans import current_plan, load_plan_order, plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import Batch
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import get_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.worker import loop as extraction
from fabric_pipelines.lib.worker.loop import ExtractionJob, ExtractionReport, run_worker
from fabric_pipelines.lib.worker.main import PARENT_GONE_EXIT
from fabric_testing.scratch_db import empty_public_schema
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
            sys.executable, "-m", "fabric_pipelines.lib.worker.main", "set", "--manifest", str(manifest),
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
    # Short leases on the survivor too: its heartbeat keeps them while it works.
    survivor = Worker(paths, db_url, manifest, "survivor", 2.0, tmp_path).wait()
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


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, from /proc; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[2])


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie runs nothing


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[1] == pgid and stat[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def _worker_pids(root: Path) -> list[int]:
    """Live worker processes whose command line points into the data root `root`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        ours = b"fabric_pipelines.lib.worker.main" in command and str(root).encode() in command
        if ours and _alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failing_supervisor_stops_its_workers_before_it_returns(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    tiny_model_dir: Path,
    tmp_path: Path,
    failure: type[BaseException],
) -> None:
    engine_manifest = _manifest(tiny_model_dir, 4)
    _prepare(db, paths, engine_manifest, FAULT_TASKS, tmp_path)
    running: list[int] = []

    def poll(_counts: Accounting) -> None:  # the supervisor's database poll, failing at its 2nd
        if not running:
            running.extend(_worker_pids(paths.root))
            return
        raise failure("the supervisor's database poll failed")

    with pytest.raises(failure, match="poll failed"):
        extract_task_set(
            db, paths, "set", engine_manifest, database_url=db_url, workers=2,
            on_progress=poll, progress_every_s=0.2,
        )  # fmt: skip
    assert len(running) == 2, "both workers were running when the poll failed"
    for pid in running:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone and reaped
        assert _group_members(pid) == [], "nothing of its process group is left"
    assert _worker_pids(paths.root) == []


SUPERVISOR = """
import json, sys
from pathlib import Path
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.worker.launch import LaunchSettings, launch_workers, supervise

task_set, manifest, root, url, out = sys.argv[1:]
settings = LaunchSettings(task_set, Path(manifest), Path(root), url)
workers = launch_workers(settings, 2, Path(out).parent / "supervised")
Path(out).write_text(json.dumps([w.process.pid for w in workers]))
supervise(workers, make_engine(url), task_set)
"""


def test_workers_die_with_their_supervisor_when_it_is_killed(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _prepare(db, paths, _manifest(tiny_model_dir, 4), FAULT_TASKS, tmp_path)
    script, pids_file = tmp_path / "supervisor.py", tmp_path / "pids.json"
    script.write_text(SUPERVISOR)
    supervisor = subprocess.Popen(
        [sys.executable, str(script), "set", str(manifest), str(paths.root), db_url,
         str(pids_file)],
    )  # fmt: skip
    STARTED.append(supervisor)
    _wait_until(pids_file.exists)
    workers = json.loads(pids_file.read_text())
    owner = f"{socket.gethostname()}:{supervisor.pid}:w0"
    try:
        _wait_until(lambda: _leased_by(db, owner) != [])  # at work, holding a lease
        assert all(_alive(pid) for pid in workers)
        supervisor.kill()  # SIGKILL: no finally, no clean-up of its own
        supervisor.wait()
        _wait_until(lambda: not any(_alive(pid) for pid in workers), timeout=30)
    finally:
        for pid in workers:
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_a_worker_whose_supervisor_is_already_gone_exits_at_once(tmp_path: Path) -> None:
    """Its supervisor died before the worker could ask to die with it: it notices, and goes."""
    result = subprocess.run(
        [sys.executable, "-m", "fabric_pipelines.lib.worker.main", "set", "--manifest",
         str(tmp_path / "never-read.json"), "--parent-pid", str(os.getpid() + 1_000_000)],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == PARENT_GONE_EXIT, result.stderr.decode()


def _current_job(db: Engine, paths: FabricPaths, manifest: EngineManifest) -> ExtractionJob:
    ts, plan = get_task_set(db, "set"), current_plan(db, "set")
    return ExtractionJob(
        task_set="set",
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=read_table(Path(ts.path), ts.content_sha256),
        order=load_plan_order(Path(plan.path), plan.sha256),
        shard_folder=paths.shards,
    )


class SlowEngine:
    """The real engine, with a stage that takes `seconds` per batch (longer than the lease)."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.manifest, self.input_location = inner.manifest, inner.input_location
        self.hidden_size, self.num_layers = inner.hidden_size, inner.num_layers
        self.profile = inner.profile

    def forward_hidden(self, ids: np.ndarray, lengths: np.ndarray) -> Any:
        time.sleep(self.seconds)
        return self.inner.forward_hidden(ids, lengths)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeat", "no-heartbeat"])
def test_a_worker_slower_than_its_lease_keeps_it_by_its_heartbeat(
    db: Engine,
    paths: FabricPaths,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    heartbeat: bool,
) -> None:
    """Two workers share a plan under 2 s leases; one takes 3 s a batch. With its heartbeat it
    keeps its batches (each runs once, no stale ack); without, the other takes them over."""
    manifest = _manifest(tiny_model_dir, 4)
    _prepare(db, paths, manifest, 48, tmp_path)
    job = _current_job(db, paths, manifest)
    if not heartbeat:  # the control: renewals do nothing
        monkeypatch.setattr(extraction, "renew_leases", lambda _db, leases, *_a, **_k: leases)
    slow_engine, fast_engine = SlowEngine(create_engine(manifest), 3.0), create_engine(manifest)
    reports: dict[str, ExtractionReport | BaseException] = {}

    def run_slow() -> None:
        try:
            reports["slow"] = run_worker(
                db, slow_engine, job, owner="slow", lease_seconds=2.0, heartbeat_seconds=0.25,
                max_in_flight=1,
            )  # fmt: skip
        except BaseException as error:
            reports["slow"] = error

    slow = threading.Thread(target=run_slow)
    slow.start()
    try:
        _wait_until(lambda: _leased_by(db, "slow") != [])
        fast = run_worker(
            db, fast_engine, job, owner="fast", lease_seconds=2.0, heartbeat_seconds=0.25
        )
    finally:
        slow.join(timeout=300)
        slow_engine.close()
        fast_engine.close()
    slow_report = reports["slow"]
    assert isinstance(slow_report, ExtractionReport), slow_report
    attempts = [s[1] for s in _states(db).values()]
    if heartbeat:
        assert slow_report.batches_done >= 1 and slow_report.stale_acks == 0
        assert fast.stale_acks == 0
        assert attempts == [1] * len(attempts), "no batch ran twice"
    else:
        assert max(attempts) >= 2 and slow_report.stale_acks >= 1, "the control must lose"
    _assert_nothing_lost_or_doubled(db, 48)


def test_a_run_whose_plan_another_run_replanned_says_which_plan_took_over(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _manifest(tiny_model_dir, 4)
    _prepare(db, paths, manifest, 1200, tmp_path)
    first_plan, batches = current_plan(db, "set").plan_id, len(_states(db))
    replanned: list[str] = []

    def another_run_replans(counts: Accounting) -> None:
        if counts.completed > 0 and not replanned:
            replanned.append(plan_task_set(db, paths, "set", manifest).plan_id)

    summary = extract_task_set(
        db, paths, "set", manifest, database_url=db_url, workers=1,
        on_progress=another_run_replans, progress_every_s=0.2,
    )  # fmt: skip
    assert replanned and replanned[0] != first_plan
    assert summary.superseded_by == replanned[0]
    assert summary.superseded == (
        f"plan {first_plan} was superseded by plan {replanned[0]} (another run of this task set "
        "re-planned it); this run's remaining batches are left to that run"
    )
    assert 0 < summary.batches_done < batches, "the worker stopped when its plan was superseded"
    again = extract_task_set(db, paths, "set", manifest, database_url=db_url, workers=1)
    assert again.superseded_by == "" and again.batches_done > 0
    _assert_nothing_lost_or_doubled(db, 1200)


@pytest.mark.postgres
def test_terminating_a_running_workers_backends_loses_and_doubles_nothing(
    postgres_server_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    db = make_engine(postgres_server_url)
    empty_public_schema(db)
    create_schema(db)
    manifest = _prepare(db, paths, _manifest(tiny_model_dir, 4), FAULT_TASKS, tmp_path)
    worker = Worker(paths, postgres_server_url, manifest, "cut", 2.0, tmp_path)
    _wait_until(lambda: any(s[0] == "completed" for s in _states(db).values()))
    db.dispose()  # from here on every 'fabric' session of this database is the worker's
    cuts = 0
    admin = make_engine(postgres_server_url)
    with admin.connect() as conn:
        while cuts < 6 and worker.process.poll() is None:
            terminated = conn.execute(
                text(
                    "select count(*) filter (where pg_terminate_backend(pid)) from "
                    "pg_stat_activity where datname = current_database() and "
                    "application_name = 'fabric' and pid <> pg_backend_pid()"
                )
            ).scalar_one()
            conn.commit()  # pg_stat_activity is read once per transaction: end it for a new look
            cuts += int(terminated > 0)
            time.sleep(0.5)  # far enough apart that the worker's retries get through
    admin.dispose()
    assert cuts == 6, f"the worker ended before six cuts: {worker.log.read_text()[-3000:]}"
    report = worker.wait()
    assert report["batches_done"] > 0
    assert "transient database error" in worker.log.read_text(), "no cut hit a statement"
    _assert_nothing_lost_or_doubled(db, FAULT_TASKS)
