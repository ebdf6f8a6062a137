"""In-flight reuse: `awaited_results`, the tasks waiting for a result another running set is
computing (lib/broker/reuse.py).

Before, a set planned while another set was computing the same content computed it too. Now
each such task waits for the other set's row and is linked to it once stored; the table holds
the waits. Nothing existing changes.

Downgrade: the table goes (its tasks are outstanding again, to be planned).

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "awaited_results",
        sa.Column("model_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("task_set_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("record_no", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("from_task_set_id", sa.Integer(), nullable=False),
        sa.Column("from_record_no", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("awaited_results")
