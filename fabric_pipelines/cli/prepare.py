"""Prepare what a run of the pipeline needs while the run's other work waits: Dagster and the
project's definitions imported and built, the Dagster instance opened (about 2 s on the GPU
machine; the instance's storage is created on a first run: about 1 s). `fabric submit --run` does
it while it launches the workers, opens the database and copies the submitted file (work that
mostly waits on the disk and the kernel, not on the interpreter); a warm runner does it once,
before it forks, and hands the result to its children with `use_prepared`."""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import Future
from typing import Any


def pipeline_modules() -> tuple[str, ...]:
    """Dagster, the definitions and every module under defs/ (what `defs()` loads)."""
    import pkgutil

    from fabric_pipelines import defs

    folder = [name.name for name in pkgutil.iter_modules(defs.__path__)]
    return (
        "dagster",
        "fabric_pipelines.definitions",
        *(f"fabric_pipelines.defs.{name}" for name in sorted(folder)),
        "fabric_pipelines.lib.steps.progress",
    )


_DEFINITIONS: Any = None


_INSTANCE: Any = None


def use_prepared(definitions: Any, instance: Any | None) -> None:
    """Runs in this process (and its forks) take these instead of making them."""
    global _DEFINITIONS, _INSTANCE
    _DEFINITIONS, _INSTANCE = definitions, instance


def dagster_instance() -> Any:
    """`DagsterInstance.get()`, which migrates a fresh DAGSTER_HOME's storage with Alembic: not
    while our own migration runs on another thread (lib/store/schema.py's ALEMBIC_LOCK)."""
    import dagster as dg

    from fabric_pipelines.lib.store.schema import ALEMBIC_LOCK

    with ALEMBIC_LOCK:
        return dg.DagsterInstance.get()


def prepare_pipeline() -> Future[tuple[Any, Any]]:
    """Import, build and open what a run of the pipeline needs, on a daemon thread: the future's
    result is (`defs()`, `DagsterInstance.get()`). DAGSTER_HOME must be set before the call. A
    failure is held in the future; the caller builds them itself then, to report it."""
    prepared: Future[tuple[Any, Any]] = Future()

    def prepare() -> None:
        try:
            for name in pipeline_modules():
                importlib.import_module(name)

            from fabric_pipelines.definitions import defs

            definitions = _DEFINITIONS if _DEFINITIONS is not None else defs()
            instance = _INSTANCE if _INSTANCE is not None else dagster_instance()
            prepared.set_result((definitions, instance))
        except BaseException as exc:  # held for the caller, which builds them again to report it
            prepared.set_exception(exc)

    threading.Thread(target=prepare, name="prepare-pipeline", daemon=True).start()
    return prepared
