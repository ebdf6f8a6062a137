"""The database's identity: one random id, made with the schema.

A warm pool worker keeps the database engine it opened for a URL between runs; a database
deleted and made again at that URL (a new SQLite file after a fresh start) is another database,
still read through the old connections. A run names the identity of the database it means in its
job, and a worker that reads another through its own connections refuses the job
(lib/worker/pool/server.py).

Downgrade: the table goes.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "database_identity",
        sa.Column("id", sa.String(32), primary_key=True, autoincrement=False),
    )
    op.bulk_insert(table, [{"id": uuid.uuid4().hex}])


def downgrade() -> None:
    op.drop_table("database_identity")
