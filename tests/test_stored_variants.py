"""Output variants made by the engine: each is its CPU twin of the float32 vectors, and a run
with one stores, combines, exports and indexes its rows as that encoding.

(The runner here is the CPU engine's, on the emulated GPU; the torch engine's graphs are
checked against the same twin in test_stored_variants_gpu.py.)"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Connection, Engine, select, text

from fabric_gpu.engines import create_engine
from fabric_gpu.engines.base import EngineError
from fabric_gpu.manifest import EngineManifest, HookSpec, ManifestError
from fabric_gpu.runtime import BatchResult, EngineRunner
from fabric_gpu.variants import Int8Calibration, Variant, stored_rows
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.build import IndexSpec
from fabric_pipelines.lib.index.publish import build_and_publish
from fabric_pipelines.lib.index.vectors import load_vectors
from fabric_pipelines.lib.records.calibration import (
    calibrate_engine,
    calibration_sha256,
    recorded_calibration,
)
from fabric_pipelines.lib.results.export import ExportError, export_task_set
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.models import WINDOW_BASE, DocumentWindow, Embedding, Model
from fabric_pipelines.lib.store.schema import stores_pgvector, upgrade
from fabric_pipelines.lib.tasks.windows import LongInputs
from fabric_testing.scratch_db import empty_public_schema
from tests.conftest import IN_CI
from tests.pipeline_helpers import run_stages

CHUNK = LongInputs.of("chunk", 32)
VARIANTS = ["float16", "int8", "binary", "int8:100", "binary:64", "float32:128"]


def _with_variant(manifest: EngineManifest, label: str) -> EngineManifest:
    # Normalised: shortened vectors are made unit length again, which the twin must match.
    return replace(manifest, hooks=HookSpec((), "mean", normalize=True, variant=label))


def _token_table(n: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 120, size=n)
    rows = [np.concatenate([[101], rng.integers(1000, 30000, size=k - 2), [102]]) for k in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.concatenate(rows).astype(np.int32), offsets


def _run(engine: object, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    results: dict[int, BatchResult] = {}
    with EngineRunner(engine, tokens, offsets, lambda r: results.__setitem__(r.batch_id, r)) as run:  # type: ignore[arg-type]
        for batch, start in enumerate(range(0, len(offsets) - 1, 16)):
            run.submit(batch, np.arange(start, min(start + 16, len(offsets) - 1)), 128)
        run.finish()
    assert all(not r.error for r in results.values())
    return np.concatenate([results[b].pooled for b in sorted(results)])  # type: ignore[misc]


@pytest.mark.parametrize("label", VARIANTS)
def test_the_engine_runner_makes_each_variant_as_its_cpu_twin(
    manifest: EngineManifest, label: str
) -> None:
    tokens, offsets = _token_table()
    variant_manifest = _with_variant(manifest, label)
    engine = create_engine(variant_manifest)
    # The float32 vectors the engine computed inside the runner, batch by batch, as they were.
    computed: list[np.ndarray] = []
    forward = engine.forward_hidden

    def recorded(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, dict]:
        pooled, hooks = forward(ids, lengths)
        computed.append(pooled.copy())
        return pooled, hooks

    engine.forward_hidden = recorded  # type: ignore[method-assign]
    variant = variant_manifest.hooks.output_variant()
    calibration = None
    if variant.needs_calibration():
        with pytest.raises(EngineError, match="no int8 calibration"):
            _run(engine, tokens, offsets)
        floats = _run(create_engine(_with_variant(manifest, "float32")), tokens, offsets)
        calibration = Int8Calibration.of(variant.prepared(floats))
        engine.set_int8_calibration(calibration)
    made = _run(engine, tokens, offsets)
    twin = variant.apply_numpy(np.concatenate(computed), calibration)
    assert made.dtype == twin.dtype and made.shape == twin.shape
    assert made.nbytes == 96 * variant.row_bytes(384)  # the padding to 16 bytes is dropped
    np.testing.assert_array_equal(made, twin)  # exact: the same float32 inputs, the same steps


def test_a_bad_variant_is_refused_naming_the_field(manifest: EngineManifest) -> None:
    with pytest.raises(ManifestError, match=r"hooks\.variant"):
        EngineManifest.from_mapping(
            {**manifest.to_mapping(), "hooks": {"layers": [], "pooling": "mean", "variant": "int4"}}
        )
    with pytest.raises(ValueError, match="dims 512 > the model's 384"):
        create_engine(_with_variant(manifest, "binary:512"))
    keys = {_with_variant(manifest, label).model_key for label in ["float32", *VARIANTS]}
    assert len(keys) == 1 + len(VARIANTS)  # each variant's rows are kept apart


def _source(tmp_path: Path) -> Path:
    rows = [{"id": f"doc-{i}", "text": f"Paragraph {i} is about topic {i % 7}."} for i in range(40)]
    long_text = " ".join(
        f"section {i} explains the licence terms of part {i % 9}" for i in range(60)
    )
    rows.append({"id": "long", "text": long_text})  # over 128 tokens: chunked into windows
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("label", ["int8", "binary:256"])
def test_a_variant_run_is_stored_combined_exported_and_indexed(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest, label: str
) -> None:
    _check_variant_run(db, paths, tmp_path, manifest, label)


@pytest.mark.pgvector
def test_on_a_pgvector_server_int8_is_kept_as_bytes_beside_float32_vectors(
    pgvector_server_url: str, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """pgvector has no int8 type: int8 rows go in the bytes column."""
    db = _pgvector_schema(pgvector_server_url)
    _check_variant_run(db, paths, tmp_path, manifest, "int8")
    with db.connect() as conn:
        stored = conn.execute(
            text(
                "select count(*) filter (where vector is not null and embedding is null), "
                "count(*) from embeddings"
            )
        ).one()
    assert stored[0] == stored[1] > 41
    db.dispose()


@pytest.mark.pgvector
@pytest.mark.parametrize(
    ("label", "column", "width"),
    [("float16", "embedding_half", "vector_dims"), ("binary:256", "embedding_bits", "bit_length")],
)
def test_on_pgvector_0_7_float16_is_halfvec_and_binary_is_bit_and_sql_searches_them(
    pgvector_server_url: str,
    paths: FabricPaths,
    tmp_path: Path,
    manifest: EngineManifest,
    label: str,
    column: str,
    width: str,
) -> None:
    """Each row in its pgvector column only (read back here through the server's own casts),
    combined, exported and indexed as the bytes are; and the server's operators (cosine for
    halfvec, Hamming for bit) find a row nearest to itself."""
    db = _pgvector_schema(pgvector_server_url)
    with db.connect() as conn:
        version = conn.execute(
            text("select extversion from pg_extension where extname = 'vector'")
        ).scalar_one()
    if tuple(int(p) for p in version.split(".")) < (0, 7):
        reason = f"the test server's pgvector is {version}; scripts/pgvector-for-tests builds 0.8"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    _check_variant_run(db, paths, tmp_path, manifest, label)
    with db.connect() as conn:
        placed = conn.execute(
            text(
                f"select count(*) filter (where {column} is not null and vector is null "
                f"and embedding is null), count(*), min({width}({column})), "
                f"max({width}({column})) from embeddings"
            )
        ).one()
        operator = "<=>" if column == "embedding_half" else "<~>"
        nearest = conn.execute(
            text(
                f"select e.record_no, (select o.record_no from embeddings o "
                f"order by o.{column} {operator} e.{column}, o.record_no limit 1) "
                "from embeddings e where e.record_no < 41 order by e.record_no"
            )
        ).all()
    expected_width = 384 if column == "embedding_half" else 256
    assert placed[0] == placed[1] > 41 and placed[2] == placed[3] == expected_width
    # Itself at distance 0 (an earlier duplicate row, by record number, would come first).
    assert sum(r[0] == r[1] for r in nearest) >= 0.9 * len(nearest)
    db.dispose()


@pytest.mark.pgvector
def test_on_a_pgvector_server_float32_rows_are_exported_from_the_vector_column(
    pgvector_server_url: str, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """Float32 rows live in pgvector's `vector` only (the bytes column is NULL): export, and an
    export variant made from them, read those values."""
    db = _pgvector_schema(pgvector_server_url)
    plain = _with_variant(manifest, "float32")
    _, report = run_stages(
        db, paths, create_engine(plain), plain, _source(tmp_path), "f", long_inputs=CHUNK
    )
    assert report.batches_failed == 0
    with db.connect() as conn:
        model = conn.execute(select(Model.id).where(Model.model_key == plain.model_key))
        rows = _stored_bytes(conn, model.scalar_one())
        in_vector_only = conn.execute(
            text("select count(*) from embeddings where vector is null and embedding is not null")
        ).scalar_one()
    assert in_vector_only == len(rows) > 41
    out = tmp_path / "f.parquet"
    export_task_set(db, "f", out)
    table = pq.read_table(out)
    record_nos = table.column("record_no").to_pylist()
    assert len(record_nos) == 41
    for record_no, vector in zip(record_nos, table.column("vector").to_pylist(), strict=True):
        assert np.asarray(vector, "<f4").tobytes() == rows[record_no][1]
    half = tmp_path / "f16.parquet"
    export_task_set(db, "f", half, variant="float16")
    stored = np.stack([np.frombuffer(rows[r][1], "<f4") for r in record_nos])
    made = np.asarray(pq.read_table(half).column("vector").to_pylist(), np.float16)
    twin = Variant.parse("float16", normalize="+normalized" in plain.model_key)
    assert np.array_equal(made, twin.apply_numpy(stored, None))
    db.dispose()


def _pgvector_schema(url: str) -> Engine:
    db = make_engine(url)
    empty_public_schema(db)
    upgrade(db)
    assert stores_pgvector(db)
    return db


def _stored_bytes(conn: Connection, model: int) -> dict[int, tuple[int, bytes]]:
    """Each row's (n_tokens, stored bytes), read by the server's own casts of its pgvector
    columns (not the product's reader): halfvec as real[], bit as a text of 0s and 1s."""
    present = conn.dialect.name == "postgresql" and set(
        conn.execute(
            text(
                "select column_name from information_schema.columns where table_name = "
                "'embeddings' and table_schema = current_schema()"
            )
        ).scalars()
    )
    floats = "embedding::real[]" if present and "embedding" in present else "null"
    half = "embedding_half::real[]" if present and "embedding_half" in present else "null"
    bits = "embedding_bits::text" if present and "embedding_bits" in present else "null"
    found = {}
    for record_no, n_tokens, raw, singles, halves, signs in conn.execute(
        text(
            f"select record_no, n_tokens, vector, {floats}, {half}, {bits} from embeddings "
            "where model_id = :m"
        ),
        {"m": model},
    ):
        if raw is not None:
            value = bytes(raw)
        elif singles is not None:
            value = np.asarray(singles, "<f4").tobytes()
        elif halves is not None:
            value = np.asarray(halves, np.float16).tobytes()
        else:
            assert signs is not None, f"record {record_no}: no vector in any column"
            value = np.packbits(np.array([c == "1" for c in signs])).tobytes()
        found[int(record_no)] = (int(n_tokens), value)
    return found


def _check_variant_run(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest, label: str
) -> None:
    variant_manifest = _with_variant(manifest, label)
    variant = variant_manifest.hooks.output_variant()
    engine = create_engine(variant_manifest)
    _, report = run_stages(
        db, paths, engine, variant_manifest, _source(tmp_path), "v", long_inputs=CHUNK
    )
    assert report.batches_failed == 0
    key = variant_manifest.model_key
    assert key.endswith("~" + label)
    with db.connect() as conn:
        calibration = recorded_calibration(conn, key)
        model = conn.execute(select(Model.id).where(Model.model_key == key)).scalar_one()
        rows = _stored_bytes(conn, model)
        window = conn.execute(
            select(DocumentWindow.record_no, DocumentWindow.first_window, DocumentWindow.n_windows)
        ).one()
    assert (calibration is not None) == variant.needs_calibration()
    assert {len(v) for _, v in rows.values()} == {variant.row_bytes(384)}
    documents = sorted(r for r in rows if r < WINDOW_BASE)
    assert len(documents) == 41 and window.n_windows > 1

    # The long document's row: its windows' values (int8 at the middle of a step, bits as
    # -1/+1) averaged by tokens, unit length, encoded again; computed here on its own.
    def values(raw: bytes) -> np.ndarray:
        if variant.encoding == "binary":
            return np.unpackbits(np.frombuffer(raw, np.uint8)).astype(np.float64) * 2 - 1
        if variant.encoding == "float16":
            return np.frombuffer(raw, np.float16).astype(np.float64)
        assert calibration is not None
        q = np.frombuffer(raw, np.int8).astype(np.float64)
        return (q + 0.5 * np.sign(q) + 128) * calibration.steps() + calibration.low

    first = window.first_window
    parts = [rows[first + w] for w in range(window.n_windows)]
    mean = sum(n * values(v) for n, v in parts) / sum(n for n, _ in parts)
    mean = (mean / np.linalg.norm(mean)).astype(np.float32)[None]
    expected = variant.apply_numpy(mean, calibration)
    assert rows[window.record_no][1] == stored_rows(expected).tobytes()

    # Export: the stored bytes as they are, the variant and its calibration in the metadata.
    out = tmp_path / "v.parquet"
    done = export_task_set(db, "v", out)
    assert done.variant == variant.label and done.bytes_per_vector == variant.row_bytes(384)
    table = pq.read_table(out)
    meta = table.schema.metadata
    assert meta[b"fabric.variant"].decode() == variant.label
    if calibration is not None:
        assert meta[b"fabric.int8_calibration"].decode() == calibration.to_json()
    exported = table.column("vector").to_pylist()
    for record_no, vector in zip(table.column("record_no").to_pylist(), exported, strict=True):
        kind = np.float16 if variant.encoding == "float16" else np.int8
        raw = vector if isinstance(vector, bytes) else np.asarray(vector, kind).tobytes()
        assert raw == rows[record_no][1]
    with pytest.raises(ExportError, match="exported as stored"):
        export_task_set(db, "v", tmp_path / "again.parquet", variant="float16")

    # The index: built on the variant's values, its receipt naming the variant and calibration.
    with db.connect() as conn:
        loaded = load_vectors(conn, key)
    assert loaded.vectors.shape == (41, variant.out_dims(384))
    published = build_and_publish(
        db, model_key=key, model=variant_manifest.receipt_model(), spec=IndexSpec(),
        index_folder=paths.indexes, receipt_folder=paths.receipts, inputs=[],
    )  # fmt: skip
    recorded = published.receipt["model"]
    assert recorded["variant"] == label and recorded["stored_variant"] == variant.label
    if calibration is not None:
        assert recorded["int8_calibration_sha256"] == calibration_sha256(calibration)
    assert published.recall_at_k >= 0.99


def test_the_variant_rows_are_the_twin_of_a_float32_run_of_the_same_set(
    db: Engine, paths: FabricPaths, tmp_path: Path, manifest: EngineManifest
) -> None:
    """Across two runs (batches need not match) the int8 rows are within one step of the float32
    rows' twin and nearly every sign bit agrees."""
    source = _source(tmp_path)
    plain = _with_variant(manifest, "float32")
    run_stages(db, paths, create_engine(plain), plain, source, "f", long_inputs=CHUNK)
    int8 = _with_variant(manifest, "int8")
    run_stages(db, paths, create_engine(int8), int8, source, "q", long_inputs=CHUNK)
    with db.connect() as conn:
        calibration = recorded_calibration(conn, int8.model_key)
        floats = load_vectors(conn, plain.model_key).vectors
        ids = {
            m: conn.execute(select(Model.id).where(Model.model_key == m)).scalar_one()
            for m in (int8.model_key,)
        }
        stored = [
            bytes(v)
            for v in conn.execute(
                select(Embedding.vector)
                .where(Embedding.model_id == ids[int8.model_key], Embedding.record_no < WINDOW_BASE)
                .order_by(Embedding.record_no)
            ).scalars()
        ]
    made = np.stack([np.frombuffer(v, np.int8) for v in stored]).astype(np.int16)
    twin = Variant("int8", normalize=True).apply_numpy(floats, calibration).astype(np.int16)
    assert made.shape == twin.shape and int(np.abs(made - twin).max()) <= 1


def test_two_runs_calibrating_one_key_at_once_record_one_range_and_both_use_it(
    db: Engine, manifest: EngineManifest
) -> None:
    from fabric_pipelines.lib.store.db import create_schema

    create_schema(db)
    int8 = _with_variant(manifest, "int8")
    engines = [create_engine(int8), create_engine(int8)]
    samples = [_token_table(n=40, seed=1), _token_table(n=40, seed=2)]  # different first tasks
    barrier = threading.Barrier(2)

    def calibrate(k: int) -> None:
        barrier.wait()
        calibrate_engine(db, engines[k], int8.model_key, *samples[k], f"run {k}")

    threads = [threading.Thread(target=calibrate, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with db.connect() as conn:
        recorded = recorded_calibration(conn, int8.model_key)
        rows = conn.execute(text("SELECT count(*) FROM int8_calibrations")).scalar_one()
    assert rows == 1 and recorded is not None
    for engine in engines:
        assert engine.int8_calibration is not None
        assert engine.int8_calibration.to_json() == recorded.to_json()


def test_encode_returns_the_manifests_variant(manifest: EngineManifest) -> None:
    """`fabric_gpu.encode` with a variant manifest gives that encoding's rows: the twin of the
    float32 vectors of another engine of the same model (nearly every sign bit: two engines'
    floats may differ in their last bits)."""
    import fabric_gpu

    texts = [f"Sentence number {i} about pinned rings." for i in range(30)]
    plain = _with_variant(manifest, "float32")
    floats = fabric_gpu.encode(texts, plain).vectors
    binary = _with_variant(manifest, "binary:128")
    made = fabric_gpu.encode(texts, binary).vectors
    assert made.dtype == np.uint8 and made.shape == (30, 16)
    twin = binary.hooks.output_variant().apply_numpy(floats)
    assert (np.unpackbits(made, axis=1) == np.unpackbits(twin, axis=1)).mean() >= 0.999
    with pytest.raises(EngineError, match="no int8 calibration"):
        fabric_gpu.encode(texts, _with_variant(manifest, "int8"))
