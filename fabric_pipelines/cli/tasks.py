"""Commands on task sets: demo, submit, run, plan, export, status, forget."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Future

    from sqlalchemy import Engine

    from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.cli.environment import open_database, prepare_environment
from fabric_pipelines.cli.pipeline import (
    DEMO_TASK_SET,
    engine_config,
    engine_manifest,
    prestart_for_run,
    print_summary,
    refuse_unreachable_database,
    run_pipeline,
    start_ahead_for_run,
    write_report,
)
from fabric_pipelines.cli.prepare import dagster_instance


def cmd_demo(args: argparse.Namespace) -> int:
    from fabric_pipelines.cli.demo_corpus import write_demo_set
    from fabric_pipelines.lib.core.settings import database_url, redact_url
    from fabric_pipelines.lib.tasks.catalog import forget_task_set
    from fabric_pipelines.lib.tasks.inbox import submit

    paths, db = open_database()
    print(f"fabric demo: data root {paths.root}, database {redact_url(database_url(paths))}")
    # The demo owns its task set: start it afresh so every demo run does (and times) real work.
    forget_task_set(db, paths, DEMO_TASK_SET)
    with prestart_for_run(DEMO_TASK_SET, args):  # the engine loads while the set is written
        from fabric_pipelines.cli.prepare import prepare_pipeline

        prepared = prepare_pipeline()  # Dagster's definitions and instance, meanwhile
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "demo.jsonl"
            n = write_demo_set(source, args.items)
            submit(source, paths.inbox, DEMO_TASK_SET)
        print(f"submitted {n} records (standard-library docstrings + deliberately bad records)")
        start_ahead_for_run(DEMO_TASK_SET, args)  # ingested and planned while Dagster loads
        summary = run_pipeline(DEMO_TASK_SET, args, prepared)
    print_summary(summary)
    return 0 if all(passed for _, passed in summary["checks"]) else 1


def cmd_submit(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.core.names import InvalidNameError, validate_task_set_name

    try:
        validate_task_set_name(args.task_set)
    except InvalidNameError as exc:
        print(f"fabric submit: {exc}", file=sys.stderr)
        return 2
    if args.run and refuse_unreachable_database(args, "submit"):
        return 2
    # With --run, the engine's workers start loading first, while the rest of this runs; then
    # Dagster's definitions and instance are made on a thread while the file is submitted.
    with prestart_for_run(args.task_set, args) if args.run else contextlib.nullcontext():
        prepared = None
        if args.run:
            from fabric_pipelines.cli.prepare import prepare_pipeline

            prepare_environment()  # DAGSTER_HOME, which the instance is opened from
            prepared = prepare_pipeline()
        return _submit(args, prepared)


def _submit(args: argparse.Namespace, prepared: Future[tuple[Any, Any]] | None = None) -> int:
    from fabric_pipelines.cli.run_clock import mark
    from fabric_pipelines.lib.core.names import InvalidNameError
    from fabric_pipelines.lib.tasks.catalog import is_ingested
    from fabric_pipelines.lib.tasks.inbox import submit
    from fabric_pipelines.lib.tasks.ingest import SubmissionError
    from fabric_pipelines.lib.tasks.prompts import PromptError, chosen_prompt, record_prompt
    from fabric_pipelines.lib.tasks.source_read import read_ahead

    mark("warm_pool_started")
    paths, db = open_database()
    mark("database_opened")
    try:
        # A set never ingested (its file could not be read) takes a corrected file in its place.
        staged = submit(
            Path(args.file), paths.inbox, args.task_set, ingested=lambda n: is_ingested(db, n)
        )
        if args.run:  # read and parsed while Dagster loads; the ingest step takes it over
            read_ahead(staged.path)
        if args.prompt is not None or args.prompt_name is not None:
            prompt = chosen_prompt(engine_manifest(args).model_id, args.prompt, args.prompt_name)
            assert prompt is not None
            record_prompt(paths.inbox, staged.task_set, prompt)
    except (SubmissionError, InvalidNameError, PromptError) as exc:
        print(f"fabric submit: {exc}", file=sys.stderr)
        return 2
    if args.run:  # ingested and planned while Dagster loads; the steps take both over
        start_ahead_for_run(staged.task_set, args)
    mark("submitted")
    print(
        f"submitted {args.file} as task set {staged.task_set!r} ({staged.path}, sha256 {staged.sha256[:16]}…)"
    )
    if args.run:
        summary = run_pipeline(staged.task_set, args, prepared)
        write_report(args, summary)
        print_summary(summary)
    else:
        print(
            "the inbox sensor picks it up while `dagster dev` runs; or run it now: "
            f"fabric run {staged.task_set}"
        )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.core.names import InvalidNameError, validate_task_set_name

    try:
        validate_task_set_name(args.task_set)
    except InvalidNameError as exc:
        print(f"fabric run: {exc}", file=sys.stderr)
        return 2
    if refuse_unreachable_database(args, "run"):
        return 2
    with prestart_for_run(args.task_set, args):
        from fabric_pipelines.cli.prepare import prepare_pipeline

        prepare_environment()  # DAGSTER_HOME, which the instance is opened from
        prepared = prepare_pipeline()  # Dagster's definitions and instance while the database opens
        paths, db = open_database()  # the schema first, before two runs' steps race to make it
        _read_ahead_if_new(paths, db, args.task_set)
        db.dispose()
        start_ahead_for_run(args.task_set, args)  # ingest and plan while Dagster loads
        summary = run_pipeline(args.task_set, args, prepared)
    write_report(args, summary)
    print_summary(summary)
    return 0 if all(passed for _, passed in summary["checks"]) else 1


def _read_ahead_if_new(paths: FabricPaths, db: Engine, task_set: str) -> None:
    """A set not ingested yet: its inbox file is read and parsed while Dagster loads."""
    from fabric_pipelines.lib.tasks.catalog import is_ingested
    from fabric_pipelines.lib.tasks.inbox import submission_path
    from fabric_pipelines.lib.tasks.source_read import read_ahead

    with contextlib.suppress(Exception):  # no file, or a bad one: the ingest step reports it
        if not is_ingested(db, task_set):
            read_ahead(submission_path(paths.inbox, task_set))


def cmd_plan(args: argparse.Namespace) -> int:
    """A job as it would run (lib/broker/preview.py): nothing is stored."""
    from fabric_pipelines.defs.resources import EngineConfig
    from fabric_pipelines.lib.broker.preview import preview_plan, render_preview
    from fabric_pipelines.lib.tasks.ingest import SubmissionError

    path = Path(args.file)
    if not path.is_file():
        print(f"fabric plan: {path}: no such file", file=sys.stderr)
        return 2
    manifest = engine_manifest(args)
    _, db = open_database()
    try:
        config = EngineConfig(**engine_config(args))
        preview = preview_plan(
            db, path, manifest, long_inputs=config.long_input_policy(), prompt=args.prompt or "",
            reuse=config.reuse_results,
        )  # fmt: skip
    except (SubmissionError, ValueError) as exc:
        print(f"fabric plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(preview.to_mapping(), indent=2) if args.json else render_preview(preview))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A task set's pooled embeddings as a Parquet file (lib/results/export.py), with a progress bar."""
    from tqdm import tqdm

    from fabric_gpu.variants import VariantError
    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.core.names import validate_task_set_name
    from fabric_pipelines.lib.results.export import ExportError, export_task_set

    name = validate_task_set_name(args.task_set)
    try:
        layers = [int(k) for k in (args.layers or "").split(",") if k.strip()]
    except ValueError:
        print(
            f"fabric export: --layers takes integers, e.g. 2,-1; got {args.layers!r}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out or f"{name}.parquet")
    if out.exists() and not args.force:
        print(f"fabric export: {out} exists; give --force to replace it", file=sys.stderr)
        return 2
    _, db = open_database()
    try:
        with db.connect() as conn:
            counts = accounting(conn, name, args.model_key)
        # Rows are documents: a chunked one is one row, not its windows.
        total = (
            counts.documents.stored
            if counts.documents is not None
            else counts.completed + counts.reused
        )
        if args.windows and counts.documents is not None:
            total += counts.documents.windows_stored
    except LookupError:
        total = None  # export names the missing set
    with tqdm(total=total, unit=" rows", desc=f"export {name}", disable=None) as bar:
        try:
            done = export_task_set(
                db, name, out, model_key=args.model_key, layers=layers, variant=args.variant,
                windows=args.windows, progress=lambda n: _advance(bar, n),
            )  # fmt: skip
        except (ExportError, VariantError) as exc:
            print(f"fabric export: {exc}", file=sys.stderr)
            return 2
    print(
        f"exported {done.rows:,} vectors of {done.model_key} (dim {done.dim}) from {name!r} to "
        f"{done.path} as {done.variant}, {done.bytes_per_vector:,} bytes a vector "
        f"(sha256 {done.sha256[:16]}…)"
    )
    return 0


def _advance(bar: Any, done: int) -> None:
    bar.update(done - bar.n)


def _document_columns(docs: Any) -> dict[str, Any]:
    """A set with chunked documents, by document: documents = stored + failed + waiting, and
    how many were split into how many windows (of which how many are stored)."""
    return {
        "documents": docs.documents, "documents_stored": docs.stored,
        "documents_failed": docs.failed, "documents_waiting": docs.waiting,
        "chunked": docs.chunked, "windows": docs.windows, "windows_stored": docs.windows_stored,
    }  # fmt: skip


def _engines(conn: Any, name: str) -> dict[str, int]:
    """The set's rows of its current plan's model, by the engine identity that computed them."""
    from fabric_pipelines.lib.broker.ledger import current_model_key, set_engines

    model_key = current_model_key(conn, name)
    return {} if model_key is None else set_engines(conn, name, model_key)


def cmd_status(args: argparse.Namespace) -> int:
    import pandas as pd
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.records.efficiency import latest_runs
    from fabric_pipelines.lib.store.models import TaskFailure, TaskSet
    from fabric_pipelines.lib.tasks.catalog import list_task_sets

    _, db = open_database()
    names = [args.task_set] if args.task_set else list_task_sets(db)
    if not names and not args.json:
        print("no task sets yet: fabric submit FILE --task-set NAME, or fabric demo")
        return 0
    rows: list[dict[str, Any]] = []
    with db.connect() as conn:
        for name in names:
            try:
                a = accounting(conn, name)
            except LookupError as exc:
                print(f"fabric status: {exc}", file=sys.stderr)
                return 2
            rows.append(
                {
                    "task_set": name,
                    "tasks": a.tasks,
                    "completed": a.completed,
                    # Tasks linked to a stored result of the same content (lib/broker/reuse.py).
                    "reused": a.reused,
                    "failed": a.failed,
                    "in_flight": a.in_flight,
                    "queued": a.queued,
                    "balanced": a.balanced,
                    "finished": a.finished,
                    # Tasks cut to max_seq_len (they count as tasks, completed or not).
                    "truncated": int(
                        conn.execute(
                            select(TaskSet.truncated).where(TaskSet.name == name)
                        ).scalar_one_or_none()
                        or 0
                    ),
                    # The distinct stored results the set's tasks point at (reused ones once).
                    "stored_results": a.stored_results,
                    # Its rows by the engine identity that computed them.
                    "engines": _engines(conn, name),
                    # Chunked documents: their windows are the tasks above; counted by document.
                    **(_document_columns(a.documents) if a.documents is not None else {}),
                }
            )
    with db.connect() as conn:  # each set's last extraction: speed and where its time went
        last_runs = latest_runs(conn, names)
    for row in rows:
        if args.json and row["task_set"] in last_runs:
            row["last_extraction"] = last_runs[row["task_set"]]
    failures = []
    if args.failures:
        with Session(db) as session:
            query = (
                select(TaskFailure)
                .join(TaskSet, TaskSet.id == TaskFailure.task_set_id)
                .where(TaskSet.name.in_(names))
            )
            failures = list(session.scalars(query.order_by(TaskSet.name, TaskFailure.record_no)))
    if args.json:  # for scripts and monitoring: the same accounting, and the failures if asked
        listed = [
            {"task_set": f.task_set, "record_no": f.record_no, "id": f.task_id, "stage": f.stage,
             "reason": f.reason}
            for f in failures
        ]  # fmt: skip
        print(json.dumps({"task_sets": rows, **({"failures": listed} if args.failures else {})}))
        return 0
    table = pd.DataFrame(rows).drop(columns=["finished", "engines"])
    print(table.fillna("").to_string(index=False))
    for row in rows:
        if row["engines"]:
            by_engine = ", ".join(f"{e} {n:,}" for e, n in row["engines"].items())
            print(f"{row['task_set']}, rows by engine: {by_engine}")
    for name in names:
        if name in last_runs:
            last = last_runs[name]
            print(f"{name}, last extraction ({last['finished_at'][:19]}): {last['sentence']}")
    if args.failures:
        print()
        if not failures:
            print("no failures")
        # One failure a line, the reason in full: it names the record and what to do.
        for f in failures:
            print(f"{f.task_set}  id {f.task_id or '-'}  {f.stage}: {f.reason}")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    """Remove a task set: its rows (results included), stored files, inbox file and partition."""

    from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS
    from fabric_pipelines.lib.core.names import validate_task_set_name
    from fabric_pipelines.lib.maintenance.forget import ForgetRefused, forget

    name = validate_task_set_name(args.task_set)  # InvalidNameError: main() prints it, exit 2
    paths, db = open_database()
    instance = dagster_instance()
    partition = instance.has_dynamic_partition(TASK_SET_PARTITIONS, name)
    try:
        forgotten = forget(db, paths, name, has_partition=partition, force=args.force)
    except ForgetRefused as exc:
        print(f"fabric forget: {exc}", file=sys.stderr)
        return 2
    if partition:
        instance.delete_dynamic_partition(TASK_SET_PARTITIONS, name)
    print(forgotten.message())
    return 0
