"""Links between a reused task and the task whose result it reads (`reused_results`), as the
store keeps them whole: a row that other sets' tasks read is never deleted with its own set.

Planning makes the links (broker/reuse.py); here is what keeps them valid when a set is
forgotten (tasks/catalog.forget_task_set). A link naming its own task (a self-link) marks a row
that task adopted from a forgotten set: it has a row of its own, computed by no batch of its set.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

# A (set id, record number) pair as one integer, for MIN() over tasks: record numbers stay below
# WINDOW_BASE (2**39), so 2**40 keeps them apart.
PAIR_STRIDE = 2**40


def hand_over_results(conn: Connection, set_id: int) -> int:
    """Before a set is forgotten: each of its rows that other sets' tasks are linked to moves to
    one of those tasks (the lowest set id, then record number), the heir, and every link to it
    follows it there; how many rows moved. Nothing else is read or copied. Links to a row that is
    already gone stay as they are: planning their set drops them (broker/reuse.py).

    The heir's own link then names the heir itself: a self-link marks a row its task adopted,
    computed by no batch of its own set (maintenance/verify.py counts them so)."""
    s = PAIR_STRIDE
    own = (
        "NOT EXISTS (SELECT 1 FROM embeddings t WHERE t.model_id = r.model_id "
        "AND t.task_set_id = r.task_set_id AND t.record_no = r.record_no)"
    )
    conn.execute(text("DROP TABLE IF EXISTS fabric_heirs"))
    conn.execute(
        text(
            "CREATE TEMPORARY TABLE fabric_heirs AS "
            f"SELECT r.model_id, r.from_record_no, min(r.task_set_id * {s} + r.record_no) AS heir "
            f"FROM reused_results r WHERE r.from_task_set_id = :set AND r.task_set_id <> :set "
            f"AND {own} AND EXISTS (SELECT 1 FROM embeddings s WHERE s.model_id = r.model_id "
            "AND s.task_set_id = r.from_task_set_id AND s.record_no = r.from_record_no) "
            "GROUP BY r.model_id, r.from_record_no"
        ),
        {"set": set_id},
    )
    # The keys of those rows are owned by their heirs now.
    conn.execute(
        text(
            f"UPDATE result_keys SET task_set_id = (SELECT h.heir / {s} FROM fabric_heirs h "
            "WHERE h.model_id = result_keys.model_id AND h.from_record_no = result_keys.record_no), "
            f"record_no = (SELECT h.heir % {s} FROM fabric_heirs h "
            "WHERE h.model_id = result_keys.model_id AND h.from_record_no = result_keys.record_no) "
            "WHERE task_set_id = :set AND EXISTS (SELECT 1 FROM fabric_heirs h "
            "WHERE h.model_id = result_keys.model_id AND h.from_record_no = result_keys.record_no)"
        ),
        {"set": set_id},
    )
    moved = conn.execute(
        text(
            f"UPDATE embeddings SET task_set_id = (SELECT h.heir / {s} FROM fabric_heirs h "
            "WHERE h.model_id = embeddings.model_id AND h.from_record_no = embeddings.record_no), "
            f"record_no = (SELECT h.heir % {s} FROM fabric_heirs h "
            "WHERE h.model_id = embeddings.model_id AND h.from_record_no = embeddings.record_no) "
            "WHERE task_set_id = :set AND EXISTS (SELECT 1 FROM fabric_heirs h "
            "WHERE h.model_id = embeddings.model_id AND h.from_record_no = embeddings.record_no)"
        ),
        {"set": set_id},
    ).rowcount
    conn.execute(
        text(
            f"UPDATE reused_results SET from_task_set_id = (SELECT h.heir / {s} "
            "FROM fabric_heirs h WHERE h.model_id = reused_results.model_id "
            "AND h.from_record_no = reused_results.from_record_no), "
            f"from_record_no = (SELECT h.heir % {s} FROM fabric_heirs h "
            "WHERE h.model_id = reused_results.model_id "
            "AND h.from_record_no = reused_results.from_record_no) "
            "WHERE from_task_set_id = :set AND task_set_id <> :set AND EXISTS (SELECT 1 "
            "FROM fabric_heirs h WHERE h.model_id = reused_results.model_id "
            "AND h.from_record_no = reused_results.from_record_no)"
        ),
        {"set": set_id},
    )
    conn.execute(text("DROP TABLE fabric_heirs"))
    return int(moved or 0)


def sets_reading_hidden_states(conn: Connection, set_id: int) -> list[str]:
    """The other sets whose tasks reuse a result of this set that has hidden states (the set
    holds shard rows of the link's model): the names, sorted. Their tasks read those states
    from this set's shard files, which go with it, so it is not forgotten before them."""
    rows = conn.execute(
        text(
            "SELECT DISTINCT s.name FROM reused_results r JOIN task_sets s ON s.id = r.task_set_id "
            "WHERE r.from_task_set_id = :set AND r.task_set_id <> :set "
            "AND EXISTS (SELECT 1 FROM hidden_state_shards h WHERE h.task_set_id = :set "
            "AND h.model_id = r.model_id) ORDER BY s.name"
        ),
        {"set": set_id},
    )
    return [str(name) for (name,) in rows]
