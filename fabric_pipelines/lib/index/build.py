"""FAISS index builds: the factory string, who trains the quantizer, adding rows in id order.

Two builders train and fill an IVF index. "faiss-cpu" is the reference: FAISS's own k-means and
list assignment. The torch builder runs Lloyd's k-means (index/kmeans.py) and assigns rows to
lists with tiled matrix products (index/torch_search.py): on the GPU ("torch-cuda") or, with the
same code, on the CPU ("torch-cpu"), which is how a GPU build is made again on a machine without
one. Either way the centroids go into FAISS's quantizer and each shard's rows go into the lists
they were assigned to, in ascending id order, so FAISS serves and stores the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from fabric_pipelines.lib.index import kmeans, torch_search

METRICS = ("cosine", "l2")
# Which rows train the quantizer (at most train_sample of them), as a receipt names the rule.
# "first": the rows of the smallest ids, which a packed plan extracts first, so the quantizer
# can be trained while the rest is still extracted (index/prebuild.py); a set whose file is
# sorted by topic trains on its first topics then, and the recall check raises nprobe to make
# up for it. "sample": a seeded sample of every row, known only once the last row is in.
TRAIN_RULES = {
    "first": "the first rows in id order",
    "sample": "seeded sample without replacement of rows in id order",
}
DEVICES = ("auto", "cpu", "gpu")
KMEANS = ("auto", "faiss", "torch")


def cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass(frozen=True)
class IndexSpec:
    factory: str = "auto"  # a FAISS factory string, or "auto" (Flat when small, else IVF-Flat)
    metric: str = "cosine"
    nprobe: int = 16  # the first nprobe tried; raised when the recall target needs it
    train_sample: int = 100_000  # at most this many rows train the quantizer
    seed: int = 1234
    recall_queries: int = 500
    k: int = 10
    shards: int = 1  # rows split by a fixed hash; one shared quantizer; merged for serving
    device: str = "auto"  # where torch computes: "gpu" (CUDA), "cpu"; "auto": the GPU if present
    kmeans: str = "auto"  # who trains and assigns: "faiss" (CPU) or "torch"; "auto": torch on GPU
    train_rule: str = "first"  # which rows train the quantizer: TRAIN_RULES

    def __post_init__(self) -> None:
        if self.train_rule not in TRAIN_RULES:
            raise ValueError(
                f"train_rule {self.train_rule!r}: expected one of {tuple(TRAIN_RULES)}"
            )
        if self.metric not in METRICS:
            raise ValueError(f"metric {self.metric!r}: expected one of {METRICS}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: expected one of {DEVICES}")
        if self.kmeans not in KMEANS:
            raise ValueError(f"kmeans {self.kmeans!r}: expected one of {KMEANS}")
        if self.device == "gpu" and not cuda_available():
            raise ValueError(
                "device 'gpu': torch sees no CUDA GPU here; use device 'cpu' or 'auto'"
            )
        if min(self.nprobe, self.k, self.recall_queries, self.train_sample, self.shards) < 1:
            raise ValueError("nprobe, k, recall_queries, train_sample and shards must be positive")


# "auto" builds an index of fewer rows than this on the CPU: in a process that has not used the
# GPU yet, making its CUDA context (half a second or more on an H200) costs more than the build.
AUTO_GPU_MIN_ROWS = 100_000


def sized_for(spec: IndexSpec, n: int) -> IndexSpec:
    """`spec` for a build of `n` rows: "auto" means the CPU below AUTO_GPU_MIN_ROWS rows."""
    if spec.device == "auto" and n < AUTO_GPU_MIN_ROWS:
        return dataclasses.replace(spec, device="cpu")
    return spec


def compute_device(spec: IndexSpec) -> str:
    """The torch device of the build's matrix work: "cuda" or "cpu"."""
    if spec.device == "gpu" or (spec.device == "auto" and cuda_available()):
        return "cuda"
    return "cpu"


def choose_builder(spec: IndexSpec, index: faiss.Index) -> str:
    """Who trains `index` and assigns its rows: torch-cuda, torch-cpu or faiss-cpu. Torch takes
    only a plain IVF index with an exact (flat) quantizer; anything else (a pre-transform, a
    graph quantizer) trains in FAISS."""
    device = compute_device(spec)
    wants_torch = spec.kmeans == "torch" or (spec.kmeans == "auto" and device == "cuda")
    return f"torch-{device}" if wants_torch and torch_trainable(index) else "faiss-cpu"


def torch_trainable(index: faiss.Index) -> bool:
    return plain_ivf(index) and isinstance(
        faiss.downcast_index(faiss.extract_index_ivf(index).quantizer), faiss.IndexFlat
    )


def tolerance(builder: str) -> dict[str, object]:
    """How closely a rebuild must match the build."""
    if builder == "faiss-cpu":
        return {
            "kind": "bitwise",
            "why": "faiss-cpu training and adds are deterministic per seed on one machine",
        }
    if builder == "torch-cpu":
        return {
            "kind": "bitwise",
            "why": "torch k-means on the CPU sums in a fixed order: deterministic per seed on one "
            "machine (same libraries and thread count)",
        }
    return {
        "kind": "recall",
        "max_recall_drop": 0.01,
        "why": "bitwise again only on the same GPU model and libraries; elsewhere (another GPU, "
        "or torch on the CPU) the products round differently, centroids differ in low bits and "
        "a few rows change lists",
    }


def resolve_factory(spec: IndexSpec, n: int) -> str:
    """'auto': exact Flat below 2,000 rows, else IVF-Flat with about sqrt(n) lists."""
    if spec.factory != "auto":
        return spec.factory
    if n < 2000:
        return "Flat"
    nlist = 2 ** round(math.log2(math.sqrt(n)))
    return f"IVF{nlist},Flat"


def empty_index(dim: int, factory: str, metric: str) -> faiss.Index:
    """An untrained index; ids are kept (IVF lists hold them; anything else gets an id map)."""
    kind = faiss.METRIC_INNER_PRODUCT if metric == "cosine" else faiss.METRIC_L2
    index = faiss.index_factory(dim, factory, kind)
    return index if is_ivf(index) else faiss.IndexIDMap2(index)


def prepared(vectors: np.ndarray, metric: str, builder: str = "faiss-cpu") -> np.ndarray:
    """What FAISS sees: float32, C-contiguous, unit length under cosine (inner product): put
    there by FAISS for a faiss-cpu build, by torch (in parallel threads) for a torch build, so a
    torch build normalises alike on every machine. Under L2 the rows are used as they are."""
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    if metric != "cosine":
        return x
    rows = torch.from_numpy(x if x.flags.writeable else x.copy())
    if builder != "faiss-cpu":
        return torch.nn.functional.normalize(rows, dim=1).numpy()
    x = rows.clone().numpy()  # a copy made in parallel threads
    faiss.normalize_L2(x)
    return x


@dataclass(frozen=True)
class Rows:
    """Rows as an index sees them (`prepared`), with their ids, in the source's order: `host`
    feeds FAISS, `device` holds the same values where torch computes (on the CPU, a view)."""

    ids: np.ndarray
    host: np.ndarray
    device: torch.Tensor

    def on_device(self, positions: np.ndarray) -> torch.Tensor:
        return self.device.index_select(0, torch.as_tensor(positions, device=self.device.device))

    def on_host(self, positions: np.ndarray) -> np.ndarray:
        """The rows at `positions`, gathered by NumPy: a copy at memory speed, about 2.5 times as
        fast as torch's index_select was (which gained nothing from a second thread)."""
        return np.take(self.host, positions, axis=0)


def prepare_rows(
    vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec, builder: str = "faiss-cpu"
) -> Rows:
    """The rows `builder` builds from, on the spec's compute device."""
    host = prepared(vectors, spec.metric, builder)
    device = torch.from_numpy(host if host.flags.writeable else host.copy())
    if compute_device(spec) == "cuda":
        device = device.to("cuda")
    return Rows(np.ascontiguousarray(ids, dtype=np.int64), host, device)


def planned_builder(spec: IndexSpec, n: int, dim: int, factory: str | None = None) -> str:
    """The builder that will train an index of `n` rows (choose_builder, before any row)."""
    return choose_builder(spec, empty_index(dim, factory or resolve_factory(spec, n), spec.metric))


@dataclass
class BuiltIndex:
    index: faiss.Index
    factory: str
    train_rows: np.ndarray  # positions (in id order) that trained the quantizer
    centroids_sha256: str | None
    builder: str = "faiss-cpu"
    iterations: int | None = None  # k-means iterations (IVF)


def training_sample(n: int, spec: IndexSpec) -> np.ndarray:
    """Positions (in id order) of the rows that train the quantizer, by the spec's rule: the
    first train_sample, or a seeded sample without replacement of that many."""
    take = min(n, spec.train_sample)
    if take == n or spec.train_rule == "first":
        return np.arange(take)
    return np.sort(np.random.default_rng(spec.seed).choice(n, size=take, replace=False))


def train_rule_of(rule: str) -> str:
    """The spec's train_rule for a receipt's `training.rule` text."""
    for name, text in TRAIN_RULES.items():
        if rule == text:
            return name
    raise ValueError(f"training.rule {rule!r}: this version trains by {list(TRAIN_RULES.values())}")


def train_rows(
    rows: Rows, spec: IndexSpec, factory: str | None = None, n: int | None = None
) -> BuiltIndex:
    """An empty index with its quantizer trained (IVF) on the rows the spec's rule picks out of
    `n` (default: all of `rows`; `rows` may hold only the first ones, under the "first" rule);
    Flat needs none. The caller has checked the vectors (vectors.check_vectors)."""
    dim = rows.host.shape[1]
    n = len(rows.host) if n is None else n
    factory = factory or resolve_factory(spec, n)
    index = empty_index(dim, factory, spec.metric)
    builder = choose_builder(spec, index)
    if index.is_trained:
        return BuiltIndex(index, factory, np.arange(0), None, builder)
    sample_rows = training_sample(n, spec)
    sample = rows.on_host(sample_rows)
    ivf = faiss.extract_index_ivf(index)
    if builder == "faiss-cpu":
        ivf.cp.seed = spec.seed
        index.train(sample)
        iterations = int(ivf.cp.niter)
    else:
        found = kmeans.kmeans(rows.on_device(sample_rows), ivf.nlist, spec.metric, spec.seed)
        ivf.quantizer.add(np.ascontiguousarray(found.cpu().numpy()))
        # The quantizer is full, so FAISS skips its k-means and trains only what encodes the
        # rows (PQ, SQ; nothing for Flat).
        index.train(sample)
        iterations = kmeans.ITERATIONS
    centroids_sha = hashlib.sha256(np.ascontiguousarray(centroids(index)).tobytes()).hexdigest()
    return BuiltIndex(index, factory, sample_rows, centroids_sha, builder, iterations)


def train(vectors: np.ndarray, spec: IndexSpec) -> BuiltIndex:
    """train_rows over raw vectors in id order."""
    builder = planned_builder(spec, *vectors.shape)
    return train_rows(prepare_rows(vectors, np.arange(len(vectors)), spec, builder), spec)


def assign(
    trained: faiss.Index,
    rows: Rows,
    positions: np.ndarray,
    builder: str,
    metric: str,
    gathered: np.ndarray | None = None,
) -> np.ndarray | None:
    """The IVF list of each row at `positions` (`gathered`: those rows on the host, where the
    caller has them): by torch for a torch builder, by the index's own quantizer for faiss-cpu.
    None where FAISS must assign rows as it adds them (no lists, or lists behind a transform)."""
    if not plain_ivf(trained):
        return None
    if builder == "faiss-cpu":
        x = rows.on_host(positions) if gathered is None else gathered
        return assign_in_faiss(trained, x)
    lists = torch.from_numpy(centroids(trained)).to(rows.device.device)
    tile = torch_search.ASSIGN_TILE_ROWS
    labels = torch_search.nearest(rows.on_device(positions), lists, metric, tile_rows=tile)
    return np.ascontiguousarray(labels.cpu().numpy())


def assign_in_faiss(trained: faiss.Index, x: np.ndarray) -> np.ndarray:
    """The list of each row of `x` by the index's own quantizer, in tiles of ASSIGN_TILE_ROWS
    rows (the last padded): FAISS searches a tile of any other size another way (one row at a
    time below 20 rows), so a row's list would depend on the rows beside it."""
    quantizer = faiss.extract_index_ivf(trained).quantizer
    tile = torch_search.ASSIGN_TILE_ROWS
    out = np.empty(len(x), dtype=np.int64)
    for start in range(0, len(x), tile):
        block = np.ascontiguousarray(x[start : start + tile], dtype=np.float32)
        if len(block) < tile:
            block = np.concatenate([block, np.zeros((tile - len(block), x.shape[1]), np.float32)])
        out[start : start + tile] = quantizer.assign(block, 1).ravel()[: min(tile, len(x) - start)]
    return out


def add_rows(index: faiss.Index, x: np.ndarray, ids: np.ndarray, lists: np.ndarray | None) -> None:
    """Append rows `x` (prepared) with `ids`, in the given order: each to its list from
    `assign`, or where FAISS assigns it (`lists` None). Appending shard after shard gives the
    same index as merging the shards' own indexes."""
    if not len(ids):
        return
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if lists is None:
        index.add_with_ids(x, ids)
        return
    x = np.ascontiguousarray(x, dtype=np.float32)
    lists = np.ascontiguousarray(lists, dtype=np.int64)
    ivf = faiss.extract_index_ivf(index)  # the index itself (plain_ivf)
    ivf.add_core(len(ids), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(lists))


def append_lists(index: faiss.Index, parts: list[faiss.Index], threads: int = 16) -> None:
    """Append each list of every part (IVF indexes of the same quantizer), in the parts' order,
    to the same list of `index`, as merging them does, but copying: the parts keep their rows
    (merge_from moves them). Each list is sized once and filled in place; lists are split over
    `threads` threads (FAISS lets other threads run during each copy). Growing a list part by
    part, on one thread, took 6 s for 1 M x 768 rows against 1.5 s for the adds it replaced."""
    into = faiss.extract_index_ivf(index)
    lists = into.invlists
    theirs = []
    for part in parts:
        part_lists = faiss.extract_index_ivf(part).invlists
        assert part_lists is not None
        theirs.append(part_lists)
    assert lists is not None

    def fill(numbers: range) -> None:
        for number in numbers:
            sizes = [t.list_size(number) for t in theirs]
            at = lists.list_size(number)
            if not sum(sizes):
                continue
            lists.resize(number, at + sum(sizes))
            for part_lists, size in zip(theirs, sizes, strict=True):
                if size:
                    lists.update_entries(
                        number, at, size, part_lists.get_ids(number), part_lists.get_codes(number)
                    )
                    at += size

    step = -(-into.nlist // threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="index-lists") as pool:
        list(
            pool.map(
                fill, [range(s, min(s + step, into.nlist)) for s in range(0, into.nlist, step)]
            )
        )
    into.ntotal += sum(faiss.extract_index_ivf(part).ntotal for part in parts)


def fill_assigned(
    trained: faiss.Index, x: np.ndarray, ids: np.ndarray, lists: np.ndarray | None, nprobe: int
) -> faiss.Index:
    """A copy of the trained empty index holding rows `x` (add_rows)."""
    index = faiss.clone_index(trained)
    add_rows(index, x, ids, lists)
    set_nprobe(index, nprobe)
    return index


def fill(
    trained: faiss.Index, vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec
) -> faiss.Index:
    """A copy of the trained empty index holding `vectors`, added in ascending id order."""
    order = np.argsort(ids, kind="stable")
    builder = choose_builder(spec, trained)
    rows = prepare_rows(vectors[order], ids[order], spec, builder)
    every = np.arange(len(order))
    lists = assign(trained, rows, every, builder, spec.metric, gathered=rows.host)
    return fill_assigned(trained, rows.host, rows.ids, lists, spec.nprobe)


def merge(parts: list[faiss.Index], spec: IndexSpec, nprobe: int | None = None) -> faiss.Index:
    """One index serving every shard (same quantizer, so lists merge: each list holds shard 0's
    rows, then shard 1's, ...). FAISS moves the rows: the parts are left empty."""
    merged = faiss.clone_index(parts[0])
    for part in parts[1:]:
        merged.merge_from(part, 0)
    set_nprobe(merged, spec.nprobe if nprobe is None else nprobe)
    return merged


def build_index(vectors: np.ndarray, ids: np.ndarray, spec: IndexSpec) -> BuiltIndex:
    """Train and fill in one go (a single shard)."""
    built = train(vectors, spec)
    built.index = fill(built.index, vectors, ids, spec)
    return built


def centroids(index: faiss.Index) -> np.ndarray:
    ivf = faiss.extract_index_ivf(index)
    return ivf.quantizer.reconstruct_n(0, ivf.nlist)


def list_sizes(index: faiss.Index) -> np.ndarray:
    lists = faiss.extract_index_ivf(index).invlists
    assert lists is not None
    return np.array([lists.list_size(i) for i in range(lists.nlist)], dtype=np.int64)


def list_ids(index: faiss.Index) -> tuple[np.ndarray, np.ndarray]:
    """(every id the IVF index holds, the list holding it)."""
    lists = faiss.extract_index_ivf(index).invlists
    assert lists is not None
    ids, owner = [], []
    for number in range(lists.nlist):
        size = lists.list_size(number)
        if size:
            ids.append(faiss.rev_swig_ptr(lists.get_ids(number), size).copy())
            owner.append(np.full(size, number, dtype=np.int64))
    if not ids:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ids), np.concatenate(owner)


def set_nprobe(index: faiss.Index, nprobe: int) -> None:
    if is_ivf(index):
        faiss.extract_index_ivf(index).nprobe = nprobe


def nlist(index: faiss.Index) -> int:
    return int(faiss.extract_index_ivf(index).nlist) if is_ivf(index) else 0


def plain_ivf(index: faiss.Index) -> bool:
    """An IVF index itself, not wrapped (by a transform or an id map)."""
    return isinstance(faiss.downcast_index(index), faiss.IndexIVF)


def is_ivf(index: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:
        return False
    return True


def is_ivf_flat(index: faiss.Index) -> bool:
    """IVF lists holding the rows themselves: a probed list is searched exactly."""
    return is_ivf(index) and type(faiss.downcast_index(faiss.extract_index_ivf(index))) is (
        faiss.IndexIVFFlat
    )


def serialize(index: faiss.Index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def deserialize(data: bytes) -> faiss.Index:
    return faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))


def index_sha256(index: faiss.Index) -> str:
    """sha256 of the index's serialised bytes, streamed: the bytes are never held at once."""
    digest = hashlib.sha256()
    faiss.write_index(index, faiss.PyCallbackIOWriter(digest.update))  # type: ignore[attr-defined]
    return digest.hexdigest()


def recorded_builder(training: dict[str, object]) -> str:
    """The builder a receipt's training names; receipts from before builders were recorded
    trained in FAISS, on the CPU or (faiss-gpu) on the GPU."""
    if "builder" in training:
        return str(training["builder"])
    return "faiss-cpu" if training.get("device") == "cpu" else "faiss-gpu"
