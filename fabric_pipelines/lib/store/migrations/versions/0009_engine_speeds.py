"""Measured engine speeds: each extraction run records the tokens its engine computed and the
seconds it took (its pulling window), per model, engine, layout and device, so that `fabric plan`
predicts a job's time from what this engine really did, never from a guess.

Downgrade: the table goes.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "engine_speeds",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("model_key", sa.String(128), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("layout", sa.String(16), nullable=False),
        sa.Column("device", sa.String(256), nullable=False),
        sa.Column("source", sa.String(256), nullable=False),
        sa.Column("padded_tokens", sa.BigInteger(), nullable=False),
        sa.Column("real_tokens", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("measured_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "ix_engine_speeds_engine", "engine_speeds", ["model_key", "backend", "layout", "device"]
    )


def downgrade() -> None:
    op.drop_index("ix_engine_speeds_engine", table_name="engine_speeds")
    op.drop_table("engine_speeds")
