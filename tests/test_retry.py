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


def test_a_unit_of_work_is_named_by_its_arguments_and_runs_again_whole() -> None:
    from fabric_pipelines.lib.core.retry import current_unit, unit_of_work

    seen: list[tuple[str | None, str]] = []

    @unit_of_work("finishing task set {task_set!r} of {model.key}")
    def finish(task_set: str, model: object, *, fail_first: int = 2) -> str:
        seen.append((current_unit(), task_set))
        if len(seen) <= fail_first:
            raise lost_connection()
        return "finished"

    class Model:
        key = "m@1"

    assert current_unit() is None
    assert finish("s", Model()) == "finished" and len(seen) == 3
    assert {unit for unit, _ in seen} == {"finishing task set 's' of m@1"}
    assert current_unit() is None  # reset after the unit, also after its failures
    assert finish.__name__ == "finish"  # the declaration keeps the function's name


def test_only_the_outermost_unit_retries_so_budgets_do_not_multiply() -> None:
    from fabric_pipelines.lib.core.retry import current_unit, unit_of_work

    inner_calls, outer_calls, units = [], [], []

    @unit_of_work("combining block {n}")
    def combine(n: int) -> None:
        inner_calls.append(n)
        units.append(current_unit())
        if len(inner_calls) == 1:
            raise lost_connection()  # the first attempt of the whole loses its connection

    @unit_of_work("finishing task set {task_set!r}")
    def finish(task_set: str) -> None:
        outer_calls.append(task_set)
        combine(1)
        combine(2)

    finish("s")
    # The inner unit ran once and raised: the outer ran again from its start, once.
    assert outer_calls == ["s", "s"] and inner_calls == [1, 1, 2]
    assert units == ["combining block 1"] * 2 + ["combining block 2"]
    # A unit alone (not inside another) retries itself.
    inner_calls.clear()
    combine(7)
    assert inner_calls == [7, 7]
