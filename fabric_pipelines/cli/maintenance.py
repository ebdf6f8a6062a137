"""Maintenance commands: verify, recombine, requeue, restore-plan, db."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from fabric_pipelines.cli.environment import open_database, prepare_environment


def cmd_verify(args: argparse.Namespace) -> int:
    """Hash every stored file again and check the ledger; each problem with its repair."""

    from fabric_pipelines.lib.maintenance.verify import verify

    paths, db = open_database()
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

    from fabric_pipelines.lib.results.documents import recombine_documents
    from fabric_pipelines.lib.store.models import Model, TaskSet

    _, db = open_database()
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
    from fabric_pipelines.lib.maintenance.repair import RepairError, requeue_batches

    paths, db = open_database()
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
    from fabric_pipelines.lib.maintenance.repair import RepairError, restore_plan_file

    paths, db = open_database()
    try:
        path = restore_plan_file(db, paths, args.task_set, args.plan)
    except (RepairError, LookupError, OSError) as exc:
        print(f"fabric restore-plan: {exc}", file=sys.stderr)
        return 2
    print(f"plan file written again: {path}")
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url, redact_url
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_pipelines.lib.store.schema import (
        current_revision,
        downgrade,
        stores_pgvector,
        upgrade,
    )

    root = prepare_environment()
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
