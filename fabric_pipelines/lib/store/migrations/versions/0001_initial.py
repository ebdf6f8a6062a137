"""The first schema: task sets and tasks, failures, batch plans and the ledger, models,
embeddings, hidden-state shards, index receipts.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "task_sets",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("source_sha256", sa.String(64), nullable=False),
        sa.Column("content_sha256", sa.String(64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("model_id", sa.String(256), nullable=False),
        sa.Column("tokenizer_sha256", sa.String(64), nullable=False),
        sa.Column("max_seq_len", sa.Integer(), nullable=False),
        sa.Column("n_records", sa.BigInteger(), nullable=False),
        sa.Column("n_tasks", sa.BigInteger(), nullable=False),
        sa.Column("truncated", sa.BigInteger(), nullable=False),
        sa.Column("current_plan_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "tasks",
        sa.Column("task_set_id", sa.Integer(), primary_key=True),
        sa.Column("record_no", sa.BigInteger(), primary_key=True),
        sa.Column("task_id", sa.String(256), nullable=False),
        sa.UniqueConstraint("task_set_id", "task_id", name="uq_tasks_id"),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("model_key", sa.String(128), nullable=False, unique=True),
    )
    op.create_table(
        "task_failures",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("task_set", sa.String(64), nullable=False, index=True),
        sa.Column("record_no", sa.BigInteger(), nullable=False),
        sa.Column("task_id", sa.String(256), nullable=True),
        sa.Column("stage", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("task_set", "record_no", name="uq_task_failures_record"),
    )
    op.create_table(
        "batch_plans",
        sa.Column("plan_id", sa.String(64), primary_key=True),
        sa.Column("task_set", sa.String(64), nullable=False, index=True),
        sa.Column("model_key", sa.String(128), nullable=False),
        sa.Column("profile_json", sa.Text(), nullable=False),
        sa.Column("n_batches", sa.Integer(), nullable=False),
        sa.Column("n_items", sa.BigInteger(), nullable=False),
        sa.Column("real_tokens", sa.BigInteger(), nullable=False),
        sa.Column("padded_tokens", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "batches",
        sa.Column("plan_id", sa.String(64), primary_key=True),
        sa.Column("batch_no", sa.Integer(), primary_key=True),
        sa.Column("task_set", sa.String(64), nullable=False, index=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("seq_len", sa.Integer(), nullable=False),
        sa.Column("item_start", sa.BigInteger(), nullable=False),
        sa.Column("item_count", sa.Integer(), nullable=False),
        sa.Column("real_tokens", sa.BigInteger(), nullable=False),
        sa.Column("padded_tokens", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_epoch", sa.Integer(), nullable=False),
        sa.Column("lease_deadline", sa.Float(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_batches_plan_state", "batches", ["plan_id", "state", "batch_no"])
    op.create_table(
        "embeddings",
        sa.Column("model_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("task_set_id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("record_no", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("vector", sa.LargeBinary(), nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        # Vectors of up to ~2,000 float32 stay in the row: PostgreSQL would otherwise try (and
        # fail) to compress every one past 2 kB and move it to a TOAST table.
        op.execute("ALTER TABLE embeddings SET (toast_tuple_target = 8160)")
    op.create_table(
        "hidden_state_shards",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("task_set", sa.String(64), nullable=False, index=True),
        sa.Column("model_key", sa.String(128), nullable=False),
        sa.Column("plan_id", sa.String(64), nullable=False),
        sa.Column("batch_no", sa.Integer(), nullable=False),
        sa.Column("layers", sa.String(256), nullable=False),
        sa.Column("n_items", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "index_receipts",
        sa.Column("receipt_sha256", sa.String(64), primary_key=True),
        sa.Column("model_key", sa.String(128), nullable=False, index=True),
        sa.Column("index_path", sa.Text(), nullable=False),
        sa.Column("index_sha256", sa.String(64), nullable=False),
        sa.Column("n_vectors", sa.BigInteger(), nullable=False),
        sa.Column("recall_at_k", sa.Float(), nullable=False),
        sa.Column("receipt_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    for table in (
        "index_receipts", "hidden_state_shards", "embeddings", "batches", "batch_plans",
        "task_failures", "models", "tasks", "task_sets",
    ):  # fmt: skip
        op.drop_table(table)
