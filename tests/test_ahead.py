"""Ingest and planning made ahead of their steps (lib/steps/ahead.py): a step takes what was made
for exactly its inputs, waits for it while it runs, makes the call itself otherwise (never racing
the one ahead), and the result is what the step's own call would have stored."""

from __future__ import annotations

import argparse
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, func, select

from fabric_gpu.engines import input_layout
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.steps import ahead
from fabric_pipelines.lib.steps.ahead import IngestInputs, PlanInputs, ingested, planned
from fabric_pipelines.lib.store.models import Batch, Task, TaskSet
from fabric_pipelines.lib.tasks import catalog
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.tasks.ingest import SubmissionError
from fabric_pipelines.lib.tasks.windows import LongInputs

pytestmark = pytest.mark.timeout(120)


def _texts_file(path: Path, n: int) -> Path:
    rows = [{"id": f"t{i}", "text": f"text number {i} " + "word " * (i % 17)} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _inputs(
    db_url: str, paths: FabricPaths, manifest: EngineManifest, task_set: str = "s"
) -> tuple[IngestInputs, PlanInputs]:
    return (
        IngestInputs.of(db_url, paths, task_set, manifest, LongInputs("truncate"), ""),
        PlanInputs.of(db_url, paths, task_set, manifest, input_layout(manifest), True),
    )


def _plan_rows(db: Engine) -> list[tuple[str, int, int, int]]:
    with db.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                select(Batch.plan_id, Batch.batch_no, Batch.item_start, Batch.item_count).order_by(
                    Batch.plan_id, Batch.batch_no
                )
            )
        ]


def test_steps_take_what_was_made_ahead_for_their_inputs(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    submit(_texts_file(tmp_path / "s.parquet", 300), paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)

    made_ingest = ingested(lambda: db, paths, ingest_inputs)
    made_plan = planned(lambda: db, paths, plan_inputs, manifest)
    assert made_ingest.ahead and made_plan.ahead
    assert made_ingest.metadata()["started_ahead"] is True
    assert made_ingest.result.n_tasks == 300 and made_plan.result.outstanding == 300
    assert ahead.pending() == {}, "taken once: nothing of the set is kept"
    # What the steps' own calls give on the same stored set: the same set and the same plan,
    # nothing stored twice.
    again = catalog.ingest_task_set(
        db, paths, "s", model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len,
        long_inputs=LongInputs("truncate"),
    )  # fmt: skip
    assert again.content_sha256 == made_ingest.result.content_sha256
    assert plan_task_set(db, paths, "s", manifest, input_layout(manifest)).plan_id == (
        made_plan.result.plan_id
    )
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Task)).scalar_one() == 300
        assert conn.execute(select(func.count()).select_from(TaskSet)).scalar_one() == 1
    # With nothing made ahead, a step makes the call itself.
    assert not ingested(lambda: db, paths, ingest_inputs).ahead


def _hold_plans(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every plan made waits for the second event; the first is set once one waits."""
    planning, release = threading.Event(), threading.Event()
    real_plan = ahead.plan_task_set

    def held_plan(*args, **kwargs):  # type: ignore[no-untyped-def]
        planning.set()
        assert release.wait(30)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(ahead, "plan_task_set", held_plan)
    return planning, release


def _waits_for(release: threading.Event, call: Any, why: str) -> object:
    """`call()`'s result, run on a thread that must still be waiting half a second in, until
    `release` is set."""
    result: list[object] = []
    step = threading.Thread(target=lambda: result.append(call()))
    try:
        step.start()
        step.join(0.5)
        assert step.is_alive(), why
    finally:
        release.set()
    step.join(60)
    (made,) = result
    return made


def test_other_plan_inputs_are_not_taken_and_the_step_waits_for_the_plan_ahead(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    tmp_path: Path,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's settings differ (another reuse setting): it makes its own plan, only after
    the one ahead has ended, so the two never plan the set at once."""
    submit(_texts_file(tmp_path / "s.parquet", 200), paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)
    planning_ahead, release = _hold_plans(monkeypatch)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)
    assert ingested(lambda: db, paths, ingest_inputs).ahead
    assert planning_ahead.wait(30)
    other = PlanInputs.of(db_url, paths, "s", manifest, input_layout(manifest), False)
    made = _waits_for(
        release, lambda: planned(lambda: db, paths, other, manifest),
        "the step waits while the plan ahead runs",
    )  # fmt: skip
    assert not made.ahead  # type: ignore[attr-defined]
    # Its own plan is the set's current one, and its batches cover the set once.
    with db.connect() as conn:
        current = conn.execute(select(TaskSet.current_plan_id)).scalar_one()
        open_items = conn.execute(
            select(func.sum(Batch.item_count)).where(
                Batch.plan_id == current, Batch.state == "queued"
            )
        ).scalar_one()
    assert current == made.result.plan_id and open_items == 200  # type: ignore[attr-defined]


def test_an_ingest_turned_down_waits_for_the_plan_ahead_which_is_never_taken(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    tmp_path: Path,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ingest step's inputs differ (another database URL spelling, say): it waits for the
    plan ahead to end before it ingests itself, and the plan step never takes that plan, made
    from an ingest no step took, even for equal plan inputs."""
    submit(_texts_file(tmp_path / "s.parquet", 200), paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)
    planning_ahead, release = _hold_plans(monkeypatch)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)
    assert planning_ahead.wait(30)
    other = dataclasses.replace(ingest_inputs, database_url=ingest_inputs.database_url + " ")
    taken = _waits_for(
        release,
        lambda: ahead.take_ingested(other),
        "the ingest step waits while the plan ahead runs",
    )
    assert taken is None
    assert ahead.take_planned(plan_inputs) is None


def test_a_failure_around_the_calls_ends_them_and_the_steps_make_their_own(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    tmp_path: Path,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread's database cannot even be opened: both calls end failed at once (no step
    waits for a call that cannot end) and the steps make them themselves."""
    submit(_texts_file(tmp_path / "s.parquet", 50), paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)

    def broken(url: str) -> Engine:
        raise ValueError("no database here")

    monkeypatch.setattr(ahead, "make_engine", broken)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)
    made = ingested(lambda: db, paths, ingest_inputs)
    assert not made.ahead and made.result.n_tasks == 50
    assert not planned(lambda: db, paths, plan_inputs, manifest).ahead


def test_a_forgotten_call_ahead_is_never_taken(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """A run that failed forgets its calls ahead: a later step in the process makes its own."""
    submit(_texts_file(tmp_path / "s.parquet", 100), paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)
    ahead.forget_ahead("s")
    assert ahead.pending() == {}
    assert not ingested(lambda: db, paths, ingest_inputs).ahead
    assert not planned(lambda: db, paths, plan_inputs, manifest).ahead


def test_a_failed_call_ahead_is_made_again_by_the_step_which_reports_it(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    bad = tmp_path / "s.parquet"
    pq.write_table(pa.table({"id": ["a"], "words": ["no text column"]}), bad)
    submit(bad, paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)
    with pytest.raises(SubmissionError, match="text"):
        ingested(lambda: db, paths, ingest_inputs)
    assert ahead.take_planned(plan_inputs) is None  # the plan ahead was never made
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(TaskSet)).scalar_one() == 0


def test_an_ingest_ahead_racing_another_runs_ingest_stores_the_set_once(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """Two runs of one set: one ingests ahead on its thread while the other's step ingests."""
    submit(_texts_file(tmp_path / "s.parquet", 400), paths.inbox, "s")
    ingest_inputs, plan_inputs = _inputs(db_url, paths, manifest)
    ahead.start_ahead(paths, ingest_inputs, plan_inputs, manifest)
    other = catalog.ingest_task_set(
        db, paths, "s", model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len,
        long_inputs=LongInputs("truncate"),
    )  # fmt: skip
    made = ingested(lambda: db, paths, ingest_inputs)
    assert made.result.content_sha256 == other.content_sha256
    planned(lambda: db, paths, plan_inputs, manifest)
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Task)).scalar_one() == 400
        assert conn.execute(select(func.count()).select_from(TaskSet)).scalar_one() == 1


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--long-inputs", "truncate"],
        ["--long-inputs", "chunk", "--window-overlap", "8"],
        ["--truncate", "--no-reuse"],
        ["--max-seq-len", "64", "--max-batch-tokens", "2048"],
    ],
)
def test_the_cli_makes_ahead_what_the_steps_will_ask_for(
    options: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inputs `fabric submit --run` starts ahead with equal the ones its steps compute from
    the engine resource the same options configure: otherwise nothing would be taken."""
    from fabric_pipelines.cli.parser import build_parser
    from fabric_pipelines.cli.pipeline import ahead_inputs, engine_config
    from fabric_pipelines.defs.resources import EngineConfig
    from fabric_pipelines.lib.core.settings import database_url

    monkeypatch.setenv("FABRIC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FABRIC_DATABASE_URL", raising=False)
    monkeypatch.delenv("FABRIC_ENGINE_MANIFEST", raising=False)
    args: argparse.Namespace = build_parser().parse_args(["run", "s", *options])
    paths, _, ingest_inputs, plan_inputs = ahead_inputs("s", args)
    engine = EngineConfig(**engine_config(args))  # the run's resource, as Dagster builds it
    step_manifest = engine.manifest()
    url = database_url(paths)
    assert ingest_inputs == IngestInputs.of(
        url, paths, "s", step_manifest, engine.long_input_policy(), ""
    )
    assert plan_inputs == PlanInputs.of(
        url, paths, "s", step_manifest, input_layout(step_manifest), engine.reuse_results
    )
