"""The int8 calibration of each model key whose engine stores int8 vectors.

An engine with the `int8` output variant (fabric_gpu/variants.py) quantises each dimension over
a recorded range. The first extraction of the model key measures it on a sample of its set and
records it here; every later run, worker and query quantises with the same one, so all of the
key's vectors are comparable. `sha256` is that of `calibration_json`, which a receipt names.

Downgrade: the table goes.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "int8_calibrations",
        sa.Column(
            "model_id",
            sa.Integer(),
            sa.ForeignKey("models.id"),
            primary_key=True,
            autoincrement=False,
        ),
        sa.Column("calibration_json", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("n_vectors", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("int8_calibrations")
