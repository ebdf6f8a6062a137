"""Where the product keeps its files and which database it talks to.

Everything lives under one data root, by default DAGSTER_HOME (the repository's dagster_home/):
the embedded SQLite database, the inbox, the stored task sets, batch plans, hidden-state shards,
indexes and receipts. FABRIC_DATABASE_URL points results at PostgreSQL instead of SQLite.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url


def default_root() -> Path:
    for var in ("FABRIC_HOME", "DAGSTER_HOME"):
        value = os.environ.get(var)
        if value:
            return Path(value).expanduser().resolve()
    return (Path.cwd() / "dagster_home").resolve()


@dataclass(frozen=True)
class FabricPaths:
    root: Path

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def task_sets(self) -> Path:
        return self.root / "task_sets"

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def indexes(self) -> Path:
        return self.root / "indexes"

    @property
    def receipts(self) -> Path:
        return self.root / "receipts"

    @property
    def device_leases(self) -> Path:
        return self.root / "device-leases"

    @property
    def sqlite_path(self) -> Path:
        return self.root / "fabric.db"

    @property
    def identity_path(self) -> Path:
        return self.root / "identity"

    def identity(self) -> str:
        """The data root's identity: a random id made at its first use (`identity`). The warm
        pool and runner keep the one they started with, so a root deleted and made again (a
        fresh start) is never served by processes bound to the old one."""
        from fabric_pipelines.lib.core.files import write_once

        return write_once(self.identity_path, uuid.uuid4().hex.encode()).decode().strip()

    def existing_identity(self) -> str | None:
        """The identity if the root has one (None: deleted, or never used); makes none."""
        try:
            return self.identity_path.read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def ensure(self) -> FabricPaths:
        for path in (
            self.inbox,
            self.task_sets,
            self.plans,
            self.shards,
            self.indexes,
            self.receipts,
        ):
            path.mkdir(parents=True, exist_ok=True)
        return self


OFF_VALUES = frozenset({"0", "off", "false", "no"})


def switched_on(variable: str) -> bool:
    """An on-by-default switch from the environment: on unless "off", "0", "false" or "no"."""
    return os.environ.get(variable, "on").strip().lower() not in OFF_VALUES


def database_url(paths: FabricPaths, explicit: str | None = None) -> str:
    """FABRIC_DATABASE_URL (or `explicit`), else the embedded SQLite file under the data root."""
    url = explicit or os.environ.get("FABRIC_DATABASE_URL")
    if url:
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            # psycopg 3 is the driver; a bare postgresql:// would ask SQLAlchemy for psycopg2.
            url = "postgresql+psycopg://" + url.split("://", 1)[1]
        return url
    return f"sqlite:///{paths.sqlite_path}"


def redact_url(url: str) -> str:
    """The URL with any password masked: safe for logs, metadata and receipts."""
    return make_url(url).render_as_string(hide_password=True)
