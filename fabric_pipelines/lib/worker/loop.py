"""Extraction of one task set by one worker: claim a batch, run it through the runtime, write,
ack, repeat.

Throughput counts delivered work only: tokens of batches whose results were written and
acknowledged. The worker's leases are short and renewed by a heartbeat thread while it holds
them; every database call on this path rides out transient errors (lib/core/retry.py). A batch's
hidden-state shard is read back and checked against its hash before the batch is acked; one that
does not verify is failed back to the ledger and run again.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
from sqlalchemy import Engine, func, select

from fabric_gpu.engines import Engine as ExtractionEngine
from fabric_gpu.engines.identity import identity_of
from fabric_gpu.runtime import BatchResult, open_runner
from fabric_pipelines.lib.broker.claim_ahead import ClaimAhead
from fabric_pipelines.lib.broker.ledger import (
    DEFAULT_LEASE_SECONDS,
    LEASED,
    Lease,
    StaleLeaseError,
    claim_many,
    hand_back,
    heartbeat_interval,
    plan_shapes,
    renew_leases,
    report_failure,
    superseded_by,
    superseded_message,
)
from fabric_pipelines.lib.core.files import CorruptFileError, verify_sha256
from fabric_pipelines.lib.core.retry import DEFAULT_BUDGET_S, GaveUpRetrying, retry
from fabric_pipelines.lib.records.calibration import calibrate_engine
from fabric_pipelines.lib.results.hidden_states import write_shard
from fabric_pipelines.lib.results.writer import (
    BatchFailed,
    BatchRows,
    GroupOutcome,
    RejectBatch,
    WriteBehind,
)
from fabric_pipelines.lib.store.keys import model_id, task_set_id
from fabric_pipelines.lib.store.models import Batch
from fabric_pipelines.lib.tasks.arrow_files import flat_tokens

T = TypeVar("T")

# Claims ahead of the submit loop (broker/claim_ahead.py): a chunk of twice as many batches as
# are in flight per transaction (on SQLite each claim waits its turn for the write lock: half as
# many turns as chunks of one in-flight's worth), ready for this long at the pace batches are
# taken (~25 MiniLM batches on an H200, ~6 BERT-base ones), never more than this many.
CLAIM_CHUNK_IN_FLIGHTS = 2
CLAIM_AHEAD_S = 0.25
CLAIM_AHEAD_MAX_BATCHES = 64


@dataclass
class ExtractionReport:
    batches_done: int = 0
    batches_failed: int = 0
    batches_requeued: int = 0
    stale_acks: int = 0
    items_done: int = 0
    # Rows the engine returned, retried batches included: what really reached it (the planner's
    # counts say what was meant to).
    engine_items: int = 0
    rows_inserted: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0  # opening the runner: graph capture, first allocations
    ready_at: float = 0.0  # unix time the engine was ready for its first batch
    last_ack_at: float = 0.0  # unix time of the last acknowledged batch
    # Another run re-planned the set while this one ran: the plan that took over, and why.
    superseded_by: str = ""
    superseded: str = ""
    errors: list[str] = field(default_factory=list)
    runtime: dict[str, Any] = field(default_factory=dict)  # the runtime's own counters
    # The GPU's seconds running batches, and from its first batch's start to its last batch's
    # end (the runtime's timing marks; 0 on the CPU engine): what the worker's report carries.
    gpu_busy_seconds: float = 0.0
    gpu_span_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class ExtractionJob:
    task_set: str
    plan_id: str
    model_key: str
    tasks: pa.Table  # the stored task set (record_no, id, token_ids)
    order: np.ndarray  # the plan's item order (task rows)
    shard_folder: Path
    pad_token_id: int = 0


ProgressFn = Callable[[ExtractionReport], None]


class _Stopped(Exception):
    """The heartbeat, or the claim-ahead thread, was told to stop while it waited to retry."""


class LeaseHeartbeat:
    """Renews the leases its worker holds, every `every_s` seconds, in one fenced statement, so
    a batch slower than its lease is not taken over while its worker lives (a stopped or dead
    worker stops renewing, and its leases expire). `hold` leases when claimed; `release` them
    once acked, failed back or found stale. A renewal that gives up (the database stayed away for
    a whole period) is noted and tried again next period; any other error is kept in `error`."""

    def __init__(self, db: Engine, lease_seconds: float, every_s: float) -> None:
        self._db, self._lease_seconds, self._every = db, lease_seconds, every_s
        self._held: dict[Lease, None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.renewals = 0
        self.missed: list[str] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="fabric-lease-heartbeat", daemon=True
        )

    def __enter__(self) -> LeaseHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def hold(self, leases: list[Lease]) -> None:
        with self._lock:
            self._held.update(dict.fromkeys(leases))

    def release(self, lease: Lease) -> None:
        with self._lock:
            self._held.pop(lease, None)

    def _renew(self, leases: list[Lease]) -> list[Lease]:
        if self._stop.is_set():
            raise _Stopped
        return renew_leases(self._db, leases, self._lease_seconds)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            with self._lock:
                leases = list(self._held)
            if not leases:
                continue
            try:
                renewed = retry(
                    f"renewing {len(leases)} lease(s)",
                    functools.partial(self._renew, leases),
                    budget_s=self._every,
                    sleep=self._stop.wait,
                )
            except _Stopped:
                return
            except GaveUpRetrying as error:
                self.missed.append(str(error))
                continue
            except BaseException as error:
                self.error = error
                return
            self.renewals += 1
            lost = set(leases).difference(renewed)  # taken over or superseded: not ours now
            with self._lock:
                for lease in lost:
                    self._held.pop(lease, None)


def run_worker(
    db: Engine,
    engine: ExtractionEngine,
    job: ExtractionJob,
    *,
    owner: str,
    lease_seconds: float = DEFAULT_LEASE_SECONDS,
    heartbeat_seconds: float | None = None,
    max_attempts: int = 3,
    max_in_flight: int = 4,
    progress: ProgressFn | None = None,
    progress_every_s: float = 5.0,
    wait_for_others: bool = True,
    retry_budget_s: float = DEFAULT_BUDGET_S,
) -> ExtractionReport:
    """Drain the plan's ledger through the runtime: claim, submit, and on each drained result
    write the rows and ack the lease (one transaction), until no batch is left. With
    `wait_for_others`, a worker also waits out leases held by other workers, and takes over
    those that expire (their holder died), so the plan ends with nothing queued or in flight.
    A plan superseded meanwhile (another run re-planned the set) ends the worker early, saying
    so in `report.superseded`."""
    settings = LoopSettings(
        owner=owner, lease_seconds=lease_seconds,
        heartbeat_seconds=heartbeat_interval(lease_seconds, heartbeat_seconds),
        max_attempts=max_attempts, max_in_flight=max_in_flight, progress=progress,
        progress_every_s=progress_every_s, wait_for_others=wait_for_others,
        retry_budget_s=retry_budget_s,
    )  # fmt: skip
    return WorkerRun(db, engine, job, settings).run()


@dataclass(frozen=True)
class LoopSettings:
    owner: str
    lease_seconds: float
    heartbeat_seconds: float
    max_attempts: int
    max_in_flight: int
    progress: ProgressFn | None
    progress_every_s: float
    wait_for_others: bool
    retry_budget_s: float


class WorkerRun:
    """One worker's extraction of one plan, as one object that owns the run.

    Three threads take part, each in its own methods:
    - the submit loop (`run`, the caller's thread) claims batches and submits them;
    - the runtime's drain thread (`_on_result`) turns each result into one event for the writer:
      `BatchRows` (done) or `BatchFailed`; it touches nothing else;
    - the writer thread (result_writer.WriteBehind) writes each batch's hidden-state file
      (`_write_hidden_states`) and rows, acks, and then reports the group (`_written`): it acks,
      fails batches back to the ledger and counts them in the report, the only thread that does.
    """

    def __init__(
        self, db: Engine, engine: ExtractionEngine, job: ExtractionJob, settings: LoopSettings
    ) -> None:
        self.db, self.engine, self.job, self.settings = db, engine, job, settings
        self.report = ExtractionReport()
        tokens, self.offsets = flat_tokens(job.tasks)
        # Batches are gathered from a private copy, not from the memory-mapped task file: on
        # the H200 machine MiniLM's pulling window (host-bound) took 12.2 s with this copy and
        # 17-18 s after it was dropped (other changes landed between those runs too). The copy:
        # ~0.1 s/GB.
        self.tokens = np.array(tokens, copy=True)
        self.record_no = job.tasks.column("record_no").to_numpy()
        self.task_ids = job.tasks.column("id")  # Arrow: taken per batch only where ids are needed
        # Submitted and not yet drained: the submit loop adds, the drain thread takes.
        self.in_flight: dict[int, tuple[Lease, np.ndarray]] = {}
        self.heartbeat = LeaseHeartbeat(db, settings.lease_seconds, settings.heartbeat_seconds)
        self.started = time.perf_counter()
        self.set_id, self.model_id = self._db_call(
            f"looking up task set {job.task_set!r}", lambda: _keys(db, job)
        )
        self.writer: WriteBehind | None = None
        self.engine_identity = identity_of(engine)

    def _db_call(self, operation: str, attempt: Callable[[], T]) -> T:
        return retry(operation, attempt, budget_s=self.settings.retry_budget_s)

    # ---- the drain thread --------------------------------------------------------------------

    def _on_result(self, result: BatchResult) -> None:
        lease, rows = self.in_flight.pop(result.batch_id)
        assert self.writer is not None
        if result.error:
            self.writer.put(BatchFailed(lease, rows, result.error))
            return
        assert result.pooled is not None
        self.report.engine_items += len(result.pooled)
        self.writer.put(
            BatchRows(
                lease=lease,
                task_set=self.job.task_set,
                task_set_id=self.set_id,
                model_key=self.job.model_key,
                model_id=self.model_id,
                record_no=self.record_no[rows],
                n_tokens=result.lengths,
                pooled=result.pooled,
                task_rows=rows,
                hidden_states=result.hooks or None,
                engine=self.engine_identity,
            )
        )

    # ---- the writer thread -------------------------------------------------------------------

    def _write_hidden_states(self, batch: BatchRows) -> None:
        """Before the batch's rows are written: its hidden states to their shard file, read back
        and checked (an ack promises a file that verifies)."""
        if not batch.hidden_states:
            return
        assert batch.task_rows is not None
        ids = self.task_ids.take(batch.task_rows).combine_chunks()
        shard = write_shard(
            self.job.shard_folder, ids, batch.n_tokens, batch.hidden_states,
            self.engine.hidden_size,
        )  # fmt: skip
        try:
            verify_sha256(shard.path, shard.sha256, "hidden-state shard", "its batch runs again")
        except (CorruptFileError, FileNotFoundError) as error:
            shard.path.unlink(missing_ok=True)
            raise RejectBatch(str(error)) from error
        batch.shard = shard
        batch.layers = tuple(batch.hidden_states)
        batch.hidden_states = None  # written: let the arrays go

    def _written(self, outcome: GroupOutcome) -> None:
        """After each commit of a group: the report, and failures back to the ledger."""
        report = self.report
        for batch, why in outcome.stale:
            self.heartbeat.release(batch.lease)
            report.stale_acks += 1
            report.errors.append(why)
        for batch in outcome.acked:
            lease = batch.lease
            self.heartbeat.release(lease)
            report.batches_done += 1
            report.items_done += lease.item_count
            report.real_tokens += lease.real_tokens
            report.padded_tokens += lease.padded_tokens
        for batch, why in outcome.rejected:  # not acked: back to the ledger, to run again
            assert batch.task_rows is not None
            self._fail(batch.lease, batch.task_rows, why)
        for failed in outcome.failed:  # the engine failed these batches
            self._fail(failed.lease, failed.task_rows, failed.error)
        report.rows_inserted += outcome.inserted
        report.seconds = time.perf_counter() - self.started
        if outcome.acked:
            report.last_ack_at = time.time()

    def _fail(self, lease: Lease, rows: np.ndarray, message: str) -> None:
        self.heartbeat.release(lease)
        report, job = self.report, self.job
        report.errors.append(f"batch {lease.batch_no} (attempt {lease.attempts}): {message}")
        items = list(
            zip(self.record_no[rows].tolist(), self.task_ids.take(rows).to_pylist(), strict=True)
        )
        try:
            state = self._db_call(
                f"reporting the failure of batch {lease.batch_no} of plan {lease.plan_id}",
                lambda: report_failure(
                    self.db, lease, message, self.settings.max_attempts, items, job.task_set
                ),
            )
        except StaleLeaseError as stale:
            report.stale_acks += 1
            report.errors.append(str(stale))
            return
        if state == "failed":
            report.batches_failed += 1
        else:
            report.batches_requeued += 1

    # ---- the submit loop ---------------------------------------------------------------------

    def _claim(self, count: int | None = None, stop: threading.Event | None = None) -> list[Lease]:
        """Lease up to `count` batches. With `stop` (the claim-ahead thread's), waits between
        retries end, and no attempt is made, once it is set: the worker is stopping."""
        if self.heartbeat.error is not None:
            raise self.heartbeat.error
        wanted = self.settings.max_in_flight if count is None else count

        def attempt() -> list[Lease]:
            if stop is not None and stop.is_set():
                raise _Stopped
            return claim_many(
                self.db, self.job.plan_id, self.settings.owner, self.settings.lease_seconds,
                wanted,
            )  # fmt: skip

        leases = retry(
            f"claiming batches of plan {self.job.plan_id}",
            attempt,
            budget_s=self.settings.retry_budget_s,
            sleep=stop.wait if stop is not None else time.sleep,
        )
        self.heartbeat.hold(leases)
        return leases

    def _others_hold_leases(self) -> bool:
        return (
            self._db_call(
                f"reading the leases of plan {self.job.plan_id}", lambda: _leased(self.db, self.job)
            )
            > 0
        )

    def _hand_back_unused(self, leases: list[Lease]) -> None:
        """Leases claimed ahead that never ran (the loop ended early): back to the queue now,
        not after their lease runs out, and without spending one of their attempts."""
        for lease in leases:
            self.heartbeat.release(lease)
        try:
            self._db_call(
                f"handing back {len(leases)} unused lease(s)", lambda: hand_back(self.db, leases)
            )
        except Exception as error:  # they still come back when their lease runs out
            self.report.errors.append(f"could not hand back {len(leases)} unused lease(s): {error}")

    def run(self) -> ExtractionReport:
        job, settings, report = self.job, self.settings, self.report
        shapes = self._db_call(
            f"reading the shapes of plan {job.plan_id}", lambda: _shapes(self.db, job)
        )
        if hasattr(self.engine, "shapes_for"):
            shapes = self.engine.shapes_for(shapes)
        # An int8 engine quantises over its key's recorded range (others: nothing to do).
        self._db_call(
            f"calibrating int8 for {job.model_key}",
            lambda: calibrate_engine(
                self.db, self.engine, job.model_key, self.tokens, self.offsets,
                f"task set {job.task_set}", job.pad_token_id,
            ),
        )  # fmt: skip
        with self.heartbeat:
            self.writer = WriteBehind(
                self.db, self._written, before_write=self._write_hidden_states
            )
            try:
                with open_runner(
                    self.engine,
                    self.tokens,
                    self.offsets,
                    self._on_result,
                    shapes=shapes,
                    pad_token_id=job.pad_token_id,
                    max_in_flight=settings.max_in_flight,
                    # For the run's efficiency record: the GPU's busy fraction (lib/records/efficiency.py).
                    measure_gpu_time=True,
                ) as runner:
                    report.warmup_seconds = time.perf_counter() - self.started
                    report.ready_at = time.time()
                    self._submit_all(runner, self.writer)
                    report.runtime = runner.finish().as_dict()
                    report.gpu_busy_seconds = float(report.runtime.get("gpu_busy_seconds", 0.0))
                    report.gpu_span_seconds = float(report.runtime.get("gpu_span_seconds", 0.0))
            finally:
                self.writer.close()  # everything queued is written (or its error is raised)
        report.errors.extend(self.heartbeat.missed)
        if self.heartbeat.error is not None:
            raise self.heartbeat.error
        by = self._db_call(
            f"checking whether plan {job.plan_id} was superseded",
            lambda: _superseded_by(self.db, job),
        )
        if by is not None:
            report.superseded_by = by
            report.superseded = superseded_message(job.plan_id, by)
            report.errors.append(report.superseded)
        report.seconds = time.perf_counter() - self.started
        return report

    def _submit_all(self, runner: Any, writer: WriteBehind) -> None:
        """Claim and submit until the plan has nothing left for this worker."""
        job, settings = self.job, self.settings
        # Claims run ahead on their own thread (broker/claim_ahead.py).
        stop_claiming = threading.Event()
        chunk = CLAIM_CHUNK_IN_FLIGHTS * settings.max_in_flight
        ahead = ClaimAhead(
            lambda count: self._claim(count, stop_claiming),
            chunk=chunk,
            max_depth=max(chunk, CLAIM_AHEAD_MAX_BATCHES),
            ahead_s=CLAIM_AHEAD_S,
            stopping=stop_claiming,
        )
        claimed: list[Lease] = []  # the end of the plan's claims, made here
        submitted = 0
        last_progress = self.started
        try:
            while True:
                if self.heartbeat.error is not None:  # leases no longer renewed: stop
                    raise self.heartbeat.error
                lease = claimed.pop(0) if claimed else ahead.take()
                if lease is None:  # the plan's queue ran empty once
                    claimed = self._claim()  # re-queued failures: no need to drain first
                if lease is None and not claimed:
                    runner.finish()  # everything in flight lands; failures re-queue
                    writer.flush()  # ... and is acknowledged: others' leases remain
                    claimed = self._claim()
                    # Batches others hold may come back (a worker died: its lease expires).
                    while not claimed and settings.wait_for_others and self._others_hold_leases():
                        time.sleep(min(1.0, settings.lease_seconds / 4))
                        claimed = self._claim()
                    if not claimed:
                        break
                if lease is None:
                    lease = claimed.pop(0)
                rows = job.order[lease.item_start : lease.item_start + lease.item_count]
                submitted += 1
                self.in_flight[submitted] = (lease, rows)
                runner.submit(submitted, rows, lease.seq_len)
                now = time.perf_counter()
                if (
                    settings.progress is not None
                    and now - last_progress >= settings.progress_every_s
                ):
                    last_progress = now
                    settings.progress(self.report)
        finally:
            unused = ahead.close() + claimed
            if unused:
                self._hand_back_unused(unused)


def _keys(db: Engine, job: ExtractionJob) -> tuple[int, int]:
    with db.begin() as conn:
        return task_set_id(conn, job.task_set), model_id(conn, job.model_key)


def _shapes(db: Engine, job: ExtractionJob) -> list[tuple[int, int]]:
    with db.connect() as conn:
        return plan_shapes(conn, job.plan_id)


def _superseded_by(db: Engine, job: ExtractionJob) -> str | None:
    with db.connect() as conn:
        return superseded_by(conn, job.task_set, job.plan_id)


def _leased(db: Engine, job: ExtractionJob) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(Batch)
                .where(Batch.plan_id == job.plan_id, Batch.state == LEASED)
            ).scalar_one()
        )
