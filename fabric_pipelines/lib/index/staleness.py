"""Is the newest index of a model still true to its rows? The database decides.

A shard's watermark version moves whenever one of its rows is inserted, updated or deleted
(store/watermarks.py: triggers, and on SQLite the writer for the rows it inserts — a row
inserted there by hand moves none). The newest receipt records the versions it was built at; a shard
whose version moved since is stale. A served index file that is gone also calls for a rebuild.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, select

from fabric_pipelines.lib.core.retry import unit_of_work
from fabric_pipelines.lib.index import shards
from fabric_pipelines.lib.store.keys import model_id, model_id_of
from fabric_pipelines.lib.store.models import IndexReceipt, Model


@dataclass(frozen=True)
class Staleness:
    model_key: str
    receipt_sha256: str
    stale_shards: list[int]
    index_missing: bool
    receipt: dict[str, Any]

    @property
    def stale(self) -> bool:
        return bool(self.stale_shards) or self.index_missing


def latest_receipt(conn: Connection, model_key: str) -> tuple[str, dict[str, Any]] | None:
    """(sha256, receipt) of the model's newest published index, or None."""
    row = conn.execute(
        select(IndexReceipt.receipt_sha256, IndexReceipt.receipt_json)
        .where(IndexReceipt.model_id == model_id_of(model_key))
        .order_by(IndexReceipt.created_at.desc(), IndexReceipt.receipt_sha256)
        .limit(1)
    ).first()
    if row is None:
        return None
    receipt: dict[str, Any] = json.loads(row.receipt_json)
    return row.receipt_sha256, receipt


@unit_of_work("reading the served index of {model_key}")
def serving_receipt(db: Engine, model_key: str) -> tuple[str, dict[str, Any]] | None:
    """`latest_receipt` in a transaction of its own."""
    with db.connect() as conn:
        return latest_receipt(conn, model_key)


def indexed_models(conn: Connection) -> list[str]:
    return sorted(
        conn.execute(
            select(Model.model_key).join(IndexReceipt, IndexReceipt.model_id == Model.id).distinct()
        ).scalars()
    )


def staleness(conn: Connection, model_key: str, index_folder: Path) -> Staleness | None:
    """How the model's newest index differs from the database now (None: no index yet)."""
    latest = latest_receipt(conn, model_key)
    if latest is None:
        return None
    sha, receipt = latest
    watermark = receipt["source"]["watermark"]
    now = shards.versions(conn, model_id(conn, model_key, create=False), watermark["n_shards"])
    stale = [s for s, (then, current) in enumerate(zip(watermark["versions"], now, strict=True))
             if then != current]  # fmt: skip
    # Here, not at the top: publish loads torch and FAISS, which a staleness check never needs.
    from fabric_pipelines.lib.index.paths import model_index_folder

    missing = not (model_index_folder(index_folder, model_key) / receipt["index_file"]).is_file()
    return Staleness(model_key, sha, stale, missing, receipt)
