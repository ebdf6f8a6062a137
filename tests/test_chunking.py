"""Long inputs split into windows (`--long-inputs chunk`, the default): every window is a task
like any other, and a document's vector is the token-weighted mean of its windows' vectors.

Checked here: the windows cover every token with the asked overlap; a task set of texts from 10
to 100,000 tokens completes with no over-long failure and its accounting balances by task and by
document; one document's stored vector equals the mean computed independently (the model run on
the windows through Hugging Face, windows cut by a loop of this file's own); combining again, or
from two threads at once, stores one row per document with the same bytes; the index reads
documents only; a failed window leaves its document failed, not lost.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Engine, func, select

from fabric_gpu.engines import create_engine
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.maintenance.verify import verify
from fabric_pipelines.lib.results.documents import combine_documents, recombine_documents
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import WINDOW_BASE, DocumentWindow, Embedding, TaskSet
from fabric_pipelines.lib.tasks.ingest import ingest
from fabric_pipelines.lib.tasks.windows import LongInputs, split, window_starts
from tests.conftest import TEST_PROFILE
from tests.pipeline_helpers import run_stages, stored_embeddings

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
    "receipt",
    "ledger",
    "worker",
    "lease",
    "shard",
    "model",
    "layer",
    "query",
    "answer",
    "file",
    "record",
    "window",
    "overlap",
    "document",
]
LENGTHS = (10, 60, 126, 127, 128, 129, 700, 5_000, 100_000)  # words: about as many tokens


def _text(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def _source(tmp_path: Path, lengths: tuple[int, ...] = LENGTHS) -> Path:
    path = tmp_path / "long.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"doc{n}", "text": _text(n, n)}) + "\n" for n in lengths)
    )
    return path


@pytest.fixture(scope="module")
def normalising() -> EngineManifest:
    """The real all-MiniLM-L6-v2, unit vectors (as its folder says), 128-token windows."""
    return manifest_for_model(
        DEFAULT_MODEL_ID, backend="cpu", dtype="float32", profile=TEST_PROFILE,
        hooks=HookSpec((), "mean", normalize=True),
    )  # fmt: skip


def _windows_by_hand(ids: list[int], max_len: int, overlap: int) -> list[list[int]]:
    """The windows of one tokenised record, cut by a plain loop: [CLS] + a run of the inner
    tokens + [SEP], each run advancing by max_len - 2 - overlap, the last flush with the end."""
    inner, width = ids[1:-1], max_len - 2
    starts, start = [], 0
    while start + width < len(inner):
        starts.append(start)
        start += width - overlap
    starts.append(len(inner) - width)
    return [[ids[0], *inner[s : s + width], ids[-1]] for s in starts]


@pytest.mark.parametrize("n_tokens", [129, 130, 300, 1000, 4097])
@pytest.mark.parametrize("overlap", [0, 1, 32, 125])
def test_windows_cover_every_token_with_the_overlap_asked(n_tokens: int, overlap: int) -> None:
    max_len = 128
    ids = list(range(1000, 1000 + n_tokens))
    tokens = np.array(ids, dtype=np.int32)
    windows = split(tokens, np.array([0, n_tokens]), np.array([0]), np.array([7]), max_len, overlap)
    got = [
        windows.tokens[windows.offsets[i] : windows.offsets[i + 1]].tolist()
        for i in range(len(windows.document))
    ]
    assert got == _windows_by_hand(ids, max_len, overlap)
    assert all(len(w) == max_len for w in got)
    assert windows.document.tolist() == [7] * len(got)
    assert windows.n_windows.tolist() == [len(got)] and windows.doc_tokens.tolist() == [n_tokens]
    covered = set().union(*(w[1:-1] for w in got))
    assert covered == set(ids[1:-1]), "every inner token is in some window"
    starts = window_starts(n_tokens, max_len, overlap)
    assert np.all(np.diff(starts)[:-1] == max_len - 2 - overlap) if len(starts) > 2 else True


def test_an_overlap_that_leaves_no_room_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"window_overlap 126 .* below 126"):
        LongInputs.of("chunk", 126).check(128)
    with pytest.raises(ValueError, match="long_inputs 'split': choose one of chunk"):
        LongInputs.of("split")


def test_ingest_turns_each_long_record_into_windows_after_the_other_tasks(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))
    tasks = ingest(
        _source(tmp_path, (10, 300, 60, 129)), tokenizer, max_seq_len=128,
        long_inputs=LongInputs("chunk", 16),
    )  # fmt: skip
    assert not tasks.failures and tasks.truncated == 0
    assert tasks.windows is not None and tasks.n_chunked == 2
    plain = [int(r) for r in tasks.record_no if r < WINDOW_BASE]
    assert plain == [0, 2]
    record_no, ids = tasks.documents()
    assert record_no.tolist() == [0, 1, 2, 3] and ids == ["doc10", "doc300", "doc60", "doc129"]
    assert tasks.lengths.max() <= 128
    windows = tasks.record_no[tasks.record_no >= WINDOW_BASE] - WINDOW_BASE
    assert windows.tolist() == list(range(len(tasks.windows.document)))


@pytest.mark.slow
def test_texts_of_10_to_100000_tokens_complete_and_balance_by_task_and_by_document(
    db: Engine, paths: FabricPaths, tmp_path: Path, normalising: EngineManifest
) -> None:
    engine = create_engine(normalising)
    try:
        summary, report = run_stages(
            db, paths, engine, normalising, _source(tmp_path), "long",
            long_inputs=LongInputs("chunk", 32),
        )  # fmt: skip
    finally:
        engine.close()
    assert summary.n_failed == 0, summary.failures
    assert report.batches_failed == 0
    tokenizer = load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))
    n_tokens = [len(tokenizer.encode(_text(n, n)).ids) for n in LENGTHS]
    assert summary.n_chunked == sum(1 for n in n_tokens if n > 128)
    with db.connect() as conn:
        counts = accounting(conn, "long", normalising.model_key)
        windows = conn.execute(select(func.sum(DocumentWindow.n_windows))).scalar_one()
    assert counts.finished and counts.failed == 0, counts
    assert counts.tasks == len(LENGTHS) - summary.n_chunked + summary.n_windows
    assert summary.n_windows == windows > 100_000 // 94  # the longest alone
    docs = counts.documents
    assert docs is not None
    assert (docs.documents, docs.stored, docs.failed, docs.waiting) == (len(LENGTHS),) * 2 + (0, 0)
    assert docs.windows == docs.windows_stored == summary.n_windows

    stored = stored_embeddings(db, "long", normalising.model_key)
    assert sorted(stored) == sorted(f"doc{n}" for n in LENGTHS)
    for vector in stored.values():
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5

    # A document row changed behind the product's back: verify finds it, recombine repairs it.
    assert verify(db, paths, "long").clean
    long_doc = LENGTHS.index(5_000)
    with db.begin() as conn:
        conn.execute(
            Embedding.__table__.update()
            .where(Embedding.record_no == long_doc)
            .values(vector=np.ones(384, np.float32).tobytes())
        )
    findings = [f for f in verify(db, paths, "long").findings if f.kind == "documents"]
    assert len(findings) == 1 and f"records {long_doc}" in findings[0].problem
    assert findings[0].repair.startswith("fabric recombine long --model-key")
    with db.connect() as conn:
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == "long")).scalar_one()
        model = model_id(conn, normalising.model_key)
    assert recombine_documents(db, set_id, model, normalize=True) == 1
    assert verify(db, paths, "long").clean
    assert np.array_equal(
        stored_embeddings(db, "long", normalising.model_key)[f"doc{LENGTHS[long_doc]}"],
        stored[f"doc{LENGTHS[long_doc]}"],
    )


@pytest.mark.slow
def test_a_documents_vector_is_the_token_weighted_mean_of_its_windows_computed_independently(
    db: Engine, paths: FabricPaths, tmp_path: Path, normalising: EngineManifest
) -> None:
    import torch
    from transformers import AutoModel

    lengths = (40, 5_000)
    engine = create_engine(normalising)
    try:
        run_stages(
            db, paths, engine, normalising, _source(tmp_path, lengths), "mean",
            long_inputs=LongInputs("chunk", 20),
        )  # fmt: skip
    finally:
        engine.close()
    stored = stored_embeddings(db, "mean", normalising.model_key)

    model_dir = resolve_model_dir(DEFAULT_MODEL_ID)
    ids = load_tokenizer(model_dir).encode(_text(5_000, 5_000)).ids
    windows = _windows_by_hand(ids, 128, 20)
    model = AutoModel.from_pretrained(model_dir).eval()
    vectors = []
    with torch.no_grad():
        for start in range(0, len(windows), 16):
            chunk = torch.tensor(windows[start : start + 16])
            hidden = model(input_ids=chunk, attention_mask=torch.ones_like(chunk))[0]
            mean = hidden.mean(dim=1)  # every window is full: no padding to leave out
            vectors.append(torch.nn.functional.normalize(mean, dim=1).numpy())
    window_vectors = np.concatenate(vectors).astype(np.float64)
    weights = np.array([len(w) for w in windows], dtype=np.float64)
    expected = (window_vectors * weights[:, None]).sum(0) / weights.sum()
    expected /= np.linalg.norm(expected)
    got = stored["doc5000"].astype(np.float64)
    cosine = float(got @ expected / np.linalg.norm(got))
    assert cosine >= 0.9999, cosine
    assert len(windows) > 40


def test_combining_twice_or_from_two_threads_stores_one_row_per_document(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    """Window rows written by hand (what the writer stores), then combined by two threads at
    once and once more: one document row each, the same bytes as a single combine gives."""
    from tests.ledger_helpers import store_set

    set_id = store_set(db, "pair")
    rng = np.random.default_rng(1)
    n_docs, per_doc, dim = 30, 5, 8
    window_vectors = rng.standard_normal((n_docs * per_doc, dim)).astype(np.float32)
    with db.begin() as conn:
        model = model_id(conn, "m@0:mean")
        conn.execute(
            TaskSet.__table__.update()
            .where(TaskSet.id == set_id)
            .values(n_chunked=n_docs, n_windows=n_docs * per_doc, n_records=n_docs)
        )
        conn.execute(
            DocumentWindow.__table__.insert(),
            [
                {
                    "task_set_id": set_id,
                    "record_no": d,
                    "first_window": WINDOW_BASE + d * per_doc,
                    "n_windows": per_doc,
                    "n_tokens": 500,
                }
                for d in range(n_docs)
            ],
        )
        conn.execute(
            Embedding.__table__.insert(),
            [
                {
                    "task_set_id": set_id,
                    "model_id": model,
                    "record_no": WINDOW_BASE + w,
                    "n_tokens": 100 + w % per_doc,
                    "vector": window_vectors[w].tobytes(),
                }
                for w in range(n_docs * per_doc)
            ],
        )
    errors: list[BaseException] = []

    def combine() -> None:
        try:
            combine_documents(db, set_id, model, normalize=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=combine) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    again = combine_documents(db, set_id, model, normalize=True)
    assert (again.documents, again.written, again.waiting) == (n_docs, 0, 0)
    with db.connect() as conn:
        rows = conn.execute(
            select(Embedding.record_no, Embedding.vector)
            .where(Embedding.task_set_id == set_id, Embedding.record_no < WINDOW_BASE)
            .order_by(Embedding.record_no)
        ).all()
    assert [r.record_no for r in rows] == list(range(n_docs))
    weights = 100 + np.arange(per_doc, dtype=np.float64)
    for d, row in enumerate(rows):
        block = window_vectors[d * per_doc : (d + 1) * per_doc].astype(np.float64)
        mean = (block * weights[:, None]).sum(0) / weights.sum()
        got = np.frombuffer(row.vector, dtype="<f4")
        np.testing.assert_allclose(got, mean / np.linalg.norm(mean), rtol=1e-6, atol=1e-7)


def test_a_document_with_a_window_missing_is_not_combined_and_counts_as_waiting(
    db: Engine, paths: FabricPaths
) -> None:
    from tests.ledger_helpers import store_set

    set_id = store_set(db, "gap")
    with db.begin() as conn:
        model = model_id(conn, "m@0:mean")
        conn.execute(
            DocumentWindow.__table__.insert(),
            [
                {
                    "task_set_id": set_id,
                    "record_no": 0,
                    "first_window": WINDOW_BASE,
                    "n_windows": 3,
                    "n_tokens": 300,
                }
            ],
        )
        conn.execute(
            Embedding.__table__.insert(),
            [
                {
                    "task_set_id": set_id,
                    "model_id": model,
                    "record_no": WINDOW_BASE + w,
                    "n_tokens": 100,
                    "vector": np.ones(4, np.float32).tobytes(),
                }
                for w in (0, 2)
            ],
        )
    combined = combine_documents(db, set_id, model, normalize=False)
    assert (combined.documents, combined.written, combined.waiting) == (1, 0, 1)


def test_the_index_reads_documents_never_windows(db: Engine) -> None:
    from fabric_pipelines.lib.index.vectors import ID_STRIDE, load_vectors
    from tests.ledger_helpers import store_set

    set_id = store_set(db, "idx")
    with db.begin() as conn:
        model = model_id(conn, "m@0:mean")
        conn.execute(
            Embedding.__table__.insert(),
            [
                {
                    "task_set_id": set_id,
                    "model_id": model,
                    "record_no": r,
                    "n_tokens": 5,
                    "vector": np.full(4, r % 7, np.float32).tobytes(),
                }
                for r in (0, 1, 2, WINDOW_BASE, WINDOW_BASE + 1)
            ],
        )
    with db.connect() as conn:
        vectors = load_vectors(conn, "m@0:mean")
    assert (vectors.ids - set_id * ID_STRIDE).tolist() == [0, 1, 2]


def test_a_lost_chunked_task_file_is_rebuilt_to_the_same_bytes_with_the_sets_own_policy(
    db: Engine, paths: FabricPaths, tmp_path: Path
) -> None:
    """The set records how it took its long records (chunk:8 here): a lost stored file is cut
    into the same windows again, whatever the run asking now would choose."""
    from fabric_pipelines.lib.core.files import sha256_file
    from fabric_pipelines.lib.tasks.catalog import IngestSummary, get_task_set, ingest_task_set
    from fabric_pipelines.lib.tasks.inbox import submit

    submit(_source(tmp_path, (10, 300, 700)), paths.inbox, "heal")

    def ingest_now(long_inputs: LongInputs) -> IngestSummary:
        return ingest_task_set(
            db, paths, "heal", model_id=DEFAULT_MODEL_ID, max_seq_len=128, long_inputs=long_inputs
        )

    first = ingest_now(LongInputs("chunk", 8))
    row = get_task_set(db, "heal")
    assert row.long_inputs == "chunk:8" and row.n_chunked == 2 and row.n_windows > 6
    Path(row.path).unlink()
    again = ingest_now(LongInputs("truncate"))  # another run's choice: the set keeps its own
    assert again.reused and again.n_windows == row.n_windows
    assert sha256_file(Path(row.path)) == row.content_sha256 == first.content_sha256


def test_export_with_windows_adds_each_window_beside_its_document(
    db: Engine, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq

    from fabric_pipelines.lib.results.export import export_task_set
    from fabric_pipelines.lib.tasks.catalog import attach_task_ids, write_task_ids
    from tests.ledger_helpers import store_set

    set_id = store_set(db, "exw", n_records=3)
    rng = np.random.default_rng(3)
    # Record 0 is a short document; 1 and 2 are chunked into 3 and 2 windows.
    window_vectors = rng.standard_normal((5, 4)).astype(np.float32)
    with db.begin() as conn:
        model = model_id(conn, "m@0:mean")
        write_task_ids(conn, set_id, np.arange(3, dtype=np.int64), [f"doc-{r}" for r in range(3)])
        attach_task_ids(conn, set_id)
        conn.execute(
            DocumentWindow.__table__.insert(),
            [
                {
                    "task_set_id": set_id,
                    "record_no": 1,
                    "first_window": WINDOW_BASE,
                    "n_windows": 3,
                    "n_tokens": 300,
                },
                {
                    "task_set_id": set_id,
                    "record_no": 2,
                    "first_window": WINDOW_BASE + 3,
                    "n_windows": 2,
                    "n_tokens": 200,
                },
            ],
        )
        rows = [{"record_no": 0, "n_tokens": 7, "vector": np.ones(4, np.float32).tobytes()}]
        rows += [
            {"record_no": WINDOW_BASE + w, "n_tokens": 100, "vector": window_vectors[w].tobytes()}
            for w in range(5)
        ]
        conn.execute(
            Embedding.__table__.insert(),
            [{"task_set_id": set_id, "model_id": model, **r} for r in rows],
        )
    combine_documents(db, set_id, model, normalize=False)
    done = export_task_set(db, "exw", tmp_path / "w.parquet", model_key="m@0:mean", windows=True)
    table = pq.read_table(done.path)
    assert done.rows == 3 + 5 and table.column_names[-1] == "window"
    got = list(
        zip(
            table.column("id").to_pylist(),
            table.column("record_no").to_pylist(),
            table.column("window").to_pylist(),
            strict=True,
        )
    )
    assert got == [
        ("doc-0", 0, None), ("doc-1", 1, None), ("doc-2", 2, None),
        ("doc-1", 1, 0), ("doc-1", 1, 1), ("doc-1", 1, 2), ("doc-2", 2, 0), ("doc-2", 2, 1),
    ]  # fmt: skip
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False)[3:])
    assert np.array_equal(vectors.astype(np.float32), window_vectors)
    plain = export_task_set(db, "exw", tmp_path / "d.parquet", model_key="m@0:mean")
    assert plain.rows == 3, "without --windows: documents only"
