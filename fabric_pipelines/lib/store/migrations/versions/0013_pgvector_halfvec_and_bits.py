"""float16 and binary output variants in pgvector's own columns, where pgvector is 0.7 or newer.

Chosen at run time, as 0002 is: on SQLite, on a server without pgvector and on one whose
installed extension is older than 0.7 (no `halfvec`, no Hamming operators) this revision changes
nothing and those variants stay bytes in `vector`. With it, `embedding_half halfvec` holds a
`float16` key's rows and `embedding_bits bit varying` a `binary` key's packed sign bits (their
bit length is 8 per stored byte: a width that is not a multiple of 8 ends in zero bits, which
leave Hamming distances unchanged), so both can be searched in SQL (`<->`, `<~>`). The writer
fills exactly one of `vector`, `embedding`, `embedding_half`, `embedding_bits` per row.

Downgrade: refused while a row is stored only in one of the two columns (export it first).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

COLUMNS = ("embedding_half", "embedding_bits")


def _installed_pgvector() -> tuple[int, ...] | None:
    """The version of pgvector installed in this database (by 0002), or None."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return None
    version = bind.execute(
        sa.text("select extversion from pg_extension where extname = 'vector'")
    ).scalar()
    if version is None:
        return None
    return tuple(int(part) for part in str(version).split(".") if part.isdigit())


def upgrade() -> None:
    version = _installed_pgvector()
    if version is None or version < (0, 7):
        return
    op.execute("ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS embedding_half halfvec")
    op.execute("ALTER TABLE embeddings ADD COLUMN IF NOT EXISTS embedding_bits bit varying")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    present = [
        name
        for name in COLUMNS
        if bind.execute(
            sa.text(
                "select 1 from information_schema.columns where table_schema = current_schema() "
                "and table_name = 'embeddings' and column_name = :name"
            ),
            {"name": name},
        ).first()
    ]
    for name in present:
        held = bind.execute(sa.text(f"select count(*) from embeddings where {name} is not null"))
        if held.scalar_one():
            raise RuntimeError(
                f"downgrading would lose the embeddings stored only in {name}; "
                "export them (fabric export) or delete them first"
            )
    for name in present:
        op.execute(f"ALTER TABLE embeddings DROP COLUMN {name}")
