"""The quantizers of built indexes: read back verified, and the served one where a build now
would reuse it (a partial rebuild keeps the lists its shards were assigned to).

Below both the index step (publish.py) and the vector tail's prebuild (prebuild.py), which
must agree on which quantizer a build takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss
from sqlalchemy import Engine

from fabric_pipelines.lib.core.files import CorruptFileError, verify_sha256
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    choose_builder,
    empty_index,
    recorded_builder,
)
from fabric_pipelines.lib.index.paths import model_index_folder
from fabric_pipelines.lib.index.receipt import RECEIPT_SCHEMA
from fabric_pipelines.lib.index.staleness import serving_receipt


def read_verified(path: Path, sha256: str) -> faiss.Index:
    """An index file, refused unless it hashes to what the receipt recorded."""
    verify_sha256(path, sha256, "index file", "fabric index rebuild --receipt writes it again")
    return faiss.read_index(str(path))


def reusable_quantizer(
    db: Engine,
    model_key: str,
    spec: IndexSpec,
    index_folder: Path,
    model: dict[str, Any],
    dim: int,
) -> tuple[faiss.Index, dict[str, Any]] | None:
    """The served index's quantizer and training record, where a build of `spec` now would
    reuse it (`reusable`); what the extraction's prebuild assigns rows with."""
    serving = serving_receipt(db, model_key)
    if serving is None:
        return None
    folder = model_index_folder(index_folder, model_key)
    return reusable(serving[1], spec, model, folder, dim)


def reusable(
    previous: dict[str, Any] | None,
    spec: IndexSpec,
    model: dict[str, Any],
    folder: Path,
    dim: int,
) -> tuple[faiss.Index, dict[str, Any]] | None:
    """The previous build's trained quantizer, when the previous receipt describes the same
    index (model, factory, metric, shards, builder) and its quantizer file is intact."""
    if not previous or previous.get("schema") != RECEIPT_SCHEMA:
        return None
    training = previous.get("training", {})
    if "trained_on" not in training:
        return None
    same = (
        previous["index"]["metric"] == spec.metric
        and previous["index"]["shards"] == spec.shards
        and previous["model"].get("weights_sha256") == model.get("weights_sha256")
        and previous["model"].get("dim") in (None, dim)
        and (spec.factory == "auto" or training["factory"] == spec.factory)
    )
    if not same:
        return None
    # New shards must be assigned to lists the way the kept ones were.
    builder_now = choose_builder(spec, empty_index(dim, training["factory"], spec.metric))
    if recorded_builder(training) != builder_now:
        return None
    try:
        quantizer = read_verified(folder / training["quantizer_file"], training["quantizer_sha256"])
    except (FileNotFoundError, CorruptFileError):
        return None
    return quantizer, training
