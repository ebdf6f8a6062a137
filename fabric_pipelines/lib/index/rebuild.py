"""Rebuild an index from its receipt, and check the files a receipt names.

A receipt pins its source rows by hash. A rebuild reads the same predicate from the database,
refuses if the rows are no longer the ones the receipt describes, then redoes every step the
receipt records: training (when the quantizer was trained on these very rows; otherwise the
stored quantizer, verified by hash, is the only copy), each shard's fill in id order, the merge.
On the receipt's own backend the result must be bitwise identical; elsewhere it must meet the
tolerance the receipt states. Missing or corrupt files are written back when the rebuild matches.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
from sqlalchemy import Engine

from fabric_pipelines.lib.files import CorruptFileError, sha256_file
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    build_device,
    fill,
    merge,
    recall_at_k,
    serialize,
    train,
)
from fabric_pipelines.lib.index.publish import (
    model_folder,
    read_verified,
    split_shards,
    write_faiss_file,
)
from fabric_pipelines.lib.index.receipt import RECEIPT_SCHEMA, array_sha256, receipt_sha256
from fabric_pipelines.lib.index.vectors import VectorSet, load_vectors


class ReceiptError(ValueError):
    """The receipt cannot be rebuilt: wrong schema, changed source rows, or a lost quantizer."""


@dataclass(frozen=True)
class FileProblem:
    file: str  # relative to the model's index folder
    problem: str  # "missing" or "corrupt"


@dataclass
class RebuildReport:
    expected_sha256: str
    rebuilt_sha256: str
    device: str
    tolerance: dict[str, Any]
    matches: bool
    detail: str
    repaired: list[str] = field(default_factory=list)


def check_files(receipt: dict[str, Any], index_folder: Path) -> list[FileProblem]:
    """Every file the receipt names (served index, quantizer, shards), hashed against it."""
    folder = model_folder(index_folder, receipt["model"]["model_key"])
    wanted = [(receipt["index_file"], receipt["index_sha256"])]
    wanted.append((receipt["training"]["quantizer_file"], receipt["training"]["quantizer_sha256"]))
    wanted += [(s["index_file"], s["index_sha256"]) for s in receipt["shards"]]
    problems = []
    for name, sha in wanted:
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


def spec_from_receipt(receipt: dict[str, Any], device: str = "auto") -> IndexSpec:
    index, training = receipt["index"], receipt["training"]
    return IndexSpec(
        factory=training["factory"],
        metric=index["metric"],
        nprobe=index["params"]["nprobe"],
        train_sample=training["max_sample"],
        seed=training["seed"],
        recall_queries=receipt["quality"]["queries"] or 1,
        k=receipt["quality"]["k"],
        shards=index["shards"],
        device=device,
    )


def _check_source(receipt: dict[str, Any], source: VectorSet) -> None:
    ids_sha = array_sha256(source.ids.astype("<i8"))
    vectors_sha = array_sha256(source.vectors.astype("<f4"))
    if ids_sha != receipt["ids_sha256"] or vectors_sha != receipt["vectors_sha256"]:
        what = "ids" if ids_sha != receipt["ids_sha256"] else "vectors"
        raise ReceiptError(
            f"the rows of model {receipt['model']['model_key']} are no longer those of this "
            f"receipt: {len(source.ids)} rows now, {receipt['source']['rows']} recorded, and "
            f"their {what} hash differs. A receipt rebuilds only the rows it describes; "
            "materialise vector_index for an index over the current rows."
        )


def rebuild_from_receipt(
    db: Engine, receipt: dict[str, Any], index_folder: Path, *, repair: bool = True
) -> RebuildReport:
    if receipt.get("schema") != RECEIPT_SCHEMA:
        raise ReceiptError(
            f"receipt schema {receipt.get('schema')!r}: this version rebuilds {RECEIPT_SCHEMA}"
        )
    model_key = receipt["model"]["model_key"]
    with db.connect() as conn:
        source = load_vectors(conn, receipt["source"]["predicate"]["model_key"])
    _check_source(receipt, source)
    spec = spec_from_receipt(receipt)
    device = build_device(spec)
    folder = model_folder(index_folder, model_key)
    training = receipt["training"]
    outputs: dict[str, tuple[str, bytes]] = {}  # file -> (sha, bytes) of what the rebuild made

    trained_on = training["trained_on"]
    # Trained on exactly these rows (ids and vectors): train again. A partial build reuses an
    # earlier quantizer, trained on other rows or older vectors: only its file reproduces it.
    if (trained_on["ids_sha256"], trained_on["vectors_sha256"]) == (
        receipt["ids_sha256"],
        receipt["vectors_sha256"],
    ):
        quantizer = train(source.vectors, spec).index
        outputs[training["quantizer_file"]] = _serialized(quantizer)
    else:
        try:
            quantizer = read_verified(
                folder / training["quantizer_file"], training["quantizer_sha256"]
            )
        except (FileNotFoundError, CorruptFileError) as exc:
            raise ReceiptError(
                f"the quantizer was trained on earlier rows ({trained_on['rows']} of them, "
                f"ids sha256 {trained_on['ids_sha256'][:12]}...) and its "
                f"file, the only copy, is unusable: {exc}. Build a fresh index instead."
            ) from exc
    parts = []
    for entry, (ids, vectors) in zip(
        receipt["shards"], split_shards(source, spec.shards), strict=True
    ):
        part = fill(quantizer, vectors, ids, spec)
        outputs[entry["index_file"]] = _serialized(part)
        parts.append(part)
    served = merge(parts, spec)
    outputs[receipt["index_file"]] = _serialized(served)

    expected = receipt["index_sha256"]
    rebuilt_sha = outputs[receipt["index_file"]][0]
    tol = receipt["tolerance"]
    if device == receipt["build_device"] and tol["kind"] == "bitwise":
        matches = rebuilt_sha == expected
        detail = "bitwise identical" if matches else f"sha256 {rebuilt_sha} differs from {expected}"
    elif rebuilt_sha == expected:
        matches, detail = True, "bitwise identical"
    else:
        recall, _ = recall_at_k(served, source.vectors, source.ids, spec)
        recorded = float(receipt["quality"]["recall_at_k"])
        drop = recorded - recall
        limit = float(tol.get("max_recall_drop", 0.0))
        matches = drop <= limit
        detail = (
            f"not bitwise ({device} rebuild of a {receipt['build_device']} build); "
            f"recall@{spec.k} {recall:.4f} vs recorded {recorded:.4f} (allowed drop {limit})"
        )
    report = RebuildReport(expected, rebuilt_sha, device, tol, matches, detail)
    if repair and matches:
        report.repaired = _repair(receipt, folder, outputs, bitwise=rebuilt_sha == expected)
    return report


def _serialized(index: faiss.Index) -> tuple[str, bytes]:
    data = serialize(index)
    return hashlib.sha256(data).hexdigest(), data


def _repair(
    receipt: dict[str, Any], folder: Path, outputs: dict[str, tuple[str, bytes]], *, bitwise: bool
) -> list[str]:
    """Write back each missing or corrupt file whose rebuilt bytes hash to what the receipt says
    (only a bitwise rebuild can restore a file under its recorded name)."""
    if not bitwise:
        return []
    repaired = []
    for problem in check_files(receipt, folder.parent):
        sha, data = outputs.get(problem.file, ("", b""))
        if sha and Path(problem.file).name == f"{sha}.faiss":
            target = folder / problem.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            write_faiss_file(target.parent, data)
            repaired.append(problem.file)
    return repaired
