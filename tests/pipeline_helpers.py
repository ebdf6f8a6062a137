"""Running the pipeline's library stages directly (no Dagster), for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from sqlalchemy import Engine, func, literal_column, select

from fabric_gpu.engines import Engine as ExtractionEngine
from fabric_gpu.engines import input_layout
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.broker.plans import load_plan_order, plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.steps.run_extraction import finish_task_set
from fabric_pipelines.lib.store.models import Embedding, Model, Task, TaskSet, task_embeddings
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import IngestSummary, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.tasks.windows import LongInputs
from fabric_pipelines.lib.worker.loop import ExtractionJob, ExtractionReport, run_worker

REPO = Path(__file__).resolve().parents[1]


def run_stages(
    db: Engine,
    paths: FabricPaths,
    engine: ExtractionEngine,
    manifest: EngineManifest,
    source: Path,
    task_set: str,
    *,
    truncate: bool = False,
    long_inputs: LongInputs | None = None,
    prompt: str = "",
) -> tuple[IngestSummary, ExtractionReport]:
    """Ingest, plan, one in-process worker, and what ends every extraction run (combining
    chunked documents, copying duplicates: run_extraction.finish_task_set)."""
    submit(source, paths.inbox, task_set)
    summary = ingest_task_set(
        db, paths, task_set, model_id=manifest.model_id,
        max_seq_len=manifest.profile.max_seq_len, truncate=truncate, long_inputs=long_inputs,
        prompt=prompt,
    )  # fmt: skip
    # The layout the engine takes, as the shape_batches asset plans (packed on the GPU).
    plan = plan_task_set(db, paths, task_set, manifest, input_layout(manifest))
    job = ExtractionJob(
        task_set=task_set,
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=read_table(summary.path, summary.content_sha256),
        order=load_plan_order(plan.path, plan.sha256),
        shard_folder=paths.shards,
    )
    report = run_worker(db, engine, job, owner="test")
    finish_task_set(db, task_set, manifest)
    return summary, report


def stored_embeddings(db: Engine, task_set: str, model_key: str) -> dict[str, np.ndarray]:
    """task id -> its pooled embedding: its own row, or the one it reused (the view
    `task_embeddings`)."""
    view = task_embeddings.c
    with db.connect() as conn:
        rows = conn.execute(
            select(Task.task_id, literal_column("vector"))
            .select_from(task_embeddings)
            .join(TaskSet, TaskSet.id == view.task_set_id)
            .join(Model, Model.id == view.model_id)
            .join(Task, (Task.task_set_id == view.task_set_id) & (Task.record_no == view.record_no))
            .where(TaskSet.name == task_set, Model.model_key == model_key)
        ).all()
    return {r.task_id: np.frombuffer(r.vector, dtype="<f4") for r in rows}


def embedding_counts(db: Engine) -> tuple[int, int]:
    """(rows, distinct tasks) in the embeddings table: equal when nothing is written twice."""
    with db.connect() as conn:
        rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
        distinct = conn.execute(
            select(func.count()).select_from(
                select(Embedding.task_set_id, Embedding.record_no, Embedding.model_id)
                .distinct()
                .subquery()
            )
        ).scalar_one()
    return int(rows), int(distinct)


def validate_workspace(dagster_home: Path, **env: str) -> str:
    """`dagster definitions validate -w workspace.yaml` as a user runs it, with `env` on top of
    this process's environment; checks that the code location validated and returns the output."""
    result = subprocess.run(
        [
            Path(sys.executable).parent / "dagster",
            "definitions",
            "validate",
            "-w",
            "workspace.yaml",
        ],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(dagster_home), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Validation successful for code location fabric_pipelines" in output, output
    return output
