"""The four asset families: tokenised_tasks -> shape_batches -> extraction_outputs -> vector_index.

Each asset is a thin call into fabric_pipelines.lib; results go to the database and to files
through resources, and each returns a MaterializeResult with a data version and small metadata.
"""

import hashlib
import time
import warnings
from typing import Any

import dagster as dg

from fabric_gpu.engines import input_layout
from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS, task_sets
from fabric_pipelines.defs.resources import ArtifactStore, Database, EngineConfig
from fabric_pipelines.lib.broker.ledger import Accounting, accounting
from fabric_pipelines.lib.broker.plans import current_plan, plan_task_set
from fabric_pipelines.lib.charts import power_of_two_bins
from fabric_pipelines.lib.index import vector_tail
from fabric_pipelines.lib.index.staleness import latest_receipt
from fabric_pipelines.lib.plots import chart_and_table
from fabric_pipelines.lib.preload import INDEX_MODULES, preload
from fabric_pipelines.lib.progress import TaskProgress, stage
from fabric_pipelines.lib.run_extraction import extract_task_set
from fabric_pipelines.lib.store.settle import settle_embeddings, settling_meanwhile
from fabric_pipelines.lib.tasks.catalog import get_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.ingest import SubmissionError
from fabric_pipelines.lib.verify import verify_extraction

CODE_VERSION = "0.1.0"
# Each asset's code version; the index receipt records them all.
CODE_VERSIONS = {
    "tokenised_tasks": f"tokenise-{CODE_VERSION}",
    "shape_batches": f"plan-{CODE_VERSION}",
    "extraction_outputs": f"extract-{CODE_VERSION}",
    "vector_index": f"index-{CODE_VERSION}",
}
# One group for the four families: the UI opens a graph of several groups with each group
# collapsed, and a group of one asset then hides that asset's name.
PIPELINE_GROUP = "inference_fabric"


@dg.asset(
    partitions_def=task_sets,
    group_name=PIPELINE_GROUP,
    kinds={"python", "arrow"},
    code_version=CODE_VERSIONS["tokenised_tasks"],
    description=(
        "A submitted task set, tokenised with the model's fast tokenizer and stored as an Arrow "
        "IPC file (atomic write, sha256 checked on read). Bad records are failed back with a "
        "reason each; they never abort the set."
    ),
)
def tokenised_tasks(
    context: dg.AssetExecutionContext,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    manifest = engine.manifest()
    started = time.perf_counter()
    stage("ingest")
    try:
        summary = ingest_task_set(
            database.engine(),
            store.paths(),
            context.partition_key,
            model_id=manifest.model_id,
            max_seq_len=manifest.profile.max_seq_len,
            truncate=engine.truncate,
        )
    except (SubmissionError, ValueError) as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    # The reason starts with where the record is in the file ("line 5", "row 4").
    failures = "\n".join(f"| {f.task_id or ''} | {f.reason} |" for f in summary.failures[:50])
    lengths = summary.lengths
    return dg.MaterializeResult(
        metadata={
            "records": summary.n_records,
            "tasks": summary.n_tasks,
            "failed": summary.n_failed,
            "truncated": summary.truncated,
            "tokens": int(lengths.sum()),
            "mean_length": round(float(lengths.mean()), 2) if lengths.size else 0.0,
            "max_length": int(lengths.max()) if lengths.size else 0,
            "reused": summary.reused,
            "seconds": round(time.perf_counter() - started, 3),
            "path": dg.MetadataValue.path(str(summary.path)),
            "sha256": summary.content_sha256,
            "length_histogram": dg.MetadataValue.md(
                chart_and_table(
                    *power_of_two_bins(lengths), ("tokens", "tasks"), title="tasks per length"
                )
                if lengths.size
                else "no tasks"
            ),
            "failures": dg.MetadataValue.md(
                "| id | reason |\n|---|---|\n" + failures if failures else "none"
            ),
        },
        data_version=dg.DataVersion(summary.content_sha256),
    )


@dg.asset(
    partitions_def=task_sets,
    deps=[tokenised_tasks],
    group_name=PIPELINE_GROUP,
    kinds={"numpy", "arrow"},
    code_version=CODE_VERSIONS["shape_batches"],
    description=(
        "Shape-pure batches of the task set's outstanding items for the engine's consumer "
        "profile (max batch tokens, items, sequence length, granularity), plus one ledger row per "
        "batch in the database."
    ),
)
def shape_batches(
    context: dg.AssetExecutionContext,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    manifest = engine.manifest()
    started = time.perf_counter()
    stage("plan")
    summary = plan_task_set(
        database.engine(), store.paths(), context.partition_key, manifest, input_layout(manifest)
    )
    plan = summary.plan
    by_bucket = summary.padding_by_bucket()
    return dg.MaterializeResult(
        metadata={
            "plan_id": summary.plan_id,
            "batches": plan.n_batches,
            "new_ledger_rows": summary.new_batches,
            "items": int(plan.item_count.sum()),
            "real_tokens": int(plan.real_tokens.sum()),
            "padded_tokens": int(plan.padded_tokens.sum()),
            "padding_fraction": round(plan.padding_fraction, 5),
            "shapes": len(plan.shapes()),
            "padding_by_bucket": dg.MetadataValue.md(
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
            ),
            "path": dg.MetadataValue.path(str(summary.path)),
            "seconds": round(time.perf_counter() - started, 3),
        },
        data_version=dg.DataVersion(summary.plan_id),
    )


def _partitioned_check_spec(name: str, **kwargs: Any) -> dg.AssetCheckSpec:
    """A check recorded per task set: a failed set's check is that partition's, and the UI
    keeps every other set's result beside it. (Dagster marks check partitions a preview.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec.*")
        return dg.AssetCheckSpec(name, partitions_def=task_sets, **kwargs)


@dg.asset(
    partitions_def=task_sets,
    deps=[shape_batches],
    group_name=PIPELINE_GROUP,
    kinds={"pytorch", "sql"},
    code_version=CODE_VERSIONS["extraction_outputs"],
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=2, delay=10),
    check_specs=[
        _partitioned_check_spec(
            "accounting",
            asset="extraction_outputs",
            blocking=True,
            description=(
                "tasks = completed + failed + in_flight + queued, nothing left in flight, and "
                "every stored output verified: each completed task has its embedding row and, "
                "when the engine keeps hook layers, is in exactly one shard file (sha256 "
                "checked) per layer"
            ),
        )
    ],
    description=(
        "Pooled embeddings (database rows) and hook-layer hidden states (content-addressed shard "
        "files) of every task, from the engine driven batch by batch off the ledger."
    ),
)
def extraction_outputs(
    context: dg.AssetExecutionContext,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    task_set = context.partition_key
    started = time.perf_counter()
    manifest = engine.manifest()
    db = database.engine()
    try:
        plan_row = current_plan(db, task_set)
    except LookupError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc

    stage("extract", tasks=plan_row.n_items, real_tokens=plan_row.real_tokens)
    bar = TaskProgress(f"extract {task_set}")

    def progress(counts: Accounting) -> None:
        bar.update(counts)
        context.log.info(
            f"{task_set}: {counts.completed:,} completed, {counts.failed:,} failed, "
            f"{counts.in_flight:,} in flight, {counts.queued:,} queued of {counts.tasks:,}"
        )
        context.log_event(
            dg.AssetObservation(
                asset_key=context.asset_key,
                partition=task_set,
                metadata={
                    "completed": counts.completed,
                    "in_flight": counts.in_flight,
                    "queued": counts.queued,
                },
            )
        )

    def waiting_for_gpus() -> None:
        context.log.info(f"{task_set}: waiting for {engine.workers} free GPU(s)")

    # The index step that follows needs torch and FAISS: import them while the workers run
    # (lib/preload.py).
    preload(INDEX_MODULES)
    try:
        # The index step's vectors are read while the workers write them (lib/index/vector_tail.py);
        # PostgreSQL's fresh pages are marked visible as they fill (lib/store/settle.py).
        with (
            vector_tail.following(db, manifest.model_key, task_set),
            settling_meanwhile(db),
            engine.devices(store.paths(), waiting_for_gpus, task_set) as devices,
        ):
            report = extract_task_set(
                db,
                store.paths(),
                task_set,
                manifest,
                database_url=database.resolved_url(),
                workers=engine.workers,
                lease_seconds=engine.lease_seconds,
                heartbeat_seconds=engine.heartbeat_seconds,
                devices=devices,
                on_progress=progress,
                pool_idle_seconds=engine.pool_idle(),
            )
    finally:
        bar.close()
    # PostgreSQL: make the fresh rows countable from the primary key alone (lib/store/settle.py).
    settle_started = time.perf_counter()
    if report.rows_inserted:
        settle_embeddings(db)
    settle_seconds = time.perf_counter() - settle_started
    with db.connect() as conn:
        counts = accounting(conn, task_set, manifest.model_key)
    # This run's engine promised its hook layers for what it extracted; batches of earlier runs
    # are held to the layers their own shard rows record.
    layers = manifest.hooks.layers if report.batches_done else None
    # Coverage, not a second hash of every shard: the writer hashed each one before its ack.
    verify_started = time.perf_counter()
    verified = verify_extraction(db, store.paths(), task_set, layers, rehash_shards=False)
    verify_seconds = time.perf_counter() - verify_started
    problems = [
        f"{f.kind} {f.subject}: {f.problem} (repair: {f.repair})" for f in verified.findings
    ]
    if report.superseded:
        # Another run of this set re-planned it: say so instead of a bare failed count.
        context.log.warning(report.superseded)
        problems.insert(0, report.superseded)
    version = hashlib.sha256(
        f"{plan_row.plan_id}:{counts.completed}:{counts.failed}".encode()
    ).hexdigest()
    return dg.MaterializeResult(
        metadata={
            "model_key": manifest.model_key,
            "database": database.describe(),
            "batches_done": report.batches_done,
            "batches_failed": report.batches_failed,
            "stale_acks": report.stale_acks,
            "workers": report.workers,
            "rows_inserted": report.rows_inserted,
            "real_tokens": report.real_tokens,
            "real_tokens_per_s": round(report.tokens_per_second, 1),
            # The step's wall time; the workers' part of it; their pulling window (first
            # engine ready, graphs captured, to the last batch acknowledged); the check after.
            "seconds": round(time.perf_counter() - started, 3),
            "extract_seconds": round(report.seconds, 3),
            "pulling_seconds": round(report.pulling_seconds, 3),
            "settle_seconds": round(settle_seconds, 3),
            "verify_seconds": round(verify_seconds, 3),
            "worker_timelines": dg.MetadataValue.json(list(report.timelines)),
            "pulling_tokens_per_s": round(
                report.real_tokens / report.pulling_seconds if report.pulling_seconds else 0.0, 1
            ),
            "completed": counts.completed,
            "failed": counts.failed,
            "superseded_by": report.superseded_by or "none",
            # What this extraction ran: its plan and its task file, by content hash.
            "plan_id": plan_row.plan_id,
            "plan_sha256": plan_row.sha256,
            "plan_path": dg.MetadataValue.path(str(plan_row.path)),
            **_task_file(database.engine(), context.partition_key),
        },
        data_version=dg.DataVersion(version),
        check_results=[
            dg.AssetCheckResult(
                check_name="accounting",
                passed=counts.finished and verified.clean,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata={
                    "task_set": task_set,
                    "tasks": counts.tasks,
                    "completed": counts.completed,
                    "failed": counts.failed,
                    "in_flight": counts.in_flight,
                    "queued": counts.queued,
                    "shard_files_verified": verified.checked.get("shard_files", 0),
                    "hidden_state_tasks": verified.checked.get("hidden_state_tasks", 0),
                    "findings": len(verified.findings),
                    "problems": "; ".join(problems[:20]) or "none",
                },
            )
        ],
    )


class IndexConfig(dg.Config):
    """Launchpad settings of an index build."""

    factory: str = "auto"
    metric: str = "cosine"
    nprobe: int = 16
    min_recall: float = 0.9
    shards: int = 8
    device: str = "auto"
    kmeans: str = "auto"  # torch on a GPU, faiss-cpu without one; or "torch" / "faiss"
    full_rebuild: bool = False  # retrain and refill every shard instead of only the stale ones


@dg.asset(
    deps=[extraction_outputs],
    group_name=PIPELINE_GROUP,
    kinds={"faiss"},
    code_version=CODE_VERSIONS["vector_index"],
    # Rebuilt when any set's extraction updates, even while another set has no output (a bad
    # set must not hold back the index of the good ones).
    automation_condition=dg.AutomationCondition.eager()
    .without(~dg.AutomationCondition.any_deps_missing())
    .with_label("eager, allowing sets without output"),
    check_specs=[
        dg.AssetCheckSpec(
            "recall_at_10",
            asset="vector_index",
            description="recall@10 against exact search is at least the configured floor",
            blocking=True,
        )
    ],
    description=(
        "A FAISS index over every pooled embedding of the engine's model, with a receipt "
        "(canonical JSON; its sha256 is this asset's data version) that says how to rebuild it."
    ),
)
def vector_index(
    context: dg.AssetExecutionContext,
    config: IndexConfig,
    store: ArtifactStore,
    database: Database,
    engine: EngineConfig,
) -> dg.MaterializeResult:
    # Imported here, not with the definitions: torch and FAISS take seconds to load, and every
    # process that loads the definitions would pay them (the extraction step preloads them).
    from fabric_pipelines.lib.index.build import IndexSpec
    from fabric_pipelines.lib.index.publish import (
        EmptySourceError,
        build_and_publish,
        cluster_health_table,
        cluster_sizes_chart,
        recall_curve_chart,
        receipt_summary,
    )

    manifest = engine.manifest()
    paths = store.paths()
    started = time.perf_counter()
    stage("index")
    spec = IndexSpec(
        factory=config.factory,
        metric=config.metric,
        nprobe=config.nprobe,
        shards=config.shards,
        device=config.device,
        kmeans=config.kmeans,
    )
    db = database.engine()
    with db.connect() as conn:
        serving = latest_receipt(conn, manifest.model_key)
    latest = None if config.full_rebuild else serving
    try:
        published = build_and_publish(
            db,
            model_key=manifest.model_key,
            model={
                "model_id": manifest.model_id,
                "weights_sha256": manifest.weights_sha256,
                "pooling": manifest.hooks.pooling,
                "layer": "pooled",
                "dtype": manifest.dtype,
                "backend": manifest.backend,
            },
            spec=spec,
            index_folder=paths.indexes,
            receipt_folder=paths.receipts,
            inputs=_input_partitions(context),
            previous=latest[1] if latest else None,
            min_recall=config.min_recall,
            code=CODE_VERSIONS,
        )
    except EmptySourceError:
        # Nothing to index (an empty set, or one whose every task failed) is an outcome, not a
        # failure: the asset materialises with no index file and says so.
        note = (
            f"no index built: model {manifest.model_key} has no embeddings (the task sets are "
            "empty, or every task failed: fabric status --failures lists why)"
        )
        context.log.info(f"vector_index: {note}")
        return dg.MaterializeResult(
            metadata={"vectors": 0, "note": note, "published": False},
            data_version=dg.DataVersion(f"empty:{manifest.model_key}"),
            check_results=[
                dg.AssetCheckResult(
                    check_name="recall_at_10",
                    passed=True,
                    severity=dg.AssetCheckSeverity.ERROR,
                    metadata={"note": "no vectors: nothing to measure"},
                )
            ],
        )
    context.log.info(
        f"vector_index: rebuilt shards {published.rebuilt_shards or 'none'} of {spec.shards}"
    )
    recall = published.recall_at_k
    if not published.accepted:
        # Failed before any materialisation is recorded: the asset's latest materialisation stays
        # the index that is served, so the UI's first line never shows an unpublished one.
        served = f"receipt {serving[0]}" if serving else "none yet"
        raise dg.Failure(
            description=(
                f"index not published: {published.shortfall}. The index served stays: {served}. "
                f"The extraction results are committed; only the index was refused."
            ),
            metadata={
                "recall_at_10": recall,
                "floor": config.min_recall,
                "nprobe": published.receipt["index"]["params"].get("nprobe", 0),
                "what_to_change": published.shortfall,
                "served_index": served,
                "refused_receipt_path": dg.MetadataValue.path(str(published.receipt_path)),
                "published": False,
            },
            allow_retries=False,
        )
    return dg.MaterializeResult(
        metadata={
            "receipt_sha256": published.receipt_sha256,
            "index_sha256": published.receipt["index_sha256"],
            "index_path": dg.MetadataValue.path(str(published.index_path)),
            "receipt_path": dg.MetadataValue.path(str(published.receipt_path)),
            "vectors": published.receipt["source"]["rows"],
            "factory": published.receipt["index"]["factory"],
            "recall_at_10": recall,
            "rebuilt_shards": dg.MetadataValue.json(published.rebuilt_shards),
            "recall_curve": dg.MetadataValue.md(recall_curve_chart(published.receipt["quality"])),
            "cluster_health": dg.MetadataValue.md(
                cluster_health_table(published.receipt["quality"])
            ),
            "cluster_sizes": dg.MetadataValue.md(cluster_sizes_chart(published.receipt["quality"])),
            "published": published.accepted,
            "builder": published.receipt["training"].get("builder", ""),
            "nprobe": published.receipt["index"]["params"].get("nprobe", 0),
            "nprobe_requested": published.receipt["index"]["params"].get(
                "nprobe_requested", spec.nprobe
            ),
            "shortfall": published.shortfall or "none",
            "seconds": round(time.perf_counter() - started, 3),
            "vectors_followed": published.vectors_followed,
            "phase_seconds": dg.MetadataValue.json(
                {k: round(v, 3) for k, v in published.seconds.items()}
            ),
            # The essentials; the whole receipt is the file at receipt_path.
            "receipt": dg.MetadataValue.md(
                receipt_summary(published.receipt, published.receipt_sha256)
            ),
            **_input_links(published.receipt["inputs"]),
        },
        data_version=dg.DataVersion(published.receipt_sha256),
        check_results=[
            dg.AssetCheckResult(
                check_name="recall_at_10",
                passed=recall >= config.min_recall,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata={
                    "recall_at_10": recall,
                    "floor": config.min_recall,
                    "nprobe": published.receipt["index"]["params"].get("nprobe", 0),
                    "what_to_change": published.shortfall or "nothing",
                },
            )
        ],
    )


def _input_partitions(context: dg.AssetExecutionContext) -> list[dict[str, str]]:
    """Each extraction_outputs partition's latest run id and data version, for the receipt."""
    key = dg.AssetKey("extraction_outputs")
    out = []
    for partition in sorted(context.instance.get_dynamic_partitions(TASK_SET_PARTITIONS)):
        records = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1
        ).records
        if not records:
            continue
        materialization = records[0].asset_materialization
        version = materialization.tags.get("dagster/data_version") if materialization else None
        out.append(
            {"partition": partition, "run_id": records[0].run_id, "data_version": version or ""}
        )
    return out


# Links to the runs the index was built from; a receipt with more inputs names the rest in its file.
MAX_INPUT_LINKS = 20


def _input_links(inputs: list[dict[str, str]]) -> dict[str, Any]:
    """One metadata entry per input: a link to the extraction run that made its embeddings."""
    links: dict[str, Any] = {
        f"input {entry['partition']}": dg.MetadataValue.dagster_run(entry["run_id"])
        for entry in inputs[:MAX_INPUT_LINKS]
        if entry.get("run_id")
    }
    if len(inputs) > MAX_INPUT_LINKS:
        links["inputs not linked"] = (
            f"{len(inputs) - MAX_INPUT_LINKS} more: see the receipt's inputs at receipt_path"
        )
    return links


def _task_file(db: Any, task_set: str) -> dict[str, Any]:
    """The set's stored task file and its content hash, for the extraction's metadata."""
    row = get_task_set(db, task_set)
    return {
        "task_file_sha256": row.content_sha256,
        "task_file_path": dg.MetadataValue.path(str(row.path)),
    }
