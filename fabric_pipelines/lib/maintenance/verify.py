"""`fabric verify`: every stored file hashed again against the database and the receipts, the
ledger's invariants checked, and each problem named with the shell command that repairs it.

What is checked, per task set: its stored Arrow file (TaskSet.content_sha256); each plan file
(BatchPlanRow.sha256) and its ledger rows; every completed batch's embedding rows; every
hidden-state shard file (HiddenStateShard.sha256, its task ids against the batch's, its layers);
that each task of a completed batch is in that batch only and, once the set keeps hidden states
(any shard row of its model), in exactly one verified shard file per layer; and the accounting
tasks = completed + reused + failed + in_flight + queued, each reused row equal to its source's,
with nothing left queued or in flight once no run holds a lease. Per indexed model: the newest receipt's files (served index, quantizer,
shards) against the receipt, and every receipt file against its own name.

A stale index is normal after new rows (the sensors rebuild it): it is a note, not a finding.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy import Connection, Engine, Text, cast, func, select
from sqlalchemy.orm import Session

from fabric_gpu.model import DEFAULT_MODEL_ID
from fabric_pipelines.lib.broker.ledger import COMPLETED, LEASED, QUEUED, accounting
from fabric_pipelines.lib.broker.reuse import broken_links
from fabric_pipelines.lib.core.files import sha256_file
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.receipt import Receipt
from fabric_pipelines.lib.index.staleness import indexed_models, latest_receipt, staleness
from fabric_pipelines.lib.results.documents import mismatched_documents
from fabric_pipelines.lib.store.models import (
    Batch,
    BatchPlanRow,
    DocumentWindow,
    Embedding,
    HiddenStateShard,
    IndexReceipt,
    Model,
    ReusedResult,
    TaskSet,
)
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.inbox import submitted_files


@dataclass(frozen=True)
class Finding:
    kind: str  # task_set_file, plan_file, shard_file, shard_coverage, rows, ledger, index_file, receipt
    subject: str  # the file, task set or batch concerned
    problem: str  # what is wrong
    repair: str  # the shell command that repairs it


@dataclass
class VerifyReport:
    findings: list[Finding] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # how many of each kind were checked
    notes: list[str] = field(default_factory=list)  # worth knowing, nothing to repair

    @property
    def clean(self) -> bool:
        return not self.findings

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    def add(self, kind: str, subject: str, problem: str, repair: str) -> None:
        self.findings.append(Finding(kind, subject, problem, repair))

    def repairs(self) -> list[str]:
        """Each distinct repair command once, in the order to run them: plan files first (a
        run reads its set's current plan; restore-plan also rewrites a damaged task-set file),
        then in the order of the findings."""
        ordered = sorted(self.findings, key=lambda f: f.kind != "plan_file")
        return list(dict.fromkeys(f.repair for f in ordered))

    def to_json(self) -> dict[str, Any]:
        return {
            "clean": self.clean,
            "findings": [asdict(f) for f in self.findings],
            "checked": self.checked,
            "notes": self.notes,
            "repairs": self.repairs(),
        }


def verify(db: Engine, paths: FabricPaths, task_set: str | None = None) -> VerifyReport:
    """Verify one task set and the indexes of its models, or (None) every task set, every
    indexed model and every receipt file. LookupError if `task_set` does not exist."""
    report = VerifyReport()
    with db.connect() as conn:
        names = (
            [task_set]
            if task_set
            else list(conn.execute(select(TaskSet.name).order_by(TaskSet.name)).scalars())
        )
        models: set[str] = set()
        for name in names:
            models |= _verify_task_set(conn, paths, name, report)
        if task_set is None:
            models |= set(indexed_models(conn))
        for model_key in sorted(models):
            _verify_index(conn, paths, model_key, report)
        if task_set is None:
            _verify_receipt_files(conn, paths, report)
    return report


@unit_of_work("verifying the outputs of task set {task_set!r}")
def verify_extraction(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    hook_layers: Sequence[int] | None = None,
    *,
    rehash_shards: bool = True,
) -> VerifyReport:
    """The checks of one task set's own outputs (no indexes): what extraction_outputs'
    accounting check calls. `hook_layers`: the layers the current plan's batches must have
    shards of (the engine manifest's); other plans' layers are read from their shard rows.
    Without `rehash_shards`, shard files are checked by presence, size and content (ids,
    layers) but not hashed again: right after a run whose writer hashed each one before its
    ack, a second full read of every hidden state would only repeat that work."""
    report = VerifyReport()
    with db.connect() as conn:
        _verify_task_set(conn, paths, task_set, report, hook_layers, rehash_shards)
    return report


# ---- one task set -----------------------------------------------------------------------------


@dataclass
class _Batch:
    plan_id: str
    batch_no: int
    state: str
    item_start: int
    item_count: int
    lease_deadline: float | None


@dataclass
class _Context:
    """What the checks of one task set share."""

    name: str
    row: Any  # the TaskSet row
    report: VerifyReport
    table: pa.Table | None = None  # the verified task-set file, or None when it is unusable
    current_plan: str | None = None
    layers_seen: list[int] = field(default_factory=list)
    # Hash shard files again and recompute combined document vectors (False: shard presence,
    # size and content only).
    rehash: bool = True

    def run(self, layers: Sequence[int] | None = None) -> str:
        return repair_command(self.row, layers if layers is not None else self.layers_seen)

    def requeue(self, batches: Sequence[tuple[str, int]], layers: Sequence[int]) -> str:
        by_plan: dict[str, list[int]] = defaultdict(list)
        for plan_id, batch_no in batches:
            by_plan[plan_id].append(batch_no)
        steps = [
            f"fabric requeue {self.name} --plan {plan_id}"
            + "".join(f" --batch {n}" for n in sorted(set(numbers)))
            for plan_id, numbers in by_plan.items()
        ]
        return " && ".join([*steps, self.run(layers)])


def repair_command(task_set: Any, layers: Sequence[int]) -> str:
    """`fabric run NAME` with the settings the set was ingested and extracted with, spelled out
    whatever the defaults are (ingest refuses another max_seq_len for a stored set; a re-run
    without the set's hook layers would leave its tasks without hidden states)."""
    command = f"fabric run {task_set.name}"
    if task_set.model_id != DEFAULT_MODEL_ID:
        command += " --manifest ENGINE_MANIFEST"  # the set's model is not the default one
    command += f" --max-seq-len {task_set.max_seq_len}"
    if layers:
        command += f" --hook-layers={','.join(str(layer) for layer in layers)}"
    return command


def file_problem(
    path: Path, sha256: str, size: int | None = None, rehash: bool = True
) -> str | None:
    """None when `path` holds the bytes recorded as `sha256` (without `rehash`: as many bytes
    as were recorded); else what is wrong with it."""
    if not path.is_file():
        return "missing"
    actual_size = path.stat().st_size
    if size is not None and actual_size < size:
        return f"truncated: {actual_size} of {size} bytes"
    if not rehash and size is not None:
        return (
            None if actual_size == size else f"grown: {actual_size} bytes where {size} were written"
        )
    actual = sha256_file(path)
    if actual == sha256:
        return None
    if size is not None and actual_size > size:
        return f"grown: {actual_size} bytes where {size} were written; sha256 {actual}"
    return f"sha256 {actual} but {sha256} recorded"


def _verify_task_set(
    conn: Connection,
    paths: FabricPaths,
    name: str,
    report: VerifyReport,
    hook_layers: Sequence[int] | None = None,
    rehash_shards: bool = True,
) -> set[str]:
    """Every check of one task set; returns the model keys of its plans."""
    row = conn.execute(select(TaskSet).where(TaskSet.name == name)).first()
    if row is None:
        raise LookupError(f"no task set named {name!r}: `fabric status` lists them")
    report.count("task_sets")
    ctx = _Context(name, row, report, current_plan=row.current_plan_id, rehash=rehash_shards)
    # ORM rows: they carry the model key read through the model's id (store/models.py).
    session = Session(conn)
    shard_rows = session.scalars(
        select(HiddenStateShard).where(HiddenStateShard.task_set_id == row.id)
    ).all()
    # In the order the engine kept them: a repair run must keep the same layers.
    ctx.layers_seen = list(dict.fromkeys(x for s in shard_rows for x in json.loads(s.layers)))
    if hook_layers is not None:
        ctx.layers_seen = list(hook_layers)
    ctx.table = _check_task_set_file(ctx, paths)

    plans = session.scalars(
        select(BatchPlanRow)
        .where(BatchPlanRow.task_set_id == row.id)
        .order_by(BatchPlanRow.created_at)
    ).all()
    batches = [
        _Batch(*b)
        for b in conn.execute(
            select(
                Batch.plan_id,
                Batch.batch_no,
                Batch.state,
                Batch.item_start,
                Batch.item_count,
                Batch.lease_deadline,
            )
            .where(Batch.task_set_id == row.id)
            .order_by(Batch.plan_id, Batch.batch_no)
        ).all()
    ]
    by_plan: dict[str, list[_Batch]] = defaultdict(list)
    for b in batches:
        by_plan[b.plan_id].append(b)
    shards_by_batch: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for s in shard_rows:
        shards_by_batch[(s.plan_id, s.batch_no)].append(s)

    orders = {plan.plan_id: _check_plan(ctx, plan, by_plan.get(plan.plan_id, [])) for plan in plans}
    known = set(orders)
    for plan_id in sorted(set(by_plan) - known):
        report.add(
            "ledger",
            f"{name} plan {plan_id}",
            f"{len(by_plan[plan_id])} ledger batch(es) belong to a plan with no plan row",
            _no_repair(name, "the plan row is gone, so which tasks those batches held is lost"),
        )
    in_ledger = {(b.plan_id, b.batch_no) for b in batches if b.plan_id in known}
    for plan_id, batch_no in sorted(set(shards_by_batch) - in_ledger):
        report.add(
            "shard_coverage",
            f"{name} plan {plan_id} batch {batch_no}",
            "hidden-state shard row(s) of a batch the ledger does not hold",
            _no_repair(name, "the shard's batch is not in the ledger"),
        )

    n_rows = ctx.table.num_rows if ctx.table is not None else 0
    record_no = ctx.table.column("record_no").to_numpy() if ctx.table is not None else None
    for model_key in sorted({plan.model_key for plan in plans}):
        model_plans = [plan for plan in plans if plan.model_key == model_key]
        embedded = _embedded_record_nos(conn, row.id, model_key)
        # Once a set keeps hidden states, every completed task of it has them, whichever run
        # extracted it: a batch re-run without the set's hook layers is a coverage gap.
        set_layers = list(
            dict.fromkeys(
                layer
                for s in shard_rows
                if s.model_key == model_key
                for layer in json.loads(s.layers)
            )
        )
        report.count("embedding_rows", int(embedded.size))
        # Completed batches per task row: each task is in one completed batch at most.
        in_batches = np.zeros(n_rows, dtype=np.int64)
        short: list[tuple[str, int]] = []
        completed_items = 0
        is_embedded = np.isin(record_no, embedded) if record_no is not None else None
        for plan in model_plans:
            order = orders[plan.plan_id]
            layers = (
                list(hook_layers)
                if hook_layers is not None and plan.plan_id == ctx.current_plan
                else set_layers
            )
            for b in by_plan.get(plan.plan_id, []):
                shards = shards_by_batch.get((plan.plan_id, b.batch_no), [])
                if b.state != COMPLETED:
                    if shards:
                        _stray_shards(ctx, b, shards, layers)
                    continue
                report.count("batches")
                completed_items += b.item_count
                rows = None
                if order is not None and ctx.table is not None:
                    rows = order[b.item_start : b.item_start + b.item_count]
                    in_batches[rows] += 1
                    assert is_embedded is not None
                    missing = int((~is_embedded[rows]).sum())
                    if missing:
                        short.append((plan.plan_id, b.batch_no))
                        report.add(
                            "rows",
                            f"{name} plan {plan.plan_id} batch {b.batch_no}",
                            f"{missing} of {b.item_count} tasks of this completed batch have no "
                            f"embedding row of {model_key}",
                            ctx.requeue([(plan.plan_id, b.batch_no)], layers),
                        )
                _check_shards(ctx, paths, b, rows, shards, layers)
        _check_duplicates(ctx, model_plans, orders, by_plan, in_batches)
        # Reused results are links, not rows (lib/broker/reuse.py); rows adopted from a forgotten
        # set belong to no batch of this one.
        adopted = _check_reused(ctx, conn, row.id, model_key)
        if embedded.size - adopted > completed_items and not short:
            report.add(
                "rows",
                f"{name} ({model_key})",
                f"{embedded.size - adopted} embedding rows (besides {adopted} adopted) but the "
                f"ledger's completed batches hold {completed_items} tasks: "
                f"{embedded.size - adopted - completed_items} rows belong to no completed batch",
                _no_repair(name, "rows were written outside the ledger"),
            )
        if model_key == _plan_model(plans, ctx.current_plan):
            _check_accounting(ctx, conn, model_key, by_plan.get(ctx.current_plan or "", []), short)
        # The extraction step (no rehash) has just combined them from its windows.
        if row.n_chunked and ctx.rehash:
            _check_documents(ctx, conn, row.id, model_key)
    return {plan.model_key for plan in plans}


def _check_documents(ctx: _Context, conn: Connection, set_id: int, model_key: str) -> None:
    """Every combined document row is what its stored windows give now, byte for byte."""
    model = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    if model is None:
        return
    ctx.report.count("chunked_sets")
    wrong = mismatched_documents(
        conn, set_id, int(model), normalize=model_key.endswith("+normalized")
    )
    if wrong:
        shown = ", ".join(map(str, wrong[:10])) + (" …" if len(wrong) > 10 else "")
        ctx.report.add(
            "documents",
            f"{ctx.name} ({model_key})",
            f"{len(wrong)} document vector(s) differ from the token-weighted mean of their "
            f"stored windows (records {shown})",
            f"fabric recombine {ctx.name} --model-key '{model_key}'",
        )


def _plan_model(plans: Sequence[Any], plan_id: str | None) -> str | None:
    return next((p.model_key for p in plans if p.plan_id == plan_id), None)


def _no_repair(name: str, why: str) -> str:
    return (
        f"# no automatic repair ({why}): submit the source file again under a new name, "
        f"`fabric submit FILE --task-set NEW && fabric run NEW`, and retire {name}"
    )


def _check_task_set_file(ctx: _Context, paths: FabricPaths) -> pa.Table | None:
    ctx.report.count("task_set_files")
    path = Path(ctx.row.path)
    problem = file_problem(path, ctx.row.content_sha256)
    if problem is None:
        try:
            return read_table(path, None)
        except OSError as exc:  # hashes as written, yet unreadable: a bad write, not a bit flip
            problem = str(exc)
    ctx.report.add("task_set_file", str(path), problem, _task_set_repair(ctx, paths))
    return None


def _task_set_repair(ctx: _Context, paths: FabricPaths) -> str:
    """Ingest writes a lost or corrupt task-set file again from the set's unchanged inbox file;
    without that file the original must be submitted again first."""
    name, run = ctx.name, ctx.run()
    present = [p for p in submitted_files(paths.inbox, name) if p.is_file()]
    original = f"ORIGINAL_FILE  # the file first submitted, sha256 {ctx.row.source_sha256}"
    if len(present) == 1 and sha256_file(present[0]) == ctx.row.source_sha256:
        return run
    removal = "".join(f"rm {shlex.quote(str(p))} && " for p in present)
    return f"{removal}fabric submit ORIGINAL_FILE --task-set {name} && {run}  # {original}"


def _check_plan(ctx: _Context, plan: Any, batches: list[_Batch]) -> np.ndarray | None:
    """The plan file (its item order, or None when unusable) and its ledger rows."""
    report, name = ctx.report, ctx.name
    report.count("plan_files")
    path = Path(plan.path)
    problem = file_problem(path, plan.sha256)
    order: np.ndarray | None = None
    if problem is None:
        try:
            order = read_table(path, None).column("task_row").to_numpy()
        except (OSError, KeyError) as exc:
            problem = str(exc)
    if problem is not None:
        report.add("plan_file", str(path), problem, f"fabric restore-plan {name} {plan.plan_id}")
    items = sum(b.item_count for b in batches)
    if len(batches) != plan.n_batches or items != plan.n_items:
        report.add(
            "ledger",
            f"{name} plan {plan.plan_id}",
            f"the ledger holds {len(batches)} batches of {items} tasks, the plan "
            f"{plan.n_batches} batches of {plan.n_items}",
            _no_repair(name, "ledger rows of the plan were deleted or added by hand"),
        )
    return order


def _embedded_record_nos(conn: Connection, set_id: int, model_key: str) -> np.ndarray:
    """The record numbers of the set's task rows for the model (not the rows of chunked
    documents, combined from their windows'), read as one row of text: a million
    rows through the driver one at a time took 0.45 s on one core (more while other threads
    want the GIL), one comma-separated string and NumPy's parse 0.1 s."""
    model = select(Model.id).where(Model.model_key == model_key).scalar_subquery()
    joined = (
        func.string_agg(cast(Embedding.record_no, Text), ",")
        if conn.dialect.name == "postgresql"
        else func.group_concat(Embedding.record_no, ",")
    )
    # A chunked document's own row was combined from its windows' rows; it is no task's.
    documents = select(DocumentWindow.record_no).where(DocumentWindow.task_set_id == set_id)
    text = conn.execute(
        select(joined).where(
            Embedding.task_set_id == set_id,
            Embedding.model_id == model,
            Embedding.record_no.not_in(documents),
        )
    ).scalar_one()
    if not text:  # no rows: the aggregate is NULL
        return np.zeros(0, np.int64)
    return np.fromstring(text, dtype=np.int64, sep=",")


def _check_shards(
    ctx: _Context,
    paths: FabricPaths,
    b: _Batch,
    rows: np.ndarray | None,
    shards: list[Any],
    layers: list[int],
) -> None:
    """A completed batch: one shard file per layer, holding exactly the batch's tasks."""
    subject = f"{ctx.name} plan {b.plan_id} batch {b.batch_no}"
    repair = ctx.requeue([(b.plan_id, b.batch_no)], layers)
    if layers and not shards:
        ctx.report.add(
            "shard_coverage",
            subject,
            f"no hidden-state shard file for layers {layers}: its {b.item_count} tasks have "
            "no hidden states",
            repair,
        )
    if len(shards) > 1:
        ctx.report.add(
            "shard_coverage",
            subject,
            f"its tasks are in {len(shards)} shard files, not one: "
            + ", ".join(s.sha256[:16] for s in shards),
            repair,
        )
    good = 0
    for s in shards:
        good += _check_shard_file(ctx, paths, s, rows, layers, b)
    if good == 1 and len(shards) == 1:
        ctx.report.count("hidden_state_tasks", b.item_count * max(len(layers), 1))


def _stray_shards(ctx: _Context, b: _Batch, shards: list[Any], layers: list[int]) -> None:
    states = {QUEUED: "queued again", LEASED: "being extracted"}
    if b.state in states:  # requeued or running: its shard row goes with its new ack
        return
    repair = (
        ctx.requeue([(b.plan_id, b.batch_no)], layers)
        if b.state == "failed"
        else _no_repair(ctx.name, f"the batch was {b.state}")
    )
    ctx.report.add(
        "shard_coverage",
        f"{ctx.name} plan {b.plan_id} batch {b.batch_no}",
        f"{len(shards)} hidden-state shard row(s) of a batch that is {b.state}, not completed",
        repair,
    )


def _check_shard_file(
    ctx: _Context,
    paths: FabricPaths,
    s: Any,
    rows: np.ndarray | None,
    layers: list[int],
    b: _Batch | None = None,
) -> int:
    """1 when the shard file verifies and matches its batch, else 0 (with a finding)."""
    ctx.report.count("shard_files")
    path = Path(s.path)
    repair = ctx.requeue([(s.plan_id, s.batch_no)], layers)
    problem = file_problem(path, s.sha256, s.bytes, ctx.rehash)
    if problem is not None:
        ctx.report.add("shard_file", str(path), problem, repair)
        return 0
    try:
        with pa.memory_map(str(path), "r") as source:
            table = pa.ipc.open_file(source).read_all()
        file_layers = json.loads(table.schema.metadata[b"fabric.layers"])
        ids = table.column("task_id").to_pylist()
    except (OSError, KeyError, ValueError, pa.ArrowException) as exc:
        ctx.report.add("shard_file", str(path), f"unreadable as a shard: {exc}", repair)
        return 0
    subject = f"{path} ({ctx.name} plan {s.plan_id} batch {s.batch_no})"
    problems = []
    if file_layers != json.loads(s.layers):
        problems.append(f"holds layers {file_layers}, its row says {json.loads(s.layers)}")
    if layers and sorted(file_layers) != sorted(layers):
        problems.append(f"holds layers {file_layers}, the plan's batches keep {layers}")
    if len(ids) != s.n_items or (b is not None and len(ids) != b.item_count):
        problems.append(
            f"holds {len(ids)} tasks, its row says {s.n_items}"
            + (f" and its batch {b.item_count}" if b is not None else "")
        )
    elif rows is not None and ctx.table is not None:
        expected = ctx.table.column("id").take(pa.array(rows)).to_pylist()
        if ids != expected:
            wrong = sum(1 for a, e in zip(ids, expected, strict=True) if a != e)
            problems.append(f"{wrong} of its {len(ids)} task ids are not the batch's")
    for problem in problems:
        ctx.report.add("shard_coverage", subject, problem, repair)
    return 0 if problems else 1


def _check_duplicates(
    ctx: _Context,
    plans: Sequence[Any],
    orders: dict[str, np.ndarray | None],
    by_plan: dict[str, list[_Batch]],
    in_batches: np.ndarray,
) -> None:
    """A task in two completed batches has two results and two shard files: requeue both."""
    if not (in_batches > 1).any():
        return
    twice = np.flatnonzero(in_batches > 1)
    involved: set[tuple[str, int]] = set()
    for plan in plans:
        order = orders[plan.plan_id]
        if order is None:
            continue
        for b in by_plan.get(plan.plan_id, []):
            if (
                b.state == COMPLETED
                and np.isin(order[b.item_start : b.item_start + b.item_count], twice).any()
            ):
                involved.add((plan.plan_id, b.batch_no))
    ctx.report.add(
        "ledger",
        f"{ctx.name}",
        f"{twice.size} tasks are in more than one completed batch: "
        + ", ".join(f"plan {p} batch {n}" for p, n in sorted(involved)),
        ctx.requeue(sorted(involved), ctx.layers_seen),
    )


def _check_reused(ctx: _Context, conn: Connection, set_id: int, model_key: str) -> int:
    """Every link of the set names a result that is stored, failed, or still to be computed by
    the set itself; how many rows the set's tasks adopted from a forgotten set (computed by no
    batch of their own, store/result_links.py)."""
    model = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    if model is None:
        return 0
    links, broken, adopted = broken_links(conn, set_id, int(model))
    ctx.report.count("reused_rows", links)
    if broken:
        ctx.report.add(
            "rows",
            f"{ctx.name} ({model_key})",
            f"{broken} of {links} reused results name a row that is no longer stored",
            ctx.run(),
        )
    # A set that keeps hidden states reads its reused tasks' states from their sources' shard
    # files: each source set must hold shard files of the same layers.
    if ctx.layers_seen and links:
        sources = conn.execute(
            select(ReusedResult.from_task_set_id)
            .where(ReusedResult.task_set_id == set_id, ReusedResult.model_id == model,
                   ReusedResult.from_task_set_id != set_id)
            .distinct()
        ).scalars().all()  # fmt: skip
        for source in sources:
            kept = {
                k
                for layers in conn.execute(
                    select(HiddenStateShard.layers).where(
                        HiddenStateShard.task_set_id == source, HiddenStateShard.model_id == model
                    )
                ).scalars()
                for k in json.loads(layers)
            }
            missing = [k for k in ctx.layers_seen if k not in kept]
            if missing:
                ctx.report.add(
                    "shard_coverage",
                    f"{ctx.name} ({model_key})",
                    f"tasks reuse results of task set id {source}, which holds no hidden states "
                    f"of layers {missing}: those tasks have none",
                    ctx.run(),
                )
    return adopted


def _check_accounting(
    ctx: _Context,
    conn: Connection,
    model_key: str,
    current: list[_Batch],
    short: list[tuple[str, int]],
) -> None:
    a = accounting(conn, ctx.name, model_key)
    ctx.report.count("ledgers")
    repair = ctx.requeue(short, ctx.layers_seen) if short else ctx.run()
    if not a.balanced:
        ctx.report.add(
            "ledger",
            ctx.name,
            f"tasks {a.tasks} != completed {a.completed} + reused {a.reused} + failed "
            f"{a.failed} + in flight {a.in_flight} + queued {a.queued} "
            f"(= {a.completed + a.reused + a.failed + a.in_flight + a.queued})",
            repair,
        )
    docs = a.documents
    if docs is not None and docs.waiting and not (a.in_flight or a.queued):
        ctx.report.add(
            "ledger",
            ctx.name,
            f"{docs.waiting} of {docs.documents} documents are neither stored nor failed, though "
            f"no window is queued or in flight: their vectors were never combined from their "
            "windows",
            ctx.run(),
        )
    if a.in_flight or a.queued:
        now = time.time()
        live = [b for b in current if b.state == LEASED and (b.lease_deadline or 0) > now]
        if live:
            ctx.report.notes.append(
                f"{ctx.name}: a run is in progress ({len(live)} batch(es) under a live lease, "
                f"{a.queued} tasks queued): its outputs are checked as they are now"
            )
        else:
            ctx.report.add(
                "ledger",
                ctx.name,
                f"{a.queued} tasks queued and {a.in_flight} in flight under expired leases, "
                "with no run holding a lease: the last run did not finish",
                ctx.run(),
            )


# ---- indexes and receipts ---------------------------------------------------------------------


def _verify_index(
    conn: Connection, paths: FabricPaths, model_key: str, report: VerifyReport
) -> None:
    """The newest receipt of `model_key`: its file, and the index files it names."""
    # Here, not at the top: they load FAISS and torch, which checking a task set never needs.
    from fabric_pipelines.lib.index.paths import model_index_folder
    from fabric_pipelines.lib.index.rebuild import check_files, check_receipt_file

    latest = latest_receipt(conn, model_key)
    if latest is None:
        report.notes.append(f"{model_key}: no index yet")
        return
    sha, recorded = latest
    receipt = Receipt.parse(recorded, f"receipt {sha} of {model_key}")
    receipt_path = paths.receipts / f"{sha}.json"
    report.count("receipt_files")
    problem = check_receipt_file(receipt_path)
    if problem is not None:
        report.add("receipt", str(receipt_path), problem, f"fabric receipt restore {sha}")
    found = staleness(conn, model_key, paths.indexes)
    stale = found is not None and bool(found.stale_shards)
    if stale and found is not None:
        report.notes.append(
            f"{model_key}: index stale (rebuild pending): shards {found.stale_shards} changed "
            f"since receipt {sha[:16]}; the staleness sensor or the nightly schedule rebuilds it"
        )
    folder = model_index_folder(paths.indexes, model_key)
    wanted = dict(receipt.files())
    report.count("index_files", len(wanted))
    for p in check_files(receipt, paths.indexes):
        path = folder / p.file
        detail = file_problem(path, wanted[p.file]) or p.problem
        if stale:
            # The receipt's rows changed: a fresh build over today's rows replaces its files.
            sets = receipt.source.task_sets
            row = conn.execute(select(TaskSet).where(TaskSet.name == sets[0])).first() if sets else None  # fmt: skip
            repair = (
                repair_command(row, [])
                if row is not None
                else "# materialise vector_index (Dagster UI) for a fresh index"
            )
        else:
            restore = f"fabric receipt restore {sha} && " if problem is not None else ""
            repair = f"{restore}fabric index rebuild --receipt {shlex.quote(str(receipt_path))}"
        report.add("index_file", str(path), detail, repair)


def _verify_receipt_files(conn: Connection, paths: FabricPaths, report: VerifyReport) -> None:
    """Every receipt file against its own name, and every receipt row's file (the newest
    receipts' files were checked with their index)."""
    from fabric_pipelines.lib.index.rebuild import check_receipt_file  # see _verify_index

    latest = {
        sha
        for key in indexed_models(conn)
        if (found := latest_receipt(conn, key)) is not None
        for sha in [found[0]]
    }
    rows = set(conn.execute(select(IndexReceipt.receipt_sha256)).scalars())
    names = {p.stem for p in paths.receipts.glob("*.json") if not p.name.startswith(".")}
    for stem in sorted((names | rows) - latest):
        path = paths.receipts / f"{stem}.json"
        report.count("receipt_files")
        problem = check_receipt_file(path)
        if problem is None:
            continue
        repair = (
            f"fabric receipt restore {stem}"
            if stem in rows
            else f"rm {shlex.quote(str(path))}  # no index row refers to it"
        )
        report.add("receipt", str(path), problem, repair)
