"""Ingest and planning started ahead of their steps, in the process that submitted the set.

`fabric submit --run` and `fabric run` know the set, its file and the engine the moment they
start, but Dagster's definitions and instance take seconds to make (cli/prepare.py), and the
ingest and plan steps run only after them, one after the other, while the workers (started
first: lib/worker/prestart.py) wait for their plan. `start_ahead` makes the same two calls the
steps make (`ingest_task_set`, then `plan_task_set`) on a thread of its own as soon as the file
is submitted, so that they overlap Dagster's start instead of following it.

Each step, in the same process, takes the result over (`take_ingested`, `take_planned`) when it
was made from exactly the inputs the step has (database, data root, set, model, lengths,
long-input policy, prompt; manifest, input layout, reuse), waiting for it if it is still
running. A result made from other inputs, or a call that failed, is not taken: the step makes
the call itself (after the one ahead has ended, so the two never race), and reports a failure
as it always has. Both calls are idempotent for the same inputs (a set ingested before is read
as stored; a plan of the same outstanding items is kept), so a result not taken costs time,
never a second copy. A result is taken once; one nobody takes is dropped with its process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine

from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.plans import PlanSummary, plan_task_set
from fabric_pipelines.lib.broker.reuse import reuse_enabled
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.tasks.catalog import IngestSummary, ingest_task_set
from fabric_pipelines.lib.tasks.windows import LongInputs

T = TypeVar("T")


@dataclass(frozen=True)
class IngestInputs:
    """What decides an ingest: the step takes one made ahead only for equal inputs."""

    database_url: str
    root: str  # the data root, resolved
    task_set: str
    model_id: str
    max_seq_len: int
    long_inputs: LongInputs
    prompt: str

    @staticmethod
    def of(
        database_url: str,
        paths: FabricPaths,
        task_set: str,
        manifest: EngineManifest,
        long_inputs: LongInputs,
        prompt: str,
    ) -> IngestInputs:
        return IngestInputs(
            database_url, str(Path(paths.root).resolve()), task_set, manifest.model_id,
            manifest.profile.max_seq_len, long_inputs, prompt,
        )  # fmt: skip


@dataclass(frozen=True)
class PlanInputs:
    """What decides a plan besides the stored set: the manifest (as JSON), layout and reuse."""

    database_url: str
    root: str
    task_set: str
    manifest: str
    layout: str
    reuse: bool

    @staticmethod
    def of(
        database_url: str,
        paths: FabricPaths,
        task_set: str,
        manifest: EngineManifest,
        layout: str,
        reuse: bool | None,
    ) -> PlanInputs:
        return PlanInputs(
            database_url, str(Path(paths.root).resolve()), task_set,
            json.dumps(manifest.to_mapping(), sort_keys=True), layout, reuse_enabled(reuse),
        )  # fmt: skip


@dataclass(frozen=True)
class Taken(Generic[T]):
    """A result made ahead: the call's own seconds, and how long the step waited for it."""

    result: T
    seconds: float
    waited_seconds: float


@dataclass
class _Ahead:
    ingest_inputs: IngestInputs
    plan_inputs: PlanInputs
    ingested: Future[tuple[IngestSummary, float]]
    planned: Future[tuple[PlanSummary, float]]


_ahead: dict[str, _Ahead] = {}  # task set -> the calls started for it, until taken
_lock = threading.Lock()


def start_ahead(
    paths: FabricPaths,
    ingest: IngestInputs,
    plan: PlanInputs,
    manifest: EngineManifest,
    on_mark: Callable[[str], None] = lambda name: None,
) -> None:
    """Ingest and then plan `ingest.task_set` on a thread now (see the module's doc).
    `on_mark` is told "ahead_ingested" and "ahead_planned" as each ends (the run's clock)."""
    if (ingest.task_set, ingest.database_url, ingest.root) != (
        plan.task_set, plan.database_url, plan.root,
    ):  # fmt: skip
        raise ValueError("start_ahead: the ingest and the plan must be of one set and database")
    ahead = _Ahead(ingest, plan, Future(), Future())
    with _lock:
        _ahead[ingest.task_set] = ahead

    def run() -> None:
        db = make_engine(ingest.database_url)
        try:
            started = time.perf_counter()
            try:
                summary = ingest_task_set(
                    db, paths, ingest.task_set, model_id=ingest.model_id,
                    max_seq_len=ingest.max_seq_len, long_inputs=ingest.long_inputs,
                    prompt=ingest.prompt,
                )  # fmt: skip
            except BaseException as exc:  # held for the step, which makes the call itself
                ahead.ingested.set_exception(exc)
                ahead.planned.set_exception(exc)
                return
            ahead.ingested.set_result((summary, time.perf_counter() - started))
            on_mark("ahead_ingested")
            started = time.perf_counter()
            try:
                planned = plan_task_set(
                    db, paths, plan.task_set, manifest, plan.layout, reuse=plan.reuse
                )
            except BaseException as exc:
                ahead.planned.set_exception(exc)
                return
            ahead.planned.set_result((planned, time.perf_counter() - started))
            on_mark("ahead_planned")
        finally:
            db.dispose()

    threading.Thread(target=run, name=f"ahead-{ingest.task_set}", daemon=True).start()


def take_ingested(inputs: IngestInputs) -> Taken[IngestSummary] | None:
    """The ingest made ahead for exactly `inputs`, once it has ended; None when there is none,
    it was made from other inputs, or it failed (the step then ingests itself)."""
    with _lock:
        ahead = _ahead.get(inputs.task_set)
    if ahead is None:
        return None
    return _taken(ahead.ingested, ahead.ingest_inputs == inputs)


def take_planned(inputs: PlanInputs) -> Taken[PlanSummary] | None:
    """The plan made ahead for exactly `inputs` (after its ingest), once it has ended; None as
    for `take_ingested`. Taken once: the set's calls made ahead are forgotten here."""
    with _lock:
        ahead = _ahead.pop(inputs.task_set, None)
    if ahead is None:
        return None
    return _taken(ahead.planned, ahead.plan_inputs == inputs)


def _taken(made: Future[tuple[T, float]], same_inputs: bool) -> Taken[T] | None:
    started = time.perf_counter()
    # Waited for even when not taken: the step's own call must not race the one ahead.
    if made.exception() is not None or not same_inputs:  # the step's own call reports it
        return None
    result, seconds = made.result()
    return Taken(result, seconds, time.perf_counter() - started)


@dataclass(frozen=True)
class Made(Generic[T]):
    """A step's call: its result, its own seconds, and whether it was made ahead (then how
    long the step waited for it)."""

    result: T
    seconds: float
    ahead: bool = False
    waited_seconds: float = 0.0

    def metadata(self) -> dict[str, Any]:
        """For the step's materialisation: where the call ran, and the step's wait for it."""
        if not self.ahead:
            return {"started_ahead": False}
        return {"started_ahead": True, "waited_seconds": round(self.waited_seconds, 3)}


def ingested(db: Engine, paths: FabricPaths, inputs: IngestInputs) -> Made[IngestSummary]:
    """The ingest step's call: the one made ahead for these inputs, else made now."""
    taken = take_ingested(inputs)
    if taken is not None:
        return Made(taken.result, taken.seconds, True, taken.waited_seconds)
    started = time.perf_counter()
    summary = ingest_task_set(
        db, paths, inputs.task_set, model_id=inputs.model_id, max_seq_len=inputs.max_seq_len,
        long_inputs=inputs.long_inputs, prompt=inputs.prompt,
    )  # fmt: skip
    return Made(summary, time.perf_counter() - started)


def planned(
    db: Engine, paths: FabricPaths, inputs: PlanInputs, manifest: EngineManifest
) -> Made[PlanSummary]:
    """The plan step's call: the one made ahead for these inputs, else made now."""
    taken = take_planned(inputs)
    if taken is not None:
        return Made(taken.result, taken.seconds, True, taken.waited_seconds)
    started = time.perf_counter()
    summary = plan_task_set(db, paths, inputs.task_set, manifest, inputs.layout, reuse=inputs.reuse)
    return Made(summary, time.perf_counter() - started)


def forget_ahead(task_set: str) -> None:
    """Drop what was started for `task_set` (a run that ends without its steps taking it)."""
    with _lock:
        _ahead.pop(task_set, None)


def pending() -> dict[str, Any]:
    """The sets with calls started ahead and not yet taken (for tests)."""
    with _lock:
        return dict(_ahead)
