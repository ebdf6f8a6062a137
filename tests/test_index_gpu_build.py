"""The torch-cuda index build on a real GPU: deterministic on it, equal in quality to the same
algorithm on the CPU, and rebuilt from its receipt by a machine without a GPU.

Marked `gpu`: skipped with the reason where torch sees no CUDA GPU. The database is SQLite in a
temporary folder, so these run on a GPU machine that has no PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch
from sqlalchemy import Engine, insert

from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import build, torch_search
from fabric_pipelines.lib.index.build import IndexSpec, build_index, serialize
from fabric_pipelines.lib.index.publish import build_and_publish
from fabric_pipelines.lib.index.rebuild import check_files, rebuild_from_receipt
from fabric_pipelines.lib.index.recall import recall_at_k
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[tuple[Engine, FabricPaths]]:
    paths = FabricPaths(tmp_path / "fabric").ensure()
    engine = make_engine(f"sqlite:///{paths.sqlite_path}")
    create_schema(engine)
    yield engine, paths
    engine.dispose()


def _clustered(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((200, dim), dtype=np.float32)
    noise = rng.standard_normal((n, dim), dtype=np.float32)
    return centres[rng.integers(0, 200, n)] + 0.5 * noise


def test_a_gpu_build_is_deterministic_and_as_good_as_its_cpu_twin() -> None:
    x = _clustered(60_000, 96)
    ids = np.arange(60_000, dtype=np.int64)
    on_gpu = IndexSpec(factory="IVF256,Flat", nprobe=8, device="gpu")
    first, second = build_index(x, ids, on_gpu), build_index(x, ids, on_gpu)
    assert first.builder == "torch-cuda"
    assert serialize(first.index) == serialize(second.index)  # run to run, same GPU
    on_cpu = IndexSpec(factory="IVF256,Flat", nprobe=8, device="cpu", kmeans="torch")
    twin = build_index(x, ids, on_cpu)
    assert twin.builder == "torch-cpu"
    gpu_recall = recall_at_k(first.index, x, ids, on_gpu)[0]
    cpu_recall = recall_at_k(twin.index, x, ids, on_cpu)[0]
    assert abs(gpu_recall - cpu_recall) <= 0.01, (gpu_recall, cpu_recall)


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_gpu_exact_search_equals_the_cpu(metric: str) -> None:
    rng = np.random.default_rng(1)
    base = torch.from_numpy(rng.standard_normal((50_000, 64), dtype=np.float32))
    if metric == "cosine":
        base = torch.nn.functional.normalize(base, dim=1)
    queries = base[:300]
    cpu_scores, cpu_at = torch_search.top_k(queries, base, 20, metric)
    gpu_scores, gpu_at = torch_search.top_k(queries.cuda(), base.cuda(), 20, metric)
    same = (gpu_at.cpu() == cpu_at).float().mean().item()
    assert same > 0.999  # rows within float32 rounding of each other may swap
    assert torch.allclose(gpu_scores.cpu(), cpu_scores, atol=1e-4)
    lists = base[:512]
    agree = torch_search.nearest(base.cuda(), lists.cuda(), metric).cpu()
    assert (agree == torch_search.nearest(base, lists, metric)).float().mean().item() > 0.999


def test_a_gpu_receipt_is_rebuilt_without_the_gpu(sqlite: tuple[Engine, FabricPaths]) -> None:
    db, paths = sqlite
    x = _clustered(40_000, 64)
    with db.begin() as conn:
        model = model_id(conn, "m")
        conn.execute(
            insert(Embedding),
            [
                {"model_id": model, "task_set_id": 1, "record_no": i, "n_tokens": 5,
                 "vector": v.astype("<f4").tobytes()}
                for i, v in enumerate(x)
            ],
        )  # fmt: skip
    published = build_and_publish(
        db,
        model_key="m",
        model={"model_id": "test", "weights_sha256": "w"},
        spec=IndexSpec(factory="IVF256,Flat", nprobe=2, shards=4, device="gpu"),
        index_folder=paths.indexes,
        receipt_folder=paths.receipts,
        inputs=[],
        min_recall=0.9,
    )
    receipt = published.receipt
    assert published.accepted, published.shortfall
    assert receipt["training"]["builder"] == "torch-cuda" and receipt["build_device"] == "gpu"
    assert receipt["tolerance"]["kind"] == "recall"
    assert receipt["index"]["params"]["nprobe"] >= 2
    same_gpu = rebuild_from_receipt(db, receipt, paths.indexes)
    assert same_gpu.device == "torch-cuda" and same_gpu.detail == "bitwise identical"
    with patch.object(build, "cuda_available", return_value=False):
        on_cpu = rebuild_from_receipt(db, receipt, paths.indexes)
    assert on_cpu.device == "torch-cpu"
    assert on_cpu.matches, on_cpu.detail
    assert check_files(receipt, paths.indexes) == []
