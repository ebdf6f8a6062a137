"""Which database errors are transient, and the one retry helper that rides them out."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import exc

from fabric_pipelines.lib.core.retry import GaveUpRetrying, is_transient, retry
from tests.flaky_db import database_locked, lost_connection, undefined_table


def _pg(error_name: str, message: str = "boom") -> Exception:
    from psycopg import errors

    return exc.OperationalError("stmt", {}, getattr(errors, error_name)(message))


@pytest.mark.parametrize(
    "error",
    [
        lost_connection(),
        database_locked(),
        _pg("AdminShutdown", "terminating connection due to administrator command"),
        _pg("SerializationFailure"),
        _pg("DeadlockDetected"),
        _pg("ConnectionFailure"),
        _pg("CannotConnectNow", "the database system is starting up"),
    ],
    ids=["lost", "sqlite-locked", "terminated", "serialization", "deadlock", "08006", "starting"],
)
def test_lost_connections_conflicts_and_locks_are_transient(error: Exception) -> None:
    assert is_transient(error)
    assert is_transient(error.orig)  # type: ignore[attr-defined]  # bare, as raw COPY raises it


@pytest.mark.parametrize(
    "error",
    [
        undefined_table(),
        exc.OperationalError("stmt", {}, sqlite3.OperationalError("no such table: batches")),
        exc.IntegrityError("stmt", {}, sqlite3.IntegrityError("UNIQUE constraint failed")),
        _pg("DiskFull", "could not extend file"),
        _pg("QueryCanceled", "canceling statement due to statement timeout"),
        ValueError("not a database error"),
    ],
    ids=["undefined-table", "sqlite-no-table", "duplicate", "disk-full", "cancelled", "other"],
)
def test_bugs_and_bad_data_are_not_transient(error: Exception) -> None:
    assert not is_transient(error)


def test_a_dropped_connection_counts_however_it_is_wrapped() -> None:
    error = exc.DBAPIError("stmt", {}, Exception("gone"), connection_invalidated=True)
    assert is_transient(error)


def test_retry_rides_out_transient_errors_then_returns() -> None:
    calls, retried, slept = [], [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) <= 3:
            raise lost_connection()
        return "done"

    result = retry("claiming", flaky, on_retry=retried.append, sleep=slept.append)
    assert result == "done" and len(calls) == 4 and len(retried) == 3
    assert slept[0] <= 0.1 and slept[0] < slept[2] <= 0.4  # back-off doubles (with jitter)


def test_retry_raises_a_non_transient_error_at_once() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise undefined_table()

    with pytest.raises(exc.ProgrammingError, match="nowhere"):
        retry("claiming", broken, sleep=lambda _s: None)
    assert len(calls) == 1


def test_retry_gives_up_naming_the_operation_attempts_and_time() -> None:
    def down() -> None:
        raise lost_connection()

    with pytest.raises(GaveUpRetrying, match=r"gave up claiming batches after 4 attempts over"):
        retry("claiming batches", down, attempts=4, sleep=lambda _s: None)
    with pytest.raises(GaveUpRetrying, match=r"after 1 attempts .* server closed the connection"):
        retry("claiming batches", down, budget_s=0.0)  # the budget is spent before a wait
