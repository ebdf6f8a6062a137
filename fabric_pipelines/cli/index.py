"""Index commands: index (build, status, rebuild, verify) and receipt (lineage)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from fabric_pipelines.cli.environment import open_database


def cmd_index(args: argparse.Namespace) -> int:
    """Check an index's files against its receipt, or rebuild it from the receipt."""
    from fabric_pipelines.lib.index.rebuild import (
        check_files,
        load_verified_receipt,
        rebuild_from_receipt,
    )
    from fabric_pipelines.lib.index.receipt import ReceiptError
    from fabric_pipelines.lib.index.staleness import indexed_models, staleness

    paths, db = open_database()
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
    from fabric_pipelines.lib.index.lineage import find_receipt, render_lineage, trace

    paths, db = open_database()
    if args.action == "restore":
        from fabric_pipelines.lib.maintenance.repair import RepairError, restore_receipt_file

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
    print(lineage.to_json() if args.json else render_lineage(lineage))
    return 0
