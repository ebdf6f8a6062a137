"""Content keys and reused results (lib/broker/reuse.py): a task whose token ids, model key and hook
layers match a stored result's is linked to it instead of being computed again.

`content_keys` holds each planned task's key (sha256, 32 bytes), indexed by model and key;
`reused_results` each task whose embedding row was (or will be, once its source is stored)
copied from another task's. `extraction_runs` keeps each extraction step's efficiency record
(lib/records/efficiency.py) for `fabric status`.

Downgrade: the three tables go (copied embedding rows stay, and then count as completed).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "content_keys",
        sa.Column("model_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("task_set_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("record_no", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("content_key", sa.LargeBinary(32), nullable=False),
    )
    op.create_index("ix_content_keys_key", "content_keys", ["model_id", "content_key"])
    op.create_table(
        "reused_results",
        sa.Column(
            "model_id",
            sa.Integer(),
            sa.ForeignKey("models.id", name="fk_reused_results_model_id"),
            primary_key=True,
            autoincrement=False,
        ),
        sa.Column(
            "task_set_id",
            sa.Integer(),
            sa.ForeignKey("task_sets.id", name="fk_reused_results_task_set_id", ondelete="CASCADE"),
            primary_key=True,
            autoincrement=False,
        ),
        sa.Column("record_no", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("from_task_set_id", sa.Integer(), nullable=False),
        sa.Column("from_record_no", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )

    op.create_table(
        "extraction_runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "task_set_id",
            sa.Integer(),
            sa.ForeignKey(
                "task_sets.id", name="fk_extraction_runs_task_set_id", ondelete="CASCADE"
            ),
            nullable=False,
        ),
        sa.Column(
            "model_id",
            sa.Integer(),
            sa.ForeignKey("models.id", name="fk_extraction_runs_model_id"),
            nullable=False,
        ),
        sa.Column("plan_id", sa.String(64), nullable=False),
        sa.Column("record_json", sa.Text(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index(
        "ix_extraction_runs_task_set_id", "extraction_runs", ["task_set_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_extraction_runs_task_set_id", table_name="extraction_runs")
    op.drop_table("extraction_runs")
    op.drop_table("reused_results")
    op.drop_index("ix_content_keys_key", table_name="content_keys")
    op.drop_table("content_keys")
