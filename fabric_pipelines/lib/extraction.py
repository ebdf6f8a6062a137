"""Extraction of one task set by one worker: claim a batch, run it through the runtime, write,
ack, repeat.

Throughput counts delivered work only: tokens of batches whose results were written and
acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy import Engine, func, select

from fabric_gpu.engines import Engine as ExtractionEngine
from fabric_gpu.engines import PaddedBatch
from fabric_gpu.runtime import BatchResult, open_runner
from fabric_pipelines.lib.broker.ledger import (
    LEASED,
    Lease,
    StaleLeaseError,
    claim_many,
    plan_shapes,
    report_failure,
)
from fabric_pipelines.lib.store.keys import model_id, task_set_id
from fabric_pipelines.lib.store.models import Batch
from fabric_pipelines.lib.store.shards import write_shard
from fabric_pipelines.lib.store.writer import BatchRows, GroupOutcome, WriteBehind
from fabric_pipelines.lib.tasks.store import flat_tokens


@dataclass
class ExtractionReport:
    batches_done: int = 0
    batches_failed: int = 0
    batches_requeued: int = 0
    stale_acks: int = 0
    items_done: int = 0
    rows_inserted: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0  # opening the runner: graph capture, first allocations
    ready_at: float = 0.0  # unix time the engine was ready for its first batch
    last_ack_at: float = 0.0  # unix time of the last acknowledged batch
    errors: list[str] = field(default_factory=list)
    runtime: dict[str, Any] = field(default_factory=dict)  # the runtime's own counters

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


def gather_padded(
    tokens: np.ndarray, offsets: np.ndarray, rows: np.ndarray, seq_len: int, pad_id: int
) -> PaddedBatch:
    """Scatter the items' tokens into a `[items, seq_len]` array padded with `pad_id`."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    positions = np.arange(seq_len, dtype=np.int64)[None, :]
    real = positions < lengths[:, None]
    ids = np.full((rows.size, seq_len), pad_id, dtype=np.int64)
    ids[real] = tokens[(starts[:, None] + positions)[real]]
    return PaddedBatch(input_ids=ids, lengths=lengths)


def run_worker(
    db: Engine,
    engine: ExtractionEngine,
    job: ExtractionJob,
    *,
    owner: str,
    lease_seconds: float = 600.0,
    max_attempts: int = 3,
    max_in_flight: int = 4,
    progress: ProgressFn | None = None,
    progress_every_s: float = 5.0,
    wait_for_others: bool = True,
) -> ExtractionReport:
    """Drain the plan's ledger through the runtime: claim, submit, and on each drained result
    write the rows and ack the lease (one transaction), until no batch is left. With
    `wait_for_others`, a worker also waits out leases held by other workers, and takes over
    those that expire (their holder died), so the plan ends with nothing queued or in flight."""
    tokens, offsets = flat_tokens(job.tasks)
    record_no = job.tasks.column("record_no").to_numpy()
    task_ids = job.tasks.column("id")  # Arrow: taken per batch only where ids are needed
    report = ExtractionReport()
    in_flight: dict[int, tuple[Lease, np.ndarray]] = {}
    started = last_progress = time.perf_counter()
    with db.begin() as conn:
        set_id = task_set_id(conn, job.task_set)
        model = model_id(conn, job.model_key)

    def written(outcome: GroupOutcome) -> None:  # the writer thread, after each commit
        for _batch, why in outcome.stale:
            report.stale_acks += 1
            report.errors.append(why)
        for batch in outcome.acked:
            lease = batch.lease
            report.batches_done += 1
            report.items_done += lease.item_count
            report.real_tokens += lease.real_tokens
            report.padded_tokens += lease.padded_tokens
        report.rows_inserted += outcome.inserted
        report.seconds = time.perf_counter() - started
        if outcome.acked:
            report.last_ack_at = time.time()

    def hidden_states_to_shard(batch: BatchRows) -> None:  # the writer thread, before the write
        pending = pending_hooks.pop(batch.lease.batch_no, None)
        if pending:
            hooks, rows = pending
            ids = task_ids.take(rows).combine_chunks()
            batch.shard = write_shard(
                job.shard_folder, ids, batch.n_tokens, hooks, engine.hidden_size
            )
            batch.layers = tuple(hooks)

    # batch no -> (hidden states per hook layer, task rows): from the drain to the writer
    pending_hooks: dict[int, tuple[dict[int, np.ndarray], np.ndarray]] = {}
    writer = WriteBehind(db, written, before_write=hidden_states_to_shard)

    def on_result(result: BatchResult) -> None:  # the runtime's drain thread
        lease, rows = in_flight.pop(result.batch_id)
        if result.error:
            _fail(db, job, lease, rows, record_no, task_ids, result.error, max_attempts, report)
            return
        assert result.pooled is not None
        if result.hooks:
            pending_hooks[lease.batch_no] = (result.hooks, rows)
        writer.put(
            BatchRows(
                lease=lease,
                task_set=job.task_set,
                task_set_id=set_id,
                model_key=job.model_key,
                model_id=model,
                record_no=record_no[rows],
                n_tokens=result.lengths,
                pooled=result.pooled,
            )
        )

    submitted = 0
    with db.connect() as conn:
        shapes = plan_shapes(conn, job.plan_id)
    if hasattr(engine, "shapes_for"):
        shapes = engine.shapes_for(shapes)
    try:
        with open_runner(
            engine,
            tokens,
            offsets,
            on_result,
            shapes=shapes,
            pad_token_id=job.pad_token_id,
            max_in_flight=max_in_flight,
        ) as runner:
            report.warmup_seconds = time.perf_counter() - started
            report.ready_at = time.time()
            claimed: list[Lease] = []
            while True:
                if not claimed:  # a few leases per transaction: claims stay off the critical path
                    claimed = claim_many(db, job.plan_id, owner, lease_seconds, max_in_flight)
                if not claimed:
                    runner.finish()  # everything in flight lands; failures may re-queue batches
                    writer.flush()  # ... and is acknowledged, so only others' leases remain
                    claimed = claim_many(db, job.plan_id, owner, lease_seconds, max_in_flight)
                    # Batches other workers hold may come back (a worker died: its lease expires).
                    while not claimed and wait_for_others and _others_hold_leases(db, job.plan_id):
                        time.sleep(min(1.0, lease_seconds / 4))
                        claimed = claim_many(db, job.plan_id, owner, lease_seconds, max_in_flight)
                    if not claimed:
                        break
                lease = claimed.pop(0)
                rows = job.order[lease.item_start : lease.item_start + lease.item_count]
                submitted += 1
                in_flight[submitted] = (lease, rows)
                runner.submit(submitted, rows, lease.seq_len)
                now = time.perf_counter()
                if progress is not None and now - last_progress >= progress_every_s:
                    last_progress = now
                    progress(report)
            report.runtime = runner.finish()
    finally:
        writer.close()  # everything queued is written (or the writer's error is raised here)
    report.seconds = time.perf_counter() - started
    return report


def _others_hold_leases(db: Engine, plan_id: str) -> bool:
    with db.connect() as conn:
        return (
            conn.execute(
                select(func.count())
                .select_from(Batch)
                .where(Batch.plan_id == plan_id, Batch.state == LEASED)
            ).scalar_one()
            > 0
        )


def _fail(
    db: Engine,
    job: ExtractionJob,
    lease: Lease,
    rows: np.ndarray,
    record_no: np.ndarray,
    task_ids: pa.ChunkedArray,
    message: str,
    max_attempts: int,
    report: ExtractionReport,
) -> None:
    report.errors.append(f"batch {lease.batch_no} (attempt {lease.attempts}): {message}")
    items = list(zip(record_no[rows].tolist(), task_ids.take(rows).to_pylist(), strict=True))
    try:
        state = report_failure(db, lease, message, max_attempts, items, job.task_set)
    except StaleLeaseError as stale:
        report.stale_acks += 1
        report.errors.append(str(stale))
        return
    if state == "failed":
        report.batches_failed += 1
    else:
        report.batches_requeued += 1
