"""How well an extraction step fed its engine, and where the rest of its wall time went: the
record a user reads when a run was slower than `fabric plan` predicted.

The step's wall time splits, on the wall clock, into:
  before the engine   step start to the first worker ready for batches (worker start-up, model
                      load, graph capture, waiting for the plan: a warm pool worker has most of
                      this done before the step starts);
  engine              the pulling window: the first worker ready to the last batch acknowledged
                      (what `fabric plan` predicts, and what engine_speeds records);
  after the engine    the last acknowledgement to the workers done (their last writes, closing);
  settle, verify      the step's own work after the workers (PostgreSQL's settle; the check);
  other               the rest (the step's own start-up and bookkeeping).
On the GPU the runtime also times each batch on the compute stream (a timing mark after its
doorbell wait and one after its last output is published): the GPU busy fraction is the sum of
those batch times over the GPU's span, its first batch's start to its last batch's end; the rest
of the span the GPU waited for work. Summed over the GPU workers; none on the CPU engine.

Each step's record is kept (table extraction_runs, `record_run`) and `fabric status` shows the
set's last one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select

from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.store.keys import model_id, task_set_id
from fabric_pipelines.lib.store.models import ExtractionRun, TaskSet


@dataclass(frozen=True)
class Efficiency:
    real_tokens: int
    padded_tokens: int
    step_seconds: float
    before_engine_seconds: float
    engine_seconds: float
    after_engine_seconds: float
    settle_seconds: float
    verify_seconds: float
    gpu_busy_seconds: float = 0.0  # summed over GPU workers; 0 where no GPU ran
    gpu_span_seconds: float = 0.0

    @property
    def gpu_busy_fraction(self) -> float | None:
        """The part of the GPU's span it ran batches (None: no GPU timing in this step)."""
        if self.gpu_span_seconds <= 0:
            return None
        return min(1.0, self.gpu_busy_seconds / self.gpu_span_seconds)

    @property
    def other_seconds(self) -> float:
        accounted = (
            self.before_engine_seconds + self.engine_seconds + self.after_engine_seconds
            + self.settle_seconds + self.verify_seconds
        )  # fmt: skip
        return max(0.0, self.step_seconds - accounted)

    @property
    def real_tokens_per_s(self) -> float:
        return self.real_tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def engine_real_tokens_per_s(self) -> float:
        return self.real_tokens / self.engine_seconds if self.engine_seconds > 0 else 0.0

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens > 0 else 0.0

    @property
    def engine_share(self) -> float:
        """The part of the step's wall time the engine was pulling batches."""
        return self.engine_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def as_mapping(self) -> dict[str, Any]:
        return {
            "real_tokens_per_s": round(self.real_tokens_per_s, 1),
            "engine_real_tokens_per_s": round(self.engine_real_tokens_per_s, 1),
            "padding_fraction": round(self.padding_fraction, 5),
            "engine_share": round(self.engine_share, 4),
            "gpu_busy_fraction": (
                None if self.gpu_busy_fraction is None else round(self.gpu_busy_fraction, 4)
            ),
            "seconds": {
                "step": round(self.step_seconds, 3),
                "before_engine": round(self.before_engine_seconds, 3),
                "engine": round(self.engine_seconds, 3),
                "after_engine": round(self.after_engine_seconds, 3),
                "settle": round(self.settle_seconds, 3),
                "verify": round(self.verify_seconds, 3),
                "other": round(self.other_seconds, 3),
            },
            # Not parts of the step: the GPU ran these inside the engine's window.
            "gpu_seconds": {
                "busy": round(self.gpu_busy_seconds, 3),
                "span": round(self.gpu_span_seconds, 3),
            },
        }

    def sentence(self) -> str:
        """One line for a person: the speed, the engine's share, and where the rest went."""
        if self.engine_seconds <= 0:
            return (
                f"no batch ran in this step ({self.step_seconds:.2f} s: the set's work was "
                "already done or failed)"
            )
        busy = self.gpu_busy_fraction
        gpu = (
            ""
            if busy is None
            else f", the GPU busy {busy:.1%} of its {self.gpu_span_seconds:.2f} s span"
        )
        return (
            f"{self.real_tokens_per_s:,.0f} real tokens/s over the step's {self.step_seconds:.2f} s; "
            f"the engine pulled batches for {self.engine_seconds:.2f} s "
            f"({self.engine_share:.0%}, {self.engine_real_tokens_per_s:,.0f} tokens/s, "
            f"{self.padding_fraction:.1%} padding{gpu}); before its first batch "
            f"{self.before_engine_seconds:.2f} s, after its last {self.after_engine_seconds:.2f} s, "
            f"settle {self.settle_seconds:.2f} s, check {self.verify_seconds:.2f} s, "
            f"other {self.other_seconds:.2f} s"
        )


def extraction_efficiency(
    *,
    real_tokens: int,
    padded_tokens: int,
    timelines: tuple[dict[str, float], ...],
    step_started_at: float,
    workers_done_at: float,
    step_ended_at: float,
    settle_seconds: float,
    verify_seconds: float,
    gpu_busy_seconds: float = 0.0,
    gpu_span_seconds: float = 0.0,
) -> Efficiency:
    """From the workers' timelines (wall-clock `started_at` plus offsets in seconds, as
    run_extraction reports them) and the step's own wall-clock marks."""
    ready = [t["started_at"] + t["ready"] for t in timelines if "ready" in t]
    acked = [t["started_at"] + t["last_ack"] for t in timelines if "last_ack" in t]
    if ready and acked:
        first_ready, last_ack = min(ready), max(acked)
        before = max(0.0, first_ready - step_started_at)
        engine = max(0.0, last_ack - first_ready)
        after = max(0.0, workers_done_at - last_ack)
    else:  # no batch ran: the whole workers' part is before any engine
        before, engine, after = max(0.0, workers_done_at - step_started_at), 0.0, 0.0
    return Efficiency(
        real_tokens=real_tokens,
        padded_tokens=padded_tokens,
        step_seconds=max(0.0, step_ended_at - step_started_at),
        before_engine_seconds=before,
        engine_seconds=engine,
        after_engine_seconds=after,
        settle_seconds=settle_seconds,
        verify_seconds=verify_seconds,
        gpu_busy_seconds=gpu_busy_seconds,
        gpu_span_seconds=gpu_span_seconds,
    )


@unit_of_work("recording the run of task set {task_set!r}")
def record_run(
    db: Engine, task_set: str, model_key: str, plan_id: str, record: dict[str, Any]
) -> None:
    """Keep one step's record (`as_mapping()` and what the step adds) for `fabric status`."""
    with db.begin() as conn:
        conn.execute(
            insert(ExtractionRun),
            {
                "task_set_id": task_set_id(conn, task_set),
                "model_id": model_id(conn, model_key),
                "plan_id": plan_id,
                "record_json": json.dumps(record, sort_keys=True),
            },
        )


def latest_runs(conn: Connection, task_sets: list[str]) -> dict[str, dict[str, Any]]:
    """Each named set's last extraction record (sets never extracted are left out)."""
    last = (
        select(ExtractionRun.task_set_id, func.max(ExtractionRun.id).label("id"))
        .group_by(ExtractionRun.task_set_id)
        .subquery()
    )
    rows = conn.execute(
        select(TaskSet.name, ExtractionRun.record_json, ExtractionRun.finished_at)
        .join(last, last.c.id == ExtractionRun.id)
        .join(TaskSet, TaskSet.id == ExtractionRun.task_set_id)
        .where(TaskSet.name.in_(task_sets))
    ).all()
    return {
        name: {**json.loads(record), "finished_at": str(finished_at)}
        for name, record, finished_at in rows
    }
