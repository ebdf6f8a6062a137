"""Index builds, recall against exact search, receipts, and refusal of bad vectors."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import faiss
import numpy as np
import pytest
import torch
from sqlalchemy import Engine, insert

from fabric_pipelines.lib.core.files import sha256_file
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import kmeans, quality, torch_search
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    build_index,
    prepare_rows,
    resolve_factory,
    serialize,
    set_nprobe,
)
from fabric_pipelines.lib.index.list_recall import ListRecall
from fabric_pipelines.lib.index.probe import RecallProbe
from fabric_pipelines.lib.index.publish import build_and_publish
from fabric_pipelines.lib.index.recall import doublings, recall_at_k
from fabric_pipelines.lib.index.receipt import canonical_json, receipt_sha256
from fabric_pipelines.lib.index.vectors import BadVectorsError, check_vectors
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
    short = RecallProbe.of_vectors(x, ids, spec, max_k=10)
    wide = RecallProbe.of_vectors(x, ids, spec, max_k=100)
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


def test_torch_kmeans_on_the_cpu_is_deterministic_and_as_good_as_faiss() -> None:
    """The torch builder (the GPU build's algorithm, here on the CPU) gives the same bytes run
    to run, and an index as good as FAISS's own k-means."""
    x = _clustered(6000)
    ids = np.arange(6000, dtype=np.int64)
    torch_spec = IndexSpec(factory="IVF64,Flat", nprobe=4, kmeans="torch", device="cpu")
    first, second = build_index(x, ids, torch_spec), build_index(x, ids, torch_spec)
    assert first.builder == "torch-cpu" and first.iterations == 10
    assert serialize(first.index) == serialize(second.index)
    assert first.centroids_sha256 == second.centroids_sha256
    faiss_spec = IndexSpec(factory="IVF64,Flat", nprobe=4, kmeans="faiss", device="cpu")
    reference = build_index(x, ids, faiss_spec)
    assert reference.builder == "faiss-cpu"
    with_torch = recall_at_k(first.index, x, ids, torch_spec)[0]
    with_faiss = recall_at_k(reference.index, x, ids, faiss_spec)[0]
    assert with_torch > with_faiss - 0.03, (with_torch, with_faiss)


def test_torch_builds_only_plain_ivf_and_faiss_trains_the_rest() -> None:
    x = _clustered(3000)
    ids = np.arange(3000, dtype=np.int64)
    for factory, builder in [
        ("IVF32,Flat", "torch-cpu"),
        ("IVF32,PQ4x4", "torch-cpu"),  # torch's centroids; FAISS trains the codes on residuals
        ("PCA16,IVF32,Flat", "faiss-cpu"),  # the quantizer works on transformed rows
        ("Flat", "faiss-cpu"),  # nothing to train
    ]:
        spec = IndexSpec(factory=factory, kmeans="torch", device="cpu")
        built = build_index(x, ids, spec)
        assert built.builder == builder, factory
        assert built.index.ntotal == 3000
        reference = build_index(x, ids, IndexSpec(factory=factory, kmeans="faiss", device="cpu"))
        assert recall_at_k(built.index, x, ids, spec)[0] > (
            recall_at_k(reference.index, x, ids, spec)[0] - 0.05
        ), factory


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_the_lists_curve_equals_searching_the_index(metric: str) -> None:
    """recall per nprobe worked out from the exact neighbours and the index's lists is what
    searching the IVF-Flat index at each nprobe measures."""
    x = np.random.default_rng(3).standard_normal((5000, 24)).astype(np.float32)
    ids = np.arange(7, 5007, dtype=np.int64)
    spec = IndexSpec(factory="IVF64,Flat", metric=metric, nprobe=1, device="cpu")
    built = build_index(x, ids, spec)
    probe = RecallProbe.of_vectors(x, ids, spec, max_k=100)
    steps = doublings(1, 64)
    worked_out = ListRecall(probe, built.index).curve(steps, 10)
    searched = {}
    for nprobe in steps:
        set_nprobe(built.index, nprobe)
        searched[nprobe] = round(probe.recall(built.index, 10)[0], 6)
    assert worked_out == searched
    assert searched[1] < 0.5 and searched[64] == 1.0


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_torch_exact_search_matches_a_full_sort(metric: str) -> None:
    rng = np.random.default_rng(5)
    base = rng.standard_normal((3000, 16)).astype(np.float32)
    if metric == "cosine":
        base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = base[:50]
    dots = queries.astype(np.float64) @ base.T.astype(np.float64)
    if metric == "cosine":
        order = np.argsort(-dots, axis=1, kind="stable")
    else:
        squares = (base.astype(np.float64) ** 2).sum(1)
        order = np.argsort(squares[None, :] - 2 * dots, axis=1, kind="stable")
    t_base, t_queries = torch.from_numpy(base), torch.from_numpy(queries)
    with patch.object(torch_search, "TILE_ELEMENTS", 50 * 700):  # several tiles to merge
        scores, at = torch_search.top_k(t_queries, t_base, 12, metric)
        labels = torch_search.nearest(t_base, t_base[:40], metric)
    assert np.array_equal(at.numpy(), order[:, :12])
    if metric == "cosine":
        assert np.allclose(scores.numpy(), np.take_along_axis(dots, order[:, :12], 1), atol=1e-5)
    assert np.array_equal(labels.numpy()[:40], np.arange(40))  # each centroid is its own nearest


def test_an_empty_cluster_takes_over_half_of_the_largest() -> None:
    centroids = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [5.0, 6.0]])
    counts = torch.tensor([10, 40, 0, 40])
    split = kmeans.split_empty(centroids.clone(), counts)
    nudge = kmeans.SPLIT_NUDGE
    # Cluster 1 is the largest (the lower number of two equals): both halves straddle it.
    assert torch.equal(split[2], torch.tensor([3.0 * (1 + nudge), 4.0 * (1 - nudge)]))
    assert torch.equal(split[1], torch.tensor([3.0 * (1 - nudge), 4.0 * (1 + nudge)]))
    assert torch.equal(split[[0, 3]], centroids[[0, 3]])


def test_kmeans_refuses_fewer_rows_than_lists_and_fills_every_list() -> None:
    x = torch.from_numpy(_clustered(300, dim=8))
    with pytest.raises(ValueError, match="at least one row per list"):
        kmeans.kmeans(x[:10], 16, "l2", seed=1)
    # Many duplicates: initial centroids collide and clusters go empty; splits refill them.
    duplicated = torch.cat([x[:5].repeat(40, 1), x[5:]])
    found = kmeans.kmeans(duplicated, 32, "l2", seed=1)
    sizes = torch.bincount(torch_search.nearest(duplicated, found, "l2"), minlength=32)
    assert int((sizes > 0).sum()) > 20
    assert torch.equal(found, kmeans.kmeans(duplicated, 32, "l2", seed=1))


def test_spec_refuses_unknown_builders_and_a_gpu_it_cannot_see() -> None:
    with pytest.raises(ValueError, match="kmeans"):
        IndexSpec(kmeans="sklearn")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            IndexSpec(device="gpu")


def test_vector_counts_come_back_from_the_check() -> None:
    x = _clustered(50)
    x[4] = 0.0
    x[6, 3] = 1e30  # finite, though its square overflows float32: not a bad row
    counts = check_vectors(x, "l2")
    assert (counts.rows, counts.nan_rows, counts.inf_rows, counts.zero_norm_rows) == (50, 0, 0, 1)


def test_density_and_near_duplicates_are_read_off_the_recall_queries() -> None:
    x = np.repeat(_clustered(1500), 2, axis=0)  # every row twice
    ids = np.arange(len(x), dtype=np.int64)
    spec = IndexSpec(factory="IVF16,Flat", recall_queries=100)
    built = build_index(x, ids, spec)
    rows = prepare_rows(x, ids, spec)
    measured = quality.measure(built.index, rows, x, check_vectors(x, "cosine"), spec, 0.0)
    assert measured.measures["near_duplicates"] == 100  # each query's twin
    nearest = RecallProbe(rows, spec, max_k=100).neighbour_distances(10)
    assert nearest.shape == (100, 10) and np.all(nearest[:, 0] < 1e-6)
    assert measured.measures["knn_density_10"] == round(float(nearest.mean()), 6) > 0
