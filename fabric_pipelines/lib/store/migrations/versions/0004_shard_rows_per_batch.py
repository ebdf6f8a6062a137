"""Hidden-state shard rows keyed by their batch, (plan_id, batch_no), not by their file's sha256.

Shard files are content-addressed, so two task sets whose batches hold the same task ids and
hidden states write one file. Keyed by sha256, the second set's row was dropped and its tasks
looked uncovered. A row describes one ledger batch (a plan id hashes its task set's stored
file, whose bytes name the set, so it belongs to one set); sha256 stays, as an index, and
several rows may share one file.

Upgrade: should an older database hold two rows of one batch (a replay that wrote a second
file), the row with the smaller sha256 is kept; `fabric verify` checks the file it names.
Downgrade: rows that share a file with another row are DELETED (the one with the smallest
(plan_id, batch_no) is kept), since sha256 becomes the key again; `fabric verify` then reports
those batches as having no hidden states, and requeueing them cannot bring them back under the
old key either.

SQLite cannot change a primary key in place: batch_alter_table copies the table.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TABLE = "hidden_state_shards"
PK = "hidden_state_shards_pkey"  # PostgreSQL's name for 0001's unnamed key; kept for both keys
SHA_INDEX = "ix_hidden_state_shards_sha256"  # the name the model's `index=True` gives
# SQLite reflects 0001's key without a name: give it PostgreSQL's, so one drop serves both.
NAMES = {"pk": "%(table_name)s_pkey"}


def upgrade() -> None:
    op.execute(
        f"DELETE FROM {TABLE} WHERE EXISTS (SELECT 1 FROM {TABLE} k "
        f"WHERE k.plan_id = {TABLE}.plan_id AND k.batch_no = {TABLE}.batch_no "
        f"AND k.sha256 < {TABLE}.sha256)"
    )
    with op.batch_alter_table(TABLE, naming_convention=NAMES) as batch:
        batch.drop_constraint(PK, type_="primary")
        batch.create_primary_key(PK, ["plan_id", "batch_no"])
        batch.create_index(SHA_INDEX, ["sha256"])


def downgrade() -> None:
    op.execute(
        f"DELETE FROM {TABLE} WHERE EXISTS (SELECT 1 FROM {TABLE} k "
        f"WHERE k.sha256 = {TABLE}.sha256 AND (k.plan_id < {TABLE}.plan_id "
        f"OR (k.plan_id = {TABLE}.plan_id AND k.batch_no < {TABLE}.batch_no)))"
    )
    with op.batch_alter_table(TABLE, naming_convention=NAMES) as batch:
        batch.drop_index(SHA_INDEX)
        batch.drop_constraint(PK, type_="primary")
        batch.create_primary_key(PK, ["sha256"])
