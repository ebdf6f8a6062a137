"""Rebuild an index from its receipt, and check the files a receipt names.

A receipt pins its source rows by hash. A rebuild reads the same predicate from the database,
refuses if the rows are no longer the ones the receipt describes, then redoes every step the
receipt records: training (when the quantizer was trained on these very rows; otherwise the
stored quantizer, verified by hash, is the only copy), each shard's fill in id order, the merge.
On the receipt's own backend the result must be bitwise identical; elsewhere it must meet the
tolerance the receipt states. Missing or corrupt files are written back when the rebuild matches.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from sqlalchemy import Engine

from fabric_pipelines.lib.core.files import CorruptFileError, sha256_file
from fabric_pipelines.lib.index.build import (
    TRAIN_RULES,
    IndexSpec,
    add_rows,
    assign,
    choose_builder,
    fill_assigned,
    index_sha256,
    list_sizes,
    nlist,
    planned_builder,
    prepare_rows,
    recorded_builder,
    set_nprobe,
    train_rows,
    train_rule_of,
)
from fabric_pipelines.lib.index.index_file import store_index
from fabric_pipelines.lib.index.layout import layout_sha256, store_layout
from fabric_pipelines.lib.index.paths import model_index_folder
from fabric_pipelines.lib.index.probe import RecallProbe
from fabric_pipelines.lib.index.publish import shard_rows
from fabric_pipelines.lib.index.quantizers import read_verified
from fabric_pipelines.lib.index.receipt import Receipt, ReceiptError, array_sha256, receipt_sha256
from fabric_pipelines.lib.index.vectors import VectorSet, load_vectors


@dataclass(frozen=True)
class FileProblem:
    file: str  # relative to the model's index folder
    problem: str  # "missing" or "corrupt"


@dataclass
class RebuildReport:
    expected_sha256: str
    rebuilt_sha256: str
    device: str  # the builder that rebuilt it: faiss-cpu, torch-cpu or torch-cuda
    tolerance: dict[str, Any]
    matches: bool
    detail: str
    repaired: list[str] = field(default_factory=list)


def check_files(receipt: Receipt | dict[str, Any], index_folder: Path) -> list[FileProblem]:
    """Every file the receipt names (served index, quantizer, layout or shards), hashed
    against it."""
    typed = receipt if isinstance(receipt, Receipt) else Receipt.parse(receipt)
    folder = model_index_folder(index_folder, typed.model_key)
    problems = []
    for name, sha in typed.files():
        path = folder / name
        if not path.is_file():
            problems.append(FileProblem(name, "missing"))
        elif sha256_file(path) != sha:
            problems.append(FileProblem(name, "corrupt"))
    return problems


def check_receipt_file(path: Path) -> str | None:
    """None when the receipt file `<sha256>.json` holds the receipt its name says (its bytes
    hash to the name, or, re-formatted, its canonical JSON does); else what is wrong."""
    if not path.is_file():
        return "missing"
    if not re.fullmatch(r"[0-9a-f]{64}", path.stem):
        return "not named <sha256>.json, so nothing can check it"
    actual = sha256_file(path)
    if actual == path.stem:
        return None
    try:
        receipt = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError too
        return f"sha256 {actual} but named {path.stem}, and not readable JSON: {exc}"
    if isinstance(receipt, dict) and receipt_sha256(receipt) == path.stem:
        return None
    return f"sha256 {actual} but named {path.stem}: edited or corrupt since it was written"


def load_verified_receipt(path: Path) -> dict[str, Any]:
    """A receipt file, refused (ReceiptError) unless it holds the receipt its name says."""
    problem = check_receipt_file(path)
    if problem is not None:
        raise ReceiptError(
            f"receipt {path}: {problem}; `fabric receipt restore {path.stem}` writes it again "
            "from the database"
        )
    receipt: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return receipt


def spec_from_receipt(receipt: Receipt, device: str | None = None) -> IndexSpec:
    """The spec that rebuilds `receipt`: its builder where this machine has it. A torch-cuda
    build is redone by torch on the CPU where torch sees no GPU (same algorithm; the receipt's
    tolerance says how close it must come); a faiss-gpu build (older receipts) by faiss-cpu."""
    index, training = receipt.index, receipt.training
    builder = recorded_builder(training.as_dict())
    where, kmeans = {
        "torch-cuda": ("auto", "torch"),
        "torch-cpu": ("cpu", "torch"),
    }.get(builder, ("cpu", "faiss"))
    return IndexSpec(
        factory=training.factory,
        metric=index.metric,
        # Shards keep the nprobe asked for; the served index the one chosen (params.nprobe).
        nprobe=index.params.get("nprobe_requested", index.params["nprobe"]),
        train_sample=training.max_sample,
        seed=training.seed,
        train_rule=_train_rule(training.as_dict()),
        recall_queries=receipt.quality["queries"] or 1,
        k=receipt.quality["k"],
        shards=index.shards,
        device=device or where,
        kmeans=kmeans,
    )


def _train_rule(training: dict[str, Any]) -> str:
    try:
        return train_rule_of(str(training.get("rule", TRAIN_RULES["sample"])))
    except ValueError as exc:
        raise ReceiptError(
            f"receipt field {exc}; rebuild it with the version that built it"
        ) from exc


def _check_source(receipt: Receipt, source: VectorSet) -> None:
    ids_sha = array_sha256(source.ids)
    vectors_sha = array_sha256(source.vectors)
    if ids_sha != receipt.ids_sha256 or vectors_sha != receipt.vectors_sha256:
        what = "ids" if ids_sha != receipt.ids_sha256 else "vectors"
        raise ReceiptError(
            f"the rows of model {receipt.model_key} are no longer those of this "
            f"receipt: {len(source.ids)} rows now, {receipt.source.rows} recorded, and "
            f"their {what} hash differs. A receipt rebuilds only the rows it describes; "
            "materialise vector_index for an index over the current rows."
        )


def rebuild_from_receipt(
    db: Engine, recorded: Receipt | dict[str, Any], index_folder: Path, *, repair: bool = True
) -> RebuildReport:
    receipt = recorded if isinstance(recorded, Receipt) else Receipt.parse(recorded)
    model_key = receipt.model_key
    with db.connect() as conn:
        source = load_vectors(conn, receipt.source.predicate["model_key"])
    _check_source(receipt, source)
    spec = spec_from_receipt(receipt)
    folder = model_index_folder(index_folder, model_key)
    training = receipt.training
    recorded_by = recorded_builder(training.as_dict())
    outputs: dict[str, faiss.Index] = {}  # file -> what the rebuild made for it

    trained_on = training.trained_on
    # Trained on exactly these rows (ids and vectors): train again. A partial build reuses an
    # earlier quantizer, trained on other rows or older vectors: only its file reproduces it.
    if (trained_on["ids_sha256"], trained_on["vectors_sha256"]) == (
        receipt.ids_sha256,
        receipt.vectors_sha256,
    ):
        builder = planned_builder(spec, len(source.ids), source.dim, training.factory)
        rows = prepare_rows(source.vectors, source.ids, spec, builder)
        built = train_rows(rows, spec, training.factory)
        quantizer, builder = built.index, built.builder
        outputs[training.quantizer_file] = quantizer
    else:
        try:
            quantizer = read_verified(folder / training.quantizer_file, training.quantizer_sha256)
        except (FileNotFoundError, CorruptFileError) as exc:
            raise ReceiptError(
                f"the quantizer was trained on earlier rows ({trained_on['rows']} of them, "
                f"ids sha256 {trained_on['ids_sha256'][:12]}...) and its "
                f"file, the only copy, is unusable: {exc}. Build a fresh index instead."
            ) from exc
        builder = choose_builder(spec, quantizer)
        rows = prepare_rows(source.vectors, source.ids, spec, builder)
    served = faiss.clone_index(quantizer)
    n_lists = nlist(quantizer)
    counts = np.zeros((len(receipt.shards), n_lists), dtype=np.int64)
    pairs = zip(receipt.shards, shard_rows(source, spec.shards), strict=True)
    for number, (entry, positions) in enumerate(pairs):
        x, ids = rows.on_host(positions), source.ids[positions]
        lists = assign(quantizer, rows, positions, builder, spec.metric, gathered=x)
        if entry.index_file is not None:  # schema 2: each shard had an index file of its own
            outputs[entry.index_file] = fill_assigned(quantizer, x, ids, lists, spec.nprobe)
        before = list_sizes(served) if n_lists else None
        add_rows(served, x, ids, lists)  # shard after shard, as the build appends them
        if before is not None:
            counts[number] = list_sizes(served) - before
    set_nprobe(served, receipt.index.params["nprobe"])
    outputs[receipt.index_file] = served
    with ThreadPoolExecutor(len(outputs)) as pool:  # hashlib lets the threads run side by side
        hashes = dict(zip(outputs, pool.map(index_sha256, outputs.values()), strict=True))
    if receipt.layout_file is not None:  # schema 3: where each shard's rows lie in the lists
        hashes[receipt.layout_file] = layout_sha256(counts)

    expected = receipt.index_sha256
    rebuilt_sha = hashes[receipt.index_file]
    tol = receipt.tolerance
    if builder == recorded_by and tol["kind"] == "bitwise":
        matches = rebuilt_sha == expected
        detail = "bitwise identical" if matches else f"sha256 {rebuilt_sha} differs from {expected}"
        layout = receipt.layout_file
        if matches and layout is not None and hashes[layout] != receipt.layout_sha256:
            matches = False
            detail = f"index identical, but its layout's sha256 {hashes[layout]} differs"
    elif rebuilt_sha == expected:
        matches, detail = True, "bitwise identical"
    else:
        recall, _ = RecallProbe(rows, spec, spec.k).recall(served, spec.k)
        recorded_recall = receipt.recall_at_k
        drop = recorded_recall - recall
        limit = float(tol.get("max_recall_drop", 0.0))
        matches = drop <= limit
        detail = (
            f"not bitwise ({builder} rebuild of a {recorded_by} build); "
            f"recall@{spec.k} {recall:.4f} vs recorded {recorded_recall:.4f} (allowed drop {limit})"
        )
    report = RebuildReport(expected, rebuilt_sha, builder, tol, matches, detail)
    if repair and matches and rebuilt_sha == expected:
        report.repaired = _repair(receipt, folder, outputs, counts, hashes)
    return report


def _repair(
    receipt: Receipt,
    folder: Path,
    outputs: dict[str, faiss.Index],
    counts: np.ndarray,
    hashes: dict[str, str],
) -> list[str]:
    """Write back each missing or corrupt file whose rebuilt bytes hash to what the receipt says
    (only a bitwise rebuild can restore a file under its recorded name)."""
    repaired = []
    for problem in check_files(receipt, folder.parent):
        sha = hashes.get(problem.file, "")
        if not sha or not Path(problem.file).name.startswith(sha):
            continue
        target = folder / problem.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        if problem.file in outputs:
            store_index(target.parent, outputs[problem.file])
        else:  # the layout
            store_layout(folder, counts)
        repaired.append(problem.file)
    return repaired
