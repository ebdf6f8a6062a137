"""The data root every command works in: DAGSTER_HOME and the offline switches set, the results database opened at the newest schema."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from fabric_pipelines.lib.core.settings import FabricPaths


def prepare_environment() -> Path:
    """Set DAGSTER_HOME (default ./dagster_home) and keep Hugging Face offline."""
    from fabric_pipelines.lib.core.settings import default_root

    root = default_root()
    root.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(root)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    return root


CONNECT_BUDGET_S = 10.0  # how long a command waits for a database that does not answer


def _ping(db: Engine) -> None:
    with db.connect() as conn:
        conn.exec_driver_sql("select 1")


def open_database() -> tuple[FabricPaths, Engine]:
    """The data root's paths and its results database, brought to the newest schema."""
    from sqlalchemy.exc import DBAPIError

    from fabric_pipelines.lib.core.retry import retry
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.store.db import create_schema, make_engine

    paths = FabricPaths(prepare_environment()).ensure()
    db = make_engine(database_url(paths))
    # A database that does not answer at all is said in seconds (cli/errors.py), not after the
    # two minutes a unit of work rides out a server restart for.
    retry("connecting to the results database", lambda: _ping(db), budget_s=CONNECT_BUDGET_S)
    for attempt in range(3):
        try:
            create_schema(db)
            break
        except DBAPIError:
            # Another command was creating the same schema at that moment (two first runs):
            # once its migration commits, this one finds the schema current.
            if attempt == 2:
                raise
            time.sleep(1.0)
    return paths, db
