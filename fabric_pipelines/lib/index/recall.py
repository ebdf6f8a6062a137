"""Recall against exact search, and the nprobe an IVF index needs to reach a recall target.

Queries are a seeded sample of the indexed rows. Their exact neighbours are found once (torch,
on the build's device) up to `max_k`; any index over the same rows is then scored at any k up to
it. Each query's own row is left out of both answers, so recall measures its neighbours. A
returned neighbour counts when it is as close as the k-th exact one, so rows tied at that
distance (duplicates) count alike, whichever order a search returned them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np

from fabric_pipelines.lib.index.build import (
    IndexSpec,
    Rows,
    is_ivf,
    is_ivf_flat,
    list_ids,
    nlist,
    prepare_rows,
    set_nprobe,
)
from fabric_pipelines.lib.index.torch_search import top_k

RULE = (
    "seeded sample of indexed rows, each query's own row left out; a returned neighbour counts "
    "when it is as close as the k-th exact one (ties count alike)"
)
CURVE_RULE_LISTS = (
    "from the exact neighbours and the index's own lists: at nprobe p a query finds every exact "
    "neighbour whose list is among its p nearest (IVF-Flat scans a probed list exactly)"
)
CURVE_RULE_SEARCH = "searched: the index at each nprobe"


class RecallProbe:
    """The exact neighbours of a seeded sample of `rows` (up to max_k + 1, own row included),
    found once on the rows' device; scores any index over the same rows."""

    def __init__(self, rows: Rows, spec: IndexSpec, max_k: int) -> None:
        n = len(rows.ids)
        self.rows = n
        self.max_k = max_k
        self.metric = spec.metric
        rng = np.random.default_rng(spec.seed + 1)
        q = np.sort(rng.choice(n, size=min(spec.recall_queries, n), replace=False))
        self.x = rows.host
        self.by_id = np.argsort(rows.ids, kind="stable")  # id -> row, through searchsorted
        self.sorted_ids = rows.ids[self.by_id]
        self.queries = rows.host[q]
        self.own = rows.ids[q]
        self.truth = np.empty((len(q), 0), dtype=np.int64)
        self.truth_distance = np.empty((len(q), 0), dtype=np.float32)
        if n > 1:  # with one row there is no neighbour: every k gives recall 1
            scores, at = top_k(rows.on_device(q), rows.device, min(max_k + 1, n), spec.metric)
            self.truth_distance = scores.cpu().numpy()
            self.truth = rows.ids[at.cpu().numpy()]

    @classmethod
    def of_vectors(
        cls, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec, max_k: int
    ) -> RecallProbe:
        return cls(prepare_rows(vectors, ids, spec), spec, max_k)

    def _kth(self, k: int) -> np.ndarray:
        """Per query, the distance of its k-th exact neighbour other than itself."""
        others = self.truth != self.own[:, None]
        at = np.argmax(np.cumsum(others, axis=1) == k, axis=1)
        return self.truth_distance[np.arange(len(at)), at]

    def _as_close(self, distance: np.ndarray, kth: np.ndarray) -> np.ndarray:
        """Whether each distance (queries x m) is as close as its query's `kth`, within float32
        rounding: inner product under cosine (larger is closer), squared L2 otherwise."""
        slack = (1e-5 * np.maximum(1.0, np.abs(kth)))[:, None]
        if self.metric == "cosine":
            return distance >= kth[:, None] - slack
        return distance <= kth[:, None] + slack

    def search(self, index: faiss.Index) -> np.ndarray:
        """The ids `index` returns for every query, max_k + 1 of them (own row included)."""
        _, found = index.search(self.queries, min(self.max_k + 1, max(self.rows, 1)))
        return np.asarray(found)

    def scores(self, found: np.ndarray, ks: list[int]) -> dict[int, float]:
        """recall@k of a search's results (`search`) at each k; 1.0 when there are no k
        neighbours to find."""
        if max(ks) > self.max_k:
            raise ValueError(f"k={max(ks)}: this probe holds exact neighbours up to k={self.max_k}")
        valid = (found >= 0) & (found != self.own[:, None])
        looked_up = np.where(valid, found, self.sorted_ids[0])
        rows = self.x[self.by_id[np.searchsorted(self.sorted_ids, looked_up)]]  # queries x m x dim
        if self.metric == "cosine":
            distance = np.matmul(rows, self.queries[:, :, None])[..., 0]
        else:
            distance = ((rows - self.queries[:, None, :]) ** 2).sum(axis=2)
        out = {}
        for k in ks:
            if self.rows <= k:
                out[k] = 1.0
                continue
            keep = valid & (np.cumsum(valid, axis=1) <= k)  # the first k other rows returned
            hits = keep & self._as_close(distance, self._kth(k))
            out[k] = int(hits.sum()) / (len(self.queries) * k)
        return out

    def score(self, found: np.ndarray, k: int) -> float:
        return self.scores(found, [k])[k]

    def recall(self, index: faiss.Index, k: int) -> tuple[float, int]:
        """(recall@k of `index`, queries used); 1.0 when there are no k neighbours to find."""
        if k > self.max_k:
            raise ValueError(f"k={k}: this probe holds exact neighbours up to k={self.max_k}")
        if self.rows <= k:
            return 1.0, 0
        return self.score(self.search(index), k), len(self.queries)

    def neighbour_distances(self, k: int) -> np.ndarray:
        """Per query, the distances to its k nearest other rows (fewer if there are not k), in
        float64 and as index/metrics.py measures them: 1 - inner product under cosine, squared
        L2 otherwise."""
        others = self.truth != self.own[:, None]
        k = min(k, int(others.sum(axis=1).min(initial=k)))
        first = np.argsort(~others, axis=1, kind="stable")[:, :k]  # the first k others, in order
        ids = np.take_along_axis(self.truth, first, axis=1)
        rows = self.x[self.by_id[np.searchsorted(self.sorted_ids, ids)]].astype(np.float64)
        queries = self.queries.astype(np.float64)[:, None, :]
        if self.metric == "cosine":
            return 1.0 - (rows * queries).sum(axis=2)
        return ((rows - queries) ** 2).sum(axis=2)

    def lists_curve(self, index: faiss.Index, nprobes: list[int], k: int) -> dict[int, float]:
        """recall@k of an IVF-Flat index at each nprobe without searching it: a probed list is
        scanned exactly, so at nprobe p a query returns its k nearest rows among the lists it
        probes, and finds min(k, exact neighbours as close as the k-th that lie in its p
        nearest lists). Ties beyond the max_k + 1 exact neighbours held are not seen."""
        if self.rows <= k:
            return {p: 1.0 for p in nprobes}
        ivf = faiss.extract_index_ivf(index)
        held, owner = list_ids(index)
        order = np.argsort(held, kind="stable")
        lists = owner[order][np.searchsorted(held[order], self.truth)]
        _, nearest = ivf.quantizer.search(self.queries, ivf.nlist)  # the probing order
        rank = np.empty_like(nearest)
        rank[np.arange(len(nearest))[:, None], nearest] = np.arange(ivf.nlist)
        list_rank = np.take_along_axis(rank, lists, axis=1)
        found = (self.truth != self.own[:, None]) & self._as_close(
            self.truth_distance, self._kth(k)
        )
        total = len(self.queries) * k
        return {
            p: round(float(np.minimum(k, (found & (list_rank < p)).sum(1)).sum()) / total, 6)
            for p in nprobes
        }


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


def nprobe_curve(index: faiss.Index, probe: RecallProbe, spec: IndexSpec) -> dict[int, float]:
    """recall@k at each nprobe 1, 2, 4, ... up to the number of lists (IVF only): from the lists
    for IVF-Flat (cheap at any size), by searching otherwise."""
    if not is_ivf(index):
        return {}
    points = doublings(1, nlist(index))
    if is_ivf_flat(index):
        return probe.lists_curve(index, points, spec.k)
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
    tried: dict[int, float]  # recall@k at each nprobe searched, in order
    met: bool  # whether recall@k at `nprobe` reaches the target
    recall: dict[int, float]  # recall at `nprobe` for each k asked for


def choose_nprobe(
    index: faiss.Index,
    probe: RecallProbe,
    spec: IndexSpec,
    min_recall: float,
    ks: tuple[int, ...] = (),
) -> NprobeChoice:
    """Search at the spec's nprobe, then at twice that, ... up to every list, until recall@k
    reaches `min_recall`; the index keeps the nprobe that did (or every list, when none did).
    Doubling keeps the searches' total cost within twice that of the last one. Recall is
    reported (rounded to 6 places) at the spec's k and at each of `ks`."""
    steps = doublings(spec.nprobe, nlist(index)) if is_ivf(index) else [spec.nprobe]
    tried: dict[int, float] = {}
    for nprobe in steps:
        set_nprobe(index, nprobe)
        found = probe.search(index)
        recall = {k: round(v, 6) for k, v in probe.scores(found, [spec.k, *ks]).items()}
        tried[nprobe] = recall[spec.k]
        if tried[nprobe] >= min_recall:
            break
    return NprobeChoice(nprobe, spec.nprobe, tried, tried[nprobe] >= min_recall, recall)
