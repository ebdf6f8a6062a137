"""What a user or their environment got wrong, said in one line with what to do, instead of a
traceback: a database that does not answer (its URL's password masked). Anything else is a bug
and keeps its traceback."""

from __future__ import annotations

import os


def environment_error(error: BaseException) -> str | None:
    """The one-line message for `error`, or None when it is not the user's or environment's."""
    from sqlalchemy import exc

    from fabric_pipelines.lib.core.retry import GaveUpRetrying, is_transient

    if isinstance(error, GaveUpRetrying) or (
        isinstance(error, exc.DBAPIError) and is_transient(error)
    ):
        cause = error.__cause__ if isinstance(error, GaveUpRetrying) else error
        detail = str(getattr(cause, "orig", None) or cause).strip().splitlines()
        return (
            f"the results database {_database()} did not answer"
            f" ({detail[0] if detail else type(cause).__name__}): check that it is running and "
            "reachable, or point FABRIC_DATABASE_URL at one that is"
        )
    return None


def _database() -> str:
    from fabric_pipelines.lib.core.settings import (
        FabricPaths,
        database_url,
        default_root,
        redact_url,
    )

    url = os.environ.get("FABRIC_DATABASE_URL") or database_url(FabricPaths(default_root()))
    try:
        return redact_url(url)
    except Exception:  # not even a URL: say nothing of it rather than echo a password
        return "(FABRIC_DATABASE_URL)"
