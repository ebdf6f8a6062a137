"""Index builds, recall against exact search, receipts, and refusal of bad vectors."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest
from sqlalchemy import Engine, insert

from fabric_pipelines.lib.files import sha256_file
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    RecallProbe,
    build_index,
    recall_at_k,
    resolve_factory,
    serialize,
)
from fabric_pipelines.lib.index.publish import build_and_publish
from fabric_pipelines.lib.index.receipt import canonical_json, receipt_sha256
from fabric_pipelines.lib.index.vectors import BadVectorsError, check_vectors
from fabric_pipelines.lib.settings import FabricPaths
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding


def _clustered(n: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(20, dim))
    return (centres[rng.integers(0, 20, n)] + 0.3 * rng.normal(size=(n, dim))).astype(np.float32)


def test_auto_factory_is_flat_when_small_and_ivf_when_large() -> None:
    spec = IndexSpec()
    assert resolve_factory(spec, 500) == "Flat"
    assert resolve_factory(spec, 10_000) == "IVF128,Flat"


def test_flat_recall_is_exact_and_ivf_recall_is_measured() -> None:
    x = _clustered(5000)
    ids = np.arange(100, 5100, dtype=np.int64)
    flat = build_index(x, ids, IndexSpec(factory="Flat"))
    assert recall_at_k(flat.index, x, ids, IndexSpec())[0] == 1.0
    ivf_spec = IndexSpec(factory="IVF64,Flat", nprobe=1)
    ivf = build_index(x, ids, ivf_spec)
    one_list, queries = recall_at_k(ivf.index, x, ids, ivf_spec)
    assert queries == 500
    faiss.extract_index_ivf(ivf.index).nprobe = 64  # every list: exact again
    all_lists, _ = recall_at_k(ivf.index, x, ids, ivf_spec)
    assert all_lists == 1.0
    assert one_list < all_lists
    assert ivf.centroids_sha256 is not None and len(ivf.train_rows) == 5000


def test_recall_counts_neighbours_tied_at_the_kth_distance_alike() -> None:
    """Every vector three times over: the k-th exact neighbour is tied with others, and which of
    them a search returns is arbitrary. Recall must not depend on it, nor on how far the exact
    search looked."""
    x = np.repeat(_clustered(1000), 3, axis=0)
    ids = np.arange(len(x), dtype=np.int64)
    spec = IndexSpec(factory="IVF32,Flat", nprobe=2, recall_queries=300)
    ivf = build_index(x, ids, spec)
    short, wide = RecallProbe(x, ids, spec, max_k=10), RecallProbe(x, ids, spec, max_k=100)
    assert short.recall(ivf.index, 10) == wide.recall(ivf.index, 10)
    # An "index" that returns the tied duplicates in reverse order of the exact search still
    # finds every neighbour: full recall.
    flat = build_index(x, ids, IndexSpec(factory="Flat"))
    assert short.recall(_ReversedTies(flat.index), 10)[0] == 1.0


class _ReversedTies:
    """Searches `index` but lists results of equal distance in descending id order."""

    def __init__(self, index: faiss.Index) -> None:
        self.index = index

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        d, i = self.index.search(queries, k + 5)
        order = np.lexsort((-i, -d))  # by distance (inner product: larger first), then id down
        d, i = np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)
        return d[:, :k], i[:, :k]


def test_the_same_inputs_build_the_same_bytes() -> None:
    x = _clustered(3000)
    ids = np.arange(3000, dtype=np.int64)
    spec = IndexSpec(factory="IVF32,Flat")
    assert serialize(build_index(x, ids, spec).index) == serialize(build_index(x, ids, spec).index)


@pytest.mark.parametrize(
    ("damage", "message"),
    [("nan", "1 with NaN"), ("inf", "1 with Inf"), ("zero", "1 with zero norm")],
)
def test_bad_vectors_are_refused_with_counts(damage: str, message: str) -> None:
    x = _clustered(10)
    x[3] = {"nan": np.nan, "inf": np.inf, "zero": 0.0}[damage]
    with pytest.raises(BadVectorsError, match=message):
        check_vectors(x, "cosine")
    if damage == "zero":
        check_vectors(x, "l2")  # zero vectors are fine under L2


def test_canonical_json_is_stable_and_rejects_nan() -> None:
    a = {"b": 1, "a": [1, 2, {"z": "é", "y": None}]}
    assert canonical_json(a) == b'{"a":[1,2,{"y":null,"z":"\xc3\xa9"}],"b":1}'
    assert receipt_sha256(a) == receipt_sha256(json.loads(canonical_json(a)))
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_publish_writes_index_receipt_file_and_row(db: Engine, paths: FabricPaths) -> None:
    x = _clustered(2500, dim=16)
    with db.begin() as conn:
        model = model_id(conn, "m")
        conn.execute(
            insert(Embedding),
            [
                {
                    "task_set_id": 1, "record_no": i, "model_id": model, "n_tokens": 5,
                    "vector": v.astype("<f4").tobytes(),
                }
                for i, v in enumerate(x)
            ],
        )  # fmt: skip
    published = build_and_publish(
        db,
        model_key="m",
        model={"model_id": "test"},
        spec=IndexSpec(),
        index_folder=paths.indexes,
        receipt_folder=paths.receipts,
        inputs=[],
    )
    receipt = published.receipt
    assert receipt["index"]["factory"] == "IVF64,Flat"
    assert receipt["source"]["rows"] == 2500
    assert sha256_file(published.index_path) == receipt["index_sha256"]
    assert published.receipt_path.read_bytes() == canonical_json(receipt)
    assert published.receipt_sha256 == receipt_sha256(receipt)
    assert published.recall_at_k > 0.9
    # Building again from the same rows gives the same receipt.
    again = build_and_publish(
        db, model_key="m", model={"model_id": "test"}, spec=IndexSpec(),
        index_folder=paths.indexes, receipt_folder=paths.receipts, inputs=[],
    )  # fmt: skip
    assert again.receipt_sha256 == published.receipt_sha256
    assert Path(again.index_path) == Path(published.index_path)
