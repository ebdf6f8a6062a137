"""The `fabric` command line: demo, submit, run, status, verify, requeue, restore-plan, db,
index, receipt, worker.

Runs go through the same Dagster definitions the UI uses, in-process, against the instance in
DAGSTER_HOME, so every run shows up in the UI afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Future

    from sqlalchemy import Engine

    from fabric_pipelines.lib.settings import FabricPaths

DEMO_TASK_SET = "demo"


def _prepare_environment() -> Path:
    """Set DAGSTER_HOME (default ./dagster_home) and keep Hugging Face offline."""
    from fabric_pipelines.lib.settings import default_root

    root = default_root()
    root.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(root)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    return root


def _open_database() -> tuple[FabricPaths, Engine]:
    """The data root's paths and its results database, brought to the newest schema."""
    from sqlalchemy.exc import DBAPIError

    from fabric_pipelines.lib.settings import FabricPaths, database_url
    from fabric_pipelines.lib.store.db import create_schema, make_engine

    paths = FabricPaths(_prepare_environment()).ensure()
    db = make_engine(database_url(paths))
    for attempt in range(3):
        try:
            create_schema(db)
            break
        except DBAPIError:
            # Another command was creating the same schema at that moment (two first runs):
            # once its migration commits, this one finds the schema current.
            if attempt == 2:
                raise
            time.sleep(1.0)
    return paths, db


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name in (
        "model_id",
        "max_batch_tokens",
        "max_batch_items",
        "max_seq_len",
        "seq_granularity",
    ):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    if getattr(args, "hook_layers", None) is not None:
        config["hook_layers"] = [int(x) for x in args.hook_layers.split(",") if x.strip()]
    if getattr(args, "manifest", None):
        config["manifest_path"] = str(Path(args.manifest).resolve())
    for name in ("workers", "lease_seconds", "heartbeat_seconds", "pool_idle_seconds"):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    if getattr(args, "long_inputs", None) is not None:
        config["long_inputs"] = args.long_inputs
    if getattr(args, "window_overlap", None) is not None:
        config["window_overlap"] = args.window_overlap
    for name in ("pooling", "normalize"):
        if getattr(args, name, None) is not None:
            config[name] = getattr(args, name)
    if getattr(args, "store_variant", None) is not None:
        config["variant"] = args.store_variant
    if getattr(args, "reuse_results", None) is not None:
        config["reuse_results"] = args.reuse_results
    return config


def _run_config(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine_config(args)
    return {"resources": {"engine": {"config": engine}}} if engine else {}


def _quiet_dagster() -> None:
    logging.getLogger("dagster").setLevel(logging.WARNING)


def run_pipeline(
    task_set: str, args: argparse.Namespace, prepared: Future[tuple[Any, Any]] | None = None
) -> dict[str, Any]:
    """Materialise the three partitioned assets for `task_set`, then the index; return a summary.

    `prepared`: the definitions and Dagster instance made meanwhile (preload.prepare_pipeline).
    The name is checked before it becomes a partition; a partition this call registered is
    removed again when the set could not even be ingested, so a typo leaves nothing behind."""
    import dagster as dg

    from fabric_pipelines.definitions import defs
    from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS
    from fabric_pipelines.lib.index import vector_tail
    from fabric_pipelines.lib.names import validate_task_set_name
    from fabric_pipelines.lib.progress import run_progress
    from fabric_pipelines.lib.run_clock import mark, marks, steps_of

    validate_task_set_name(task_set)  # InvalidNameError: main() prints it, exit 2
    vector_tail.follow_in_this_process()  # both jobs run here, the index right after extraction
    mark("dagster_imported")
    try:
        if prepared is None:
            raise LookupError("nothing prepared")
        definitions, instance = prepared.result()
    except Exception:  # not prepared, or it failed there: made here, where a failure is reported
        definitions, instance = defs(), dg.DagsterInstance.get()
    mark("definitions_loaded")
    registered = _register_partition(instance, TASK_SET_PARTITIONS, task_set)
    run_config = _run_config(args)
    log_config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
    started = time.perf_counter()
    with run_progress():  # one bar for the run: stage, tasks done, tokens/s, ETA
        extract = definitions.resolve_job_def("extract_task_set").execute_in_process(
            partition_key=task_set,
            instance=instance,
            run_config={**run_config, **log_config},
            raise_on_error=False,
        )
        mark("extraction_job_done")
        if not extract.success:
            if registered and not _ingested(task_set):
                instance.delete_dynamic_partition(TASK_SET_PARTITIONS, task_set)
            raise SystemExit(_failure_text(extract, "extraction", task_set))
        index = definitions.resolve_job_def("build_vector_index").execute_in_process(
            instance=instance, run_config={**run_config, **log_config}, raise_on_error=False
        )
        mark("index_job_done")
    if not index.success:
        raise SystemExit(_failure_text(index, "index build", task_set))
    materialized = {**_materializations(extract), **_materializations(index)}
    return {
        "extract": _materializations(extract),
        "index": _materializations(index),
        "checks": _checks(extract) + _checks(index),
        "seconds": time.perf_counter() - started,
        "stage_seconds": {
            name: meta["seconds"] for name, meta in materialized.items() if "seconds" in meta
        },
        "run_ids": (extract.run_id, index.run_id),
        # Wall-clock marks and every step's start and end, for `--report` readers (bench/e2e.py).
        "clock": {
            "marks": marks(),
            "steps": {
                **steps_of(instance, extract.run_id),
                **{f"index:{k}": v for k, v in steps_of(instance, index.run_id).items()},
            },
        },
    }


def _warm_workers(task_set: str, args: argparse.Namespace) -> Any:
    """Start the run's extraction workers first thing (lib/warm_workers.py), so that Python,
    torch, the CUDA context and the weights load while the CLI imports Dagster and the set is
    submitted, ingested and planned. A no-op when the engine settings cannot be read here (the
    run's own step reports why); the step takes the workers over only if its settings match."""
    from fabric_pipelines.lib.broker.ledger import DEFAULT_LEASE_SECONDS
    from fabric_pipelines.lib.engine_pool import idle_seconds_setting
    from fabric_pipelines.lib.gpu_pool import visible_gpus
    from fabric_pipelines.lib.run_clock import mark
    from fabric_pipelines.lib.settings import FabricPaths, database_url
    from fabric_pipelines.lib.warm_workers import warm_workers

    try:
        manifest = _engine_manifest(args)
        pool_idle_seconds = idle_seconds_setting(getattr(args, "pool_idle_seconds", None))
    except Exception:  # the extraction step reports the same error, in the run
        return contextlib.nullcontext()
    mark("manifest_read")
    paths = FabricPaths(_prepare_environment()).ensure()
    gpus = visible_gpus() if manifest.backend != "cpu" else 0
    mark("gpus_counted")
    return warm_workers(
        paths,
        task_set,
        manifest,
        database_url=database_url(paths),
        count=1 if args.workers is None else args.workers,  # EngineConfig's default: 1
        visible_gpus=gpus,
        lease_seconds=args.lease_seconds or DEFAULT_LEASE_SECONDS,
        heartbeat_seconds=args.heartbeat_seconds,
        pool_idle_seconds=pool_idle_seconds,
    )


def _engine_manifest(args: argparse.Namespace) -> Any:
    """The run's engine manifest: a manifest file is read directly (no Dagster import, which
    takes seconds); the options' defaults come from the engine resource."""
    from fabric_gpu.manifest import EngineManifest

    path = getattr(args, "manifest", None) or os.environ.get("FABRIC_ENGINE_MANIFEST", "")
    if path:
        return EngineManifest.load(Path(path))
    from fabric_pipelines.defs.resources import EngineConfig

    return EngineConfig(**_engine_config(args)).manifest()


def _write_report(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """The run's summary as JSON, for scripts (`--report FILE`)."""
    if not getattr(args, "report", None):
        return
    from fabric_pipelines.lib.files import write_bytes
    from fabric_pipelines.lib.run_clock import mark, marks
    from fabric_pipelines.lib.warm_runner import IN_RUNNER

    mark("report_written")
    plain = {key: value for key, value in summary.items() if key != "run_ids"}
    plain.setdefault("clock", {})["marks"] = marks()
    plain["run_ids"] = list(summary["run_ids"])
    # Whether a warm runner's child ran it (lib/warm_runner.py), and which process.
    plain["process"] = {"pid": os.getpid(), "warm_runner": bool(os.environ.get(IN_RUNNER))}
    write_bytes(Path(args.report), json.dumps(plain, default=str, indent=1).encode())


def _register_partition(instance: Any, partitions: str, task_set: str) -> bool:
    """Add the set's partition; True when this call added it. Two first runs of one set may
    race to add it: whichever loses finds it there, which is all it needs."""
    if instance.has_dynamic_partition(partitions, task_set):
        return False
    try:
        instance.add_dynamic_partitions(partitions, [task_set])
    except Exception:
        if not instance.has_dynamic_partition(partitions, task_set):
            raise
        return False
    return True


def _ingested(task_set: str) -> bool:
    from sqlalchemy import select

    from fabric_pipelines.lib.store.models import TaskSet

    _, db = _open_database()
    try:
        with db.connect() as conn:
            return (
                conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).first() is not None
            )
    finally:
        db.dispose()


def _failure_text(result: Any, what: str, task_set: str = "") -> str:
    """One line that says why the run failed and what to do: the failed step's own error (a
    dg.Failure's description, or the exception the asset raised), not Dagster's wrapper."""
    for event in result.all_events:
        if not event.is_step_failure or event.event_specific_data is None:
            continue
        error = getattr(event.event_specific_data, "error", None)
        if error is None:
            continue
        cause = _user_error(error)
        if cause.cls_name == "DagsterAssetCheckFailedError":
            text = "; ".join(_failed_checks(result)) or _strip_class(cause)
        elif cause.cls_name in ("IntegrityError", "UniqueViolation"):
            text = (
                f"another run of task set {task_set!r} wrote the same rows at the same moment "
                f"({_strip_class(cause).splitlines()[0]}); when it has finished, "
                f"`fabric run {task_set}` again picks up whatever is left"
            )
        else:
            text = _strip_class(cause)
        return f"{what} failed in {event.step_key}: {text}"
    return f"{what} failed; see the run {result.run_id} in the Dagster UI"


def _user_error(error: Any) -> Any:
    """The first error of Dagster's chain that is not Dagster's own wrapper around it."""
    while (
        error.cause is not None
        and error.cls_name.startswith("Dagster")
        and (error.cls_name != "DagsterAssetCheckFailedError")
    ):
        error = error.cause
    return error


def _strip_class(error: Any) -> str:
    """An error's message without the `module.Class: ` its text starts with."""
    message = str(error.message).strip()
    head, sep, rest = message.partition(": ")
    if sep and head.rsplit(".", 1)[-1] == error.cls_name:
        return rest.strip()
    return message


def _failed_checks(result: Any) -> list[str]:
    """Failed asset checks, each with the problems it recorded."""
    out = []
    for e in result.get_asset_check_evaluations():
        if e.passed:
            continue
        problems = e.metadata.get("problems") or e.metadata.get("what_to_change")
        detail = f": {problems.value}" if problems is not None else ""
        out.append(f"check {e.asset_key.to_user_string()}:{e.check_name} failed{detail}")
    return out


def _materializations(result: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for materialization in result.get_asset_materialization_events():
        m = materialization.materialization
        out[m.asset_key.to_user_string()] = {k: v.value for k, v in m.metadata.items()}
    return out


def _checks(result: Any) -> list[tuple[str, bool]]:
    return [
        (f"{e.asset_key.to_user_string()}:{e.check_name}", e.passed)
        for e in result.get_asset_check_evaluations()
    ]


# ---- commands -------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.demo_corpus import write_demo_set
    from fabric_pipelines.lib.settings import database_url, redact_url
    from fabric_pipelines.lib.tasks.catalog import forget_task_set
    from fabric_pipelines.lib.tasks.inbox import submit

    paths, db = _open_database()
    print(f"fabric demo: data root {paths.root}, database {redact_url(database_url(paths))}")
    # The demo owns its task set: start it afresh so every demo run does (and times) real work.
    forget_task_set(db, paths, DEMO_TASK_SET)
    with _warm_workers(DEMO_TASK_SET, args):  # the engine loads while the set is written
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "demo.jsonl"
            n = write_demo_set(source, args.items)
            submit(source, paths.inbox, DEMO_TASK_SET)
        print(f"submitted {n} records (standard-library docstrings + deliberately bad records)")
        summary = run_pipeline(DEMO_TASK_SET, args)
    _print_summary(summary)
    return 0 if all(passed for _, passed in summary["checks"]) else 1


def _reused_rows(reused: int) -> list[tuple[str, str]]:
    """Tasks given a copy of a stored result instead of being computed (lib/reuse.py)."""
    if not reused:
        return []
    return [("reused", f"{reused:,} tasks (a stored result of the same content copied)")]


def _print_summary(summary: dict[str, Any]) -> None:
    tasks = summary["extract"].get("tokenised_tasks", {})
    extraction = summary["extract"].get("extraction_outputs", {})
    index = summary["index"].get("vector_index", {})
    rows = [
        ("tasks submitted", f"{tasks.get('records', 0):,}"),
        ("completed", f"{extraction.get('completed', 0):,} tasks"),
        *_reused_rows(extraction.get("reused", 0)),
        *_document_rows(extraction.get("documents")),
        (
            "failed",
            f"{extraction.get('failed', 0):,} (each with a reason: fabric status --failures)",
        ),
        (
            "real tokens/s",
            f"{extraction.get('real_tokens_per_s', 0):,.0f} (delivered: written and acked)",
        ),
        *([("extraction", str(extraction["efficiency"]))] if extraction.get("efficiency") else []),
        *_index_rows(index),
        (
            "checks",
            ", ".join(f"{name} {'passed' if ok else 'FAILED'}" for name, ok in summary["checks"]),
        ),
        ("wall time", f"{summary['seconds']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _document_rows(documents: dict[str, int] | None) -> list[tuple[str, str]]:
    """A set with chunked documents: its documents stored, and into how many windows (tasks)
    its long ones were split."""
    if not documents:
        return []
    return [
        (
            "documents",
            f"{documents['stored']:,} stored of {documents['documents']:,}; "
            f"{documents['chunked']:,} longer than the model's length, split into "
            f"{documents['windows']:,} windows",
        )
    ]


def _index_rows(index: dict[str, Any]) -> list[tuple[str, str]]:
    if not index.get("vectors"):
        return [("index", f"none: {index.get('note', 'no vectors to index')}")]
    return [
        (
            "index",
            f"{index.get('index_path', '')}  ({index.get('factory', '')}, "
            f"{index.get('vectors', 0):,} vectors)",
        ),
        ("recall@10", f"{index.get('recall_at_10', 0):.4f}"),
        ("receipt sha256", f"{index.get('receipt_sha256', '')}"),
    ]


def cmd_submit(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.names import InvalidNameError, validate_task_set_name

    try:
        validate_task_set_name(args.task_set)
    except InvalidNameError as exc:
        print(f"fabric submit: {exc}", file=sys.stderr)
        return 2
    # With --run, the engine's workers start loading first, while the rest of this runs; then
    # Dagster's definitions and instance are made on a thread while the file is submitted.
    with _warm_workers(args.task_set, args) if args.run else contextlib.nullcontext():
        prepared = None
        if args.run:
            from fabric_pipelines.lib.preload import prepare_pipeline

            _prepare_environment()  # DAGSTER_HOME, which the instance is opened from
            prepared = prepare_pipeline()
        return _submit(args, prepared)


def _submit(args: argparse.Namespace, prepared: Future[tuple[Any, Any]] | None = None) -> int:
    from fabric_pipelines.lib.names import InvalidNameError
    from fabric_pipelines.lib.run_clock import mark
    from fabric_pipelines.lib.tasks.catalog import is_ingested
    from fabric_pipelines.lib.tasks.inbox import submit
    from fabric_pipelines.lib.tasks.ingest import SubmissionError
    from fabric_pipelines.lib.tasks.prompts import PromptError, chosen_prompt, record_prompt
    from fabric_pipelines.lib.tasks.source_read import read_ahead

    mark("warm_pool_started")
    paths, db = _open_database()
    mark("database_opened")
    try:
        # A set never ingested (its file could not be read) takes a corrected file in its place.
        staged = submit(
            Path(args.file), paths.inbox, args.task_set, ingested=lambda n: is_ingested(db, n)
        )
        if args.run:  # read and parsed while Dagster loads; the ingest step takes it over
            read_ahead(staged.path)
        if args.prompt is not None or args.prompt_name is not None:
            prompt = chosen_prompt(_engine_manifest(args).model_id, args.prompt, args.prompt_name)
            assert prompt is not None
            record_prompt(paths.inbox, staged.task_set, prompt)
    except (SubmissionError, InvalidNameError, PromptError) as exc:
        print(f"fabric submit: {exc}", file=sys.stderr)
        return 2
    mark("submitted")
    print(
        f"submitted {args.file} as task set {staged.task_set!r} ({staged.path}, sha256 {staged.sha256[:16]}…)"
    )
    if args.run:
        summary = run_pipeline(staged.task_set, args, prepared)
        _write_report(args, summary)
        _print_summary(summary)
    else:
        print(
            "the inbox sensor picks it up while `dagster dev` runs; or run it now: "
            f"fabric run {staged.task_set}"
        )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.names import InvalidNameError, validate_task_set_name

    try:
        validate_task_set_name(args.task_set)
    except InvalidNameError as exc:
        print(f"fabric run: {exc}", file=sys.stderr)
        return 2
    with _warm_workers(args.task_set, args):
        from fabric_pipelines.lib.preload import prepare_pipeline

        _prepare_environment()  # DAGSTER_HOME, which the instance is opened from
        prepared = prepare_pipeline()  # Dagster's definitions and instance while the database opens
        paths, db = _open_database()  # the schema first, before two runs' steps race to make it
        _read_ahead_if_new(paths, db, args.task_set)
        db.dispose()
        summary = run_pipeline(args.task_set, args, prepared)
    _write_report(args, summary)
    _print_summary(summary)
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
    """A job as it would run (lib/plan_preview.py): nothing is stored."""
    from fabric_pipelines.defs.resources import EngineConfig
    from fabric_pipelines.lib.plan_preview import preview_plan, render
    from fabric_pipelines.lib.tasks.ingest import SubmissionError

    path = Path(args.file)
    if not path.is_file():
        print(f"fabric plan: {path}: no such file", file=sys.stderr)
        return 2
    manifest = _engine_manifest(args)
    _, db = _open_database()
    try:
        config = EngineConfig(**_engine_config(args))
        preview = preview_plan(
            db, path, manifest, long_inputs=config.long_input_policy(), prompt=args.prompt or "",
            reuse=config.reuse_results,
        )  # fmt: skip
    except (SubmissionError, ValueError) as exc:
        print(f"fabric plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(preview.to_mapping(), indent=2) if args.json else render(preview))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A task set's pooled embeddings as a Parquet file (lib/export.py), with a progress bar."""
    from tqdm import tqdm

    from fabric_gpu.variants import VariantError
    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.export import ExportError, export_task_set
    from fabric_pipelines.lib.names import validate_task_set_name

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
    _, db = _open_database()
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


def cmd_status(args: argparse.Namespace) -> int:
    import pandas as pd
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.efficiency import latest_runs
    from fabric_pipelines.lib.store.models import TaskFailure, TaskSet
    from fabric_pipelines.lib.tasks.catalog import list_task_sets

    _, db = _open_database()
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
                    # Copies of stored results of the same content (lib/reuse.py).
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
    print(pd.DataFrame(rows).drop(columns="finished").fillna("").to_string(index=False))
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


def cmd_verify(args: argparse.Namespace) -> int:
    """Hash every stored file again and check the ledger; each problem with its repair."""
    import json

    from fabric_pipelines.lib.verify import verify

    paths, db = _open_database()
    try:
        report = verify(db, paths, args.task_set)
    except LookupError as exc:
        print(f"fabric verify: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
        return 0 if report.clean else 1
    for f in report.findings:
        print(f"{f.kind}: {f.subject}: {f.problem}")
        print(f"  repair: {f.repair}")
    for note in report.notes:
        print(f"note: {note}")
    checked = ", ".join(f"{what.replace('_', ' ')}: {n:,}" for what, n in report.checked.items())
    print(f"checked {checked or 'nothing (no task sets, no indexes)'}")
    if report.clean:
        print("clean: every file matches its recorded sha256 and the accounting balances")
        return 0
    print(f"{len(report.findings)} finding(s); to repair them, run in order:")
    for command in report.repairs():
        print(f"  {command}")
    return 1


def cmd_recombine(args: argparse.Namespace) -> int:
    """The repair `fabric verify` names for document vectors that differ from their windows'."""
    from sqlalchemy import select

    from fabric_pipelines.lib.documents import recombine_documents
    from fabric_pipelines.lib.store.models import Model, TaskSet

    _, db = _open_database()
    with db.connect() as conn:
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == args.task_set)).scalar()
        model = conn.execute(select(Model.id).where(Model.model_key == args.model_key)).scalar()
    if set_id is None or model is None:
        missing = f"task set {args.task_set!r}" if set_id is None else f"model {args.model_key!r}"
        print(f"fabric recombine: no {missing} (fabric status lists them)", file=sys.stderr)
        return 2
    replaced = recombine_documents(
        db, int(set_id), int(model), normalize=args.model_key.endswith("+normalized")
    )
    print(f"{args.task_set}: {replaced} document vector(s) combined again from their windows")
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    """Delete a batch's results and queue it again; `fabric run` then extracts it once more."""
    from fabric_pipelines.lib.repair import RepairError, requeue_batches

    paths, db = _open_database()
    try:
        done = requeue_batches(db, paths, args.task_set, args.batch, args.plan)
    except (RepairError, LookupError) as exc:
        print(f"fabric requeue: {exc}", file=sys.stderr)
        return 2
    print(
        f"requeued batch(es) {', '.join(map(str, done.batches))} of plan {done.plan_id}: "
        f"deleted {done.rows_deleted} embedding rows, {done.shards_deleted} shard rows, "
        f"{done.failures_deleted} failures; extract them again: fabric run {done.task_set}"
    )
    return 0


def cmd_restore_plan(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.repair import RepairError, restore_plan_file

    paths, db = _open_database()
    try:
        path = restore_plan_file(db, paths, args.task_set, args.plan)
    except (RepairError, LookupError, OSError) as exc:
        print(f"fabric restore-plan: {exc}", file=sys.stderr)
        return 2
    print(f"plan file written again: {path}")
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.settings import FabricPaths, database_url, redact_url
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_pipelines.lib.store.schema import (
        current_revision,
        downgrade,
        stores_pgvector,
        upgrade,
    )

    root = _prepare_environment()
    url = database_url(FabricPaths(root))
    engine = make_engine(url)
    if args.action == "upgrade":
        upgrade(engine, args.revision or "head")
    elif args.action == "downgrade":
        downgrade(engine, args.revision or "-1")
    revision = current_revision(engine)
    storage = "pgvector" if revision and stores_pgvector(engine) else "float32 bytes"
    print(
        f"{redact_url(url)}: schema revision {revision or 'none (empty)'}; embeddings as {storage}"
    )
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    """Check an index's files against its receipt, or rebuild it from the receipt."""
    from fabric_pipelines.lib.index.rebuild import (
        check_files,
        load_verified_receipt,
        rebuild_from_receipt,
    )
    from fabric_pipelines.lib.index.receipt import ReceiptError
    from fabric_pipelines.lib.index.staleness import indexed_models, staleness

    paths, db = _open_database()
    if args.action == "status":
        with db.connect() as conn:
            models = indexed_models(conn)
            if not models:
                print("no index yet: materialise vector_index (fabric demo builds one)")
            for key in models:
                found = staleness(conn, key, paths.indexes)
                assert found is not None  # an indexed model has a receipt
                problems = check_files(found.receipt, paths.indexes)
                print(
                    f"{key}: receipt {found.receipt_sha256[:16]}, "
                    f"{found.receipt['source']['rows']} vectors, "
                    f"stale shards {found.stale_shards or 'none'}, "
                    + (
                        "files: " + ", ".join(f"{p.file} {p.problem}" for p in problems)
                        if problems
                        else "files intact"
                    )
                )
        return 0
    if not args.receipt:
        print(f"fabric index {args.action}: --receipt FILE is required", file=sys.stderr)
        return 2
    try:
        receipt = load_verified_receipt(Path(args.receipt))
    except ReceiptError as exc:
        # A receipt that is not what its name says cannot vouch for any file.
        print(f"fabric index {args.action}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fabric index: cannot read receipt {args.receipt}: {exc}", file=sys.stderr)
        return 2
    if args.action == "verify":
        problems = check_files(receipt, paths.indexes)
        for p in problems:
            print(f"{p.file}: {p.problem}")
        print("all files match the receipt" if not problems else f"{len(problems)} problem(s)")
        return 1 if problems else 0
    try:
        report = rebuild_from_receipt(db, receipt, paths.indexes, repair=not args.no_repair)
    except ReceiptError as exc:
        print(f"fabric index rebuild: {exc}", file=sys.stderr)
        return 1
    print(f"expected index sha256 {report.expected_sha256}")
    print(f"rebuilt  index sha256 {report.rebuilt_sha256} on {report.device}")
    print(f"tolerance {report.tolerance['kind']}: {report.detail}")
    for name in report.repaired:
        print(f"repaired {name}")
    print("MATCH" if report.matches else "MISMATCH")
    return 0 if report.matches else 1


def cmd_receipt(args: argparse.Namespace) -> int:
    """Trace an index back to its task sets, batches, model and code versions."""
    from fabric_pipelines.lib.index.lineage import find_receipt, render, trace

    paths, db = _open_database()
    if args.action == "restore":
        from fabric_pipelines.lib.repair import RepairError, restore_receipt_file

        try:
            path = restore_receipt_file(db, paths, args.index)
        except RepairError as exc:
            print(f"fabric receipt restore: {exc}", file=sys.stderr)
            return 2
        print(f"receipt file written again from the database: {path}")
        return 0
    with db.connect() as conn:
        try:
            sha, receipt = find_receipt(conn, args.index)
        except (LookupError, ValueError) as exc:
            print(f"fabric receipt show: {exc}", file=sys.stderr)
            return 2
        lineage = trace(conn, sha, receipt)
    print(lineage.to_json() if args.json else render(lineage))
    return 0


def _worker(argv: list[str]) -> int:
    from fabric_pipelines.lib.workers import main as worker_main

    _prepare_environment()
    return worker_main(argv)


def cmd_forget(args: argparse.Namespace) -> int:
    """Remove a task set: its rows (results included), stored files, inbox file and partition."""
    import dagster as dg

    from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS
    from fabric_pipelines.lib.forget import ForgetRefused, forget
    from fabric_pipelines.lib.names import validate_task_set_name

    name = validate_task_set_name(args.task_set)  # InvalidNameError: main() prints it, exit 2
    paths, db = _open_database()
    instance = dg.DagsterInstance.get()
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


def cmd_workers(args: argparse.Namespace) -> int:
    """The warm engine pool: start its workers for a manifest, stop them, or show them."""
    from fabric_pipelines.lib.engine_pool import describe, pool_states, stop_pool
    from fabric_pipelines.lib.warm_runner import runner_states, stop_runners

    root = _prepare_environment()
    if args.action == "status":
        states = pool_states(root)
        runners = runner_states(root)
        if args.json:  # the pool workers (a list, as before); runners are shown as text
            print(json.dumps([state.__dict__ for state in states], indent=1))
            return 0
        if not states:
            print("no pool workers (a run starts them; or: fabric workers start --manifest FILE)")
        for state in states:
            print(describe(state))
        for runner in runners:
            doing = "serves the next fabric run" if runner["serving"] else "loading"
            print(f"warm runner {runner['key']}: pid {runner['pid']}, {doing}")
        return 0
    if args.action == "stop":
        stopped = stop_pool(root)
        runner_pids = stop_runners(root)
        print(
            f"stopped {len(stopped)} pool worker(s){': ' + ', '.join(stopped) if stopped else ''}"
            f" and {len(runner_pids)} warm runner(s)"
        )
        return 0
    return _start_pool(root, args)


def _start_pool(root: Path, args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.engine_pool import (
        START_TIMEOUT_S,
        describe,
        idle_seconds_setting,
        manifest_sha256,
        pool_folder,
        pool_states,
        slots_for,
        start_pool_worker,
        stop_pool,
        wait_until_serving,
        worker_threads,
    )
    from fabric_pipelines.lib.files import write_bytes
    from fabric_pipelines.lib.gpu_pool import visible_gpus
    from fabric_pipelines.lib.pool_run import device_of

    try:
        manifest = _engine_manifest(args)
        idle = idle_seconds_setting(args.pool_idle_seconds)
    except (OSError, ValueError) as exc:
        print(f"fabric workers start: {exc}", file=sys.stderr)
        return 2
    if idle <= 0:
        print(
            "fabric workers start: the pool is off (idle time 0): give --pool-idle-seconds "
            "or set FABRIC_POOL_IDLE_SECONDS above 0",
            file=sys.stderr,
        )
        return 2
    gpus = visible_gpus() if manifest.backend != "cpu" else 0
    count = args.workers if args.workers is not None else max(1, gpus)
    if manifest.backend != "cpu" and count > gpus:
        print(f"fabric workers start: {count} worker(s) but {gpus} GPU(s) visible", file=sys.stderr)
        return 2
    sha = manifest_sha256(manifest)
    manifest_path = pool_folder(root) / f"engine-{sha[:16]}.json"
    write_bytes(manifest_path, json.dumps(manifest.to_mapping()).encode())
    slots = slots_for(manifest, list(range(count)) if gpus else None, count)
    live = {state.slot: state for state in pool_states(root)}
    busy = [s for s in slots if s in live and live[s].manifest_sha256 != sha and live[s].busy_with]
    for slot in busy:  # never stopped mid-job: started again once it is free
        print(f"{slot}: busy with task set {live[slot].busy_with!r} for another model; left as is")
    replace = [s for s in slots if s in live and live[s].manifest_sha256 != sha and s not in busy]
    if replace:
        stop_pool(root, replace)  # a slot serves one manifest: the newest start wins
    threads = worker_threads(manifest, count)
    started = {}
    for slot in slots:
        if (slot not in live or slot in replace) and slot not in busy:
            started[slot] = start_pool_worker(
                root, slot, manifest_path, idle_seconds=idle, device=device_of(slot),
                threads=threads,
            )  # fmt: skip
    for slot, process in started.items():
        print(f"{slot}: loading {manifest.model_key} (pid {process.pid}) ...", flush=True)
        if wait_until_serving(root, slot, process, START_TIMEOUT_S) is None:
            log = pool_folder(root) / f"{slot}.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            print(
                f"fabric workers start: {slot} did not come up; its log:\n{tail}", file=sys.stderr
            )
            return 1
    for state in pool_states(root):
        print(describe(state))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric",
        description="Inference Fabric: bulk embedding and hidden-state extraction, orchestrated by Dagster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_options(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("engine (defaults: CPU engine, all-MiniLM-L6-v2)")
        g.add_argument(
            "--manifest", help="engine manifest (JSON/YAML); overrides the options below"
        )
        g.add_argument(
            "--model-id",
            help="a packaged model (sentence-transformers/all-MiniLM-L6-v2, the default, or "
            "sentence-transformers/all-mpnet-base-v2) or a local model folder",
        )
        g.add_argument(
            "--max-batch-tokens", type=int, help="padded tokens per batch (default 8192)"
        )
        g.add_argument("--max-batch-items", type=int, help="items per batch (default 256)")
        g.add_argument(
            "--max-seq-len",
            type=int,
            help="longest item in tokens (default: the model's own, 256 for all-MiniLM-L6-v2)",
        )
        g.add_argument(
            "--pooling",
            choices=("mean", "cls", "last"),
            help="how an item's vector is made from its tokens (default: the model's own)",
        )
        g.add_argument(
            "--normalize",
            action=argparse.BooleanOptionalAction,
            help="unit-length vectors (default: as the model's configuration says)",
        )
        g.add_argument(
            "--variant",
            dest="store_variant",
            metavar="V[:DIMS]",
            help=(
                "the encoding the engine stores vectors in, made on the GPU before the copy to "
                "the host: float32 (default), float16, int8 (calibrated once per model key) or "
                "binary (sign bits), optionally shortened to the first DIMS dimensions"
            ),
        )
        g.add_argument("--seq-granularity", type=int, help="bucket length step (default 8)")
        g.add_argument(
            "--hook-layers", help="comma-separated layers whose hidden states to keep (default -1)"
        )
        g.add_argument(
            "--workers", type=int, help="worker processes (default 1; 0: in this process)"
        )
        g.add_argument(
            "--long-inputs",
            choices=("chunk", "truncate", "fail"),
            help=(
                "items over max_seq_len: split into overlapping windows of the model's length, "
                "one vector per item from them (chunk, the default); cut to it and counted, as "
                "sentence-transformers does (truncate); or failed with the reason (fail)"
            ),
        )
        g.add_argument(
            "--window-overlap",
            type=int,
            help="chunk: tokens two neighbouring windows share (default 32)",
        )
        g.add_argument(
            "--truncate",
            dest="long_inputs",
            action="store_const",
            const="truncate",
            help=argparse.SUPPRESS,  # the earlier spelling of --long-inputs truncate
        )
        g.add_argument(
            "--reuse",
            dest="reuse_results",
            action=argparse.BooleanOptionalAction,
            help="give tasks whose token ids already have a stored result of this model a copy "
            "of it instead of computing them again (default: on, or FABRIC_REUSE)",
        )
        g.add_argument(
            "--lease-seconds",
            type=float,
            help="a worker's lease on a batch; an expired one is taken over (default 600)",
        )
        g.add_argument(
            "--heartbeat-seconds",
            type=float,
            help="how often a worker renews its leases while it extracts",
        )
        g.add_argument(
            "--pool-idle-seconds",
            type=float,
            help="keep the warm engine pool's workers this long after their last job "
            "(default 300, or FABRIC_POOL_IDLE_SECONDS; 0: no pool, the run's own workers)",
        )
        p.add_argument(
            "--report", metavar="FILE", help="with a run: write its summary here as JSON"
        )

    demo = sub.add_parser(
        "demo", help="run the whole pipeline on the standard library's docstrings"
    )
    demo.add_argument("--items", type=int, default=3000, help="docstrings to take (default 3000)")
    engine_options(demo)
    demo.set_defaults(func=cmd_demo)

    submit = sub.add_parser("submit", help="put a JSONL/Parquet file in the inbox as a task set")
    submit.add_argument("file")
    submit.add_argument(
        "--task-set", required=True, help="name of the task set (its partition key)"
    )
    submit.add_argument("--run", action="store_true", help="run the pipeline now, in this process")
    prompt = submit.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        help='text put before each text of the set before tokenising, e.g. "query: " '
        "(default: the model's default prompt, if it has one)",
    )
    prompt.add_argument(
        "--prompt-name", help="a prompt the model's sentence-transformers config names"
    )
    engine_options(submit)
    submit.set_defaults(func=cmd_submit)

    run = sub.add_parser("run", help="run the pipeline for a submitted task set, in this process")
    run.add_argument("task_set")
    engine_options(run)
    run.set_defaults(func=cmd_run)

    forget = sub.add_parser(
        "forget", help="remove a task set: its results, files, inbox file and partition"
    )
    forget.add_argument("task_set")
    forget.add_argument("--force", action="store_true", help="even while a run is extracting it")
    forget.set_defaults(func=cmd_forget)

    workers = sub.add_parser(
        "workers",
        help="the warm engine pool: start its workers for a manifest, stop them, show them",
    )
    workers.add_argument("action", choices=["start", "stop", "status"])
    workers.add_argument("--json", action="store_true", help="status: machine-readable output")
    engine_options(workers)
    workers.set_defaults(func=cmd_workers)

    worker = sub.add_parser(
        "worker", help="run one worker process on a task set's current plan", add_help=False
    )
    worker.add_argument("args", nargs=argparse.REMAINDER, help="see fabric worker -h")
    worker.set_defaults(func=lambda a: _worker(a.args))

    db = sub.add_parser("db", help="the results database's schema: upgrade, downgrade, current")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?", help="target revision (upgrade: head; downgrade: -1)")
    db.set_defaults(func=cmd_db)

    index = sub.add_parser(
        "index", help="vector indexes: status, verify files, rebuild from a receipt"
    )
    index.add_argument("action", choices=["status", "verify", "rebuild"])
    index.add_argument("--receipt", help="receipt JSON (dagster_home/receipts/<sha256>.json)")
    index.add_argument(
        "--no-repair", action="store_true", help="rebuild: do not write back missing files"
    )
    index.set_defaults(func=cmd_index)

    receipt = sub.add_parser("receipt", help="an index's lineage, from its receipt")
    receipt.add_argument("action", choices=["show", "restore"])
    receipt.add_argument(
        "index",
        help="show: receipt file, receipt or index sha256 (a prefix will do), or model key; "
        "restore: the receipt sha256 whose file to write again from the database",
    )
    receipt.add_argument("--json", action="store_true", help="machine-readable output")
    receipt.set_defaults(func=cmd_receipt)

    status = sub.add_parser(
        "status", help="accounting per task set: tasks = completed + failed + ..."
    )
    status.add_argument("task_set", nargs="?")
    status.add_argument("--failures", action="store_true", help="list every failed record and why")
    status.add_argument(
        "--json", action="store_true", help="machine-readable: one JSON object on stdout"
    )
    status.set_defaults(func=cmd_status)

    plan = sub.add_parser(
        "plan",
        help="what a file would become: tasks, failures, lengths, batches, padding and the "
        "predicted engine time, without running anything",
    )
    plan.add_argument("file")
    plan.add_argument("--prompt", help="as `fabric submit --prompt` would put before each text")
    plan.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    engine_options(plan)
    plan.set_defaults(func=cmd_plan)

    export = sub.add_parser(
        "export", help="a task set's embeddings as a Parquet file (id, record_no, n_tokens, vector)"
    )
    export.add_argument("task_set")
    export.add_argument("--out", help="the Parquet file to write (default: TASK_SET.parquet)")
    export.add_argument(
        "--model-key", help="whose embeddings (default: the model of the set's current plan)"
    )
    export.add_argument(
        "--layers",
        help="comma-separated hook layers whose hidden states to add, one column each "
        "(layers the run kept: --hook-layers); rows then come batch by batch",
    )
    export.add_argument(
        "--variant",
        help="the vectors as float16, int8 (calibrated on the first 50,000) or binary (sign "
        "bits), optionally shortened to their first N dimensions: e.g. int8:256 (default float32)",
    )
    export.add_argument(
        "--windows",
        action="store_true",
        help="also each window of the chunked documents (column `window`: its place, from 0; "
        "null on document rows)",
    )
    export.add_argument("--force", action="store_true", help="replace --out if it exists")
    export.set_defaults(func=cmd_export)

    verify = sub.add_parser(
        "verify",
        help="hash every stored file again, check the accounting; name each repair",
    )
    verify.add_argument("task_set", nargs="?", help="one task set (default: all, and receipts)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(func=cmd_verify)

    recombine = sub.add_parser(
        "recombine",
        help="combine again the document vectors verify found differing from their windows'",
    )
    recombine.add_argument("task_set")
    recombine.add_argument("--model-key", required=True, help="whose vectors (verify names it)")
    recombine.set_defaults(func=cmd_recombine)

    requeue = sub.add_parser(
        "requeue",
        help="delete batches' results and queue them again (then: fabric run TASK_SET)",
    )
    requeue.add_argument("task_set")
    requeue.add_argument(
        "--batch", type=int, action="append", required=True, help="batch number (repeatable)"
    )
    requeue.add_argument("--plan", help="plan id or prefix (default: the set's current plan)")
    requeue.set_defaults(func=cmd_requeue)

    restore_plan = sub.add_parser(
        "restore-plan", help="write a lost or corrupt plan file again by planning again"
    )
    restore_plan.add_argument("task_set")
    restore_plan.add_argument("plan", help="plan id (or a prefix)")
    restore_plan.set_defaults(func=cmd_restore_plan)
    return parser


def main(argv: Sequence[str] | None = None, started_at: float | None = None) -> int:
    """The `fabric` command. `started_at`: when the command started, where a warm runner's child
    runs it for a `fabric` process started earlier (lib/warm_runner.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # its own parser (fabric_pipelines.lib.workers), options and all
        return _worker(argv[1:])
    from fabric_pipelines.lib.run_clock import begin

    begin("cli_started", at=started_at)
    args = build_parser().parse_args(argv)
    runs_pipeline = args.command in ("run", "demo") or (args.command == "submit" and args.run)
    environment = None
    if runs_pipeline:
        root = _prepare_environment()
        environment = dict(os.environ)  # before the run changes it: the next run's runner key
        code = _in_warm_runner(argv, args, root)
        if code is not None:
            return code
    _quiet_dagster()
    from fabric_pipelines.lib.names import InvalidNameError

    try:
        result: int = args.func(args)
    except InvalidNameError as exc:
        print(f"fabric {args.command}: {exc}", file=sys.stderr)
        return 2
    if environment is not None:
        _leave_warm_runner(args, root, environment)
    return result


def _in_warm_runner(argv: list[str], args: argparse.Namespace, root: Path) -> int | None:
    """Run the command in a warm runner of this data root, code and settings, if one serves:
    its exit code; None to run it here."""
    from fabric_pipelines.lib.run_clock import marks
    from fabric_pipelines.lib.warm_runner import enabled, forward

    if not enabled() or _pool_idle_seconds(args) <= 0:
        return None
    return forward(argv, root, marks()["cli_started"])


def _leave_warm_runner(args: argparse.Namespace, root: Path, environment: dict[str, str]) -> None:
    """After a run made here, start a warm runner for the next (idle exit as the engine pool)."""
    from fabric_pipelines.lib.warm_runner import enabled, start_in_background

    if not enabled():
        return
    with contextlib.suppress(Exception):  # a run that worked is not failed for its successor
        start_in_background(root, _pool_idle_seconds(args), environment)


def _pool_idle_seconds(args: argparse.Namespace) -> float:
    from fabric_pipelines.lib.engine_pool import idle_seconds_setting

    try:
        return idle_seconds_setting(getattr(args, "pool_idle_seconds", None))
    except ValueError:
        return 0.0  # the run itself reports the bad setting


def run_command() -> None:
    """The `fabric` console script. Once a command has returned, everything it wrote is
    committed and fsynced: exit without the interpreter's teardown, which (torch and the CUDA
    context loaded by an index build) takes a second or more after a run."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_command()
