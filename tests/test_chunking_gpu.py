"""Chunked documents on the GPU: a set of texts from 10 to 20,000 tokens through the whole
library path (ingest with windows, plan, ledger, the torch engine through the runtime, writer,
combining) gives every document the vector the fp32 CPU engine gives it, and balances.

The weights are a small random BERT with the real MiniLM tokenizer (tests/conftest.py): the real
model's weights are not on the GPU machine. Marked `gpu`; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fabric_gpu.engines import create_engine
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.tasks.windows import LongInputs
from tests.gpu_marks import TORCH_GPU
from tests.pipeline_helpers import run_stages, stored_embeddings

pytestmark = TORCH_GPU

WORDS = [
    "pinned",
    "memory",
    "ring",
    "doorbell",
    "stream",
    "kernel",
    "batch",
    "shape",
    "token",
    "vector",
    "index",
]
LENGTHS = (10, 100, 130, 400, 3_000, 20_000)


def _manifest(model_dir: Path, backend: str, dtype: str) -> EngineManifest:
    return manifest_for_model(
        str(model_dir), backend=backend, dtype=dtype,
        profile=ConsumerProfile(4096, 64, 128, 8), hooks=HookSpec((), "mean", normalize=True),
    )  # fmt: skip


def _extract(tmp_path: Path, name: str, manifest: EngineManifest) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    source = tmp_path / f"{name}.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"doc{n}", "text": " ".join(rng.choice(WORDS, n))}) + "\n"
            for n in LENGTHS
        )
    )
    paths = FabricPaths(tmp_path / name).ensure()
    db = make_engine(f"sqlite:///{paths.sqlite_path}")
    create_schema(db)
    engine = create_engine(manifest)
    try:
        summary, report = run_stages(
            db, paths, engine, manifest, source, "long", long_inputs=LongInputs("chunk", 16)
        )
    finally:
        engine.close()
    assert summary.n_failed == 0 and report.batches_failed == 0
    with db.connect() as conn:
        counts = accounting(conn, "long", manifest.model_key)
    assert counts.finished and counts.documents is not None
    assert counts.documents.stored == len(LENGTHS) and counts.documents.waiting == 0
    assert summary.n_windows > 20_000 // 126
    vectors = stored_embeddings(db, "long", manifest.model_key)
    db.dispose()
    return vectors


def test_chunked_documents_on_the_torch_engine_match_the_cpu_engine(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    gpu = _extract(tmp_path, "gpu", _manifest(tiny_model_dir, "torch", "float16"))
    cpu = _extract(tmp_path, "cpu", _manifest(tiny_model_dir, "cpu", "float32"))
    assert sorted(gpu) == sorted(cpu) == sorted(f"doc{n}" for n in LENGTHS)
    for task_id in cpu:
        a, b = gpu[task_id].astype(np.float64), cpu[task_id].astype(np.float64)
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert cosine >= 0.999, f"{task_id}: cosine {cosine:.6f}"
