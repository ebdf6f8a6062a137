"""What a built index is worth: recall against exact search at the nprobe it serves with (raised
until it meets the recall target), the recall curve over nprobe, list balance, cluster health.
Exact search runs where the build computes (torch on the GPU when there is one); an IVF-Flat
index's recall is read off its lists at every nprobe (a few queries searched in FAISS confirm
it), other indexes are searched in FAISS; cluster health looks at a sample, in float64 NumPy;
local density and near-duplicates are read off the recall queries' exact neighbours among all
rows."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from fabric_pipelines.lib.core.charts import power_of_two_bins
from fabric_pipelines.lib.index import metrics
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    Rows,
    centroids,
    is_ivf,
    is_ivf_flat,
    list_sizes,
)
from fabric_pipelines.lib.index.list_recall import ListRecall
from fabric_pipelines.lib.index.probe import RecallProbe
from fabric_pipelines.lib.index.recall import (
    CURVE_RULE_LISTS,
    CURVE_RULE_SEARCH,
    RULE,
    NprobeChoice,
    choose_nprobe,
    nprobe_curve,
)
from fabric_pipelines.lib.index.vectors import VectorCounts

HEALTH_SAMPLE = 20_000  # rows the cluster-health metrics look at
NEAR_DUPLICATE = 1e-6  # a row this close to another (metrics.py's distance) is a near-duplicate


@dataclass(frozen=True)
class Quality:
    measures: dict[str, Any]  # the receipt's "quality"
    choice: NprobeChoice
    # Wall seconds of its parts (exact neighbours, nprobe, curve, the rest): not in the receipt.
    seconds: dict[str, float] = field(default_factory=dict)


def measure(
    index: faiss.Index,
    rows: Rows,
    vectors: np.ndarray,
    counts: VectorCounts,
    spec: IndexSpec,
    min_recall: float,
    chosen: Callable[[NprobeChoice], object] | None = None,
) -> Quality:
    """Measure `index` over `rows` (prepared; `vectors` the same rows as stored), leaving it set
    to the nprobe chosen (NprobeChoice). `chosen` is called as soon as the index is final (set to
    that nprobe, searched for the last time): what is measured after only reads it, so the caller
    may store it meanwhile."""
    seconds: dict[str, float] = {}
    last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        seconds[name], last = round(now - last, 3), now

    probe = RecallProbe(rows, spec, max_k=max(100, spec.k))
    lap("exact_neighbours")
    lists = ListRecall(probe, index) if is_ivf_flat(index) else None
    choice = choose_nprobe(index, probe, spec, min_recall, ks=(1, 10, 100), lists=lists)
    lap("nprobe")
    curve = nprobe_curve(index, probe, spec, lists)  # IVF-Flat: from the lists, no search
    if chosen is not None:
        chosen(choice)
    lap("curve")
    recall = choice.recall
    out: dict[str, Any] = {
        "k": spec.k,
        "recall_at_k": recall[spec.k],
        **{f"recall_at_{k}": recall[k] for k in (1, 10, 100)},
        "queries": min(spec.recall_queries, len(rows.ids)),
        "query_rule": RULE,
        "query_seed": spec.seed + 1,
        "vectors": {
            "rows": counts.rows,
            "nan": counts.nan_rows,
            "inf": counts.inf_rows,
            "zero_norm": counts.zero_norm_rows,
        },
    }
    if is_ivf(index):
        out["nprobe_curve"] = {str(k): v for k, v in curve.items()}
        out["nprobe_curve_rule"] = CURVE_RULE_LISTS if is_ivf_flat(index) else CURVE_RULE_SEARCH
        sizes = list_sizes(index)
        out["lists"] = {
            "count": int(sizes.size),
            "imbalance": round(float(sizes.max() / max(sizes.mean(), 1e-12)), 4),
            # How many lists hold 1-8, 9-16, ... vectors (empty lists are counted apart).
            "empty": int((sizes == 0).sum()),
            "size_ranges": dict(zip(*power_of_two_bins(sizes[sizes > 0]), strict=True)),
        }
        out["cluster_health"] = _cluster_health(index, vectors, spec)
        # Around the recall queries, against every row (their exact neighbours are known).
        nearest = probe.neighbour_distances(10)
        out["knn_density_10"] = round(float(nearest.mean()) if nearest.size else 0.0, 6)
        out["near_duplicates"] = int((nearest[:, :1] < NEAR_DUPLICATE).sum())
    lap("health")
    return Quality(out, choice, seconds)


def _cluster_health(index: faiss.Index, vectors: np.ndarray, spec: IndexSpec) -> dict[str, Any]:
    rng = np.random.default_rng(spec.seed + 2)
    sample = rng.choice(len(vectors), size=min(HEALTH_SAMPLE, len(vectors)), replace=False)
    x = metrics.prepare(vectors[sample], spec.metric, np, np.float64)
    c = metrics.prepare(centroids(index), spec.metric, np, np.float64)
    return metrics.cluster_health(x, c, spec.metric, np).summary()


def shortfall(
    quality: dict[str, Any], choice: NprobeChoice, factory: str, min_recall: float
) -> str:
    """What to change when no nprobe reaches `min_recall` ("" when one did)."""
    if choice.met:
        return ""
    k, recall = quality["k"], quality["recall_at_k"]
    below = f"recall@{k} {recall:.4f} is below min_recall {min_recall}"
    if "nprobe_curve" not in quality:  # Flat: exhaustive search
        where = f"{below} with exhaustive search ({factory})"
        exact = True
    else:
        lists = quality["lists"]["count"]
        where = f"{below} at nprobe={choice.nprobe} (all {lists} lists)"
        exact = quality["nprobe_curve_rule"] == CURVE_RULE_LISTS
    duplicates = quality.get("near_duplicates")
    rows = f" ({duplicates} of the sampled rows have a near-duplicate)" if duplicates else ""
    if exact:
        return (
            f"{where}: that search is exact, so no index setting reaches the target. Lower "
            f"min_recall, or check the embeddings{rows}: rows so alike that float32 cannot order "
            "them defeat any index"
        )
    return (
        f"{where}: '{factory}' stores compressed codes, so even every list misses neighbours. "
        f"Use uncompressed lists (e.g. 'IVF{quality['lists']['count']},Flat') or more code "
        f"bytes per vector, or factory 'Flat', or lower min_recall"
    )
