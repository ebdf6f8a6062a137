"""SQLite: inserted rows are counted by the writer, not by a row trigger.

0003's AFTER INSERT trigger ran a sub-program once per inserted row; on the single SQLite writer
that cost about a third of its rows a second (1.5 KB rows, 32 KiB pages). The writer now adds
each shard's inserted rows to its watermark in the same transaction (store/watermarks.py), so
the numbers are the same as before for every row the product writes. The update and delete
triggers stay: rows changed or removed by hand still move their watermarks. PostgreSQL is
unchanged (its statement-level trigger runs once per COPY).

Downgrade: the row trigger again.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

INSERT_TRIGGER = (
    "CREATE TRIGGER embeddings_watermark_insert AFTER INSERT ON embeddings BEGIN "
    "UPDATE shard_watermarks SET version = version + 1 WHERE model_id = NEW.model_id "
    "AND shard = ((NEW.task_set_id * 7919 + NEW.record_no) % n_shards); END"
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS embeddings_watermark_insert")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(INSERT_TRIGGER)
