"""`fabric plan`: a file's tasks, failures, lengths and batches as ingest and the planner would
make them, and a predicted engine time only from this engine's own measured speed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine

from fabric_gpu.batching import plan_batches, prefix_keys
from fabric_gpu.engines import input_layout
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import load_tokenizer, resolve_model_dir
from fabric_pipelines.lib.broker.preview import preview_plan, render_preview
from fabric_pipelines.lib.records.engine_speeds import record_speed
from fabric_pipelines.lib.store.db import create_schema
from fabric_pipelines.lib.tasks.ingest import ingest


def _file(tmp_path: Path) -> Path:
    rows = [{"id": f"d{i}", "text": f"document {i} " + "word " * (i % 40)} for i in range(60)]
    rows += [{"id": "blank", "text": " "}, {"id": "long", "text": "many words " * 200}]
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_preview_is_what_ingest_and_the_planner_make_and_predicts_only_from_a_measurement(
    db: Engine, tmp_path: Path, manifest: EngineManifest
) -> None:
    create_schema(db)
    path = _file(tmp_path)
    preview = preview_plan(db, path, manifest, truncate=False)
    tasks = ingest(
        path, load_tokenizer(resolve_model_dir(manifest.model_id)),
        max_seq_len=manifest.profile.max_seq_len,
    )  # fmt: skip
    layout = input_layout(manifest)
    plan = plan_batches(
        tasks.lengths, manifest.profile.with_layout(layout),
        keys=prefix_keys(tasks.tokens, tasks.offsets),
    )  # fmt: skip
    assert (preview.records, preview.tasks, preview.failed) == (62, 60, 2)
    assert preview.failure_kinds == {"over-long": 1, "only whitespace": 1}
    assert preview.real_tokens == int(tasks.lengths.sum())
    assert sum(n for _, n in preview.length_histogram) == 60
    assert (preview.batches, preview.padded_tokens) == (
        plan.n_batches,
        int(plan.padded_tokens.sum()),
    )
    assert preview.prediction is None
    assert "no measurement yet" in render_preview(preview)
    assert json.loads(json.dumps(preview.to_mapping()))["predicted_seconds"] is None

    # A run records 1,000,000 padded tokens in 4 s: the prediction is this job's at that rate.
    record_speed(
        db, manifest, layout, source="extraction of task set earlier", padded_tokens=1_000_000,
        real_tokens=900_000, seconds=4.0,
    )  # fmt: skip
    measured = preview_plan(db, path, manifest, truncate=False)
    assert measured.prediction is not None
    assert measured.prediction.seconds == pytest.approx(preview.padded_tokens / 250_000)
    text = render_preview(measured)
    assert "250,000 padded tokens/s" in text and "extraction of task set earlier" in text
    # Truncating long inputs changes the tasks, not the engine: still predicted.
    other = preview_plan(db, path, manifest, truncate=True)
    assert other.prediction is not None and other.truncated == 1 and other.failed == 1
    assert np.isclose(other.to_mapping()["predicted_seconds"], other.prediction.seconds, atol=0.01)
