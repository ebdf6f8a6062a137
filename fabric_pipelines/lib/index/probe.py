"""The exact neighbours of a seeded sample of an index's rows, found once, and the scoring of any
index over the same rows against them (recall.py, list_recall.py and quality.py use it)."""

from __future__ import annotations

import faiss
import numpy as np

from fabric_pipelines.lib.index.build import IndexSpec, Rows, prepare_rows
from fabric_pipelines.lib.index.torch_search import top_k

TIE_DEPTH = 2  # exact neighbours held: this many times max_k + 1, so that rows tied (within


class RecallProbe:
    """The exact neighbours of a seeded sample of `rows` (TIE_DEPTH * (max_k + 1) of them, own
    row included), found once on the rows' device; scores any index over the same rows."""

    def __init__(self, rows: Rows, spec: IndexSpec, max_k: int) -> None:
        n = len(rows.ids)
        self.rows = n
        self.max_k = max_k
        self.metric = spec.metric
        rng = np.random.default_rng(spec.seed + 1)
        q = np.sort(rng.choice(n, size=min(spec.recall_queries, n), replace=False))
        self.x = rows.host
        # id -> row through searchsorted; rows come in ascending id order, so usually no sort.
        ascending = bool(np.all(rows.ids[1:] > rows.ids[:-1]))
        self.by_id = None if ascending else np.argsort(rows.ids, kind="stable")
        self.sorted_ids = rows.ids if self.by_id is None else rows.ids[self.by_id]
        self.queries = rows.host[q]
        self.own = rows.ids[q]
        self.truth_rows = np.empty((len(q), 0), dtype=np.int64)  # positions in `rows`
        self.truth_distance = np.empty((len(q), 0), dtype=np.float32)
        if n > 1:  # with one row there is no neighbour: every k gives recall 1
            depth = min(TIE_DEPTH * (max_k + 1), n)
            scores, at = top_k(rows.on_device(q), rows.device, depth, spec.metric)
            self.truth_distance = scores.cpu().numpy()
            self.truth_rows = at.cpu().numpy()
        self.truth = rows.ids[self.truth_rows]

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id (every id must be one of the rows')."""
        at = np.searchsorted(self.sorted_ids, ids)
        return at if self.by_id is None else self.by_id[at]

    def held_positions(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, -1 for an id that is none of the rows'."""
        at = np.minimum(np.searchsorted(self.sorted_ids, ids), max(len(self.sorted_ids) - 1, 0))
        held = self.sorted_ids[at] == ids if len(self.sorted_ids) else np.zeros(len(ids), bool)
        rows = at if self.by_id is None else self.by_id[at]
        return np.where(held, rows, -1)

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

    def counted(self, k: int) -> np.ndarray:
        """Per query and held exact neighbour, whether a search finding it scores it at k: the
        others as close as the k-th."""
        return (self.truth != self.own[:, None]) & self._as_close(self.truth_distance, self._kth(k))

    def complete(self, k: int) -> np.ndarray:
        """Per query, whether every row as close as its k-th exact neighbour is held (`counted`
        then names every neighbour a search may score at k)."""
        if self.truth.shape[1] >= self.rows:
            return np.ones(len(self.queries), dtype=bool)
        last = self.truth_distance[:, -1:]
        return ~self._as_close(last, self._kth(k))[:, 0]

    def search(self, index: faiss.Index, queries: np.ndarray | None = None) -> np.ndarray:
        """The ids `index` returns for every query (or those at `queries`), max_k + 1 of them
        (own row included)."""
        x = self.queries if queries is None else self.queries[queries]
        _, found = index.search(x, min(self.max_k + 1, max(self.rows, 1)))
        return np.asarray(found)

    def hits(
        self, found: np.ndarray, ks: list[int], queries: np.ndarray | None = None
    ) -> dict[int, int]:
        """Neighbours a search's results (`search`, of every query or those at `queries`) find
        at each k below the number of rows: among the first k other rows returned, those as
        close as the k-th exact."""
        if max(ks) > self.max_k:
            raise ValueError(f"k={max(ks)}: this probe holds exact neighbours up to k={self.max_k}")
        chosen = slice(None) if queries is None else queries
        own, x = self.own[chosen], self.queries[chosen]
        valid = (found >= 0) & (found != own[:, None])
        looked_up = np.where(valid, found, self.sorted_ids[0])
        rows = self.x[self.positions(looked_up)]  # queries x m x dim
        if self.metric == "cosine":
            distance = np.matmul(rows, x[:, :, None])[..., 0]
        else:
            distance = ((rows - x[:, None, :]) ** 2).sum(axis=2)
        out = {}
        for k in ks:
            if self.rows <= k:  # no k neighbours to find
                continue
            keep = valid & (np.cumsum(valid, axis=1) <= k)  # the first k other rows returned
            out[k] = int((keep & self._as_close(distance, self._kth(k)[chosen])).sum())
        return out

    def scores(self, found: np.ndarray, ks: list[int]) -> dict[int, float]:
        """recall@k of a search's results (`search`) at each k; 1.0 when there are no k
        neighbours to find."""
        hits = self.hits(found, ks)
        return {k: 1.0 if self.rows <= k else hits[k] / (len(self.queries) * k) for k in ks}

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
        rows = self.x[self.positions(ids)].astype(np.float64)
        queries = self.queries.astype(np.float64)[:, None, :]
        if self.metric == "cosine":
            return 1.0 - (rows * queries).sum(axis=2)
        return ((rows - queries) ** 2).sum(axis=2)
