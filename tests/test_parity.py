"""Parity with the reference implementation: sentence-transformers on the same packaged model.

The pooled embeddings as stored in the database by the real pipeline path (ingest, plan, ledger,
CPU engine, writer) must match SentenceTransformer.encode on the same texts, item by item, and
`fabric_gpu.encode` must give those stored vectors exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine

from fabric_gpu.encoding import encode
from fabric_gpu.engines import create_engine
from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, MPNET_MODEL_ID, resolve_model_dir
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.cli.demo_corpus import stdlib_docstrings
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.db import create_schema, make_engine
from tests.pipeline_helpers import run_stages, stored_embeddings
from tests.test_chunking import _windows_by_hand

N_TEXTS = 240
# Each model with its own length and a sample stride; each long-input policy (shared with
# tests/test_parity_gpu.py).
MODELS = pytest.mark.parametrize(
    ("model_id", "max_seq_len", "every"),
    [(DEFAULT_MODEL_ID, 256, 10), (MPNET_MODEL_ID, 384, 20)],
    ids=["all-MiniLM-L6-v2", "all-mpnet-base-v2"],
)
LONG_INPUTS = pytest.mark.parametrize("long_inputs", ["truncate", "chunk"])


@pytest.mark.slow
def test_pooled_embeddings_match_sentence_transformers(paths: FabricPaths, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    manifest = manifest_for_model(
        DEFAULT_MODEL_ID,
        backend="cpu",
        dtype="float32",
        profile=ConsumerProfile(8192, 128, 512, 8),
        hooks=HookSpec((), "mean"),
    )
    # Every 10th docstring of the demo corpus: a spread of modules and lengths.
    texts = dict(list(stdlib_docstrings(N_TEXTS * 10))[::10])
    source = tmp_path / "parity.jsonl"
    source.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    db: Engine = make_engine(f"sqlite:///{paths.sqlite_path}")
    create_schema(db)
    summary, report = run_stages(db, paths, create_engine(manifest), manifest, source, "parity")
    ours = stored_embeddings(db, "parity", manifest.model_key)
    assert len(ours) >= 200, summary.failures
    assert report.batches_failed == 0

    reference = SentenceTransformer(str(resolve_model_dir(DEFAULT_MODEL_ID)), device="cpu")
    reference.max_seq_length = 512
    ids = sorted(ours)
    expected = reference.encode([texts[i] for i in ids], batch_size=32, convert_to_numpy=True)
    got = np.stack([ours[i] for i in ids])
    cosine = (got * expected).sum(1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    worst = int(np.argmin(cosine))
    assert cosine.min() >= 0.9999, f"{ids[worst]}: cosine {cosine[worst]:.6f}"

    # The one-call API takes the same path: in the pipeline's item order it plans the same
    # batches, so its vectors are the stored ones bit for bit.
    in_order = [k for k in texts if k in ours]
    encoded = encode([texts[k] for k in in_order], manifest)
    assert np.array_equal(encoded.vectors, np.stack([ours[k] for k in in_order]))


@pytest.mark.slow
@LONG_INPUTS
@MODELS
def test_the_models_own_defaults_give_encode_at_its_defaults_for_every_item(
    paths: FabricPaths,
    tmp_path: Path,
    model_id: str,
    max_seq_len: int,
    every: int,
    long_inputs: str,
) -> None:
    """No overrides: the engine takes the model's sentence-transformers configuration (its
    length, mean pooling, unit vectors); every item's vector, read back with `fabric export`, is
    encode()'s. Long items: truncated, as encode() truncates them; or chunked (the default), when
    each is the token-weighted mean of the model's own vectors of the same windows (cut here by
    a loop of the test's own). all-mpnet-base-v2 (MPNet: relative position bias) comes from its
    split PyPI archive."""
    check_encode_parity(paths, tmp_path, model_id, max_seq_len, every, long_inputs)


def check_encode_parity(
    paths: FabricPaths,
    tmp_path: Path,
    model_id: str,
    max_seq_len: int,
    every: int,
    long_inputs: str,
    backend: str = "cpu",
    dtype: str = "float32",
    min_cosine: float = 0.9999,
) -> float:
    """The body of the test above on any engine; returns the lowest cosine (also used by
    tests/test_parity_gpu.py for the torch engine)."""
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    from fabric_pipelines.defs.resources import EngineConfig
    from fabric_pipelines.lib.results.export import export_task_set

    engine_config = EngineConfig(
        model_id=model_id, long_inputs=long_inputs, backend=backend, dtype=dtype
    )
    manifest = engine_config.manifest()
    assert manifest.profile.max_seq_len == max_seq_len and manifest.hooks.normalize is True
    policy = engine_config.long_input_policy()
    assert policy.mode == long_inputs and EngineConfig().long_inputs == "chunk"
    # Every `every`-th docstring of the demo corpus, and its longest ones (past the model's
    # length, so truncation is checked too).
    corpus = list(stdlib_docstrings(N_TEXTS * 10))
    longest = sorted(corpus, key=lambda item: len(item[1]))[-8:]
    texts = dict(corpus[::every] + longest)
    source = tmp_path / "defaults.jsonl"
    source.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    db: Engine = make_engine(f"sqlite:///{paths.sqlite_path}")
    create_schema(db)
    engine = create_engine(manifest)
    try:
        summary, report = run_stages(
            db, paths, engine, manifest, source, "defaults", long_inputs=policy
        )
    finally:
        engine.close()
    long_items = summary.truncated if long_inputs == "truncate" else summary.n_chunked
    assert long_items > 0, "the sample holds items longer than the model's length"
    assert summary.n_failed == 0 and report.batches_failed == 0
    exported = export_task_set(db, "defaults", tmp_path / "defaults.parquet")
    table = pq.read_table(exported.path)
    ids = table.column("id").to_pylist()
    got = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    assert len(ids) == len(texts)

    reference = SentenceTransformer(str(resolve_model_dir(model_id)), device="cpu")
    expected = reference.encode([texts[i] for i in ids], batch_size=32, convert_to_numpy=True)
    if long_inputs == "chunk":
        for row, task_id in enumerate(ids):
            token_ids = reference.tokenizer(texts[task_id])["input_ids"]
            if len(token_ids) > max_seq_len:
                windows = _windows_by_hand(token_ids, max_seq_len, policy.overlap)
                expected[row] = _weighted_mean_of_windows(reference, windows)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosine = (got * expected).sum(1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    worst = int(np.argmin(cosine))
    assert cosine.min() >= min_cosine, f"{ids[worst]}: cosine {cosine[worst]:.6f}"
    return float(cosine.min())


def _weighted_mean_of_windows(reference: Any, windows: list[list[int]]) -> np.ndarray:
    """The model's own (encode()'s) vector of each window, fed as token ids, averaged with each
    window's token count as its weight, then unit length (the model normalises)."""
    import torch

    ids = torch.tensor(windows)
    with torch.no_grad():
        out = reference({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    vectors = out["sentence_embedding"].numpy().astype(np.float64)
    weights = np.array([len(w) for w in windows], dtype=np.float64)
    mean = (vectors * weights[:, None]).sum(0) / weights.sum()
    return (mean / np.linalg.norm(mean)).astype(np.float32)
