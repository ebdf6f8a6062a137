"""The planning stage: a task set's outstanding items -> batch plan file + ledger rows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.orm import Session

from fabric_gpu.batching import PLANNER_VERSION, BatchPlan, plan_batches, prefix_keys
from fabric_gpu.engines.identity import planned_identity
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import resolve_model_dir, tokenizer_sha256
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import (
    LEASED,
    QUEUED,
    outstanding_rows,
    register_plan,
    supersede_open_batches,
)
from fabric_pipelines.lib.broker.reuse import (
    content_keys,
    link_before_planning,
    reuse_enabled,
)
from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.db import insert_ignoring_duplicates
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Batch, BatchPlanRow, Model, TaskSet
from fabric_pipelines.lib.tasks.arrow_files import (
    checked_meanwhile,
    flat_tokens,
    read_table,
    write_table,
)
from fabric_pipelines.lib.tasks.catalog import get_task_set


class PlanMismatchError(ValueError):
    pass


@dataclass(frozen=True)
class PlanSummary:
    plan_id: str
    task_set: str
    plan: BatchPlan
    path: Path
    sha256: str
    outstanding: int
    new_batches: int
    # Tasks given a copy of a stored result of the same content key instead of planned
    # (lib/broker/reuse.py), and duplicates inside the set waiting for their first copy, by this planning.
    reused: int = 0
    deferred: int = 0

    def padding_by_bucket(self) -> dict[int, float]:
        """Padding fraction per bucket length."""
        out: dict[int, float] = {}
        for length in np.unique(self.plan.seq_len):
            sel = self.plan.seq_len == length
            padded = int(self.plan.padded_tokens[sel].sum())
            out[int(length)] = 1.0 - int(self.plan.real_tokens[sel].sum()) / padded
        return out


def plan_id(
    task_set_sha256: str, model_key: str, profile: ConsumerProfile, rows: np.ndarray
) -> str:
    """Identity of a plan: the same inputs always give the same id (and the same batches)."""
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            {
                "task_set_sha256": task_set_sha256,
                "model_key": model_key,
                "profile": profile.__dict__,
                "planner": PLANNER_VERSION,
            },
            sort_keys=True,
        ).encode()
    )
    digest.update(np.ascontiguousarray(rows, dtype=np.int64).tobytes())
    return digest.hexdigest()[:32]


@unit_of_work("planning task set {task_set!r}")
def plan_task_set(
    db: Engine,
    paths: FabricPaths,
    task_set: str,
    manifest: EngineManifest,
    layout: str = "padded",
    *,
    reuse: bool | None = None,
) -> PlanSummary:
    """Plan the set's outstanding items for the manifest's engine, which takes `layout` input.
    Items whose content key has a stored result are linked to it instead (lib/broker/reuse.py; `reuse`
    None: FABRIC_REUSE decides, on by default)."""
    ts = get_task_set(db, task_set)
    tok_sha = tokenizer_sha256(resolve_model_dir(manifest.model_id))
    if ts.tokenizer_sha256 != tok_sha:
        raise PlanMismatchError(
            f"task set {task_set!r} was tokenised for {ts.model_id}, whose tokenizer differs from "
            f"{manifest.model_id}'s; submit the set again under a new name for this model"
        )
    if ts.max_seq_len > manifest.profile.max_seq_len:
        raise PlanMismatchError(
            f"task set {task_set!r} admits items up to {ts.max_seq_len} tokens but the engine's "
            f"max_seq_len is {manifest.profile.max_seq_len}"
        )
    profile = manifest.profile.with_layout(layout)
    # The plan is computed while the file's hash is checked; nothing is stored before it passes.
    with checked_meanwhile(Path(ts.path), ts.content_sha256) as table:
        tokens, offsets = flat_tokens(table)
        lengths = np.diff(offsets)
        record_no = table.column("record_no").to_numpy()
        # Items sharing their first tokens run together (padded engines; packed keep arrival
        # order).
        keys = prefix_keys(tokens, offsets)
        # The hook layers are part of the key: a reused task's hidden states are its source's,
        # in the source's shard file (lib/results/export.py reads them there).
        content = (
            content_keys(
                tokens,
                offsets,
                manifest.model_key,
                manifest.hooks.layers,
                engine=planned_identity(manifest),
            )
            if reuse_enabled(reuse)
            else None
        )
        with db.begin() as conn:
            rows = outstanding_rows(conn, task_set, manifest.model_key, record_no)
            mid = model_id(conn, manifest.model_key)
    reused = None
    if content is not None:  # also with none outstanding: a broken link is dropped there
        reused = link_before_planning(db, ts.id, mid, record_no, content, rows)
        rows = reused.rows
    plan = plan_batches(lengths, profile, rows, keys=keys)

    def plannable(conn: Connection) -> np.ndarray:
        """The items with neither a result, nor a link to one, nor a failure."""
        return outstanding_rows(conn, task_set, manifest.model_key, record_no)

    if rows.size == 0:
        kept = _kept_plan_summary(db, ts, manifest.model_key)
        if kept is not None:
            return kept
    try:
        stored = _store_plan(
            db, paths, ts, manifest.model_key, profile, rows, plan, plannable,
            replan=lambda outstanding: plan_batches(lengths, profile, outstanding, keys=keys),
        )  # fmt: skip
        if reused is None:
            return stored
        return dataclasses.replace(stored, reused=reused.linked, deferred=reused.deferred)
    except _NothingLeft:
        # Another run finished the rest while this plan was computed: its plan stays current.
        kept = _kept_plan_summary(db, get_task_set(db, task_set), manifest.model_key)
        assert kept is not None  # _store_plan raises only when there is one
        return kept


def _kept_plan_summary(db: Engine, ts: TaskSet, model_key: str) -> PlanSummary | None:
    """The set's current plan for `model_key` described as it was made (from its ledger rows and
    its file), for when nothing is left to do; None if the current plan is another engine's.

    The plan that did the work stays current (an empty plan made current would hide it from what
    reads the set's lineage): planning a finished set again shows the same plan, never an empty
    one."""
    kept = _finished_current_plan(db, ts, model_key)
    if kept is None:
        return None
    order = load_plan_order(Path(kept.path), kept.sha256)
    recorded = recorded_plan(db, kept.plan_id, order)
    return PlanSummary(kept.plan_id, ts.name, recorded, Path(kept.path), kept.sha256, 0, 0)


class _NothingLeft(Exception):
    """Another run finished the set's last items while this plan was computed."""


def _store_plan(
    db: Engine,
    paths: FabricPaths,
    ts: TaskSet,
    model_key: str,
    profile: ConsumerProfile,
    rows: np.ndarray,
    plan: BatchPlan,
    plannable: Callable[[Connection], np.ndarray],
    replan: Callable[[np.ndarray], BatchPlan],
) -> PlanSummary:
    """Write the plan's file and ledger rows and make it current.

    Another run of the set may finish batches while the plan is computed (outside any lock, as
    it takes a while); a plan holding an item that meanwhile got its result would do it twice.
    So the store checks, once no older batch can finish any more, that the outstanding items are
    still `rows`, and otherwise plans again there, from what is outstanding (`replan`)."""
    task_set = ts.name
    with db.begin() as conn:
        pid = plan_id(ts.content_sha256, model_key, profile, rows)
        # Superseding the older plans' open batches comes first: from here on none of them can
        # be acked (PostgreSQL: their rows are locked; SQLite: this transaction holds the write
        # lock), so the read below sees every batch that will ever finish under an older plan.
        supersede_open_batches(conn, task_set, keep_plan=pid)
        now = plannable(conn)
        if not np.array_equal(now, rows):
            # Batches finished meanwhile. `pid` may be a plan registered before whose open
            # batches are still running: superseding those too leaves nothing that can finish,
            # so the items read now are final and the plan made from them exact.
            supersede_open_batches(conn, task_set, keep_plan=None)
            rows = plannable(conn)
            if rows.size == 0 and _current_plan_model_key(conn, task_set) == model_key:
                raise _NothingLeft  # rolls the transaction back
            plan = replan(rows)
            pid = plan_id(ts.content_sha256, model_key, profile, rows)
        path, sha = _plan_file(conn, paths, task_set, pid, plan)
        conn.execute(
            insert_ignoring_duplicates(db, BatchPlanRow),
            {
                "plan_id": pid,
                "task_set_id": ts.id,
                "model_id": model_id(conn, model_key),
                "profile_json": json.dumps(profile.__dict__, sort_keys=True),
                "n_batches": plan.n_batches,
                "n_items": int(plan.item_count.sum()),
                "real_tokens": int(plan.real_tokens.sum()),
                "padded_tokens": int(plan.padded_tokens.sum()),
                "path": str(path),
                "sha256": sha,
            },
        )
        new = register_plan(conn, pid, task_set, plan)
        conn.execute(update(TaskSet).where(TaskSet.name == task_set).values(current_plan_id=pid))
    return PlanSummary(pid, task_set, plan, path, sha, int(rows.size), new)


def _current_plan_model_key(conn: Connection, task_set: str) -> str | None:
    current = (
        select(Model.model_key)
        .join(BatchPlanRow, BatchPlanRow.model_id == Model.id)
        .join(TaskSet, TaskSet.current_plan_id == BatchPlanRow.plan_id)
        .where(TaskSet.name == task_set)
    )
    return conn.execute(current).scalar_one_or_none()


def _plan_file(
    conn: Connection, paths: FabricPaths, task_set: str, pid: str, plan: BatchPlan
) -> tuple[Path, str]:
    """The plan's order file: a plan stored before (same set, engine and outstanding items)
    reuses its file, checked against its hash; a new one is written."""
    existing = conn.execute(
        select(BatchPlanRow.path, BatchPlanRow.sha256).where(BatchPlanRow.plan_id == pid)
    ).first()
    if existing is not None:
        path, sha = Path(existing.path), existing.sha256
        load_plan_order(path, sha)
        return path, sha
    path = paths.plans / task_set / f"{pid}.arrow"
    sha = write_table(
        path,
        pa.table({"task_row": pa.array(plan.order, type=pa.int64())}),
        {"fabric.plan_id": pid, "fabric.task_set": task_set},
    )
    return path, sha


def _finished_current_plan(db: Engine, ts: TaskSet, model_key: str) -> BatchPlanRow | None:
    """The set's current plan, if it is for `model_key` and has no open batch (the caller knows
    nothing is left to compute). A plan with open batches whose tasks got linked meanwhile (to
    rows another set computed) is not kept: run, it would compute them again."""
    if ts.current_plan_id is None:
        return None
    with Session(db, expire_on_commit=False) as session:
        row = session.get(BatchPlanRow, ts.current_plan_id)
        still_open = session.scalar(
            select(Batch.batch_no)
            .where(Batch.plan_id == ts.current_plan_id, Batch.state.in_((QUEUED, LEASED)))
            .limit(1)
        )
    if still_open is not None:
        return None
    return row if row is not None and row.model_key == model_key else None


def recorded_plan(db: Engine, plan_id: str, order: np.ndarray) -> BatchPlan:
    """A plan as its ledger rows record it (every batch, in batch order) with its item order."""
    with db.connect() as conn:
        rows = conn.execute(
            select(
                Batch.seq_len, Batch.item_start, Batch.item_count, Batch.real_tokens,
                Batch.padded_tokens,
            )
            .where(Batch.plan_id == plan_id)
            .order_by(Batch.batch_no)
        ).all()  # fmt: skip
    columns = np.array(rows, dtype=np.int64).reshape(-1, 5).T
    return BatchPlan(order, *(np.ascontiguousarray(c) for c in columns))


def load_plan_order(path: Path, sha256: str) -> np.ndarray:
    table = read_table(path, sha256)
    order: np.ndarray = table.column("task_row").to_numpy()
    return order


@unit_of_work("reading the plan of task set {task_set!r}")
def current_plan(db: Engine, task_set: str) -> BatchPlanRow:
    """The plan that shape_batches last made for `task_set`; LookupError if there is none."""
    with Session(db, expire_on_commit=False) as session:
        ts = session.scalars(select(TaskSet).where(TaskSet.name == task_set)).one_or_none()
        row = session.get(BatchPlanRow, ts.current_plan_id) if ts and ts.current_plan_id else None
    if row is None:
        raise LookupError(
            f"task set {task_set!r} has no batch plan: materialise shape_batches first"
        )
    return row
