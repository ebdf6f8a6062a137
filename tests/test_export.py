"""`fabric export`: a set's embeddings as Parquet, equal to what is stored, in record order,
streamed in blocks; refusals name what is missing; the CLI keeps an existing file unless told."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine

from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.lib.core.files import sha256_file
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.results import export
from fabric_pipelines.lib.results.export import ExportError, export_task_set
from tests.pipeline_helpers import run_stages, stored_embeddings


def _source(tmp_path: Path) -> Path:
    rows = [{"id": f"doc-{i}", "text": f"Document {i} is about topic {i % 5}."} for i in range(23)]
    rows.insert(5, {"id": "blank", "text": "   "})  # fails at ingest: not exported
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_export_is_the_stored_embeddings_in_record_order(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine,  # type: ignore[no-untyped-def]
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_stages(db, paths, cpu_engine, manifest, _source(tmp_path), "ex")
    monkeypatch.setattr(export, "BLOCK_ROWS", 7)  # several blocks, a short last one
    seen: list[int] = []
    out = tmp_path / "out" / "ex.parquet"
    out.parent.mkdir()
    done = export_task_set(db, "ex", out, progress=seen.append)
    assert seen == [7, 14, 21, 23] and done.rows == 23 and done.model_key == manifest.model_key
    assert done.sha256 == sha256_file(out) and list(out.parent.iterdir()) == [out]
    table = pq.read_table(out)
    assert table.column_names == ["id", "record_no", "n_tokens", "vector"]
    record_no = table.column("record_no").to_pylist()
    assert record_no == sorted(record_no) and 5 not in record_no  # the blank record failed
    stored = stored_embeddings(db, "ex", manifest.model_key)
    vectors = table.column("vector").to_numpy(zero_copy_only=False)
    for task_id, vector in zip(table.column("id").to_pylist(), vectors, strict=True):
        np.testing.assert_array_equal(np.asarray(vector, np.float32), stored[task_id])
    assert done.dim == len(vectors[0]) == stored["doc-0"].size


def test_refusals_name_the_set_and_write_nothing(db: Engine, tmp_path: Path) -> None:
    from fabric_pipelines.lib.store.db import create_schema

    create_schema(db)
    with pytest.raises(ExportError, match="no task set named 'nope'"):
        export_task_set(db, "nope", tmp_path / "x.parquet")
    assert not list(tmp_path.glob("*.parquet*"))


def test_hidden_states_are_exported_beside_each_vector_from_the_checked_shards(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine,  # type: ignore[no-untyped-def]
    manifest: EngineManifest,
) -> None:
    """The shared manifest keeps layers 2 and -1: exporting layer -1 gives each task its
    [tokens, hidden] states, exactly those encode() gives for the same text."""
    from fabric_gpu.encoding import encode

    run_stages(db, paths, cpu_engine, manifest, _source(tmp_path), "hs")
    out = tmp_path / "hs.parquet"
    done = export_task_set(db, "hs", out, layers=[-1])
    table = pq.read_table(out)
    assert table.column_names == ["id", "record_no", "n_tokens", "vector", "layer_-1"]
    assert done.rows == table.num_rows == 23
    texts = {f"doc-{i}": f"Document {i} is about topic {i % 5}." for i in range(23)}
    ids = table.column("id").to_pylist()
    encoded = encode([texts[i] for i in ids], manifest, engine=cpu_engine)
    stored = stored_embeddings(db, "hs", manifest.model_key)
    for row, (task_id, n_tokens) in enumerate(
        zip(ids, table.column("n_tokens").to_pylist(), strict=True)
    ):
        states = np.asarray(table.column("layer_-1")[row].as_py(), dtype=np.float16)
        assert states.shape == (n_tokens, 384)
        np.testing.assert_array_equal(states, encoded.hidden_state(-1, row))
        vector = np.asarray(table.column("vector")[row].as_py(), np.float32)
        np.testing.assert_array_equal(vector, stored[task_id])
    with pytest.raises(ExportError, match=r"kept hidden states of layers \[2, -1\], not \[4\]"):
        export_task_set(db, "hs", tmp_path / "other.parquet", layers=[4])
    assert not (tmp_path / "other.parquet").exists()


@pytest.mark.parametrize("variant", ["float16", "int8", "binary", "int8:128", "binary:100"])
def test_a_variant_export_is_the_cpu_twin_of_the_stored_vectors_read_back(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine,  # type: ignore[no-untyped-def]
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
    variant: str,
) -> None:
    """Read back from the file: every vector equals the variant's CPU twin of the stored float32
    one (int8 with the calibration the file records, made from its first block)."""
    from fabric_gpu.variants import Int8Calibration, Variant

    run_stages(db, paths, cpu_engine, manifest, _source(tmp_path), "var")
    monkeypatch.setattr(export, "BLOCK_ROWS", 10)  # the calibration is the first block's
    out = tmp_path / f"var-{variant.replace(':', '-')}.parquet"
    done = export_task_set(db, "var", out, variant=variant)
    chosen = Variant.parse(variant)  # the fixture's manifest does not normalise
    assert done.variant == chosen.label
    assert done.bytes_per_vector == chosen.row_bytes(done.dim)
    table = pq.read_table(out)
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    assert metadata["fabric.variant"] == chosen.label
    stored = stored_embeddings(db, "var", manifest.model_key)
    ids = table.column("id").to_pylist()
    floats = np.stack([stored[i] for i in ids])
    calibration = None
    if chosen.needs_calibration():
        calibration = Int8Calibration.from_json(metadata["fabric.int8_calibration"])
        expected_calibration = Int8Calibration.of(chosen.prepared(floats[:10]))
        assert np.array_equal(calibration.low, expected_calibration.low)
    expected = chosen.apply_numpy(floats, calibration)
    column = table.column("vector").combine_chunks()
    if chosen.encoding == "binary":
        got = np.frombuffer(column.buffers()[1], np.uint8)[: expected.size].reshape(expected.shape)
    else:
        got = column.values.to_numpy(zero_copy_only=False).reshape(expected.shape)
    assert got.dtype == expected.dtype
    assert np.array_equal(got, expected)
