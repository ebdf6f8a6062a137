"""Settling the embeddings table after a run's bulk writes, so that the checks after it are cheap.

Right after a million rows arrive through COPY, PostgreSQL knows none of the table's pages to be
visible to every transaction: a count, or a read of the keys, cannot be answered from the primary
key's index alone and reads the whole heap (vectors are stored inline: 4 GB at 1 M x 768), and
the first reader sets every row's hint bits as it goes. Those are the accounting count and the
verify read at the end of each extraction (2-3 s each at 1 M rows here). One VACUUM (ANALYZE)
reads the heap once, marks it all-visible and refreshes the planner's row estimates; both
queries then read the index only (a tenth of the time).

SQLite has no such state: nothing to do there.
"""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

# VACUUM waits for another VACUUM of the same table (a concurrent run's, or autovacuum that is
# not about to yield): not longer than this. The checks still work without it, only slower.
LOCK_WAIT_MS = 2000


def settle_embeddings(db: Engine) -> bool:
    """VACUUM (ANALYZE) the embeddings table on PostgreSQL; False where nothing was done (SQLite,
    or the table's maintenance lock was held by another session past LOCK_WAIT_MS)."""
    if db.dialect.name != "postgresql":
        return False
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # VACUUM cannot run inside a transaction block: the session-level timeout is reset after.
        conn.execute(text(f"SET lock_timeout = {LOCK_WAIT_MS}"))
        try:
            conn.execute(text("VACUUM (ANALYZE) embeddings"))
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available
                raise
            return False
        finally:
            conn.execute(text("RESET lock_timeout"))
    return True
