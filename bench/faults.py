"""Hundreds of faults against the real product path, on SQLite and PostgreSQL.

    .venv/bin/python bench/faults.py --db both [--faults 200] [--seed S] [--url postgresql+psycopg://...]

Per database, in a fresh data root (and a scratch PostgreSQL database, dropped at the end),
rounds of: a task set of small token-id tasks (tiny batches with the hook layer on, so every batch
also stores a hidden-state shard) run by runs of two real worker processes (the CPU engine on
all-MiniLM-L6-v2), hit at random points by SIGKILL of a worker or of the whole run, SIGSTOP of a
worker past its 2 s lease, termination of the workers' PostgreSQL backends (on SQLite: its write
lock held by another connection past the runs' busy timeout), a second run of the same set at once, and an unwritable hidden-state folder; runs start again until the set is
finished (after ten faulty runs of a set, fault-free ones: the final recovery). Then the model's index is built, and stored files (task set, plans, shards, index files,
receipts) are truncated at random offsets, extended with garbage, bit-flipped or deleted: each
must be refused by the product's reader and named by `fabric verify`, then restored and verified
clean.

Prints one JSON object, per database {runs, faults, lost, duplicated, corrupted_undetected,
orphans, by_kind, ...}, and exits non-zero if any of lost, duplicated, corrupted_undetected,
orphans, acked_without_file or unclean_after_recovery is not zero. `lost` counts tasks neither
completed nor failed after the final recovery; `duplicated` result or failure rows beyond one per
key, and tasks both completed and failed; `corrupted_undetected` corruptions the product's reader
accepted or `fabric verify` did not name; `orphans` worker processes alive 5 s after their run
returned; `acked_without_file` completed batches without their hidden-state shard;
`unclean_after_recovery` verify's findings once a set is finished; `failed_for_the_database` runs
that ended on a database error instead of riding it out (lib/core/retry.py). The seed (printed) replays
the same choices; timings on a shared machine make the runs differ in detail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from sqlalchemy import Engine
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fabric_testing, beside the product
from fabric_gpu.model import DEFAULT_MODEL_ID
from fabric_pipelines.lib.core.files import CorruptFileError, write_bytes
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.build import IndexSpec
from fabric_pipelines.lib.index.publish import build_and_publish
from fabric_pipelines.lib.index.staleness import latest_receipt
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_testing import fault_drill as faults
from fabric_testing.scratch_db import scratch_database

LEASE_S = 2.0
HEARTBEAT_S = 0.5
ORPHAN_GRACE_S = 5.0
# Runs of one set hit by faults; then fault-free runs (the final recovery) must finish it.
FAULTY_RUNS = 10
RECOVERY_RUNS = 3
# Process faults, by weight; each run gets one every FAULT_GAP_S seconds on average.
PROCESS_FAULTS = {
    "kill_worker": 3,
    "stop_worker": 2,
    "kill_run": 1,
    "terminate_backends": 4,  # PostgreSQL only
    "lock_database": 4,  # SQLite only: the write lock held past the runs' busy timeout
    "second_run": 1,
    "unwritable_output": 1,
}
FAULT_GAP_S = (0.2, 1.2)
FILE_SHARE = 0.6  # of all faults, about this share are stored-file faults (cheap)
MUST_BE_ZERO = (
    "lost",
    "duplicated",
    "corrupted_undetected",
    "orphans",
    "acked_without_file",
    "unclean_after_recovery",
    "failed_for_the_database",
)
# The runs' SQLite busy timeout here: a lock held longer fails "database is locked" (retried).
BUSY_TIMEOUT_MS = 250
LOCK_S = (0.1, 2.0)
# A run that ended on one of these lost its database and did not ride it out (lib/core/retry.py).
DATABASE_ERROR = re.compile(
    r"GaveUpRetrying|OperationalError|InterfaceError|database is locked|terminating connection|"
    r"server closed the connection|connection (is )?closed"
)
ERROR_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception|Exit|GaveUp\w*)\b")


class Campaign:
    def __init__(
        self, db: Engine, db_url: str, paths: FabricPaths, args: argparse.Namespace, seed: int
    ) -> None:
        self.db, self.db_url, self.paths, self.args = db, db_url, paths, args
        self.rng = np.random.default_rng(seed)
        self.tally = faults.Tally()
        self.acked_without_file = 0
        self.reader_accepted = 0
        self.stale_acks = 0
        self.killer = faults.BackendKiller(db_url) if db.dialect.name == "postgresql" else None
        self.manifest = faults.fault_manifest(DEFAULT_MODEL_ID, args.items, (-1,))
        self.bar = tqdm(total=args.faults, desc=db.dialect.name, unit="fault")
        self.sets: list[str] = []
        self.run_errors: dict[str, int] = {}  # how failed runs ended (most by a fault, by design)
        self.failed_for_the_database = 0  # runs that ended on a database error (none may)
        self.unclean = 0

    def process_faults(self) -> int:
        return sum(n for kind, n in self.tally.by_kind.items() if not kind.startswith("file:"))

    def fault(self, kind: str) -> None:
        self.tally.count(kind)
        self.bar.update(1)

    # --- process faults, during runs

    def run_set(self, name: str, manifest_path: Path) -> None:
        settings = faults.RunSettings(
            name, manifest_path, workers=2, lease_seconds=LEASE_S, heartbeat_seconds=HEARTBEAT_S
        )
        only = {"terminate_backends": self.killer is not None, "lock_database": self.killer is None}
        kinds = [k for k in PROCESS_FAULTS if only.get(k, True)]
        weights = np.array([PROCESS_FAULTS[k] for k in kinds], dtype=float)
        weights /= weights.sum()
        process_budget = int(self.args.faults * (1 - FILE_SHARE))
        for attempt in range(FAULTY_RUNS + RECOVERY_RUNS):
            if attempt > 0 and faults.outcome(self.db, name).lost == 0:
                return  # every task completed or failed
            faulty = attempt < FAULTY_RUNS
            runs = [self.start(settings, f"{name}-{attempt}")]
            while any(run.running() for run in runs):
                self.pause(runs, float(self.rng.uniform(*FAULT_GAP_S)))
                live = [run for run in runs if run.running()]
                if not live or not faulty or self.process_faults() >= process_budget:
                    continue
                kind = str(self.rng.choice(kinds, p=weights))
                if self.inject(kind, live[int(self.rng.integers(len(live)))], runs, settings):
                    self.fault(kind)
            for run in runs:
                self.finished(run)
        self.tally.notes.append(
            f"{name}: not finished by {RECOVERY_RUNS} fault-free runs after {FAULTY_RUNS} faulty ones"
        )

    def start(self, settings: faults.RunSettings, label: str) -> faults.Run:
        self.tally.runs += 1
        return faults.Run(self.paths, self.db_url, settings, self.paths.root / f"{label}.log")

    def pause(self, runs: list[faults.Run], seconds: float) -> None:
        """Wait, noting each run's workers as they appear (for the orphan count)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(run.running() for run in runs):
            for run in runs:
                if run.running():
                    run.workers()
            time.sleep(0.05)

    def inject(
        self, kind: str, run: faults.Run, runs: list[faults.Run], settings: faults.RunSettings
    ) -> bool:
        workers = run.workers()
        if kind == "kill_worker":
            return bool(workers) and faults.kill(workers[int(self.rng.integers(len(workers)))])
        if kind == "stop_worker":
            if not workers:
                return False
            return faults.stop_past_lease(workers[int(self.rng.integers(len(workers)))], LEASE_S)
        if kind == "terminate_backends":
            assert self.killer is not None
            return self.killer.terminate(self.rng) > 0
        if kind == "lock_database":
            with faults.locked_database(self.paths.sqlite_path):
                self.pause(runs, float(self.rng.uniform(*LOCK_S)))
            return True
        if kind == "kill_run":
            run.kill()
            return True
        if kind == "second_run":
            if len(runs) > 1:
                return False
            runs.append(self.start(settings, f"{settings.task_set}-also-{self.tally.runs}"))
            return True
        if kind == "unwritable_output":
            with faults.unwritable_folder(self.paths.shards):
                self.pause(runs, float(self.rng.uniform(1.0, 4.0)))
            return True
        raise ValueError(kind)

    def finished(self, run: faults.Run) -> None:
        if run.wait() != 0:
            errors = [line for line in run.output().splitlines() if ERROR_LINE.match(line)]
            last = errors[-1][:160] if errors else f"exit code {run.process.returncode}"
            self.run_errors[last] = self.run_errors.get(last, 0) + 1
            if any(DATABASE_ERROR.search(line) for line in errors):
                self.failed_for_the_database += 1
                self.tally.notes.append(f"run {run.pid} failed on the database: {last}")
        mine = run.orphans(ORPHAN_GRACE_S)
        if mine:
            self.tally.orphans += len(mine)
            self.tally.notes.append(f"run {run.pid}: workers {mine} outlived it")

    # --- file faults, after a set is finished and indexed

    def build_index(self) -> None:
        with self.db.connect() as conn:
            latest = latest_receipt(conn, self.manifest.model_key)
        build_and_publish(
            self.db,
            model_key=self.manifest.model_key,
            model={
                "model_id": self.manifest.model_id,
                "weights_sha256": self.manifest.weights_sha256,
                "pooling": "mean",
                "layer": "pooled",
            },
            spec=IndexSpec(factory="auto", shards=2, recall_queries=100),
            index_folder=self.paths.indexes,
            receipt_folder=self.paths.receipts,
            inputs=[],
            previous=latest[1] if latest else None,
        )

    def file_faults(self, name: str, count: int) -> None:
        items = faults.stored_files(self.db, self.paths, name)
        by_kind: dict[str, list[faults.StoredItem]] = {}
        for item in items:
            by_kind.setdefault(item.kind, []).append(item)
        kinds = sorted(by_kind)
        for _ in range(count):
            choices = by_kind[kinds[int(self.rng.integers(len(kinds)))]]
            item = choices[int(self.rng.integers(len(choices)))]
            how = faults.CORRUPTIONS[int(self.rng.integers(len(faults.CORRUPTIONS)))]
            self.one_file_fault(name, item, how)
            self.fault(f"file:{item.kind}:{how}")

    def one_file_fault(self, name: str, item: faults.StoredItem, how: str) -> None:
        original = item.path.read_bytes()
        done = faults.corrupt(item.path, how, self.rng)
        if item.path.exists() and item.path.read_bytes() == original:
            done += " (same bytes: nothing to detect)"  # an empty truncation of an empty file
        scope = name if item.kind in ("task_set", "plan", "shard") else None
        try:
            faults.read_with_product_reader(item)
            self.reader_accepted += 1
            self.tally.corrupted_undetected += 1
            self.tally.notes.append(f"reader accepted {item.path} after: {done}")
        except (CorruptFileError, OSError):
            pass
        findings = faults.verify_findings(self.db, self.paths, scope)
        if not any(faults.names(f, item) for f in findings):
            self.tally.corrupted_undetected += 1
            self.tally.notes.append(f"verify did not name {item.path} after: {done}")
        write_bytes(item.path, original)  # the repair: the file's recorded bytes back
        still = [
            f for f in faults.verify_findings(self.db, self.paths, scope) if faults.names(f, item)
        ]
        if still:
            self.unclean += len(still)
            self.tally.notes.append(f"verify still names {item.path} once restored: {still[:2]}")

    # --- one round and the checks

    def round(self, n: int) -> None:
        name = f"set{n}"
        manifest_path = faults.prepare_task_set(
            self.db, self.paths, name, self.args.tasks, self.manifest, self.rng
        )
        self.sets.append(name)
        self.run_set(name, manifest_path)
        self.acked_without_file += faults.acked_without_shard(self.db, name)
        after = faults.verify_findings(self.db, self.paths, name)  # after the final recovery
        if after:
            self.unclean += len(after)
            self.tally.notes.append(f"{name}: verify after recovery: {after[:3]}")
        if faults.outcome(self.db, name).lost == 0:
            self.build_index()
        files = self.tally.faults - self.process_faults()
        want = int(FILE_SHARE / (1 - FILE_SHARE) * self.process_faults()) - files
        if self.process_faults() >= int(self.args.faults * (1 - FILE_SHARE)):
            want = self.args.faults - self.tally.faults  # the process budget is spent
        self.file_faults(name, max(0, min(want, self.args.faults - self.tally.faults)))

    def summary(self, seconds: float) -> dict[str, Any]:
        for name in self.sets:
            result = faults.outcome(self.db, name)
            self.tally.lost += result.lost
            self.tally.duplicated += result.duplicated + result.both
        self.tally.orphans += len(faults.wait_for_orphans(self.paths.root, 0))
        for report in (self.paths.root / "workers").rglob("worker-*.json"):
            self.stale_acks += int(json.loads(report.read_text()).get("stale_acks", 0))
        final = faults.verify_findings(self.db, self.paths, None)
        if self.killer is not None:
            self.killer.close()
        self.bar.close()
        t = self.tally
        return {
            "runs": t.runs,
            "faults": t.faults,
            "lost": t.lost,
            "duplicated": t.duplicated,
            "corrupted_undetected": t.corrupted_undetected,
            "orphans": t.orphans,
            "acked_without_file": self.acked_without_file,
            "unclean_after_recovery": self.unclean,
            "failed_for_the_database": self.failed_for_the_database,
            "reader_accepted_corrupt": self.reader_accepted,
            "stale_acks_in_worker_reports": self.stale_acks,  # of workers that exited normally
            "task_sets": len(self.sets),
            "tasks": len(self.sets) * self.args.tasks,
            "verify_findings_at_end": final[:10],
            "by_kind": dict(sorted(t.by_kind.items())),
            "run_errors": dict(sorted(self.run_errors.items(), key=lambda kv: -kv[1])[:10]),
            "notes": t.notes[:20],
            "seconds": round(seconds, 1),
        }


@contextmanager
def database(kind: str, root: Path, server_url: str) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{root / 'fabric.db'}"
        return
    with scratch_database(server_url, "fabric_faults") as url:
        yield url


def bench(kind: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"fabric-faults-{kind}-") as tmp:
        paths = FabricPaths(Path(tmp) / "fabric").ensure()
        with database(kind, paths.root, args.url) as url:
            db = make_engine(url)
            create_schema(db)
            campaign = Campaign(db, url, paths, args, seed)
            try:
                n = 0
                while campaign.tally.faults < args.faults:
                    campaign.round(n)
                    n += 1
                return {"db": kind, "seed": seed, **campaign.summary(time.perf_counter() - started)}
            finally:
                faults.wait_for_orphans(paths.root, 0)
                db.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--faults", type=int, default=200, help="faults per database")
    parser.add_argument("--seed", type=int, help="default: from the clock (printed)")
    parser.add_argument("--tasks", type=int, default=1500, help="tasks per round")
    parser.add_argument("--items", type=int, default=4, help="tasks per batch")
    parser.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    os.environ["FABRIC_SQLITE_BUSY_TIMEOUT_MS"] = str(BUSY_TIMEOUT_MS)  # the runs inherit it
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    print(f"seed {seed} (rerun the same faults with --seed {seed})", file=sys.stderr)
    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    results = {kind: bench(kind, args, seed) for kind in kinds}
    print(json.dumps(results, indent=2))
    bad = [
        f"{kind}: {key} {result[key]}"
        for kind, result in results.items()
        for key in MUST_BE_ZERO
        if result[key]
    ]
    if bad:
        print("FAILED: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
