"""Running the pipeline's library stages directly (no Dagster), for tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sqlalchemy import Engine, select

from fabric_gpu.engines import Engine as ExtractionEngine
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.plans import load_plan_order, plan_task_set
from fabric_pipelines.lib.extraction import ExtractionJob, ExtractionReport, run_worker
from fabric_pipelines.lib.settings import FabricPaths
from fabric_pipelines.lib.store.models import Embedding
from fabric_pipelines.lib.tasks.catalog import IngestSummary, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.tasks.store import read_table


def run_stages(
    db: Engine,
    paths: FabricPaths,
    engine: ExtractionEngine,
    manifest: EngineManifest,
    source: Path,
    task_set: str,
) -> tuple[IngestSummary, ExtractionReport]:
    submit(source, paths.inbox, task_set)
    summary = ingest_task_set(
        db, paths, task_set, model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    plan = plan_task_set(db, paths, task_set, manifest)
    job = ExtractionJob(
        task_set=task_set,
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=read_table(summary.path, summary.content_sha256),
        order=load_plan_order(plan.path, plan.sha256),
        shard_folder=paths.shards,
    )
    return summary, run_worker(db, engine, job, owner="test")


def stored_embeddings(db: Engine, task_set: str, model_key: str) -> dict[str, np.ndarray]:
    with db.connect() as conn:
        rows = conn.execute(
            select(Embedding.task_id, Embedding.vector).where(
                Embedding.task_set == task_set, Embedding.model_key == model_key
            )
        ).all()
    return {r.task_id: np.frombuffer(r.vector, dtype="<f4") for r in rows}
