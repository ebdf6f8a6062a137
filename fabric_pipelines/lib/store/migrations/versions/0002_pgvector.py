"""Embeddings as pgvector `vector` values where the PostgreSQL server has the extension.

Chosen at run time: on a server without pgvector (and on SQLite) this revision changes nothing
and embeddings stay float32 bytes. With it, an `embedding vector` column is added and
`vector` (the bytes) becomes optional; the writer fills whichever the schema has.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _pgvector_available() -> bool:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    found = bind.execute(
        sa.text("select 1 from pg_available_extensions where name = 'vector'")
    ).first()
    return found is not None


def upgrade() -> None:
    if not _pgvector_available():
        return
    op.execute("CREATE EXTENSION IF NOT EXISTS vector")
    op.execute("ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS embedding vector")
    op.alter_column("embeddings", "vector", nullable=True)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    has_column = bind.execute(
        sa.text(
            "select 1 from information_schema.columns "
            "where table_name = 'embeddings' and column_name = 'embedding'"
        )
    ).first()
    if has_column is None:
        return
    only_pgvector = bind.execute(
        sa.text("select count(*) from embeddings where vector is null")
    ).scalar_one()
    if only_pgvector:
        raise RuntimeError(
            f"downgrading would lose {only_pgvector} embeddings stored only as pgvector values; "
            "export them (or delete them) first"
        )
    op.execute("ALTER TABLE embeddings DROP COLUMN embedding")
    op.alter_column("embeddings", "vector", nullable=False)
