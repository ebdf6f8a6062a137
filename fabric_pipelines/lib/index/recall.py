"""Recall against exact search, and the nprobe an IVF index needs to reach a recall target.

Queries are a seeded sample of the indexed rows. Their exact neighbours are found once (torch,
on the build's device) up to `max_k`; any index over the same rows is then scored at any k up to
it. Each query's own row is left out of both answers, so recall measures its neighbours. A
returned neighbour counts when it is as close as the k-th exact one, so rows tied at that
distance (duplicates) count alike, whichever order a search returned them in.

An IVF-Flat index's recall at any nprobe is read off its lists (index/list_recall.py): what a
search would find, without paying for the rows of every probed list per query. Searching 500
queries costs the rows of the lists each probes, which uneven lists (a few holding many rows,
probed by most queries) and every extra nprobe tried multiply. Other indexes store compressed
codes, so they are searched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import faiss
import numpy as np

from fabric_pipelines.lib.index.build import (
    IndexSpec,
    is_ivf,
    is_ivf_flat,
    nlist,
    set_nprobe,
)
from fabric_pipelines.lib.index.list_recall import ListRecall
from fabric_pipelines.lib.index.probe import RecallProbe

RULE = (
    "seeded sample of indexed rows, each query's own row left out; a returned neighbour counts "
    "when it is as close as the k-th exact one (ties count alike)"
)
CURVE_RULE_LISTS = (
    "from the exact neighbours and the index's own lists: at nprobe p a query finds every exact "
    "neighbour whose list is among its p nearest (IVF-Flat scans a probed list exactly)"
)
CURVE_RULE_SEARCH = "searched: the index at each nprobe"


# rounding) with the k-th are seen too; dense data has many rows within rounding of it


def recall_at_k(
    index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec, k: int | None = None
) -> tuple[float, int]:
    """Recall@k (default the spec's k) of `index` against exact search: one RecallProbe."""
    k = spec.k if k is None else k
    return RecallProbe.of_vectors(vectors, ids, spec, k).recall(index, k)


def doublings(start: int, stop: int) -> list[int]:
    """start, 2 start, 4 start, ... and then `stop` itself (start <= stop)."""
    out = [min(start, stop)]
    while out[-1] < stop:
        out.append(min(2 * out[-1], stop))
    return out


def nprobe_curve(
    index: faiss.Index, probe: RecallProbe, spec: IndexSpec, lists: ListRecall | None = None
) -> dict[int, float]:
    """recall@k at each nprobe 1, 2, 4, ... up to the number of lists (IVF only): from the lists
    for IVF-Flat (cheap at any size; `lists` where the caller has them), by searching otherwise."""
    if not is_ivf(index):
        return {}
    points = doublings(1, nlist(index))
    if is_ivf_flat(index):
        return (lists or ListRecall(probe, index)).curve(points, spec.k)
    before = faiss.extract_index_ivf(index).nprobe
    curve = {}
    for p in points:
        set_nprobe(index, p)
        curve[p] = round(probe.recall(index, spec.k)[0], 6)
    set_nprobe(index, before)
    return curve


@dataclass(frozen=True)
class NprobeChoice:
    nprobe: int  # the nprobe the served index keeps
    requested: int
    tried: dict[int, float]  # recall@k at each nprobe tried, in order
    met: bool  # whether recall@k at `nprobe` reaches the target
    recall: dict[int, float]  # recall at `nprobe` for each k asked for


def choose_nprobe(
    index: faiss.Index,
    probe: RecallProbe,
    spec: IndexSpec,
    min_recall: float,
    ks: tuple[int, ...] = (),
    lists: ListRecall | None = None,
) -> NprobeChoice:
    """Recall@k at the spec's nprobe, then at twice that, ... up to every list, until it reaches
    `min_recall`; the index keeps the nprobe that did (or every list, when none did). Recall is
    reported (rounded to 6 places) at the spec's k and at each of `ks`.

    With `lists` (IVF-Flat) each nprobe's recall is read off the lists, and FAISS searches a
    few queries at the chosen nprobe to confirm it; where the two disagree, or without `lists`,
    the index is searched at each nprobe (doubling keeps the total within twice the last)."""
    steps = doublings(spec.nprobe, nlist(index)) if is_ivf(index) else [spec.nprobe]
    every_k = [spec.k, *ks]
    if lists is not None:
        choice = _choose(steps, min_recall, spec, lambda p: lists.at(index, p, every_k))
        if lists.agrees_with_search(index, choice.nprobe, every_k):
            return choice

    def searched(nprobe: int) -> dict[int, float]:
        set_nprobe(index, nprobe)
        return probe.scores(probe.search(index), every_k)

    choice = _choose(steps, min_recall, spec, searched)
    set_nprobe(index, choice.nprobe)
    return choice


def _choose(
    steps: list[int],
    min_recall: float,
    spec: IndexSpec,
    recall_at: Callable[[int], dict[int, float]],
) -> NprobeChoice:
    """The first of `steps` whose recall@k (`recall_at`) reaches `min_recall`, else the last."""
    tried: dict[int, float] = {}
    recall: dict[int, float] = {}
    for nprobe in steps:
        recall = {k: round(v, 6) for k, v in recall_at(nprobe).items()}
        tried[nprobe] = recall[spec.k]
        if tried[nprobe] >= min_recall:
            break
    return NprobeChoice(nprobe, spec.nprobe, tried, tried[nprobe] >= min_recall, recall)
