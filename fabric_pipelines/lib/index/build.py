"""FAISS index builds: factory string, training, adding rows in id order, recall against exact."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import faiss
import numpy as np

METRICS = ("cosine", "l2")
DEVICES = ("auto", "cpu", "gpu")


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def build_device(spec: IndexSpec) -> str:
    """Where training runs: the spec's choice, "auto" meaning the GPU when FAISS can use one."""
    if spec.device == "auto":
        return "gpu" if gpu_available() else "cpu"
    return spec.device


def tolerance(device: str) -> dict[str, object]:
    """How closely a rebuild must match: bitwise on CPU; on GPU k-means sums in a varying order,
    so a rebuild must hold the same rows and reach the recorded recall within 0.01."""
    if device == "cpu":
        return {"kind": "bitwise", "why": "faiss-cpu training and adds are deterministic per seed"}
    return {
        "kind": "recall",
        "max_recall_drop": 0.01,
        "why": "GPU k-means reduces in a nondeterministic order; centroids differ in low bits",
    }


@dataclass(frozen=True)
class IndexSpec:
    factory: str = "auto"  # a FAISS factory string, or "auto" (Flat when small, else IVF-Flat)
    metric: str = "cosine"
    nprobe: int = 16
    train_sample: int = 100_000  # at most this many rows train the quantizer
    seed: int = 1234
    recall_queries: int = 500
    k: int = 10
    shards: int = 1  # rows split by a fixed hash; one shared quantizer; merged for serving
    device: str = "auto"  # where k-means trains: "gpu" needs faiss-gpu; "auto" picks it if present

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric {self.metric!r}: expected one of {METRICS}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: expected one of {DEVICES}")
        if self.device == "gpu" and not gpu_available():
            raise ValueError(
                "device 'gpu': this FAISS has no GPU support or sees no GPU; "
                "install faiss-gpu or use device 'cpu'"
            )
        if min(self.nprobe, self.k, self.recall_queries, self.train_sample, self.shards) < 1:
            raise ValueError("nprobe, k, recall_queries, train_sample and shards must be positive")


def resolve_factory(spec: IndexSpec, n: int) -> str:
    """'auto': exact Flat below 2,000 rows, else IVF-Flat with about sqrt(n) lists."""
    if spec.factory != "auto":
        return spec.factory
    if n < 2000:
        return "Flat"
    nlist = 2 ** round(math.log2(math.sqrt(n)))
    return f"IVF{nlist},Flat"


@dataclass
class BuiltIndex:
    index: faiss.Index
    factory: str
    train_rows: np.ndarray  # positions (in id order) that trained the quantizer
    centroids_sha256: str | None


def prepared(vectors: np.ndarray, metric: str) -> np.ndarray:
    """What FAISS sees: float32, C-contiguous, unit length under cosine (inner product)."""
    x = np.ascontiguousarray(vectors, dtype=np.float32).copy()
    if metric == "cosine":
        faiss.normalize_L2(x)
    return x


def train(vectors: np.ndarray, spec: IndexSpec) -> BuiltIndex:
    """An empty index with its quantizer trained (IVF) on a seeded sample; Flat needs none.
    The caller has checked the vectors (vectors.check_vectors)."""
    n, dim = vectors.shape
    factory = resolve_factory(spec, n)
    metric = faiss.METRIC_INNER_PRODUCT if spec.metric == "cosine" else faiss.METRIC_L2
    index = faiss.index_factory(dim, factory, metric)
    if not is_ivf(index):
        index = faiss.IndexIDMap2(index)
    train_rows = np.arange(0)
    centroids_sha = None
    if not index.is_trained:
        rng = np.random.default_rng(spec.seed)
        take = min(n, spec.train_sample)
        train_rows = np.sort(rng.choice(n, size=take, replace=False)) if take < n else np.arange(n)
        ivf = faiss.extract_index_ivf(index)
        ivf.cp.seed = spec.seed
        if build_device(spec) == "gpu":  # k-means assignment on the GPU; the index stays on CPU
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatL2(dim))
        index.train(prepared(vectors[train_rows], spec.metric))
        # Not part of the index: clones must not share the GPU clustering index.
        ivf.clustering_index = None  # type: ignore[assignment]
        centroids_sha = hashlib.sha256(np.ascontiguousarray(centroids(index)).tobytes()).hexdigest()
    return BuiltIndex(index, factory, train_rows, centroids_sha)


def fill(
    trained: faiss.Index, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec
) -> faiss.Index:
    """A copy of the trained empty index holding `vectors`, added in ascending id order."""
    index = faiss.clone_index(trained)
    order = np.argsort(ids, kind="stable")
    if len(ids):
        index.add_with_ids(
            prepared(vectors[order], spec.metric), np.ascontiguousarray(ids[order], dtype=np.int64)
        )
    set_search_params(index, spec)
    return index


def merge(parts: list[faiss.Index], spec: IndexSpec) -> faiss.Index:
    """One index serving every shard (same quantizer, so lists merge)."""
    merged = faiss.clone_index(parts[0])
    for part in parts[1:]:
        merged.merge_from(part, 0)
    set_search_params(merged, spec)
    return merged


def build_index(vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec) -> BuiltIndex:
    """Train and fill in one go (a single shard)."""
    built = train(vectors, spec)
    return BuiltIndex(
        fill(built.index, vectors, ids, spec),
        built.factory,
        built.train_rows,
        built.centroids_sha256,
    )


def centroids(index: faiss.Index) -> np.ndarray:
    ivf = faiss.extract_index_ivf(index)
    return ivf.quantizer.reconstruct_n(0, ivf.nlist)


def list_sizes(index: faiss.Index) -> np.ndarray:
    lists = faiss.extract_index_ivf(index).invlists
    assert lists is not None
    return np.array([lists.list_size(i) for i in range(lists.nlist)], dtype=np.int64)


def set_search_params(index: faiss.Index, spec: IndexSpec) -> None:
    if is_ivf(index):
        faiss.extract_index_ivf(index).nprobe = spec.nprobe


def is_ivf(index: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:
        return False
    return True


class RecallProbe:
    """Recall against exact search, over a seeded sample of the rows as queries. The exact
    neighbours are found once, up to `max_k`; any index over the same rows is then scored at
    any k up to it with one search. Each query's own row is left out of both answers, so recall
    measures its neighbours. A returned neighbour counts when it is as close as the k-th exact
    one, so rows tied at that distance (duplicates) count alike, whichever order a search
    returned them in."""

    def __init__(self, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec, max_k: int) -> None:
        n = len(ids)
        self.rows = n
        self.max_k = max_k
        self.metric = spec.metric
        rng = np.random.default_rng(spec.seed + 1)
        q = np.sort(rng.choice(n, size=min(spec.recall_queries, n), replace=False))
        self.x = prepared(vectors, spec.metric)
        self.by_id = np.argsort(ids, kind="stable")  # id -> row, through searchsorted
        self.sorted_ids = ids[self.by_id]
        self.queries = self.x[q]
        self.own = ids[q]
        self.truth = np.empty((len(q), 0), dtype=ids.dtype)
        self.truth_distance = np.empty((len(q), 0), dtype=np.float32)
        if n > 1:  # with one row there is no neighbour: every k gives recall 1
            dim = self.x.shape[1]
            exact = faiss.IndexFlatIP(dim) if spec.metric == "cosine" else faiss.IndexFlatL2(dim)
            exact.add(self.x)
            self.truth_distance, truth_pos = exact.search(self.queries, min(max_k + 1, n))
            self.truth = ids[truth_pos]

    def _as_close(self, query: int, found: np.ndarray, kth: float) -> int:
        """How many of the `found` ids are as close to the query as distance `kth` (inner
        product under cosine: larger is closer; squared L2 otherwise), within float32 rounding."""
        rows = self.x[self.by_id[np.searchsorted(self.sorted_ids, found)]]
        tolerance = 1e-5 * max(1.0, abs(kth))
        if self.metric == "cosine":
            return int((rows @ self.queries[query] >= kth - tolerance).sum())
        return int((((rows - self.queries[query]) ** 2).sum(1) <= kth + tolerance).sum())

    def recall(self, index: faiss.Index, k: int) -> tuple[float, int]:
        """(recall@k of `index`, queries used); 1.0 when there are no k neighbours to find."""
        if k > self.max_k:
            raise ValueError(f"k={k}: this probe holds exact neighbours up to k={self.max_k}")
        if self.rows <= k:
            return 1.0, 0
        _, found = index.search(self.queries, k + 1)
        hits = 0
        for query, (truth_row, distances, found_row, me) in enumerate(
            zip(self.truth, self.truth_distance, found, self.own, strict=True)
        ):
            kth = float(distances[truth_row != me][k - 1])  # the k-th exact neighbour's distance
            got = found_row[(found_row != me) & (found_row >= 0)][:k]
            hits += self._as_close(query, got, kth)
        return hits / (len(self.queries) * k), len(self.queries)


def recall_at_k(
    index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec, k: int | None = None
) -> tuple[float, int]:
    """Recall@k (default the spec's k) of `index` against exact search: one RecallProbe."""
    k = spec.k if k is None else k
    return RecallProbe(vectors, ids, spec, k).recall(index, k)


def nprobe_curve(index: faiss.Index, probe: RecallProbe, spec: IndexSpec) -> dict[int, float]:
    """recall@k at each nprobe 1, 2, 4, ... up to the number of lists (IVF only)."""
    if not is_ivf(index):
        return {}
    ivf = faiss.extract_index_ivf(index)
    curve = {}
    nprobe = 1
    while True:
        ivf.nprobe = min(nprobe, ivf.nlist)
        curve[ivf.nprobe] = round(probe.recall(index, spec.k)[0], 6)
        if nprobe >= ivf.nlist:
            break
        nprobe *= 2
    set_search_params(index, spec)
    return curve


def serialize(index: faiss.Index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def deserialize(data: bytes) -> faiss.Index:
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
