"""Task sets record the prompt their texts were tokenised with ("" for none).

A set's tokens include its prompt, so a set is its file and its prompt: ingest refuses the same
name with another prompt, and the index receipt lists each input's prompt. Existing sets had none.

Downgrade: the column goes.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("task_sets") as batch:
        batch.add_column(sa.Column("prompt", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("task_sets") as batch:
        batch.drop_column("prompt")
