"""The efficiency record of an extraction step on the GPU: the runtime's timing marks give the
GPU's busy seconds and span, so the record says how busy the GPU was. The product's own step
(run_extraction_step: a worker process, the torch engine's CUDA graphs behind the doorbell).

The weights are a small random BERT with the real MiniLM tokenizer (the real model's weights are
not on the GPU machine). Marked `gpu`; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from fabric_gpu.engines import input_layout
from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.records.efficiency import latest_runs
from fabric_pipelines.lib.steps.extraction import WorkerOptions, run_extraction_step
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from tests.gpu_marks import TORCH_GPU

pytestmark = TORCH_GPU

WORDS = ["pinned", "memory", "ring", "doorbell", "stream", "kernel", "batch", "vector"]


def test_a_gpu_step_records_how_busy_the_gpu_was(tmp_path: Path, tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(1)
    source = tmp_path / "set.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "text": " ".join(rng.choice(WORDS, int(n)))}) + "\n"
            for i, n in enumerate(rng.integers(4, 120, size=4000))
        )
    )
    paths = FabricPaths(tmp_path / "home").ensure()
    url = f"sqlite:///{paths.sqlite_path}"
    db = make_engine(url)
    create_schema(db)
    manifest = manifest_for_model(
        str(tiny_model_dir), backend="torch", dtype="float16",
        profile=ConsumerProfile(4096, 64, 128, 8), hooks=HookSpec((), "mean", normalize=True),
    )  # fmt: skip
    submit(source, paths.inbox, "s")
    ingest_task_set(db, paths, "s", model_id=manifest.model_id, max_seq_len=128)
    plan_task_set(db, paths, "s", manifest, input_layout(manifest))

    step = run_extraction_step(
        db, paths, "s", manifest,
        WorkerOptions(database_url=url, workers=1, lease_seconds=30, heartbeat_seconds=None,
                      pool_idle_seconds=0),
        database_name="sqlite", devices=lambda: nullcontext([0]), on_progress=lambda _: None,
    )  # fmt: skip

    assert step.passed, step.problems
    e = step.efficiency
    # Every batch ran on the GPU inside its span, and the span inside the engine's window.
    assert 0 < e.gpu_busy_seconds <= e.gpu_span_seconds, e
    assert e.gpu_span_seconds <= e.engine_seconds + 0.5, e
    busy = e.gpu_busy_fraction
    assert busy is not None and 0 < busy <= 1
    assert f"the GPU busy {busy:.1%}" in e.sentence()
    with db.connect() as conn:
        record = latest_runs(conn, ["s"])["s"]
    assert record["gpu_busy_fraction"] == round(busy, 4)
    assert record["gpu_seconds"]["busy"] == round(e.gpu_busy_seconds, 3)
    db.dispose()
