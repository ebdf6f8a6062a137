"""The typed receipt (index/receipt.Receipt): a published receipt reads back to the same bytes
and sha256, every file it names is listed once, and a receipt missing a field the rebuild needs,
or sharding by another rule, is refused with the field named before anything is rebuilt."""

from __future__ import annotations

import copy
import json

import pytest
from sqlalchemy import Engine

from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.rebuild import rebuild_from_receipt
from fabric_pipelines.lib.index.receipt import (
    SHARD_RULE,
    Receipt,
    ReceiptError,
    canonical_json,
    receipt_sha256,
)
from tests.test_index_lifecycle import _publish, _seed_rows


def test_a_published_receipt_round_trips_to_its_bytes_and_names_its_files(
    db: Engine, paths: FabricPaths
) -> None:
    _seed_rows(db, 1200)
    published = _publish(db, paths)
    stored = (paths.receipts / f"{published.receipt_sha256}.json").read_bytes()
    typed = Receipt.from_json(stored)
    assert typed.canonical_json() == stored
    assert typed.sha256() == published.receipt_sha256 == receipt_sha256(published.receipt)
    assert typed.as_dict() == json.loads(stored)
    assert typed.index.shard_rule == SHARD_RULE and typed.model_key == "m"
    files = typed.files()
    # The served index, its quantizer and its layout: no file per shard (the lists are stored
    # once; tests/test_index_lifecycle.py cuts the shards back out).
    assert len(files) == 3 and len(set(files)) == len(files)
    assert files[2] == (published.receipt["layout_file"], published.receipt["layout_sha256"])
    assert files[0] == (published.receipt["index_file"], published.receipt["index_sha256"])
    assert typed.recall_at_k == published.recall_at_k


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda r: r["training"].pop("quantizer_sha256"), "training.quantizer_sha256"),
        (lambda r: r["source"].update(rows="1200"), "source.rows"),
        (lambda r: r["index"].update(shard_rule="record_no mod shards"), "index.shard_rule"),
        (lambda r: r.update(extra_field=1), "extra_field"),
        # Schema 2 named a file per shard: a receipt of that schema without one is refused.
        (
            lambda r: [r.update(schema="fabric.index_receipt/2"), r.pop("layout_file")],
            "shards.0.index_file",
        ),
        (lambda r: r.pop("layout_file"), "layout_file and layout_sha256 come together"),
        (lambda r: [r.pop("layout_file"), r.pop("layout_sha256")], "needs its layout_file"),
        (lambda r: r["shards"][0].update(index_file="shards/x.faiss"), "no shard index files"),
    ],
)
def test_a_receipt_the_rebuild_cannot_use_is_refused_naming_the_field(
    db: Engine, paths: FabricPaths, change, named: str
) -> None:  # type: ignore[no-untyped-def]
    _seed_rows(db, 1200)
    published = _publish(db, paths)
    broken = copy.deepcopy(published.receipt)
    change(broken)
    with pytest.raises(ReceiptError, match=named.replace(".", r"\.")):
        Receipt.parse(broken)
    with pytest.raises(ReceiptError, match=named.replace(".", r"\.")):
        rebuild_from_receipt(db, broken, paths.indexes)
    # The published one still reads, and its bytes are what canonical_json gives.
    assert Receipt.parse(published.receipt).canonical_json() == canonical_json(published.receipt)


def test_another_schema_is_refused_by_name(db: Engine, paths: FabricPaths) -> None:
    _seed_rows(db, 1200)
    older = {**_publish(db, paths).receipt, "schema": "fabric.index_receipt/1"}
    with pytest.raises(ReceiptError, match="index_receipt/1"):
        Receipt.parse(older)
