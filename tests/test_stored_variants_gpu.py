"""Output variants made on the GPU: the torch engine's captured graphs encode pooled vectors
before the copy to the host, and the rows stored are the CPU twin of the same engine's float32
rows. Through the whole library path (ingest, plan, ledger, the runtime, writer, calibration,
combining), in one database, one model key per variant.

The weights are a small random BERT (hidden 64) with the real MiniLM tokenizer (the real
model's weights are not on the GPU machine); at 64 dimensions a binary row is 8 bytes, so the
runtime's 16-byte row padding is exercised. Marked `gpu`; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from sqlalchemy import Engine, select

from fabric_gpu.engines import create_engine
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.records.calibration import recorded_calibration
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import Embedding, Model
from fabric_pipelines.lib.tasks.windows import LongInputs
from tests.gpu_marks import TORCH_GPU
from tests.pipeline_helpers import run_stages

pytestmark = TORCH_GPU

VARIANTS = ("float16", "int8", "binary", "binary:32", "int8:48", "float32:32")
WORDS = ["pinned", "memory", "ring", "doorbell", "stream", "kernel", "batch", "vector"]


def _rows(db: Engine, model_key: str) -> dict[int, bytes]:
    with db.connect() as conn:
        model = conn.execute(select(Model.id).where(Model.model_key == model_key)).scalar_one()
        return {
            int(r.record_no): bytes(r.vector)
            for r in conn.execute(
                select(Embedding.record_no, Embedding.vector).where(Embedding.model_id == model)
            )
        }


def test_the_torch_engine_stores_each_variant_as_the_twin_of_its_float32_rows(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    rng = np.random.default_rng(0)
    source = tmp_path / "set.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"t{i}", "text": " ".join(rng.choice(WORDS, int(n)))}) + "\n"
            for i, n in enumerate(rng.integers(1, 400, size=600))
        )
    )
    paths = FabricPaths(tmp_path / "home").ensure()
    db = make_engine(f"sqlite:///{paths.sqlite_path}")
    create_schema(db)
    plain = manifest_for_model(
        str(tiny_model_dir), backend="torch", dtype="float16",
        profile=ConsumerProfile(4096, 64, 128, 8), hooks=HookSpec((), "mean", normalize=True),
    )  # fmt: skip

    def extract(manifest: EngineManifest, name: str) -> dict[int, bytes]:
        (tmp_path / f"{name}.jsonl").write_bytes(source.read_bytes())
        engine = create_engine(manifest)
        try:
            _, report = run_stages(
                db, paths, engine, manifest, tmp_path / f"{name}.jsonl", name,
                long_inputs=LongInputs("chunk", 16),
            )  # fmt: skip
        finally:
            engine.close()
        assert report.batches_failed == 0
        return _rows(db, manifest.model_key)

    floats = {k: np.frombuffer(v, "<f4") for k, v in extract(plain, "plain").items()}
    with db.connect() as conn:
        long_ones = {
            int(r)
            for r in conn.execute(
                select(Embedding.record_no).where(Embedding.n_tokens > 128).distinct()
            ).scalars()
        }
    engine_made = sorted(set(floats) - long_ones)  # combined documents are means, not the engine's
    assert len(engine_made) > 600
    x = np.stack([floats[k] for k in engine_made])
    for label in VARIANTS:
        manifest = replace(plain, hooks=replace(plain.hooks, variant=label))
        variant = manifest.hooks.output_variant()
        rows = extract(manifest, label.replace(":", "_"))
        with db.connect() as conn:
            calibration = recorded_calibration(conn, manifest.model_key)
        made = np.stack([np.frombuffer(rows[k], variant.numpy_dtype) for k in engine_made])
        twin = variant.apply_numpy(x, calibration)
        assert made.shape == twin.shape, label
        if variant.encoding in ("float16", "float32"):
            np.testing.assert_allclose(made.astype(np.float32), twin.astype(np.float32), atol=1e-3)
        elif variant.encoding == "int8":
            diff = np.abs(made.astype(np.int16) - twin.astype(np.int16))
            assert diff.max() <= 1 and (diff == 0).mean() >= 0.999, (label, (diff == 0).mean())
        else:
            agree = (np.unpackbits(made, axis=1) == np.unpackbits(twin, axis=1)).mean()
            assert agree >= 0.999, (label, agree)
    db.dispose()
