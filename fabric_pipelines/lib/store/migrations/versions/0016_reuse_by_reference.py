"""Reused results by reference: a task linked to another's result no longer holds a copy of it.

Before, planning copied each reused task's embedding row from its source (450 k rows took most of
a rerun's planning). Now `embeddings` holds each result once, under the task that computed it, and
a reused task is its row in `reused_results` alone (lib/broker/reuse.py). Readers that want one
row per task read the view `task_embeddings` (the same columns as `embeddings`: a task's own row,
or its source's under its own set and record number) or follow the links themselves.

In place, on a filled database:
1. Links to a copy are pointed at the copy's own source, where that is stored.
2. A link whose source row is gone (its set was forgotten) while the task holds a copy names the
   task itself: the copy is its own result now, adopted (a self-link, store/result_links.py).
3. Every other copy is deleted: its link reads the same bytes from the source.
The index content of every model is unchanged (its tasks and their vectors), so the shard
watermarks are put back as they were: every receipt stays valid and fresh.
4. `content_keys` (every planned task's key) becomes `result_keys`: one owner per key and model,
   the lowest (set id, record number) among the tasks holding a row of it, else among those with
   neither a row nor a link (still to compute). Planning then writes a key per computed task, not
   one per task (a million keys took longer to store than the links).

`reused_results` becomes a bulk table like `embeddings`, without foreign keys: a planning links up
to a million tasks at once, and the two checks per row cost more than the rest of the insert (its
rows go with their set in tasks/catalog.forget_task_set).

`batches.engine` records the engine identity that computed each batch's rows (set with its ack;
NULL for batches acked before).

Links now move the shard watermarks of their task as rows do (store/watermarks.py): PostgreSQL by
the same statement-level triggers as `embeddings`; SQLite by row triggers for updates and deletes,
and inserts counted by the code that links, in its transaction.

Downgrade: every linked task without a row gets a copy of its source's again (watermarks kept),
the view and the triggers go, and `content_keys` comes back holding the keys of the owners and
of the tasks linked to them (the keys of other tasks were not kept).

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from fabric_pipelines.lib.store.vector_columns import VectorColumns

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

EVENTS = {
    "insert": "REFERENCING NEW TABLE AS changed_new",
    "update": "REFERENCING OLD TABLE AS changed_old NEW TABLE AS changed_new",
    "delete": "REFERENCING OLD TABLE AS changed_old",
}
SQLITE_EVENTS = {"update": ("OLD", "NEW"), "delete": ("OLD",)}
SOURCE_ROW = (
    "s.model_id = r.model_id AND s.task_set_id = r.from_task_set_id "
    "AND s.record_no = r.from_record_no"
)
OWN_ROW = "t.model_id = r.model_id AND t.task_set_id = r.task_set_id AND t.record_no = r.record_no"


def task_embeddings_view(columns: list[str]) -> str:
    """One row per task: its own, or its source's under its own set and record number (a task
    holding a row of its own is never read through a link)."""
    own = ", ".join(columns)
    linked = ", ".join(f"s.{c}" for c in columns[3:])
    return (
        f"CREATE VIEW task_embeddings AS SELECT {own} FROM embeddings "
        f"UNION ALL SELECT r.model_id, r.task_set_id, r.record_no, {linked} "
        f"FROM reused_results r JOIN embeddings s ON {SOURCE_ROW} "
        f"WHERE NOT EXISTS (SELECT 1 FROM embeddings t WHERE {OWN_ROW})"
    )


def _columns(bind: sa.Connection) -> list[str]:
    have = VectorColumns.of(bind)
    extra = [name for name, on in (("embedding", have.float32), ("embedding_half", have.half),
                                   ("embedding_bits", have.bits)) if on]  # fmt: skip
    return ["model_id", "task_set_id", "record_no", "n_tokens", "vector", *extra]


def _watermarks(bind: sa.Connection) -> list[dict[str, int]]:
    rows = bind.execute(sa.text("SELECT model_id, n_shards, shard, version FROM shard_watermarks"))
    return [dict(row._mapping) for row in rows]


def _put_back(bind: sa.Connection, versions: list[dict[str, int]]) -> None:
    if versions:
        bind.execute(
            sa.text(
                "UPDATE shard_watermarks SET version = :version "
                "WHERE model_id = :model_id AND n_shards = :n_shards AND shard = :shard"
            ),
            versions,
        )


PAIR = 2**40  # (set id, record number) as one integer: record numbers stay below 2**39


def _keys_to_owners(bind: sa.Connection) -> None:
    op.create_table(
        "result_keys",
        sa.Column("model_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("content_key", sa.LargeBinary(32), primary_key=True),
        sa.Column("task_set_id", sa.Integer(), nullable=False),
        sa.Column("record_no", sa.BigInteger(), nullable=False),
        sqlite_with_rowid=False,  # looked up by key: the row is in the key's B-tree
    )
    op.create_index("ix_result_keys_task", "result_keys", ["task_set_id", "record_no"])
    own_row = (
        "EXISTS (SELECT 1 FROM embeddings e WHERE e.model_id = k.model_id "
        "AND e.task_set_id = k.task_set_id AND e.record_no = k.record_no)"
    )
    no_link = (
        "NOT EXISTS (SELECT 1 FROM reused_results r WHERE r.model_id = k.model_id "
        "AND r.task_set_id = k.task_set_id AND r.record_no = k.record_no)"
    )
    for which in (own_row, f"NOT {own_row} AND {no_link}"):
        bind.execute(
            sa.text(
                "INSERT INTO result_keys (model_id, content_key, task_set_id, record_no) "
                f"SELECT model_id, content_key, min(pair) / {PAIR}, min(pair) % {PAIR} FROM "
                f"(SELECT k.model_id, k.content_key, k.task_set_id * {PAIR} + k.record_no AS pair "
                f"FROM content_keys k WHERE {which}) c "
                "WHERE NOT EXISTS (SELECT 1 FROM result_keys o WHERE o.model_id = c.model_id "
                "AND o.content_key = c.content_key) GROUP BY model_id, content_key"
            )
        )
    op.drop_table("content_keys")


def _owners_to_keys(bind: sa.Connection) -> None:
    op.create_table(
        "content_keys",
        sa.Column("model_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("task_set_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("record_no", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("content_key", sa.LargeBinary(32), nullable=False),
    )
    op.create_index("ix_content_keys_key", "content_keys", ["model_id", "content_key"])
    bind.execute(
        sa.text(
            "INSERT INTO content_keys (model_id, task_set_id, record_no, content_key) "
            "SELECT model_id, task_set_id, record_no, content_key FROM result_keys"
        )
    )
    bind.execute(
        sa.text(
            "INSERT INTO content_keys (model_id, task_set_id, record_no, content_key) "
            "SELECT r.model_id, r.task_set_id, r.record_no, k.content_key FROM reused_results r "
            "JOIN result_keys k ON k.model_id = r.model_id "
            "AND k.task_set_id = r.from_task_set_id AND k.record_no = r.from_record_no "
            "WHERE NOT (r.task_set_id = k.task_set_id AND r.record_no = k.record_no)"
        )
    )
    op.drop_table("result_keys")


def upgrade() -> None:
    bind = op.get_bind()
    pg = bind.dialect.name == "postgresql"
    versions = _watermarks(bind)
    # 1. Chains (a link to a copy) become links to the copy's source, a step at a time.
    for _ in range(64):
        moved = bind.execute(
            sa.text(
                "UPDATE reused_results SET from_task_set_id = ("
                "  SELECT c.from_task_set_id FROM reused_results c"
                "  WHERE c.model_id = reused_results.model_id"
                "  AND c.task_set_id = reused_results.from_task_set_id"
                "  AND c.record_no = reused_results.from_record_no),"
                " from_record_no = ("
                "  SELECT c.from_record_no FROM reused_results c"
                "  WHERE c.model_id = reused_results.model_id"
                "  AND c.task_set_id = reused_results.from_task_set_id"
                "  AND c.record_no = reused_results.from_record_no) "
                "WHERE EXISTS (SELECT 1 FROM reused_results c JOIN embeddings s"
                "  ON s.model_id = c.model_id AND s.task_set_id = c.from_task_set_id"
                "  AND s.record_no = c.from_record_no"
                "  WHERE c.model_id = reused_results.model_id"
                "  AND c.task_set_id = reused_results.from_task_set_id"
                "  AND c.record_no = reused_results.from_record_no)"
            )
        ).rowcount
        if not moved:
            break
    # 2. A copy whose source is gone is its task's own result, adopted: a self-link.
    bind.execute(
        sa.text(
            "UPDATE reused_results SET from_task_set_id = task_set_id, from_record_no = record_no "
            "WHERE EXISTS (SELECT 1 FROM embeddings t "
            "WHERE t.model_id = reused_results.model_id "
            "AND t.task_set_id = reused_results.task_set_id "
            "AND t.record_no = reused_results.record_no) "
            "AND NOT EXISTS (SELECT 1 FROM embeddings s "
            "WHERE s.model_id = reused_results.model_id "
            "AND s.task_set_id = reused_results.from_task_set_id "
            "AND s.record_no = reused_results.from_record_no)"
        )
    )
    # 3. Every other copy goes: its link reads the source's row.
    bind.execute(
        sa.text(
            "DELETE FROM embeddings WHERE EXISTS (SELECT 1 FROM reused_results r "
            "JOIN embeddings s ON s.model_id = r.model_id AND s.task_set_id = r.from_task_set_id "
            "AND s.record_no = r.from_record_no "
            "WHERE r.model_id = embeddings.model_id AND r.task_set_id = embeddings.task_set_id "
            "AND r.record_no = embeddings.record_no)"
        )
    )
    _put_back(bind, versions)
    _keys_to_owners(bind)
    # SQLite: without rowid, each link is one entry of one B-tree (its key), not two.
    with op.batch_alter_table(
        "reused_results", recreate="always", table_kwargs={"sqlite_with_rowid": False}
    ) as links:
        links.drop_constraint("fk_reused_results_model_id", type_="foreignkey")
        links.drop_constraint("fk_reused_results_task_set_id", type_="foreignkey")
    if pg:
        for event, refs in EVENTS.items():
            op.execute(
                f"CREATE TRIGGER reused_results_watermark_{event} AFTER {event.upper()} "
                f"ON reused_results {refs} FOR EACH STATEMENT "
                "EXECUTE FUNCTION fabric_bump_watermarks()"
            )
    else:
        for event, rows in SQLITE_EVENTS.items():
            body = "\n".join(
                "UPDATE shard_watermarks SET version = version + 1 "
                f"WHERE model_id = {r}.model_id "
                f"AND shard = (({r}.task_set_id * 7919 + {r}.record_no) % n_shards);"
                for r in rows
            )
            op.execute(
                f"CREATE TRIGGER reused_results_watermark_{event} AFTER {event.upper()} "
                f"ON reused_results BEGIN {body} END"
            )
    op.execute(task_embeddings_view(_columns(bind)))
    with op.batch_alter_table("batches") as batches:
        batches.add_column(sa.Column("engine", sa.String(160), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    pg = bind.dialect.name == "postgresql"
    with op.batch_alter_table("batches") as batches:
        batches.drop_column("engine")
    op.execute("DROP VIEW IF EXISTS task_embeddings")
    for event in EVENTS if pg else SQLITE_EVENTS:
        op.execute(
            f"DROP TRIGGER IF EXISTS reused_results_watermark_{event} ON reused_results"
            if pg
            else f"DROP TRIGGER IF EXISTS reused_results_watermark_{event}"
        )
    _owners_to_keys(bind)
    bind.execute(  # the foreign key's cascade would have taken them with their set
        sa.text("DELETE FROM reused_results WHERE task_set_id NOT IN (SELECT id FROM task_sets)")
    )
    with op.batch_alter_table("reused_results", recreate="always") as links:
        links.create_foreign_key("fk_reused_results_model_id", "models", ["model_id"], ["id"])
        links.create_foreign_key(
            "fk_reused_results_task_set_id", "task_sets", ["task_set_id"], ["id"],
            ondelete="CASCADE",
        )  # fmt: skip
    versions = _watermarks(bind)
    columns = _columns(bind)
    listed = ", ".join(columns)
    selected = ", ".join(f"s.{c}" for c in columns[3:])
    bind.execute(
        sa.text(
            f"INSERT INTO embeddings ({listed}) "
            f"SELECT r.model_id, r.task_set_id, r.record_no, {selected} "
            f"FROM reused_results r JOIN embeddings s ON {SOURCE_ROW} "
            f"WHERE NOT EXISTS (SELECT 1 FROM embeddings t WHERE {OWN_ROW})"
        )
    )
    _put_back(bind, versions)
