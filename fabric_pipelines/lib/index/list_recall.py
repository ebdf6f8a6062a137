"""Recall of an IVF-Flat index read off its own lists, at any nprobe, without searching it.

An IVF-Flat index scans each probed list exactly, so at nprobe p a query returns its k nearest
rows among the lists it probes: it finds min(k, exact neighbours as close as the k-th that lie in
its p nearest lists). Given each query's exact neighbours (RecallProbe) and the list that holds
each of them, recall at every nprobe and every k is a count over a small queries x neighbours
table, whatever the lists' sizes; searching costs the rows of every probed list, per query.

A query whose rows as close as its k-th neighbour are not all held (ties past the held depth) is
searched instead, so recall is what searching every query measures; the curve over nprobe
counts the held neighbours alone. A few queries searched in FAISS confirm that the index returns
what its lists say (`agrees_with_search`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import faiss
import numpy as np

from fabric_pipelines.lib.index.build import list_ids, set_nprobe

if TYPE_CHECKING:
    from fabric_pipelines.lib.index.probe import RecallProbe

CHECK_QUERIES = 50  # queries searched in FAISS to confirm the lists' answer
CHECK_SLACK = 0.01  # share of the checked hits the answers may differ by: float rounding
# at the k-th distance's edge


class ListRecall:
    """The probing rank, per query, of the list holding each of its exact neighbours."""

    def __init__(self, probe: RecallProbe, index: faiss.Index) -> None:
        self.probe = probe
        ivf = faiss.extract_index_ivf(index)
        self.nlist = int(ivf.nlist)
        held, owner = list_ids(index)
        at = probe.held_positions(held)
        list_of_row = np.full(probe.rows, self.nlist, dtype=np.int64)  # nlist: in no list
        list_of_row[at[at >= 0]] = owner[at >= 0]
        lists = list_of_row[probe.truth_rows]
        # The order FAISS probes lists in for each query: its own quantizer's ranking.
        _, nearest = ivf.quantizer.search(probe.queries, self.nlist)
        rank = np.full((len(nearest), self.nlist + 1), self.nlist, dtype=np.int64)
        rank[np.arange(len(nearest))[:, None], nearest] = np.arange(self.nlist)
        self.rank = np.take_along_axis(rank, lists, axis=1)
        self._counted_at: dict[int, np.ndarray] = {}  # probe.counted(k), once per k

    def _counted(self, k: int) -> np.ndarray:
        if k not in self._counted_at:
            self._counted_at[k] = self.probe.counted(k)
        return self._counted_at[k]

    def hits(self, nprobe: int, k: int, queries: np.ndarray | None = None) -> int:
        """Held exact neighbours found at k by searching `nprobe` lists, over every query (or
        those at `queries`); k below the number of rows."""
        chosen = slice(None) if queries is None else queries
        found = self._counted(k)[chosen] & (self.rank[chosen] < nprobe)
        return int(np.minimum(k, found.sum(axis=1)).sum())

    def at(self, index: faiss.Index, nprobe: int, ks: list[int]) -> dict[int, float]:
        """recall@k of `index` (the one these lists are of) at `nprobe` for each k: read off the
        lists, or for a query with ties past its held neighbours, searched (leaving `index` at
        `nprobe` then). 1.0 when there are no k neighbours to find."""
        total = len(self.probe.queries)
        out = {k: 1.0 for k in ks}
        measured = [k for k in ks if k < self.probe.rows]
        untied = {k: self.probe.complete(k) for k in measured}
        tied_somewhere = np.zeros(total, dtype=bool)
        for k in measured:
            tied_somewhere |= ~untied[k]
        tied = np.flatnonzero(tied_somewhere)
        found = np.zeros((0, 0), dtype=np.int64)
        if tied.size:
            set_nprobe(index, nprobe)
            found = self.probe.search(index, tied)
        for k in measured:
            hits = self.hits(nprobe, k, np.flatnonzero(untied[k]))
            if tied.size:
                searched = ~untied[k][tied]  # rows of `found` this k searches for
                hits += self.probe.hits(found[searched], [k], tied[searched])[k]
            out[k] = hits / (total * k)
        return out

    def curve(self, nprobes: list[int], k: int) -> dict[int, float]:
        """recall@k (rounded to 6 places) at each nprobe, from the held neighbours alone."""
        if self.probe.rows <= k:
            return {p: 1.0 for p in nprobes}
        total = len(self.probe.queries) * k
        return {p: round(self.hits(p, k) / total, 6) for p in nprobes}

    def agrees_with_search(self, index: faiss.Index, nprobe: int, ks: list[int]) -> bool:
        """Whether searching `index` in FAISS at `nprobe` finds, on CHECK_QUERIES of the queries,
        the neighbours its lists say (within float rounding). Leaves the index at `nprobe`."""
        total = len(self.probe.queries)
        queries = np.unique(np.linspace(0, total - 1, min(CHECK_QUERIES, total)).astype(np.int64))
        set_nprobe(index, nprobe)
        found = self.probe.search(index, queries)
        for k in (k for k in ks if k < self.probe.rows):
            untied = self.probe.complete(k)[queries]
            searched = self.probe.hits(found[untied], [k], queries[untied])[k]
            expected = self.hits(nprobe, k, queries[untied])
            if abs(searched - expected) > 1 + CHECK_SLACK * untied.sum() * k:
                return False
        return True
