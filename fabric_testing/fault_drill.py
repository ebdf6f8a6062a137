"""Fault injection against the real product path, for tests/test_faults.py and bench/faults.py.

A run here is what a Dagster run of one task set does, in a process of its own
(`python -m fabric_testing.fault_drill run SET ...`): plan the set's outstanding items, then
`extract_task_set` with worker processes. Faults hit that run from outside: SIGKILL of the run or
of one worker, SIGSTOP of a worker past its lease, termination of the workers' PostgreSQL
backends, an output folder that cannot be written, and stored files truncated, extended or
bit-flipped. The checks afterwards count in SQL what the reliability promise forbids: tasks
neither completed nor failed (lost), result rows beyond one per key (duplicated), tasks both
completed and failed, corruption nobody reported, and worker processes that outlived their run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine, create_engine, func, select, text

from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.core.signals import stop_on_signals
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import (
    Batch,
    BatchPlanRow,
    Embedding,
    HiddenStateShard,
    IndexReceipt,
    Model,
    Task,
    TaskFailure,
    TaskSet,
    task_embeddings,
)
from fabric_pipelines.lib.worker import MAIN_MODULE

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_MODULE = MAIN_MODULE  # the worker processes a drill watches and kills
CORRUPTIONS = ("truncate", "append", "flip", "delete")


# --- the workload ---------------------------------------------------------------------------


def write_token_tasks(path: Path, n: int, rng: np.random.Generator, bad_every: int = 0) -> int:
    """A JSONL task set of `n` records of 3-8 token ids ([CLS] ... [SEP]); every `bad_every`-th
    record has a token id outside the vocabulary, so it fails at ingest. Returns the bad count."""
    lines, bad = [], 0
    for i in range(n):
        inner = rng.integers(1000, 30000, size=int(rng.integers(1, 7))).tolist()
        if bad_every and i % bad_every == bad_every - 1:
            inner[0], bad = 10**7, bad + 1
        lines.append(json.dumps({"id": f"t{i}", "token_ids": [101, *inner, 102]}) + "\n")
    path.write_text("".join(lines))
    return bad


def fault_manifest(model: str, items: int, hooks: tuple[int, ...]) -> Any:
    """The CPU engine on `model` with `items` per batch (tiny batches: many of them)."""
    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.profile import ConsumerProfile

    return manifest_for_model(
        model, backend="cpu", dtype="float32",
        profile=ConsumerProfile(items * 16, items, 16, 8), hooks=HookSpec(hooks, "mean"),
    )  # fmt: skip


def prepare_task_set(
    db: Engine, paths: FabricPaths, name: str, n: int, manifest: Any, rng: np.random.Generator
) -> Path:
    """Submit and ingest a fresh set of `n` token-id tasks; returns the manifest file for runs."""
    from fabric_pipelines.lib.core.files import write_bytes
    from fabric_pipelines.lib.tasks.catalog import ingest_task_set
    from fabric_pipelines.lib.tasks.inbox import submit

    folder = paths.root / "fault-inputs"
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"{name}.jsonl"
    write_token_tasks(source, n, rng, bad_every=97)
    submit(source, paths.inbox, name)
    ingest_task_set(db, paths, name, model_id=manifest.model_id, max_seq_len=16)
    manifest_path = folder / f"{name}.engine.json"
    write_bytes(manifest_path, json.dumps(manifest.to_mapping()).encode())
    return manifest_path


# --- runs and their workers -----------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    task_set: str
    manifest: Path
    workers: int = 2
    lease_seconds: float = 2.0
    heartbeat_seconds: float = 0.5
    # Stand-ins for workers that died or were lost; 0: none, and no lost worker is stopped (a
    # worker on a host the run cannot reach: only the ledger's fence stands between it and
    # the rows).
    max_restarts: int = 3


class Run:
    """One run of a task set in its own process (plan, then extract with worker processes)."""

    def __init__(self, paths: FabricPaths, db_url: str, settings: RunSettings, log: Path) -> None:
        self.paths = paths
        self.settings = settings
        self.log = log
        env = {
            **os.environ,
            "FABRIC_DATABASE_URL": db_url,
            "FABRIC_HOME": str(paths.root),
            "HF_HUB_OFFLINE": "1",
            # fabric_testing is not installed: the run's process finds it beside the product.
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        command = [
            sys.executable, "-m", __spec__.name if __spec__ else "fabric_testing.fault_drill", "run", settings.task_set,
            "--manifest", str(settings.manifest), "--workers", str(settings.workers),
            "--lease-seconds", str(settings.lease_seconds),
            "--heartbeat-seconds", str(settings.heartbeat_seconds),
            "--max-restarts", str(settings.max_restarts),
        ]  # fmt: skip
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.seen_workers: set[int] = set()

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def workers(self) -> list[int]:
        """Pids of this run's live worker processes (remembered for the orphan check)."""
        found = [pid for pid in worker_pids(self.paths.root) if _parent(pid) == self.pid]
        self.seen_workers.update(found)
        return found

    def wait(self, timeout: float = 600) -> int:
        """The run's exit code, noting its workers while it runs; TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {self.pid} still running after {timeout:.0f} s")
            self.workers()
            time.sleep(0.1)
        return self.process.returncode

    def orphans(self, grace_s: float) -> list[int]:
        """This run's workers still alive `grace_s` after it ended (then killed): none may be."""
        return wait_for_orphans(self.paths.root, grace_s, self.seen_workers)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the run's own process (not its workers: they must notice and exit)."""
        self.workers()
        for pid in self.seen_workers:  # a stopped worker could not notice anything
            _signal(pid, signal.SIGCONT)
        _signal(self.pid, signal.SIGKILL)
        self.process.wait()


def worker_pids(root: Path) -> list[int]:
    """Live (not zombie) worker processes that work on the data root `root`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if WORKER_MODULE.encode() not in args:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it exited meanwhile
            continue
        if f"FABRIC_HOME={root}".encode() in environ and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _signal(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def owner_of(pid: int) -> str | None:
    """The lease owner a worker claims batches as (its --owner argument)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return args[args.index("--owner") + 1] if "--owner" in args else None


def wait_for_orphans(root: Path, grace_s: float = 10.0, among: set[int] | None = None) -> list[int]:
    """Worker processes of `root` (or only those `among`) still alive `grace_s` after their run
    ended; they are killed (after counting) so that they cannot disturb what comes next."""

    def alive() -> list[int]:
        return [pid for pid in worker_pids(root) if among is None or pid in among]

    deadline = time.monotonic() + grace_s
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGKILL)
    return left


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def completed_batches(db: Engine, task_set: str) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(Batch)
                .where(Batch.task_set_id == set_id_of(task_set), Batch.state == "completed")
            ).scalar_one()
        )


def leased_by(db: Engine, owner: str) -> list[tuple[str, int]]:
    with db.connect() as conn:
        return [
            (r.plan_id, r.batch_no)
            for r in conn.execute(
                select(Batch.plan_id, Batch.batch_no).where(
                    Batch.lease_owner == owner, Batch.state == "leased"
                )
            )
        ]


# --- process and database faults ------------------------------------------------------------


def stop(pid: int) -> bool:
    """SIGSTOP and return once every thread of the process has stopped (the signal is delivered
    to each thread on its own: one still running could open a transaction after we looked)."""
    if not _signal(pid, signal.SIGSTOP):
        return False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            states = {
                (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                for task in Path(f"/proc/{pid}/task").iterdir()
            }
        except OSError:  # it exited, or a thread did while we read
            if not Path(f"/proc/{pid}").exists():
                return False
            continue
        if states <= {"T", "t"}:
            return True
        if states & {"Z", "X"} and not Path(f"/proc/{pid}/task").exists():
            return False
        time.sleep(0.002)
    return False


def in_a_transaction(db: Engine, pid: int, window_s: float = 0.3) -> bool:
    """Is the (stopped) process `pid` inside a database transaction, holding locks that others
    would wait on? PostgreSQL: its sessions, found by their client ports. SQLite: the write lock
    stays taken for `window_s` (live workers' transactions take milliseconds)."""
    if db.dialect.name == "sqlite":
        import sqlite3

        probe = sqlite3.connect(str(db.url.database), timeout=window_s, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:  # locked all along: the stopped writer holds it
            return True
        finally:
            probe.close()
    ports = client_ports(pid)
    with db.connect() as conn:
        if ports:
            return bool(
                conn.execute(
                    text(
                        "select count(*) from pg_stat_activity where datname = "
                        "current_database() and xact_start is not null and client_port = any(:p)"
                    ),
                    {"p": ports},
                ).scalar_one()
            )
        # A Unix socket: no port to tell sessions apart; one that stays in its transaction.
        query = text(
            "select pid, xact_start from pg_stat_activity where datname = current_database() "
            "and xact_start is not null and pid <> pg_backend_pid()"
        )
        before = set(conn.execute(query).all())
        time.sleep(window_s)
        return bool(before & set(conn.execute(query).all()))


def client_ports(pid: int) -> list[int]:
    """Local TCP ports of the process's sockets (PostgreSQL's client_port of its sessions)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
        ports = []
        for table in ("tcp", "tcp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[9]) in inodes:
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
        return ports
    except OSError:
        return []


def stop_holding_a_lease(db: Engine, pid: int, timeout: float = 60) -> list[tuple[str, int]]:
    """SIGSTOP the worker at a moment it holds a lease and is between transactions (stopped
    inside one it would hold the database's locks, and the others would wait on it).
    Returns the (plan, batch) it holds; [] if it exited first."""
    owner = owner_of(pid)
    deadline = time.monotonic() + timeout
    while owner is not None and time.monotonic() < deadline:
        if not stop(pid):
            return []
        if not in_a_transaction(db, pid):
            held = leased_by(db, owner)
            if held:
                return held
        _signal(pid, signal.SIGCONT)
        # Long enough to leave a short transaction; short enough to try many times: a worker's
        # writers, claims and heartbeat keep one of its sessions in a transaction much of the
        # time, and a small plan ends within seconds.
        time.sleep(0.03)
    return []


def stop_one_holding_a_lease(
    db: Engine, pids: list[int], first: int, timeout: float = 60
) -> tuple[int, list[tuple[str, int]]]:
    """`stop_holding_a_lease` on the workers in turn, starting with `pids[first]`, until one
    is caught; returns its pid and leases ((0, []) if none was). Near a plan's end a worker may
    hold nothing while another runs the last batches it claimed: that one is caught instead."""
    for pid in pids[first:] + pids[:first]:
        held = stop_holding_a_lease(db, pid, timeout)
        if held:
            return pid, held
    return 0, []


def stop_past_lease(pid: int, lease_seconds: float) -> bool:
    """SIGSTOP a worker wherever it is, for longer than its lease, then SIGCONT it."""
    if not stop(pid):
        return False
    time.sleep(lease_seconds * 1.5 + 0.3)
    _signal(pid, signal.SIGCONT)
    return True


def kill(pid: int) -> bool:
    # SIGKILL ends a stopped process too. Continuing it first would let it run for a moment,
    # and on a loaded machine that moment was long enough to acknowledge the batch it held.
    return _signal(pid, signal.SIGKILL)


class BackendKiller:
    """Terminates the product's PostgreSQL sessions (application_name 'fabric') on one database,
    from a session of its own that it never terminates."""

    def __init__(self, db_url: str) -> None:
        self._admin = create_engine(
            db_url, connect_args={"application_name": "fabric-faults"}, pool_pre_ping=True
        )

    def terminate(self, rng: np.random.Generator) -> int:
        """Terminate every product session, or one at random; returns how many ended."""
        with self._admin.connect() as conn:
            pids = list(
                conn.execute(
                    text(
                        "select pid from pg_stat_activity where datname = current_database() "
                        "and application_name = 'fabric' and pid <> pg_backend_pid()"
                    )
                ).scalars()
            )
            if pids and rng.random() < 0.5:
                pids = [pids[int(rng.integers(len(pids)))]]
            ended = 0
            for pid in pids:
                ended += bool(
                    conn.execute(text("select pg_terminate_backend(:p)"), {"p": pid}).scalar()
                )
            conn.commit()
        return ended

    def close(self) -> None:
        self._admin.dispose()


@contextmanager
def locked_database(path: Path) -> Iterator[None]:
    """SQLite's write lock held by another connection for the block: writers of the run wait
    their busy timeout, then fail "database is locked" and retry their unit of work."""
    import sqlite3

    holder = sqlite3.connect(str(path), timeout=60, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        yield
        holder.execute("ROLLBACK")
    finally:
        holder.close()


@contextmanager
def unwritable_folder(folder: Path) -> Iterator[None]:
    """Make `folder` impossible to write into, even for root (where chmod stops nothing): it is
    moved aside and a plain file takes its name, so every mkdir, staging file and rename under
    it fails. Restored afterwards, with anything created there meanwhile merged back."""
    away = folder.with_name(folder.name + ".away")
    blocker = folder.with_name(folder.name + ".blocker")
    blocker.write_bytes(b"")
    os.rename(folder, away)
    while True:
        try:
            os.rename(blocker, folder)
            break
        except (IsADirectoryError, OSError):  # a worker's mkdir got in first: take it too
            _merge(folder, away)
    try:
        yield
    finally:
        if folder.is_file():
            folder.unlink()
        elif folder.is_dir():
            _merge(folder, away)
        os.rename(away, folder)


def _merge(source: Path, target: Path) -> None:
    for path in sorted(source.rglob("*"), reverse=True):
        relative = target / path.relative_to(source)
        if path.is_dir():
            if relative.exists():
                path.rmdir()
            else:
                relative.parent.mkdir(parents=True, exist_ok=True)
                os.rename(path, relative)
        else:
            relative.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, relative)
    if source.is_dir():
        source.rmdir()


# --- file faults ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredItem:
    kind: str  # task_set, plan, shard, index, receipt
    path: Path
    sha256: str | None  # recorded hash, where the database keeps one


def stored_files(db: Engine, paths: FabricPaths, task_set: str) -> list[StoredItem]:
    """Every file the product stored for `task_set`, the files of each model's index in
    service, and every receipt file."""
    from fabric_pipelines.lib.index.paths import model_index_folder
    from fabric_pipelines.lib.index.receipt import Receipt
    from fabric_pipelines.lib.index.staleness import latest_receipt

    items: list[StoredItem] = []
    with db.connect() as conn:
        ts = conn.execute(select(TaskSet).where(TaskSet.name == task_set)).one()
        items.append(StoredItem("task_set", Path(ts.path), ts.content_sha256))
        for path, sha in conn.execute(
            select(BatchPlanRow.path, BatchPlanRow.sha256).where(
                BatchPlanRow.task_set_id == set_id_of(task_set)
            )
        ):
            items.append(StoredItem("plan", Path(path), sha))
        for path, sha in conn.execute(
            select(HiddenStateShard.path, HiddenStateShard.sha256).where(
                HiddenStateShard.task_set_id == set_id_of(task_set)
            )
        ):
            items.append(StoredItem("shard", Path(path), sha))
        for model_key in conn.execute(
            select(Model.model_key).join(IndexReceipt, IndexReceipt.model_id == Model.id).distinct()
        ).scalars():
            latest = latest_receipt(conn, model_key)
            assert latest is not None
            receipt = Receipt.parse(latest[1], f"receipt {latest[0]}")
            folder = model_index_folder(paths.indexes, model_key)
            # The files of the index in service (older receipts' files are not promised).
            items += [StoredItem("index", folder / name, sha) for name, sha in receipt.files()]
        for sha in conn.execute(select(IndexReceipt.receipt_sha256)).scalars():
            items.append(StoredItem("receipt", paths.receipts / f"{sha}.json", sha))
    unique = {item.path: item for item in items}  # shared content-addressed files count once
    return sorted(unique.values(), key=lambda item: str(item.path))


def corrupt(path: Path, how: str, rng: np.random.Generator) -> str:
    """Damage `path` one way: truncate at a random offset, append garbage, flip one bit, or
    delete it. Returns what was done, with the offset, for messages."""
    data = path.read_bytes()
    if how == "truncate":
        at = int(rng.integers(0, len(data)))
        with open(path, "r+b") as handle:
            handle.truncate(at)
        return f"truncated {path.name} at byte {at} of {len(data)}"
    if how == "append":
        garbage = rng.integers(0, 256, size=int(rng.integers(1, 65)), dtype=np.uint8).tobytes()
        with open(path, "ab") as handle:
            handle.write(garbage)
        return f"appended {len(garbage)} bytes to {path.name}"
    if how == "flip":
        at, bit = int(rng.integers(0, len(data))), int(rng.integers(0, 8))
        with open(path, "r+b") as handle:
            handle.seek(at)
            handle.write(bytes([data[at] ^ (1 << bit)]))
        return f"flipped bit {bit} of byte {at} of {path.name}"
    if how == "delete":
        path.unlink()
        return f"deleted {path.name}"
    raise ValueError(f"unknown corruption {how!r}; use one of {CORRUPTIONS}")


def read_with_product_reader(item: StoredItem) -> None:
    """Open the file as the product does, hash check included; raises if it is refused."""
    if item.sha256 is None:
        raise ValueError(f"{item.path}: no recorded hash to read it against")
    if item.kind in ("task_set", "plan"):
        from fabric_pipelines.lib.tasks.arrow_files import read_table

        read_table(item.path, item.sha256)
    elif item.kind == "shard":
        from fabric_pipelines.lib.results.hidden_states import read_shard

        read_shard(item.path, item.sha256)
    elif item.kind == "index":
        from fabric_pipelines.lib.index.publish import read_verified

        read_verified(item.path, item.sha256)
    elif item.kind == "receipt":
        from fabric_pipelines.lib.core.files import verify_sha256

        # A receipt is named by the sha256 of its canonical bytes.
        verify_sha256(item.path, item.sha256, "index receipt", "rebuild the index")
    else:
        raise ValueError(f"unknown stored file kind {item.kind!r}")


# --- checks ---------------------------------------------------------------------------------


def verify_findings(db: Engine, paths: FabricPaths, task_set: str | None = None) -> list[str]:
    """`fabric verify`'s findings, one line each ([] when everything checks out)."""
    from fabric_pipelines.lib.maintenance.verify import verify

    return [
        f"{f.kind} {f.subject}: {f.problem} (repair: {f.repair})"
        for f in verify(db, paths, task_set).findings
    ]


def names(finding: str, item: StoredItem) -> bool:
    """Does this finding point at the file (by name, path or recorded hash)?"""
    return item.path.name in finding or (item.sha256 is not None and item.sha256[:16] in finding)


@dataclass
class Outcome:
    """What the database says became of a task set's tasks."""

    tasks: int  # records submitted (good and bad)
    completed: int  # distinct tasks with a result: their own row or one they reused
    failed: int  # distinct records with a failure
    lost: int  # tasks with neither a result nor a failure
    duplicated: int  # result or failure rows beyond one per key
    both: int  # tasks with a result and a failure
    open_batches: int  # batches of the current plan queued or leased

    @property
    def clean(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.both == 0
            and self.completed + self.failed == self.tasks
        )


def outcome(db: Engine, task_set: str) -> Outcome:
    """Counts in SQL: rows vs distinct keys, tasks with neither or both outcomes."""
    with db.connect() as conn:
        ts = conn.execute(select(TaskSet).where(TaskSet.name == task_set)).one()
        key = (Embedding.task_set_id, Embedding.record_no, Embedding.model_id)
        rows = conn.execute(
            select(func.count()).select_from(Embedding).where(Embedding.task_set_id == ts.id)
        ).scalar_one()
        distinct = conn.execute(
            select(func.count()).select_from(
                select(*key).where(Embedding.task_set_id == ts.id).distinct().subquery()
            )
        ).scalar_one()
        # A task's result is its own row or the one it reused (the view task_embeddings).
        view = task_embeddings.c
        completed = conn.execute(
            select(func.count()).select_from(
                select(view.task_set_id, view.record_no, view.model_id)
                .where(view.task_set_id == ts.id)
                .distinct()
                .subquery()
            )
        ).scalar_one()
        failure_rows = conn.execute(
            select(func.count())
            .select_from(TaskFailure)
            .where(TaskFailure.task_set_id == set_id_of(task_set))
        ).scalar_one()
        failed = conn.execute(
            select(func.count(func.distinct(TaskFailure.record_no))).where(
                TaskFailure.task_set_id == set_id_of(task_set)
            )
        ).scalar_one()
        has_result = (
            select(view.record_no)
            .select_from(task_embeddings)
            .where(view.task_set_id == ts.id, view.record_no == Task.record_no)
            .exists()
        )
        has_failure = (
            select(TaskFailure.record_no)
            .where(
                TaskFailure.task_set_id == set_id_of(task_set),
                TaskFailure.record_no == Task.record_no,
            )
            .exists()
        )
        lost = conn.execute(
            select(func.count())
            .select_from(Task)
            .where(Task.task_set_id == ts.id, ~has_result, ~has_failure)
        ).scalar_one()
        both = conn.execute(
            select(func.count())
            .select_from(Task)
            .where(Task.task_set_id == ts.id, has_result, has_failure)
        ).scalar_one()
        open_batches = conn.execute(
            select(func.count())
            .select_from(Batch)
            .where(Batch.plan_id == ts.current_plan_id, Batch.state.in_(("queued", "leased")))
        ).scalar_one()
    return Outcome(
        tasks=int(ts.n_records),
        completed=int(completed),
        failed=int(failed),
        lost=int(lost),
        duplicated=int(rows - distinct) + int(failure_rows - failed),
        both=int(both),
        open_batches=int(open_batches),
    )


def acked_without_shard(db: Engine, task_set: str) -> int:
    """Completed batches with no hidden-state shard row (for engines with hook layers)."""
    with db.connect() as conn:
        has_shard = (
            select(HiddenStateShard.sha256)
            .where(
                HiddenStateShard.plan_id == Batch.plan_id,
                HiddenStateShard.batch_no == Batch.batch_no,
            )
            .exists()
        )
        return int(
            conn.execute(
                select(func.count())
                .select_from(Batch)
                .where(
                    Batch.task_set_id == set_id_of(task_set), Batch.state == "completed", ~has_shard
                )
            ).scalar_one()
        )


@dataclass
class Tally:
    """Per database: runs, faults by kind, and the four numbers that must stay zero."""

    runs: int = 0
    faults: int = 0
    lost: int = 0
    duplicated: int = 0
    corrupted_undetected: int = 0
    orphans: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def count(self, kind: str) -> None:
        self.faults += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.corrupted_undetected or self.orphans)


# --- the run process ------------------------------------------------------------------------


def _run_main(argv: list[str]) -> int:
    """Plan the set's outstanding items and extract them with worker processes."""
    parser = argparse.ArgumentParser(prog="python -m fabric_testing.fault_drill run")
    parser.add_argument("task_set")
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lease-seconds", type=float, default=2.0)
    parser.add_argument("--heartbeat-seconds", type=float, default=0.5)
    parser.add_argument("--max-restarts", type=int, default=3)
    args = parser.parse_args(argv)

    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.lib.broker.plans import plan_task_set
    from fabric_pipelines.lib.core.settings import database_url, default_root
    from fabric_pipelines.lib.steps.run_extraction import extract_task_set
    from fabric_pipelines.lib.store.db import make_engine

    paths = FabricPaths(default_root()).ensure()
    url = database_url(paths)
    db = make_engine(url)
    manifest = EngineManifest.load(Path(args.manifest))
    plan = plan_task_set(db, paths, args.task_set, manifest)
    summary = extract_task_set(
        db, paths, args.task_set, manifest, database_url=url, workers=args.workers,
        lease_seconds=args.lease_seconds, heartbeat_seconds=args.heartbeat_seconds,
        max_restarts=args.max_restarts,
    )  # fmt: skip
    print(json.dumps({"plan": plan.plan_id, "planned_items": plan.outstanding, **vars(summary)}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["run"]:
        sys.exit("usage: python -m fabric_testing.fault_drill run TASK_SET --manifest M ...")
    stop_on_signals()
    sys.exit(_run_main(sys.argv[2:]))
