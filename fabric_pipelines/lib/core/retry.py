"""Retrying a database operation through transient errors, and only those.

Transient: a lost or refused connection (the server restarted, a backend was terminated, the
network dropped), a PostgreSQL serialization failure or deadlock, an SQLite "database is locked".
Anything else (a bad statement, a constraint, a missing table) is a bug or bad data and is raised
at once. Each attempt must be a whole transaction (the callable opens its own), so running it
again is safe; an attempt whose commit reply was lost may have committed, which the caller's
operation must tolerate (the ledger's epoch fence and the writer's replay do).

One level retries: a `retry` inside another (a function declared a `unit_of_work` calling
another, say) runs its attempt once and lets the outermost unit run the whole again, so budgets
do not multiply and a unit is never half redone. Units are per thread: a thread a unit starts
runs its own.

Back-off doubles from `first_backoff_s` up to `max_backoff_s` (with jitter, so workers cut off
together do not come back together) until `budget_s` is spent; then `GaveUpRetrying` names the
operation, the attempts and the time it tried.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar, cast

from sqlalchemy import exc

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 120.0
# PostgreSQL SQLSTATEs worth another attempt (class 08, connection exceptions, is matched whole):
# serialization failure, deadlock, the backend terminated or the server shutting down or starting,
# too many connections, a session ended for idling inside its transaction.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "57P01", "57P02", "57P03", "53300", "25P03"})


# The unit of work running now in this thread, named by its operation (None: outside any unit).
# Log lines and the fault drills read it; a statement outside every unit has no retry.
_UNIT: ContextVar[str | None] = ContextVar("fabric_retry_unit", default=None)


def current_unit() -> str | None:
    """The operation of the innermost `retry` running in this thread, if any."""
    return _UNIT.get()


@contextmanager
def _running_unit(operation: str) -> Iterator[None]:
    token = _UNIT.set(operation)
    try:
        yield
    finally:
        _UNIT.reset(token)


class GaveUpRetrying(RuntimeError):
    """The database stayed unavailable for the whole retry budget."""


def _psycopg_error() -> tuple[type[BaseException], ...]:
    try:
        import psycopg

        return (psycopg.Error,)
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return ()


def is_transient(error: BaseException) -> bool:
    """A database error that another attempt may not meet (see the module docstring)."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    # SQLAlchemy wraps the driver's error; raw driver calls (COPY) raise it bare.
    cause = error.orig if isinstance(error, exc.DBAPIError) and error.orig is not None else error
    psycopg_error = _psycopg_error()
    if psycopg_error and isinstance(cause, psycopg_error):
        import psycopg

        sqlstate = getattr(cause, "sqlstate", None)
        if sqlstate:
            return sqlstate.startswith("08") or sqlstate in TRANSIENT_SQLSTATES
        # No SQLSTATE: the client lost or never got its connection (refused, closed, reset).
        return isinstance(cause, psycopg.OperationalError)
    if isinstance(cause, sqlite3.OperationalError):
        message = str(cause).lower()
        return "database is locked" in message or "database table is locked" in message
    return isinstance(error, exc.DisconnectionError)


def retry(
    operation: str,
    attempt: Callable[[], T],
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    attempts: int | None = None,
    first_backoff_s: float = 0.1,
    max_backoff_s: float = 5.0,
    on_retry: Callable[[BaseException], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    gave_up: type[GaveUpRetrying] = GaveUpRetrying,
) -> T:
    """`attempt()`, again after each transient error, until it succeeds or `budget_s` (and, if
    given, `attempts`) run out. `operation` completes "gave up ..." in the final error, e.g.
    "claiming batches of plan 1a2b"."""
    if current_unit() is not None:  # inside a larger unit: that one runs the whole again
        with _running_unit(operation):
            return attempt()
    started = time.monotonic()
    delay = first_backoff_s
    tried = 0
    while True:
        tried += 1
        try:
            with _running_unit(operation):
                return attempt()
        except Exception as error:
            if not is_transient(error):
                raise
            elapsed = time.monotonic() - started
            wait = delay * random.uniform(0.5, 1.0)
            if (attempts is not None and tried >= attempts) or elapsed + wait > budget_s:
                raise gave_up(
                    f"gave up {operation} after {tried} attempts over {elapsed:.1f} s: the "
                    f"database stayed unreachable or busy (last error: {error}); check that it "
                    "is up and reachable, then run the step again"
                ) from error
            log.warning(
                "%s: transient database error (attempt %d, retrying in %.2f s): %s",
                operation, tried, wait, str(error).splitlines()[0] if str(error) else error,
            )  # fmt: skip
            if on_retry is not None:
                on_retry(error)
            sleep(wait)
            delay = min(delay * 2, max_backoff_s)


def unit_of_work(operation: str) -> Callable[[F], F]:
    """Declare a function a unit of work: idempotent as a whole, so it is run again (`retry`)
    after a transient database error. `operation` names it in logs and in the final error,
    formatted with the call's arguments: `@unit_of_work("planning task set {task_set!r}")`."""

    def declare(function: F) -> F:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return retry(operation.format(**bound.arguments), lambda: function(*args, **kwargs))

        return cast(F, run)

    return declare
