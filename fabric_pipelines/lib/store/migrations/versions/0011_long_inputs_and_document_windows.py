"""Task sets record their policy for long inputs, and chunked documents their windows.

`long_inputs` is how a set's over-long records were taken (`chunk:<overlap>`, `truncate`,
`fail`; tasks/windows.py); a set stored before this revision has NULL, and its own counts say
which it was (truncated > 0: truncate, else fail). `n_chunked` counts the documents split into
windows and `n_windows` the windows, which are tasks of their own. `document_windows` names each
chunked document's windows (a run of record numbers from WINDOW_BASE up) and its own length, for
combining its vector (lib/results/documents.py); its rows go with their set.

Downgrade: the columns and the table go.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("task_sets") as batch:
        batch.add_column(sa.Column("long_inputs", sa.String(32), nullable=True))
        batch.add_column(
            sa.Column("n_chunked", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("n_windows", sa.BigInteger(), nullable=False, server_default="0")
        )
    op.create_table(
        "document_windows",
        sa.Column(
            "task_set_id",
            sa.Integer(),
            sa.ForeignKey(
                "task_sets.id", ondelete="CASCADE", name="fk_document_windows_task_set_id"
            ),
            primary_key=True,
        ),
        sa.Column("record_no", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("first_window", sa.BigInteger(), nullable=False),
        sa.Column("n_windows", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("document_windows")
    with op.batch_alter_table("task_sets") as batch:
        batch.drop_column("n_windows")
        batch.drop_column("n_chunked")
        batch.drop_column("long_inputs")
