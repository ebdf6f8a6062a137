"""What each pipeline step's materialisation says: its metadata as plain values, assembled here so
the Dagster assets stay thin. Values are numbers and strings, or one of the small marker types
below, which the definitions turn into Dagster's metadata values (defs/metadata.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fabric_pipelines.lib.core.charts import power_of_two_bins
from fabric_pipelines.lib.core.plots import chart_and_table

if TYPE_CHECKING:
    from fabric_pipelines.lib.broker.ledger import Accounting
    from fabric_pipelines.lib.broker.plans import PlanSummary
    from fabric_pipelines.lib.index.publish import PublishedIndex
    from fabric_pipelines.lib.maintenance.verify import VerifyReport
    from fabric_pipelines.lib.records.efficiency import Efficiency
    from fabric_pipelines.lib.steps.run_extraction import ExtractionSummary
    from fabric_pipelines.lib.store.models import BatchPlanRow
    from fabric_pipelines.lib.tasks.catalog import IngestSummary

Metadata = dict[str, Any]


@dataclass(frozen=True)
class Markdown:
    text: str


@dataclass(frozen=True)
class FilePath:
    path: str


@dataclass(frozen=True)
class Json:
    value: Any


@dataclass(frozen=True)
class RunLink:
    run_id: str


# Links to the runs an index was built from; a receipt with more inputs names the rest in its file.
MAX_INPUT_LINKS = 20


def ingest_metadata(summary: IngestSummary, seconds: float) -> Metadata:
    # The reason starts with where the record is in the file ("line 5", "row 4").
    failures = "\n".join(f"| {f.task_id or ''} | {f.reason} |" for f in summary.failures[:50])
    lengths = summary.lengths
    histogram = (
        chart_and_table(*power_of_two_bins(lengths), ("tokens", "tasks"), title="tasks per length")
        if lengths.size
        else "no tasks"
    )
    return {
        "records": summary.n_records,
        "tasks": summary.n_tasks,
        "failed": summary.n_failed,
        "truncated": summary.truncated,
        # Records over the model's length split into windows (tasks among `tasks`).
        "chunked": summary.n_chunked,
        "windows": summary.n_windows,
        "tokens": int(lengths.sum()),
        "mean_length": round(float(lengths.mean()), 2) if lengths.size else 0.0,
        "max_length": int(lengths.max()) if lengths.size else 0,
        "reused": summary.reused,
        "prompt": repr(summary.prompt) if summary.prompt else "none",
        "seconds": round(seconds, 3),
        "path": FilePath(str(summary.path)),
        "sha256": summary.content_sha256,
        "length_histogram": Markdown(histogram),
        "failures": Markdown("| id | reason |\n|---|---|\n" + failures if failures else "none"),
    }


def plan_metadata(summary: PlanSummary, seconds: float) -> Metadata:
    plan = summary.plan
    by_bucket = summary.padding_by_bucket()
    padding = (
        chart_and_table(
            [f"{k} tokens" for k in by_bucket],
            [100 * v for v in by_bucket.values()],
            ("bucket", "padding %"),
            title="padding per bucket (% of padded tokens)",
            fmt="{:.3f}",
            full=100.0,
        )
        if by_bucket
        else "no batches"
    )
    return {
        "plan_id": summary.plan_id,
        "batches": plan.n_batches,
        "new_ledger_rows": summary.new_batches,
        "items": int(plan.item_count.sum()),
        # Tasks given a stored result of the same content instead (lib/broker/reuse.py), and
        # duplicates inside the set that wait for their first copy's row.
        "reused": summary.reused,
        "duplicates_waiting": summary.deferred,
        "real_tokens": int(plan.real_tokens.sum()),
        "padded_tokens": int(plan.padded_tokens.sum()),
        "padding_fraction": round(plan.padding_fraction, 5),
        "shapes": len(plan.shapes()),
        "padding_by_bucket": Markdown(padding),
        "path": FilePath(str(summary.path)),
        "seconds": round(seconds, 3),
    }


def extraction_metadata(
    report: ExtractionSummary,
    counts: Accounting,
    plan: BatchPlanRow,
    *,
    model_key: str,
    database: str,
    task_file: tuple[str, str],
    efficiency: Efficiency,
) -> Metadata:
    """`task_file`: the set's stored file (path, sha256); `efficiency`: the step's wall time
    and its parts (lib/records/efficiency.py)."""
    pulling = report.pulling_seconds
    return {
        "model_key": model_key,
        "database": database,
        "batches_done": report.batches_done,
        "batches_failed": report.batches_failed,
        "stale_acks": report.stale_acks,
        "workers": report.workers,
        "rows_inserted": report.rows_inserted,
        "real_tokens": report.real_tokens,
        "real_tokens_per_s": round(report.tokens_per_second, 1),
        # The step's wall time; the workers' part of it; their pulling window (first engine
        # ready, graphs captured, to the last batch acknowledged); the check after.
        "seconds": round(efficiency.step_seconds, 3),
        "extract_seconds": round(report.seconds, 3),
        "pulling_seconds": round(pulling, 3),
        "settle_seconds": round(efficiency.settle_seconds, 3),
        "verify_seconds": round(efficiency.verify_seconds, 3),
        "worker_timelines": Json(list(report.timelines)),
        "pulling_tokens_per_s": round(report.real_tokens / pulling if pulling else 0.0, 1),
        "completed": counts.completed,
        "reused": counts.reused,
        "engine_items": report.engine_items,
        "duplicates_after_workers": report.duplicates_after,
        "failed": counts.failed,
        # A set with chunked documents, by document (their windows are the tasks above).
        **({"documents": Json(counts.documents.to_mapping())} if counts.documents else {}),
        "documents_combined": report.documents_combined,
        "superseded_by": report.superseded_by or "none",
        # What this extraction ran: its plan and its task file, by content hash.
        "plan_id": plan.plan_id,
        "plan_sha256": plan.sha256,
        "plan_path": FilePath(str(plan.path)),
        "task_file_sha256": task_file[1],
        "task_file_path": FilePath(task_file[0]),
        # Where the step's time went and how well the engine was fed (lib/records/efficiency.py).
        "efficiency": efficiency.sentence(),
        "efficiency_record": Json(efficiency.as_mapping()),
    }


def accounting_check_metadata(
    task_set: str, counts: Accounting, verified: VerifyReport, problems: list[str]
) -> Metadata:
    return {
        "task_set": task_set,
        "tasks": counts.tasks,
        "completed": counts.completed,
        "reused": counts.reused,
        "failed": counts.failed,
        "in_flight": counts.in_flight,
        "queued": counts.queued,
        **({"documents": Json(counts.documents.to_mapping())} if counts.documents else {}),
        "shard_files_verified": verified.checked.get("shard_files", 0),
        "hidden_state_tasks": verified.checked.get("hidden_state_tasks", 0),
        "findings": len(verified.findings),
        "problems": "; ".join(problems[:20]) or "none",
    }


def index_metadata(published: PublishedIndex, nprobe_requested: int, seconds: float) -> Metadata:
    from fabric_pipelines.lib.index.report import (
        cluster_health_table,
        cluster_sizes_chart,
        recall_curve_chart,
        receipt_summary,
    )

    receipt = published.record
    params = receipt.index.params
    unchanged: Metadata = (
        {"note": "no row changed since this receipt: the served index stands, nothing was built"}
        if published.unchanged
        else {}
    )
    return {
        **unchanged,
        "receipt_sha256": published.receipt_sha256,
        "index_sha256": receipt.index_sha256,
        "index_path": FilePath(str(published.index_path)),
        "receipt_path": FilePath(str(published.receipt_path)),
        "vectors": receipt.source.rows,
        "factory": receipt.index.factory,
        "recall_at_10": published.recall_at_k,
        "rebuilt_shards": Json(published.rebuilt_shards),
        "recall_curve": Markdown(recall_curve_chart(receipt.quality)),
        "cluster_health": Markdown(cluster_health_table(receipt.quality)),
        "cluster_sizes": Markdown(cluster_sizes_chart(receipt.quality)),
        "published": published.accepted,
        "builder": receipt.training.as_dict().get("builder", ""),
        "nprobe": params.get("nprobe", 0),
        "nprobe_requested": params.get("nprobe_requested", nprobe_requested),
        "shortfall": published.shortfall or "none",
        "seconds": round(seconds, 3),
        "vectors_followed": published.vectors_followed,
        # Trained and assigned during extraction (index/prebuild.py): the seconds that took
        # there; empty where this step did it all.
        "prebuilt_seconds": Json(
            {k: round(v, 3) for k, v in (published.prebuilt_seconds or {}).items()}
        ),
        "phase_seconds": Json({k: round(v, 3) for k, v in published.seconds.items()}),
        "quality_seconds": Json(published.quality_seconds),
        # The essentials; the whole receipt is the file at receipt_path.
        "receipt": Markdown(receipt_summary(published.receipt, published.receipt_sha256)),
        **input_links(receipt.inputs),
    }


def recall_check_metadata(published: PublishedIndex, floor: float) -> Metadata:
    return {
        "recall_at_10": published.recall_at_k,
        "floor": floor,
        "nprobe": published.record.index.params.get("nprobe", 0),
        "what_to_change": published.shortfall or "nothing",
    }


def refused_index_metadata(published: PublishedIndex, floor: float, served: str) -> Metadata:
    """An index below its recall floor: not published; what it measured and what is served."""
    return {
        **recall_check_metadata(published, floor),
        "served_index": served,
        "refused_receipt_path": FilePath(str(published.receipt_path)),
        "published": False,
    }


def input_links(inputs: list[dict[str, str]]) -> Metadata:
    """One entry per input: a link to the extraction run that made its embeddings."""
    links: Metadata = {
        f"input {entry['partition']}": RunLink(entry["run_id"])
        for entry in inputs[:MAX_INPUT_LINKS]
        if entry.get("run_id")
    }
    if len(inputs) > MAX_INPUT_LINKS:
        links["inputs not linked"] = (
            f"{len(inputs) - MAX_INPUT_LINKS} more: see the receipt's inputs at receipt_path"
        )
    return links
