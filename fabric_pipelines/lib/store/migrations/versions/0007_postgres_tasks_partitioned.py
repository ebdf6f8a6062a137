"""PostgreSQL: `tasks` partitioned by task set, so an ingest keys its ids after writing them.

An ingest of 1 M tasks spent most of its database time in one COPY into `tasks`, each row an
insertion into two B-trees. Now each task set's ids live in a partition of their own, which the
ingest fills and keys itself before attaching it (store/task_partitions.py); the sets ingested
before this revision share one partition. The parent keeps the same columns, primary key and
unique constraint (their names too); task ids now compare byte by byte (COLLATE "C": the same
equality, a faster sort for the unique key). SQLite is unchanged.

Downgrade: one plain table again, every row moved back (in one transaction, which locks each
partition: a database with thousands of large sets may need max_locks_per_transaction raised).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = 'task_set_id integer NOT NULL, record_no bigint NOT NULL, task_id varchar(256) COLLATE "C" NOT NULL'
COLUMNS_BEFORE = COLUMNS.replace(' COLLATE "C"', "")
KEYS = (
    "CONSTRAINT tasks_pkey PRIMARY KEY (task_set_id, record_no), "
    "CONSTRAINT uq_tasks_id UNIQUE (task_set_id, task_id)"
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _set_aside()
    op.execute(f"CREATE TABLE tasks ({COLUMNS}, {KEYS}) PARTITION BY LIST (task_set_id)")
    set_ids = op.get_bind().execute(
        text("SELECT DISTINCT task_set_id FROM tasks_before_0007 ORDER BY 1")
    )
    values = ", ".join(str(int(set_id)) for (set_id,) in set_ids.all())
    if values:
        # Every set ingested before this revision in one partition (one table, whatever their
        # number: a partition each would lock four relations per set in this one transaction).
        # Forgetting one of them deletes its rows (store/task_partitions.py).
        op.execute("CREATE TABLE tasks_before_0007_sets (LIKE tasks)")
        op.execute(
            "INSERT INTO tasks_before_0007_sets "
            "SELECT task_set_id, record_no, task_id FROM tasks_before_0007"
        )
        op.execute(
            "ALTER TABLE tasks_before_0007_sets "
            "ADD CONSTRAINT tasks_before_0007_sets_pkey PRIMARY KEY (task_set_id, record_no), "
            "ADD CONSTRAINT tasks_before_0007_sets_task_id_key UNIQUE (task_set_id, task_id)"
        )
        op.execute(
            f"ALTER TABLE tasks ATTACH PARTITION tasks_before_0007_sets FOR VALUES IN ({values})"
        )
    op.execute("DROP TABLE tasks_before_0007")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _set_aside()
    op.execute(f"CREATE TABLE tasks ({COLUMNS_BEFORE}, {KEYS})")
    op.execute("INSERT INTO tasks SELECT task_set_id, record_no, task_id FROM tasks_before_0007")
    op.execute("DROP TABLE tasks_before_0007")  # a partitioned table takes its partitions along


def _set_aside() -> None:
    """The current `tasks` renamed, its keys too (their names are the new table's)."""
    op.execute("ALTER TABLE tasks RENAME TO tasks_before_0007")
    op.execute(
        "ALTER TABLE tasks_before_0007 RENAME CONSTRAINT tasks_pkey TO tasks_before_0007_pkey"
    )
    op.execute(
        "ALTER TABLE tasks_before_0007 RENAME CONSTRAINT uq_tasks_id TO tasks_before_0007_uq"
    )
