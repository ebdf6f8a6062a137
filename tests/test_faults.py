"""Short runs with faults at random points (the faults of docs/guarantees.md), on both databases.

The runs hit are real ones (fabric_testing/fault_drill.py's run process: plan, then `extract_task_set` with two
worker processes running the CPU engine on a small random BERT), over a few hundred token-id tasks
in batches of two, so a run has hundreds of batches to be hit in the middle of. The recovery run
after a fault runs in the test's process (`extract_task_set` with workers=0: no start-up to wait
for). Every test ends with `fabric verify` (lib/verify) and counts in SQL: one result row per
key, every task completed or failed exactly once, no worker process left alive.

Faults land at random points drawn from a seed, printed with each test and in every assertion
message; FABRIC_FAULT_SEED=<seed> replays them. The unwritable output folder is made by moving
the folder aside and putting a plain file in its place (tests may run as root, where chmod does
not stop a write).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, select

from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.core.files import CorruptFileError
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import Batch
from fabric_pipelines.lib.tasks.catalog import ImmutableTaskSetError, get_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import set_aside_path, submit
from fabric_pipelines.lib.tasks.ingest import SubmissionError
from fabric_testing import fault_drill as faults
from fabric_testing.scratch_db import empty_public_schema

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LEASE_S = 2.0
HEARTBEAT_S = 0.5
ORPHAN_GRACE_S = 5.0  # a worker whose run died must be gone by then
REFUSED = (CorruptFileError, ImmutableTaskSetError, SubmissionError)


class Seeded:
    """The test's random source and how to name it in messages."""

    def __init__(self, seed: int, where: str) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.where = where

    def __str__(self) -> str:
        return f"[{self.where}, FABRIC_FAULT_SEED={self.seed}]"


@pytest.fixture
def seeded(request: pytest.FixtureRequest) -> Seeded:
    seed = int(os.environ.get("FABRIC_FAULT_SEED") or secrets.randbelow(1_000_000))
    print(f"{request.node.name}: FABRIC_FAULT_SEED={seed}")
    return Seeded(seed, request.node.name)


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test(paths: FabricPaths) -> Iterator[None]:
    """A failed test must not leave workers (stopped ones included) that disturb the next."""
    yield
    faults.wait_for_orphans(paths.root, 0)


class Harness:
    """One data root and database, a task set prepared in it, and runs of that set."""

    def __init__(
        self,
        db: Engine,
        db_url: str,
        paths: FabricPaths,
        model: Path,
        seeded: Seeded,
        tasks: int,
        items: int = 2,
        hooks: tuple[int, ...] = (),
    ) -> None:
        self.db, self.db_url, self.paths, self.seeded = db, db_url, paths, seeded
        self.tasks = tasks
        self.manifest = faults.fault_manifest(str(model), items, hooks)
        self.manifest_path = faults.prepare_task_set(
            db, paths, "set", tasks, self.manifest, seeded.rng
        )
        self.runs = 0

    def start(self, max_restarts: int = 3) -> faults.Run:
        """A run of the set with two workers, 2 s leases renewed every 0.5 s."""
        self.runs += 1
        settings = faults.RunSettings(
            "set", self.manifest_path, 2, LEASE_S, HEARTBEAT_S, max_restarts
        )
        return faults.Run(
            self.paths, self.db_url, settings, self.paths.root / f"run{self.runs}.log"
        )

    def finish(self, run: faults.Run, timeout: float = 240) -> int:
        """Wait for the run; then no worker of it may be left."""
        code = run.wait(timeout)
        left = run.orphans(ORPHAN_GRACE_S)
        assert not left, f"workers {left} outlived their run {self.seeded}"
        return code

    def run_again(self) -> tuple[Any, Any]:
        """The recovery: the set planned and extracted again, fault free, in this process
        (as `fabric run` does with workers=0; no worker start-up to wait for). Returns the plan
        and the extraction summaries."""
        from fabric_pipelines.lib.broker.plans import plan_task_set
        from fabric_pipelines.lib.steps.run_extraction import extract_task_set

        plan = plan_task_set(self.db, self.paths, "set", self.manifest)
        summary = extract_task_set(
            self.db, self.paths, "set", self.manifest, database_url=self.db_url, workers=0,
            lease_seconds=LEASE_S, heartbeat_seconds=HEARTBEAT_S,
        )  # fmt: skip
        assert faults.outcome(self.db, "set").lost == 0, f"set unfinished {self.seeded}"
        return plan, summary

    def completed_at_least(self, batches: int, run: faults.Run) -> None:
        def reached() -> bool:
            assert run.running(), f"the run ended early {self.seeded}:\n{run.output()[-3000:]}"
            return faults.completed_batches(self.db, "set") >= batches

        faults.wait_until(reached, 180, f"{batches} completed batches {self.seeded}")

    def nothing_lost_or_doubled(self) -> None:
        result = faults.outcome(self.db, "set")
        assert result.clean and result.tasks == self.tasks, f"{result} {self.seeded}"
        assert result.open_batches == 0, f"{result} {self.seeded}"
        findings = faults.verify_findings(self.db, self.paths, "set")
        assert findings == [], f"verify after the faults {self.seeded}: {findings}"
        assert faults.worker_pids(self.paths.root) == [], f"a worker is alive {self.seeded}"


def _ledger(db: Engine) -> dict[tuple[str, int], tuple[str, int, str | None]]:
    with db.connect() as conn:
        return {
            (r.plan_id, r.batch_no): (r.state, r.lease_epoch, r.lease_owner)
            for r in conn.execute(
                select(
                    Batch.plan_id, Batch.batch_no, Batch.state, Batch.lease_epoch, Batch.lease_owner
                )
            )
        }


def _worker_report(paths: FabricPaths, owner: str) -> dict:
    for path in (paths.root / "workers").rglob("worker-*.json"):
        report = json.loads(path.read_text())
        if report.get("owner") == owner:
            return report
    raise AssertionError(f"no report of worker {owner} under {paths.root / 'workers'}")


def _random_point(seeded: Seeded, lo: int, hi: int) -> int:
    return int(seeded.rng.integers(lo, hi))


def test_killing_the_whole_run_leaves_no_worker_and_the_next_run_redoes_only_unacked_work(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    # 1000 batches, so the run is still mid-set when the kill lands: acks arrive in groups, and
    # on a fast machine 300 batches were all acknowledged between two polls.
    h = Harness(db, db_url, paths, tiny_model_dir, seeded, tasks=2000)
    run = h.start()
    h.completed_at_least(_random_point(seeded, 5, 100), run)
    workers = run.workers()
    run.kill()  # SIGKILL of the run's own process, mid-set
    left = run.orphans(ORPHAN_GRACE_S)
    assert workers and not left, (
        f"workers {left} of {workers} outlived the run killed under them {seeded}"
    )
    before = faults.outcome(db, "set")
    acked = {k: v for k, v in _ledger(db).items() if v[0] == "completed"}
    assert 0 < before.completed < before.tasks - before.failed, f"{before} {seeded}"

    plan, summary = h.run_again()
    outstanding = before.tasks - before.completed - before.failed
    # Random token tasks repeat now and then: a repeat waits for its first copy (lib/broker/reuse.py),
    # and one whose first copy was stored before the kill is copied when the rerun plans.
    assert plan.outstanding + plan.deferred + plan.reused == outstanding, (
        f"only unacknowledged work runs again {seeded}"
    )
    assert summary.rows_inserted + summary.duplicates_after + plan.reused == outstanding, (
        f"{summary} {seeded}"
    )
    after = _ledger(db)
    assert all(after[k] == v for k, v in acked.items()), f"an acked batch ran again {seeded}"
    h.nothing_lost_or_doubled()


def test_a_worker_killed_holding_a_lease_has_its_batches_done_once_by_another(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    h = Harness(db, db_url, paths, tiny_model_dir, seeded, tasks=2000)
    run = h.start()
    h.completed_at_least(_random_point(seeded, 5, 100), run)
    workers = run.workers()
    victim, held = faults.stop_one_holding_a_lease(
        db, workers, _random_point(seeded, 0, 2) % len(workers)
    )
    assert held, f"no worker was caught holding a lease {seeded}"
    owner = faults.owner_of(victim)
    faults.kill(victim)
    h.finish(run)  # the run fails (a worker died); the other one takes over its leases first
    ledger = _ledger(db)
    for batch in held:
        state, epoch, by = ledger[batch]
        assert state == "completed" and by != owner and epoch >= 2, (
            f"batch {batch} of the killed worker: {ledger[batch]} {seeded}"
        )
    h.run_again()
    h.nothing_lost_or_doubled()


def test_a_worker_stopped_past_its_lease_has_its_late_ack_refused(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    h = Harness(db, db_url, paths, tiny_model_dir, seeded, tasks=2000)
    # As a worker on another host: the run neither stops nor replaces it (max_restarts 0), so
    # only the ledger's epoch fence stands between its late acks and the rows.
    run = h.start(max_restarts=0)
    h.completed_at_least(_random_point(seeded, 5, 100), run)
    workers = run.workers()
    sleeper, held = faults.stop_one_holding_a_lease(
        db, workers, _random_point(seeded, 0, 2) % len(workers)
    )
    assert held, f"no worker was caught holding a lease {seeded}"
    owner = faults.owner_of(sleeper)
    assert owner is not None

    def taken_over() -> bool:
        ledger = _ledger(db)
        return all(ledger[b][0] == "completed" and ledger[b][2] != owner for b in held)

    faults.wait_until(taken_over, 120, f"the other worker to take over {held} {seeded}")
    os.kill(sleeper, signal.SIGCONT)
    assert h.finish(run) == 0, f"{seeded}:\n{run.output()[-3000:]}"
    late = _worker_report(paths, owner)
    assert late["stale_acks"] >= 1, f"its late acks were not refused: {late} {seeded}"
    assert any("no longer current" in e for e in late["errors"]), f"{late} {seeded}"
    h.nothing_lost_or_doubled()


@pytest.mark.postgres
def test_terminating_the_workers_backends_mid_run_loses_and_doubles_nothing(
    postgres_server_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    db = make_engine(postgres_server_url)
    empty_public_schema(db)
    create_schema(db)
    h = Harness(db, postgres_server_url, paths, tiny_model_dir, seeded, tasks=1200)
    killer = faults.BackendKiller(postgres_server_url)
    run = h.start()
    h.completed_at_least(_random_point(seeded, 2, 40), run)
    terminated = 0
    try:
        for _ in range(8):
            time.sleep(float(seeded.rng.uniform(0.2, 0.8)))
            if not run.running():
                break
            terminated += killer.terminate(seeded.rng)
    finally:
        killer.close()
    assert terminated > 0, f"no backend was terminated {seeded}"
    code = h.finish(run)
    assert code == 0, (
        f"the run must ride out {terminated} dropped connections (retry) {seeded}:\n"
        f"{run.output()[-3000:]}"
    )
    h.nothing_lost_or_doubled()
    db.dispose()


def test_two_runs_of_one_set_at_once_do_each_task_once(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    h = Harness(db, db_url, paths, tiny_model_dir, seeded, tasks=600)
    first = h.start()
    if seeded.rng.random() < 0.5:  # the second starts at once, or once the first is pulling
        h.completed_at_least(_random_point(seeded, 1, 60), first)
    second = h.start()
    codes = [h.finish(first), h.finish(second)]
    assert codes == [0, 0], f"{seeded}:\n{first.output()[-2000:]}\n{second.output()[-2000:]}"
    h.nothing_lost_or_doubled()


def test_an_unwritable_shard_folder_fails_the_run_clearly_and_no_batch_is_acked_without_its_file(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    h = Harness(db, db_url, paths, tiny_model_dir, seeded, tasks=600, hooks=(-1,))
    run = h.start()
    h.completed_at_least(_random_point(seeded, 5, 80), run)
    with faults.unwritable_folder(paths.shards):
        try:
            code: int | None = run.wait(60)
        except TimeoutError:
            code = None  # still retrying: acceptable while nothing is acked without its file
    if code == 0:
        # Right only where the run needed no new file: a small run on a fast machine can finish
        # between the last progress poll and the lock. Then every task completed, and (checked
        # below) every completed batch has its file, so each was written before the lock.
        with db.connect() as conn:
            state = accounting(conn, "set")
        assert state.completed == state.tasks and state.failed == 0, (
            f"the run reported success without its shard files: {state} {seeded}"
        )
    elif code is not None:
        assert str(paths.shards) in run.output(), (
            f"the run's error does not name the folder it could not write {seeded}:\n"
            f"{run.output()[-3000:]}"
        )
    h.finish(run)
    assert faults.acked_without_shard(db, "set") == 0, (
        f"a batch was acked without its file {seeded}"
    )
    findings = faults.verify_findings(db, paths, "set")
    assert not [f for f in findings if "shard" in f and "missing" in f], f"{findings} {seeded}"
    h.run_again()
    assert faults.acked_without_shard(db, "set") == 0, f"{seeded}"
    h.nothing_lost_or_doubled()


def test_corrupted_stored_files_are_refused_by_their_reader_and_named_by_verify(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded
) -> None:
    from fabric_pipelines.lib.index.build import IndexSpec
    from fabric_pipelines.lib.index.publish import build_and_publish

    h = Harness(db, db_url, paths, tiny_model_dir, seeded, tasks=120, items=8, hooks=(-1,))
    h.run_again()
    build_and_publish(
        db, model_key=h.manifest.model_key,
        model={"model_id": h.manifest.model_id, "weights_sha256": h.manifest.weights_sha256},
        spec=IndexSpec(shards=2, recall_queries=50), index_folder=paths.indexes,
        receipt_folder=paths.receipts, inputs=[],
    )  # fmt: skip
    h.nothing_lost_or_doubled()
    items = faults.stored_files(db, paths, "set")
    kinds = {item.kind for item in items}
    assert kinds == {"task_set", "plan", "shard", "index", "receipt"}, kinds
    for kind in sorted(kinds):
        for how in faults.CORRUPTIONS:
            choices = [item for item in items if item.kind == kind]
            item = choices[int(seeded.rng.integers(len(choices)))]
            original = item.path.read_bytes()
            done = faults.corrupt(item.path, how, seeded.rng)
            with pytest.raises((CorruptFileError, FileNotFoundError)):
                faults.read_with_product_reader(item)  # the reader's hash check refuses it
            findings = faults.verify_findings(db, paths, None)
            assert any(faults.names(f, item) for f in findings), (
                f"verify did not name {item.path} after: {done} {seeded}: {findings}"
            )
            item.path.write_bytes(original)  # the repair: its recorded bytes back
            assert faults.verify_findings(db, paths, None) == [], f"after repair of {done} {seeded}"


def test_an_inbox_file_changed_after_submit_is_refused(
    db: Engine, paths: FabricPaths, tiny_model_dir: Path, seeded: Seeded, tmp_path: Path
) -> None:
    model = str(tiny_model_dir)
    source = tmp_path / "set.jsonl"
    faults.write_token_tasks(source, 50, seeded.rng)
    stored = submit(source, paths.inbox, "set").path
    faults.corrupt(stored, str(seeded.rng.choice(["append", "flip", "truncate"])), seeded.rng)
    with pytest.raises(REFUSED) as refused:
        ingest_task_set(db, paths, "set", model_id=model, max_seq_len=16)
    assert stored.name in str(refused.value), f"the error names the file {seeded}: {refused.value}"
    with pytest.raises(LookupError):
        get_task_set(db, "set")  # nothing of the changed file was ingested

    # After a clean ingest, changing the kept file (set aside from the inbox) is refused as well.
    submit(source, paths.inbox, "again")
    ingest_task_set(db, paths, "again", model_id=model, max_seq_len=16)
    assert not (paths.inbox / "again.jsonl").exists()
    changed = set_aside_path(paths.inbox, "again", ".jsonl")
    faults.corrupt(changed, "append", seeded.rng)
    with pytest.raises(REFUSED, match="again"):
        ingest_task_set(db, paths, "again", model_id=model, max_seq_len=16)
