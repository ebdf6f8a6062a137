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
running; a plan ahead is taken only after an ingest ahead the ingest step took. A result made
from other inputs, or a call that failed, is not taken: the step makes the call itself, after
every call ahead has ended (so the two never race), and reports a failure as it always has.
Both calls are idempotent for the same inputs (a set ingested before is read as stored; a plan
of the same outstanding items is kept), so a failed call or a plan not taken costs time, never a
second copy. An ingest ahead from other inputs (the CLI builds them as the engine resource does,
`cli/pipeline.ahead_inputs`, and a test holds the two equal) would stay stored as a set is: the
step's own ingest then meets it as a second submission of the set with other settings would.
Every call ahead ends its futures, whatever fails where. A run that fails (or is stopped) before
its steps took them forgets them and ends at once: a call cut off by the exit mid-transaction
leaves nothing behind, and one that ended is what the next run of the set finds and keeps.
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


@dataclass
class _Ahead:
    ingest_inputs: IngestInputs
    plan_inputs: PlanInputs
    ingested: Future[Made[IngestSummary]]
    planned: Future[Made[PlanSummary]]
    # The ingest step turned the ingest ahead down (other inputs): the plan ahead was made
    # from a set the step did not ingest, and is never taken.
    ingest_refused: bool = False


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

    def calls() -> None:
        db = make_engine(ingest.database_url)
        try:
            ahead.ingested.set_result(_ingest(db, paths, ingest))
            on_mark("ahead_ingested")
            ahead.planned.set_result(_plan(db, paths, plan, manifest))
            on_mark("ahead_planned")
        finally:
            db.dispose()

    def run() -> None:
        try:
            calls()
        except BaseException as exc:  # held for the steps, which make the calls themselves
            failed = exc
        else:
            return
        # Every future ends, whatever failed where: a step never waits for one that cannot.
        for future in (ahead.ingested, ahead.planned):
            if not future.done():
                future.set_exception(failed)

    thread = threading.Thread(target=run, name=f"ahead-{ingest.task_set}", daemon=True)
    with _lock:
        _ahead[ingest.task_set] = ahead
    try:
        thread.start()
    except BaseException:
        forget_ahead(ingest.task_set)
        raise


def take_ingested(inputs: IngestInputs) -> Made[IngestSummary] | None:
    """The ingest made ahead for exactly `inputs`, once it has ended; None when there is none,
    it was made from other inputs, or it failed (the step then ingests itself). Turned down
    for other inputs, the plan ahead is waited for too (the step's own calls must not race it)
    and is never taken."""
    with _lock:
        ahead = _ahead.get(inputs.task_set)
    if ahead is None:
        return None
    same = ahead.ingest_inputs == inputs
    if not same:
        ahead.ingest_refused = True
        _ended(ahead.planned)
    return _taken(ahead.ingested, same)


def take_planned(inputs: PlanInputs) -> Made[PlanSummary] | None:
    """The plan made ahead for exactly `inputs`, after an ingest the ingest step took, once it
    has ended; None as for `take_ingested`. The set's calls made ahead are forgotten here."""
    with _lock:
        ahead = _ahead.pop(inputs.task_set, None)
    if ahead is None:
        return None
    return _taken(ahead.planned, ahead.plan_inputs == inputs and not ahead.ingest_refused)


def _ended(made: Future[Any]) -> None:
    """Wait for a call ahead to end, whatever its outcome."""
    made.exception()


def _taken(made: Future[Made[T]], same_inputs: bool) -> Made[T] | None:
    started = time.perf_counter()
    # Waited for even when not taken: the step's own call must not race the one ahead.
    if made.exception() is not None or not same_inputs:  # the step's own call reports it
        return None
    call = made.result()
    return Made(call.result, call.seconds, True, time.perf_counter() - started)


def ingested(
    db: Callable[[], Engine], paths: FabricPaths, inputs: IngestInputs
) -> Made[IngestSummary]:
    """The ingest step's call: the one made ahead for these inputs, else made now. `db` is
    called only then (a step's engine opens the schema: not while a call ahead writes)."""
    return take_ingested(inputs) or _ingest(db(), paths, inputs)


def planned(
    db: Callable[[], Engine], paths: FabricPaths, inputs: PlanInputs, manifest: EngineManifest
) -> Made[PlanSummary]:
    """The plan step's call: the one made ahead for these inputs, else made now (`db` as for
    `ingested`)."""
    return take_planned(inputs) or _plan(db(), paths, inputs, manifest)


def _ingest(db: Engine, paths: FabricPaths, inputs: IngestInputs) -> Made[IngestSummary]:
    """`ingest_task_set` from `inputs`, timed: the one call, ahead or in the step."""
    started = time.perf_counter()
    summary = ingest_task_set(
        db, paths, inputs.task_set, model_id=inputs.model_id, max_seq_len=inputs.max_seq_len,
        long_inputs=inputs.long_inputs, prompt=inputs.prompt,
    )  # fmt: skip
    return Made(summary, time.perf_counter() - started)


def _plan(
    db: Engine, paths: FabricPaths, inputs: PlanInputs, manifest: EngineManifest
) -> Made[PlanSummary]:
    """`plan_task_set` from `inputs`, timed: the one call, ahead or in the step."""
    started = time.perf_counter()
    summary = plan_task_set(db, paths, inputs.task_set, manifest, inputs.layout, reuse=inputs.reuse)
    return Made(summary, time.perf_counter() - started)


def forget_ahead(task_set: str) -> None:
    """Drop what was started for `task_set`, running or not."""
    with _lock:
        _ahead.pop(task_set, None)


def pending() -> dict[str, Any]:
    """The sets with calls started ahead and not yet taken (for tests)."""
    with _lock:
        return dict(_ahead)
