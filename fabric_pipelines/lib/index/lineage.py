"""Where an index came from: its receipt, followed back through the database to the task sets,
their batch plans and ledgers, the model and the code versions that made it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, func, select

from fabric_pipelines.lib.index.build import recorded_builder
from fabric_pipelines.lib.index.receipt import Receipt
from fabric_pipelines.lib.store.keys import model_id_of, set_id_of
from fabric_pipelines.lib.store.models import (
    Batch,
    BatchPlanRow,
    IndexReceipt,
    Model,
    TaskSet,
    task_embeddings,
)


@dataclass
class PlanLineage:
    plan_id: str
    current: bool
    batches: int
    states: dict[str, int]
    real_tokens: int
    padded_tokens: int
    sha256: str


@dataclass
class TaskSetLineage:
    name: str
    source_sha256: str
    content_sha256: str
    tokenizer_sha256: str
    records: int
    tasks: int
    embeddings: int  # rows of this set for the index's model
    run_id: str | None  # the extraction run the receipt names
    data_version: str | None
    plans: list[PlanLineage] = field(default_factory=list)


@dataclass
class Lineage:
    receipt_sha256: str
    index: dict[str, Any]
    model: dict[str, Any]
    code: dict[str, Any]
    task_sets: list[TaskSetLineage]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def find_receipt(conn: Connection, ref: str) -> tuple[str, dict[str, Any]]:
    """A receipt by file path, receipt sha256 (or a unique prefix), index sha256 (or prefix), or
    model key (its newest index)."""
    path = Path(ref)
    if path.suffix == ".json" and path.is_file():
        receipt: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return path.stem, receipt
    rows = conn.execute(
        select(
            IndexReceipt.receipt_sha256,
            IndexReceipt.index_sha256,
            Model.model_key,
            IndexReceipt.receipt_json,
        )
        .join(Model, Model.id == IndexReceipt.model_id)
        .where(
            IndexReceipt.receipt_sha256.startswith(ref)
            | IndexReceipt.index_sha256.startswith(ref)
            | (Model.model_key == ref)
        )
        .order_by(IndexReceipt.created_at.desc(), IndexReceipt.receipt_sha256)
    ).all()
    if not rows:
        raise LookupError(
            f"no index matches {ref!r}: give a receipt file, a receipt or index sha256 (prefix) "
            "or a model key; `fabric index status` lists the indexed models"
        )
    # A whole sha256 names one receipt (or the newest receipt of one index: a rebuild of
    # unchanged rows records the same index bytes again), whatever else it is a prefix of.
    exact = [r for r in rows if r.receipt_sha256 == ref] or [
        r for r in rows if r.index_sha256 == ref
    ]
    if exact:
        return exact[0].receipt_sha256, json.loads(exact[0].receipt_json)
    shas = {r.receipt_sha256 for r in rows}
    by_model = all(r.model_key == ref for r in rows)
    if len(shas) > 1 and not by_model:
        raise LookupError(f"{ref!r} matches {len(shas)} receipts: give more of the sha256")
    return rows[0].receipt_sha256, json.loads(rows[0].receipt_json)


def trace(conn: Connection, receipt_sha256: str, recorded: dict[str, Any]) -> Lineage:
    receipt = Receipt.parse(recorded, f"receipt {receipt_sha256}")
    model = receipt.model.model_dump(mode="json")
    model_key = receipt.model_key
    model_row = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar()
    runs = {i["partition"]: i for i in receipt.inputs}
    sets = []
    for name in receipt.source.task_sets:
        ts = conn.execute(select(TaskSet).where(TaskSet.name == name)).first()
        if ts is None:
            sets.append(TaskSetLineage(name, "?", "?", "?", 0, 0, 0, None, None))
            continue
        rows = task_embeddings.c  # a row per task: its own, or the one it reused
        embeddings = conn.execute(
            select(func.count())
            .select_from(task_embeddings)
            .where(rows.task_set_id == ts.id, rows.model_id == model_row)
        ).scalar_one()
        run = runs.get(name, {})
        entry = TaskSetLineage(
            name=name,
            source_sha256=ts.source_sha256,
            content_sha256=ts.content_sha256,
            tokenizer_sha256=ts.tokenizer_sha256,
            records=ts.n_records,
            tasks=ts.n_tasks,
            embeddings=int(embeddings),
            run_id=run.get("run_id"),
            data_version=run.get("data_version"),
        )
        plans = conn.execute(
            select(BatchPlanRow)
            .where(
                BatchPlanRow.task_set_id == set_id_of(name),
                BatchPlanRow.model_id == model_id_of(model_key),
            )
            .order_by(BatchPlanRow.created_at)
        ).all()
        for plan in plans:
            states = Counter(
                dict(
                    conn.execute(
                        select(Batch.state, func.count())
                        .where(Batch.plan_id == plan.plan_id)
                        .group_by(Batch.state)
                    ).all()
                )
            )
            entry.plans.append(
                PlanLineage(
                    plan_id=plan.plan_id,
                    current=plan.plan_id == ts.current_plan_id,
                    batches=plan.n_batches,
                    states=dict(sorted(states.items())),
                    real_tokens=plan.real_tokens,
                    padded_tokens=plan.padded_tokens,
                    sha256=plan.sha256,
                )
            )
        sets.append(entry)
    index = {
        "index_sha256": receipt.index_sha256,
        "index_file": receipt.index_file,
        "factory": receipt.index.factory,
        "metric": receipt.index.metric,
        "shards": receipt.index.shards,
        "vectors": receipt.source.rows,
        "recall_at_10": receipt.quality.get("recall_at_10"),
        "build_device": receipt.build_device,
        "builder": recorded_builder(receipt.training.as_dict()),
        "quantizer_sha256": receipt.training.quantizer_sha256,
        "libraries": receipt.libraries,
    }
    return Lineage(receipt_sha256, index, model, receipt.code, sets)


def render_lineage(lineage: Lineage) -> str:
    """The lineage as an indented tree for a terminal."""
    i, m = lineage.index, lineage.model
    lines = [
        f"index {i['index_sha256'][:16]}  {i['factory']} ({i['metric']}, {i['shards']} shards), "
        f"{i['vectors']:,} vectors, recall@10 {i['recall_at_10']}, built on {i['build_device']} ({i['builder']})",
        f"  receipt   {lineage.receipt_sha256}",
        f"  quantizer {i['quantizer_sha256'][:16]}",
        f"  libraries {', '.join(f'{k} {v}' for k, v in sorted(i['libraries'].items()))}",
        f"  model     {m.get('model_id')}  weights {str(m.get('weights_sha256'))[:16]}  "
        f"{m.get('pooling')} pooling"
        + (", normalised" if m.get("normalize") else "")
        + (f", {m['max_seq_len']} tokens" if m.get("max_seq_len") else "")
        + f", {m.get('dtype')}, {m.get('backend')} backend",
    ]
    if lineage.code:
        lines.append(
            "  code      " + ", ".join(f"{k} {v}" for k, v in sorted(lineage.code.items()))
        )
    for ts in lineage.task_sets:
        lines.append(
            f"  task set  {ts.name}: {ts.records:,} records -> {ts.tasks:,} tasks -> "
            f"{ts.embeddings:,} embeddings; source {ts.source_sha256[:16]}, "
            f"stored {ts.content_sha256[:16]}, tokenizer {ts.tokenizer_sha256[:16]}"
        )
        if ts.run_id:
            lines.append(f"    extraction run {ts.run_id} (data version {ts.data_version})")
        for plan in ts.plans:
            pad = 1 - plan.real_tokens / plan.padded_tokens if plan.padded_tokens else 0.0
            states = ", ".join(f"{n} {s}" for s, n in plan.states.items())
            lines.append(
                f"    plan {plan.plan_id[:16]}{' (current)' if plan.current else ''}: "
                f"{plan.batches} batches ({states}), padding {pad:.2%}, file {plan.sha256[:16]}"
            )
    return "\n".join(lines)
