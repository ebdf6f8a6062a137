"""The `fabric` command line: demo, submit, run, status, db, index, receipt, worker.

Runs go through the same Dagster definitions the UI uses, in-process, against the instance in
DAGSTER_HOME, so every run shows up in the UI afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from fabric_pipelines.lib.settings import FabricPaths, database_url
    from fabric_pipelines.lib.store.db import create_schema, make_engine

    paths = FabricPaths(_prepare_environment()).ensure()
    db = make_engine(database_url(paths))
    create_schema(db)
    return paths, db


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name in ("max_batch_tokens", "max_batch_items", "max_seq_len", "seq_granularity"):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    if getattr(args, "hook_layers", None) is not None:
        config["hook_layers"] = [int(x) for x in args.hook_layers.split(",") if x.strip()]
    if getattr(args, "manifest", None):
        config["manifest_path"] = str(Path(args.manifest).resolve())
    if getattr(args, "workers", None) is not None:
        config["workers"] = args.workers
    return config


def _run_config(args: argparse.Namespace) -> dict[str, Any]:
    engine = _engine_config(args)
    return {"resources": {"engine": {"config": engine}}} if engine else {}


def _quiet_dagster() -> None:
    logging.getLogger("dagster").setLevel(logging.WARNING)


def run_pipeline(task_set: str, args: argparse.Namespace) -> dict[str, Any]:
    """Materialise the three partitioned assets for `task_set`, then the index; return a summary."""
    import dagster as dg

    from fabric_pipelines.definitions import defs

    definitions = defs()
    instance = dg.DagsterInstance.get()
    instance.add_dynamic_partitions("task_set", [task_set])
    run_config = _run_config(args)
    log_config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
    started = time.perf_counter()
    extract = definitions.resolve_job_def("extract_task_set").execute_in_process(
        partition_key=task_set,
        instance=instance,
        run_config={**run_config, **log_config},
        raise_on_error=False,
    )
    if not extract.success:
        raise SystemExit(_failure_text(extract, "extraction"))
    index = definitions.resolve_job_def("build_vector_index").execute_in_process(
        instance=instance, run_config={**run_config, **log_config}, raise_on_error=False
    )
    if not index.success:
        raise SystemExit(_failure_text(index, "index build"))
    return {
        "extract": _materializations(extract),
        "index": _materializations(index),
        "checks": _checks(extract) + _checks(index),
        "seconds": time.perf_counter() - started,
        "run_ids": (extract.run_id, index.run_id),
    }


def _failure_text(result: Any, what: str) -> str:
    for event in result.all_events:
        if event.is_failure and event.event_specific_data is not None:
            error = getattr(event.event_specific_data, "error", None)
            if error is not None:
                return f"{what} failed in {event.step_key}: {error.message.strip()}"
    return f"{what} failed; see the run {result.run_id} in the Dagster UI"


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
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "demo.jsonl"
        n = write_demo_set(source, args.items)
        submit(source, paths.inbox, DEMO_TASK_SET)
    print(f"submitted {n} records (standard-library docstrings + deliberately bad records)")
    summary = run_pipeline(DEMO_TASK_SET, args)
    _print_summary(summary)
    return 0 if all(passed for _, passed in summary["checks"]) else 1


def _print_summary(summary: dict[str, Any]) -> None:
    tasks = summary["extract"].get("tokenised_tasks", {})
    extraction = summary["extract"].get("extraction_outputs", {})
    index = summary["index"].get("vector_index", {})
    rows = [
        ("tasks submitted", f"{tasks.get('records', 0):,}"),
        ("completed", f"{extraction.get('completed', 0):,}"),
        (
            "failed",
            f"{extraction.get('failed', 0):,} (each with a reason: fabric status --failures)",
        ),
        (
            "real tokens/s",
            f"{extraction.get('real_tokens_per_s', 0):,.0f} (delivered: written and acked)",
        ),
        (
            "index",
            f"{index.get('index_path', '')}  ({index.get('factory', '')}, {index.get('vectors', 0):,} vectors)",
        ),
        ("recall@10", f"{index.get('recall_at_10', 0):.4f}"),
        ("receipt sha256", f"{index.get('receipt_sha256', '')}"),
        (
            "checks",
            ", ".join(f"{name} {'passed' if ok else 'FAILED'}" for name, ok in summary["checks"]),
        ),
        ("wall time", f"{summary['seconds']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def cmd_submit(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.names import InvalidNameError
    from fabric_pipelines.lib.settings import FabricPaths
    from fabric_pipelines.lib.tasks.inbox import submit
    from fabric_pipelines.lib.tasks.ingest import SubmissionError

    root = _prepare_environment()
    paths = FabricPaths(root).ensure()
    try:
        staged = submit(Path(args.file), paths.inbox, args.task_set)
    except (SubmissionError, InvalidNameError) as exc:
        print(f"fabric submit: {exc}", file=sys.stderr)
        return 2
    print(
        f"submitted {args.file} as task set {staged.task_set!r} ({staged.path}, sha256 {staged.sha256[:16]}…)"
    )
    if args.run:
        summary = run_pipeline(staged.task_set, args)
        _print_summary(summary)
    else:
        print(
            "the inbox sensor picks it up while `dagster dev` runs; or run it now: "
            f"fabric run {staged.task_set}"
        )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    _prepare_environment()
    summary = run_pipeline(args.task_set, args)
    _print_summary(summary)
    return 0 if all(passed for _, passed in summary["checks"]) else 1


def cmd_status(args: argparse.Namespace) -> int:
    import pandas as pd
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.store.models import TaskFailure
    from fabric_pipelines.lib.tasks.catalog import list_task_sets

    _, db = _open_database()
    names = [args.task_set] if args.task_set else list_task_sets(db)
    if not names:
        print("no task sets yet: fabric submit FILE --task-set NAME, or fabric demo")
        return 0
    rows = []
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
                    "failed": a.failed,
                    "in_flight": a.in_flight,
                    "queued": a.queued,
                    "balanced": a.balanced,
                }
            )
    print(pd.DataFrame(rows).to_string(index=False))
    if args.failures:
        with Session(db) as session:
            query = select(TaskFailure).where(TaskFailure.task_set.in_(names))
            failures = pd.DataFrame(
                [
                    {
                        "task_set": f.task_set,
                        "record": f.record_no,
                        "id": f.task_id,
                        "stage": f.stage,
                        "reason": f.reason,
                    }
                    for f in session.scalars(
                        query.order_by(TaskFailure.task_set, TaskFailure.record_no)
                    )
                ]
            )
        print()
        print(failures.to_string(index=False, max_colwidth=100) if len(failures) else "no failures")
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
    from fabric_pipelines.lib.index.publish import load_receipt
    from fabric_pipelines.lib.index.rebuild import ReceiptError, check_files, rebuild_from_receipt
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
        receipt = load_receipt(Path(args.receipt))
    except (OSError, ValueError) as exc:
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

    _, db = _open_database()
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
            "--max-batch-tokens", type=int, help="padded tokens per batch (default 8192)"
        )
        g.add_argument("--max-batch-items", type=int, help="items per batch (default 256)")
        g.add_argument("--max-seq-len", type=int, help="longest item in tokens (default 512)")
        g.add_argument("--seq-granularity", type=int, help="bucket length step (default 8)")
        g.add_argument(
            "--hook-layers", help="comma-separated layers whose hidden states to keep (default -1)"
        )
        g.add_argument(
            "--workers", type=int, help="worker processes (default 1; 0: in this process)"
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
    engine_options(submit)
    submit.set_defaults(func=cmd_submit)

    run = sub.add_parser("run", help="run the pipeline for a submitted task set, in this process")
    run.add_argument("task_set")
    engine_options(run)
    run.set_defaults(func=cmd_run)

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
    receipt.add_argument("action", choices=["show"])
    receipt.add_argument(
        "index", help="receipt file, receipt or index sha256 (a prefix will do), or model key"
    )
    receipt.add_argument("--json", action="store_true", help="machine-readable output")
    receipt.set_defaults(func=cmd_receipt)

    status = sub.add_parser(
        "status", help="accounting per task set: tasks = completed + failed + ..."
    )
    status.add_argument("task_set", nargs="?")
    status.add_argument("--failures", action="store_true", help="list every failed record and why")
    status.set_defaults(func=cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # its own parser (fabric_pipelines.lib.workers), options and all
        return _worker(argv[1:])
    args = build_parser().parse_args(argv)
    _quiet_dagster()
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
