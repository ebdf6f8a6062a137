"""Alembic keeps a running migration's state in module globals: our schema upgrade and Dagster
opening a fresh instance (which stamps its SQLite storage with Alembic) on two threads of one
process, as `fabric submit --run` does on a fresh data root, must not pull it from under each
other (it did: KeyError 'script' from alembic's proxies, the command failing at random)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from fabric_pipelines.cli.prepare import dagster_instance
from fabric_pipelines.lib.store.db import create_schema, make_engine


@pytest.mark.timeout(240)
def test_our_migration_and_a_fresh_dagster_instance_on_two_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors: list[BaseException] = []
    for i in range(6):
        home = tmp_path / f"home{i}"
        home.mkdir()
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        engine = make_engine(f"sqlite:///{home / 'fabric.db'}")
        start = threading.Barrier(2)

        def ours(engine: object = engine, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                create_schema(engine)  # type: ignore[arg-type]
            except BaseException as exc:
                errors.append(exc)

        def dagsters(start: threading.Barrier = start) -> None:
            start.wait()
            try:
                dagster_instance().dispose()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ours), threading.Thread(target=dagsters)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        engine.dispose()
        assert (home / "fabric.db").exists() and os.listdir(home)
    assert not errors, [repr(e) for e in errors]
