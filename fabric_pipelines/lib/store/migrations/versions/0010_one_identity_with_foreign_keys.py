"""One identity per entity: tables that named a task set or a model by its name now hold its id,
under a foreign key (a set's failures, plans, ledger rows and shard rows are deleted with it).

Upgrade, in place and keeping every row that refers to something:
1. model keys named anywhere but not yet registered are registered in `models`;
2. rows naming a task set that is no longer stored (or a plan or batch that is gone) are deleted:
   they describe nothing a user can reach, and a foreign key could not hold them;
3. each name column is replaced by the id it names; indexes and the failures' unique key move
   to the id.
Receipts, plans, ledger rows and shard rows of stored sets are kept, row for row.

Downgrade: the names come back from the ids, the foreign keys go.

SQLite cannot add a foreign key to a table: Alembic's batch mode copies each table (with
`PRAGMA foreign_keys` off for the migration, store/schema.py, so a copy cascades nothing).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# (table, the name column it had, the id column it has)
SET_COLUMNS = [
    ("task_failures", "task_set", "task_set_id"),
    ("batch_plans", "task_set", "task_set_id"),
    ("batches", "task_set", "task_set_id"),
    ("hidden_state_shards", "task_set", "task_set_id"),
]
MODEL_COLUMNS = [
    ("batch_plans", "model_key", "model_id"),
    ("hidden_state_shards", "model_key", "model_id"),
    ("index_receipts", "model_key", "model_id"),
    ("engine_speeds", "model_key", "model_id"),
]
# Indexes on a name column (the names SQLAlchemy's index=True gives), rebuilt on the id except
# for the failures', whose unique key leads with the set's id.
NAME_INDEXES = {
    "task_failures": ["task_set"],
    "batch_plans": ["task_set"],
    "batches": ["task_set"],
    "hidden_state_shards": ["task_set"],
    "index_receipts": ["model_key"],
}
ENGINE_INDEX = "ix_engine_speeds_engine"
ENGINE_INDEX_TAIL = ["backend", "layout", "device"]
FAILURES_KEY = "uq_task_failures_record"


def _fk(table: str, column: str) -> str:
    return f"fk_{table}_{column}"  # store/models.py's naming convention


def _delete_orphans() -> None:
    for table, name_column, _ in SET_COLUMNS:
        op.execute(f"DELETE FROM {table} WHERE {name_column} NOT IN (SELECT name FROM task_sets)")
    op.execute("DELETE FROM batches WHERE plan_id NOT IN (SELECT plan_id FROM batch_plans)")
    op.execute(
        "DELETE FROM hidden_state_shards WHERE NOT EXISTS (SELECT 1 FROM batches b WHERE "
        "b.plan_id = hidden_state_shards.plan_id AND b.batch_no = hidden_state_shards.batch_no)"
    )


def _register_model_keys() -> None:
    if op.get_bind().dialect.name == "postgresql":  # ids written by hand leave the sequence behind
        op.execute(
            "SELECT setval(pg_get_serial_sequence('models', 'id'), "
            "coalesce(max(id), 0) + 1, false) FROM models"
        )
    for table, name_column, _ in MODEL_COLUMNS:
        op.execute(
            f"INSERT INTO models (model_key) SELECT DISTINCT {name_column} FROM {table} "
            f"WHERE {name_column} NOT IN (SELECT model_key FROM models)"
        )


def upgrade() -> None:
    _register_model_keys()
    _delete_orphans()
    names = {"task_set_id": ("task_sets", "name"), "model_id": ("models", "model_key")}
    columns = [(*c, "task_set_id") for c in SET_COLUMNS] + [(*c, "model_id") for c in MODEL_COLUMNS]
    for table, name_column, id_column, _ in columns:
        target, target_name = names[id_column]
        op.add_column(table, sa.Column(id_column, sa.Integer(), nullable=True))
        op.execute(
            f"UPDATE {table} SET {id_column} = (SELECT id FROM {target} "
            f"WHERE {target}.{target_name} = {table}.{name_column})"
        )
    with op.batch_alter_table("task_failures") as batch:
        batch.drop_constraint(FAILURES_KEY, type_="unique")
    with op.batch_alter_table("engine_speeds") as batch:
        batch.drop_index(ENGINE_INDEX)
    for table, indexed in NAME_INDEXES.items():
        with op.batch_alter_table(table) as batch:
            for column in indexed:
                batch.drop_index(f"ix_{table}_{column}")
    for table in ("task_failures", "batch_plans", "batches", "hidden_state_shards",
                  "index_receipts", "engine_speeds"):  # fmt: skip
        mine = [c for c in columns if c[0] == table]
        with op.batch_alter_table(table) as batch:
            for _, name_column, id_column, _ in mine:
                batch.drop_column(name_column)
                batch.alter_column(id_column, existing_type=sa.Integer(), nullable=False)
                target = names[id_column][0]
                batch.create_foreign_key(
                    _fk(table, id_column), target, [id_column], ["id"],
                    ondelete="CASCADE" if target == "task_sets" else None,
                )  # fmt: skip
            if table == "batches":
                batch.create_foreign_key(
                    _fk("batches", "plan_id"), "batch_plans", ["plan_id"], ["plan_id"],
                    ondelete="CASCADE",
                )  # fmt: skip
            if table == "hidden_state_shards":
                batch.create_foreign_key(
                    _fk("hidden_state_shards", "plan_id"), "batches", ["plan_id", "batch_no"],
                    ["plan_id", "batch_no"], ondelete="CASCADE",
                )  # fmt: skip
            if table == "task_failures":
                batch.create_unique_constraint(FAILURES_KEY, ["task_set_id", "record_no"])
            for name_column in NAME_INDEXES.get(table, []):
                id_column = "task_set_id" if name_column == "task_set" else "model_id"
                if table != "task_failures":
                    batch.create_index(f"ix_{table}_{id_column}", [id_column])
            if table == "engine_speeds":
                batch.create_index(ENGINE_INDEX, ["model_id", *ENGINE_INDEX_TAIL])


def downgrade() -> None:
    widths = {"task_set": 64, "model_key": 128}
    names = {"task_set_id": ("task_sets", "name"), "model_id": ("models", "model_key")}
    columns = [(*c, "task_set_id") for c in SET_COLUMNS] + [(*c, "model_id") for c in MODEL_COLUMNS]
    for table, name_column, id_column, _ in columns:
        target, target_name = names[id_column]
        op.add_column(table, sa.Column(name_column, sa.String(widths[name_column]), nullable=True))
        op.execute(
            f"UPDATE {table} SET {name_column} = (SELECT {target_name} FROM {target} "
            f"WHERE {target}.id = {table}.{id_column})"
        )
    for table in ("task_failures", "batch_plans", "batches", "hidden_state_shards",
                  "index_receipts", "engine_speeds"):  # fmt: skip
        mine = [c for c in columns if c[0] == table]
        with op.batch_alter_table(table) as batch:
            if table == "task_failures":
                batch.drop_constraint(FAILURES_KEY, type_="unique")
            if table == "engine_speeds":
                batch.drop_index(ENGINE_INDEX)
            if table == "batches":
                batch.drop_constraint(_fk("batches", "plan_id"), type_="foreignkey")
            if table == "hidden_state_shards":
                batch.drop_constraint(_fk("hidden_state_shards", "plan_id"), type_="foreignkey")
            for name_column in NAME_INDEXES.get(table, []):
                id_column = "task_set_id" if name_column == "task_set" else "model_id"
                if table != "task_failures":
                    batch.drop_index(f"ix_{table}_{id_column}")
            for _, name_column, id_column, _ in mine:
                batch.drop_constraint(_fk(table, id_column), type_="foreignkey")
                batch.drop_column(id_column)
                batch.alter_column(
                    name_column, existing_type=sa.String(widths[name_column]), nullable=False
                )
            for column in NAME_INDEXES.get(table, []):
                batch.create_index(f"ix_{table}_{column}", [column])
            if table == "task_failures":
                batch.create_unique_constraint(FAILURES_KEY, ["task_set", "record_no"])
            if table == "engine_speeds":
                batch.create_index(ENGINE_INDEX, ["model_key", *ENGINE_INDEX_TAIL])
