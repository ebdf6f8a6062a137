"""The index family: vector_index over every pooled embedding of the engine's model, the job
that builds it, and what rebuilds it (the eager automation, and the staleness sensor).
"""

import time
from typing import TYPE_CHECKING, Any

import dagster as dg

from fabric_pipelines.defs.asset_group import CODE_VERSIONS, PIPELINE_GROUP
from fabric_pipelines.defs.extraction import extraction_outputs
from fabric_pipelines.defs.metadata import dagster_metadata
from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS
from fabric_pipelines.defs.resources import ArtifactStore, Database, EngineConfig
from fabric_pipelines.lib.index.staleness import indexed_models, serving_receipt, staleness
from fabric_pipelines.lib.steps.metadata import (
    index_metadata,
    recall_check_metadata,
    refused_index_metadata,
)
from fabric_pipelines.lib.steps.progress import stage
from fabric_pipelines.lib.tasks.catalog import task_set_prompts

if TYPE_CHECKING:  # the index modules load torch and FAISS: imported where a build runs
    from fabric_pipelines.lib.index.build import IndexSpec
    from fabric_pipelines.lib.index.publish import PublishedIndex


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
    # Which rows train the quantizer: "first" (the smallest ids: trainable while extraction
    # runs) or "sample" (a seeded sample of all rows: after it). lib/index/build.py TRAIN_RULES.
    train_rule: str = "first"

    def spec_settings(self) -> dict[str, Any]:
        """The IndexSpec's fields (built where torch and FAISS are loaded)."""
        return {
            "factory": self.factory, "metric": self.metric, "nprobe": self.nprobe,
            "shards": self.shards, "device": self.device, "kmeans": self.kmeans,
            "train_rule": self.train_rule,
        }  # fmt: skip


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
        unchanged_index,
    )

    manifest, started = engine.manifest(), time.perf_counter()
    stage("index")
    spec = IndexSpec(**config.spec_settings())
    db = database.engine()
    serving = serving_receipt(db, manifest.model_key)
    previous = None if config.full_rebuild or serving is None else serving[1]
    # Nothing to build where no row moved since the served index (a set whose every task
    # failed, say): it stands, recorded again under its own receipt's data version.
    unchanged = None
    if previous is not None:
        unchanged = unchanged_index(
            db, model_key=manifest.model_key, spec=spec, min_recall=config.min_recall,
            index_folder=store.paths().indexes, receipt_folder=store.paths().receipts,
            code_version=CODE_VERSIONS["vector_index"],
        )  # fmt: skip
    if unchanged is not None:
        context.log.info(
            f"vector_index: no row changed since receipt {unchanged.receipt_sha256}; "
            "the served index stands (set full_rebuild to build it again)"
        )
        return _published(unchanged, spec, config, time.perf_counter() - started)
    try:
        published = build_and_publish(
            db, model_key=manifest.model_key, model=manifest.receipt_model(), spec=spec,
            index_folder=store.paths().indexes, receipt_folder=store.paths().receipts,
            inputs=_input_partitions(context, db), previous=previous, min_recall=config.min_recall,
            code=CODE_VERSIONS,
        )  # fmt: skip
    except EmptySourceError:
        return _nothing_to_index(context, manifest.model_key)
    context.log.info(
        f"vector_index: rebuilt shards {published.rebuilt_shards or 'none'} of {spec.shards}"
    )
    if not published.accepted:
        # Failed before any materialisation is recorded: the asset's latest materialisation stays
        # the index that is served, so the UI's first line never shows an unpublished one.
        served = f"receipt {serving[0]}" if serving else "none yet"
        raise dg.Failure(
            description=(
                f"index not published: {published.shortfall}. The index served stays: {served}. "
                f"The extraction results are committed; only the index was refused."
            ),
            metadata=dagster_metadata(refused_index_metadata(published, config.min_recall, served)),
            allow_retries=False,
        )
    return _published(published, spec, config, time.perf_counter() - started)


def _published(
    published: "PublishedIndex", spec: "IndexSpec", config: IndexConfig, seconds: float
) -> dg.MaterializeResult:
    return dg.MaterializeResult(
        metadata=dagster_metadata(index_metadata(published, spec.nprobe, seconds)),
        data_version=dg.DataVersion(published.receipt_sha256),
        check_results=[
            dg.AssetCheckResult(
                check_name="recall_at_10",
                passed=published.recall_at_k >= config.min_recall,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata=dagster_metadata(recall_check_metadata(published, config.min_recall)),
            )
        ],
    )


def _nothing_to_index(context: dg.AssetExecutionContext, model_key: str) -> dg.MaterializeResult:
    """No embeddings to index (an empty set, or one whose every task failed) is an outcome, not a
    failure: the asset materialises with no index file and says so."""
    note = (
        f"no index built: model {model_key} has no embeddings (the task sets are empty, or every "
        "task failed: fabric status --failures lists why)"
    )
    context.log.info(f"vector_index: {note}")
    return dg.MaterializeResult(
        metadata={"vectors": 0, "note": note, "published": False},
        data_version=dg.DataVersion(f"empty:{model_key}"),
        check_results=[
            dg.AssetCheckResult(
                check_name="recall_at_10",
                passed=True,
                severity=dg.AssetCheckSeverity.ERROR,
                metadata={"note": "no vectors: nothing to measure"},
            )
        ],
    )


def _input_partitions(context: dg.AssetExecutionContext, db: Any) -> list[dict[str, str]]:
    """Each extraction_outputs partition's latest run id and data version, and the prompt of a
    set tokenised with one, for the receipt."""
    key = dg.AssetKey("extraction_outputs")
    partitions = sorted(context.instance.get_dynamic_partitions(TASK_SET_PARTITIONS))
    prompts = task_set_prompts(db, partitions)
    out = []
    for partition in partitions:
        records = context.instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1
        ).records
        if not records:
            continue
        materialization = records[0].asset_materialization
        version = materialization.tags.get("dagster/data_version") if materialization else None
        entry = {"partition": partition, "run_id": records[0].run_id, "data_version": version or ""}
        if prompts.get(partition):
            entry["prompt"] = prompts[partition]
        out.append(entry)
    return out


index_job = dg.define_asset_job(
    "build_vector_index",
    selection=dg.AssetSelection.assets(vector_index),
    description="Build the vector index over every embedding of the engine's model.",
)


index_automation = dg.AutomationConditionSensorDefinition(
    "index_automation",
    target=dg.AssetSelection.assets(vector_index),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    description="Rebuilds vector_index once new extraction outputs land (eager condition).",
)


@dg.sensor(
    job=index_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description=(
        "Rebuilds an index whose rows changed in the database (per-shard watermarks kept by "
        "triggers) or whose file is gone; only the stale shards are rebuilt."
    ),
)
def index_staleness_sensor(
    context: dg.SensorEvaluationContext, store: ArtifactStore, database: Database
) -> dg.SensorResult:
    busy = context.instance.get_runs_count(
        dg.RunsFilter(
            statuses=[
                dg.DagsterRunStatus.QUEUED,
                dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.STARTED,
            ]
        )
    )
    if busy:  # rows may still be landing, or the eager condition already asked for a build
        return dg.SensorResult(skip_reason=f"{busy} run(s) in progress; checking after they end")
    requests = []
    with database.engine().connect() as conn:
        for model_key in indexed_models(conn):
            found = staleness(conn, model_key, store.paths().indexes)
            if found is None or not found.stale:
                continue
            shards = ",".join(map(str, found.stale_shards)) or "none"
            context.log.info(
                f"index of {model_key} is stale: shards [{shards}]"
                + ("; served file missing" if found.index_missing else "")
            )
            requests.append(
                dg.RunRequest(
                    # One run per (receipt, stale set): a failed rebuild is not retried in a loop.
                    run_key=f"{found.receipt_sha256[:16]}:{shards}:{found.index_missing}",
                    tags={"fabric/model_key": model_key, "fabric/stale_shards": shards},
                )
            )
    return dg.SensorResult(run_requests=requests)
