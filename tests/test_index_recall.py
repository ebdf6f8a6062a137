"""An IVF-Flat index's recall read off its lists: what searching it finds, at every nprobe and k,
ties included; searched instead where the index does not hold what its lists say."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from fabric_pipelines.lib.index import quality
from fabric_pipelines.lib.index.build import IndexSpec, build_index, prepare_rows, set_nprobe
from fabric_pipelines.lib.index.list_recall import ListRecall
from fabric_pipelines.lib.index.probe import RecallProbe
from fabric_pipelines.lib.index.recall import NprobeChoice, choose_nprobe, doublings
from fabric_pipelines.lib.index.vectors import check_vectors


def _clustered(n: int, dim: int = 24, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(30, dim))
    return (centres[rng.integers(0, 30, n)] + 0.4 * rng.normal(size=(n, dim))).astype(np.float32)


def _with_duplicates(seed: int = 0) -> np.ndarray:
    """3,000 rows, and 8 more rows 250 times each: their queries have more rows tied at every
    k-th distance than the probe holds exact neighbours."""
    x = _clustered(3000, seed=seed)
    return np.concatenate([x, np.repeat(x[:8] + 0.01, 250, axis=0)])


def test_recall_read_off_the_lists_is_what_searching_finds() -> None:
    x = _with_duplicates()
    ids = np.arange(11, 11 + len(x), dtype=np.int64)
    spec = IndexSpec(factory="IVF32,Flat", nprobe=1)
    index = build_index(x, ids, spec).index
    probe = RecallProbe.of_vectors(x, ids, spec, max_k=100)
    assert not probe.complete(100).all() and probe.complete(100).any()  # both kinds of query
    lists = ListRecall(probe, index)
    for nprobe in doublings(1, 32):
        read = lists.at(index, nprobe, [1, 10, 100])
        set_nprobe(index, nprobe)
        searched = probe.scores(probe.search(index), [1, 10, 100])
        assert read == searched, nprobe
        assert lists.agrees_with_search(index, nprobe, [1, 10, 100])


def test_the_choice_read_off_the_lists_is_the_searched_choice() -> None:
    x = np.random.default_rng(4).standard_normal((4000, 16)).astype(np.float32)
    ids = np.arange(len(x), dtype=np.int64)
    spec = IndexSpec(factory="IVF64,Flat", nprobe=1)
    index = build_index(x, ids, spec).index
    probe = RecallProbe.of_vectors(x, ids, spec, max_k=100)
    read = choose_nprobe(index, probe, spec, 0.9, (1, 10, 100), ListRecall(probe, index))
    chosen = faiss.extract_index_ivf(index).nprobe
    searched = choose_nprobe(index, probe, spec, 0.9, (1, 10, 100))
    assert read == searched and chosen == read.nprobe and 1 < read.nprobe < 64
    assert list(read.tried) == doublings(1, read.nprobe)


def test_an_index_whose_search_disagrees_with_its_lists_is_measured_by_searching() -> None:
    """Rows stored under one another's ids: the lists name where each id is, a search finds
    other rows there. The check catches it and the recall reported is the searched one."""
    x = _clustered(4000)
    ids = np.arange(len(x), dtype=np.int64)
    spec = IndexSpec(factory="IVF32,Flat", nprobe=4)
    swapped = np.random.default_rng(2).permutation(len(x))
    index = build_index(x[swapped], ids, spec).index
    probe = RecallProbe.of_vectors(x, ids, spec, max_k=100)
    lists = ListRecall(probe, index)
    assert not lists.agrees_with_search(index, 4, [1, 10, 100])
    read = choose_nprobe(index, probe, spec, 0.5, (1, 10, 100), lists)
    searched = choose_nprobe(index, probe, spec, 0.5, (1, 10, 100))
    assert read == searched and read.recall[10] < 0.1


@pytest.mark.parametrize("factory", ["IVF32,Flat", "IVF32,PQ4x4"])
def test_the_index_is_final_when_measure_says_its_nprobe_is_chosen(factory: str) -> None:
    """The caller stores the served index from then on: it is set to the chosen nprobe, and
    nothing measured after changes it."""
    x = _clustered(5000)
    ids = np.arange(len(x), dtype=np.int64)
    spec = IndexSpec(factory=factory, nprobe=1)
    index = build_index(x, ids, spec).index
    seen: list[tuple[int, bytes]] = []

    def chosen(choice: NprobeChoice) -> None:
        seen.append((choice.nprobe, faiss.serialize_index(index).tobytes()))

    rows = prepare_rows(x, ids, spec)
    measured = quality.measure(index, rows, x, check_vectors(x, "cosine"), spec, 0.99, chosen)
    assert len(seen) == 1 and seen[0][0] == measured.choice.nprobe > 1
    assert faiss.serialize_index(index).tobytes() == seen[0][1]  # unchanged since
