"""Import what a later step needs while this process waits on something else.

The index build needs torch and FAISS (seconds to import). The extraction step spends its time
waiting for worker processes, so it imports them then, on a daemon thread, and the index step
that follows in the same process (`fabric run`, `fabric submit --run`) finds them loaded.

Likewise `fabric submit --run` imports Dagster and the project's definitions (about 2 s on the
GPU machine), builds them and opens the Dagster instance (its storage is created on a first run:
about 1 s) while it launches the workers, opens the database and copies the submitted file
(work that mostly waits on the disk and the kernel, not on the interpreter). Importing the index
step's modules there too was tried on the H200: the run's start then waited about 1.2 s longer
for the interpreter (a small job on a warm pool gained nothing).

The CUDA context is left to the index step. Made here, it is made while the workers make
theirs: on an H200 (with the workers also opening theirs early) their engines came up about 4 s
later. In a process that never builds an index, preloading costs only idle CPU time; a failure
here is left for the step that needs the module to report.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from concurrent.futures import Future
from typing import Any

INDEX_MODULES = ("fabric_pipelines.lib.index.publish",)


def pipeline_modules() -> tuple[str, ...]:
    """Dagster, the definitions and every module under defs/ (what `defs()` loads)."""
    import pkgutil

    from fabric_pipelines import defs

    folder = [name.name for name in pkgutil.iter_modules(defs.__path__)]
    return (
        "dagster",
        "fabric_pipelines.definitions",
        *(f"fabric_pipelines.defs.{name}" for name in sorted(folder)),
        "fabric_pipelines.lib.progress",
    )


def preload(modules: tuple[str, ...]) -> threading.Thread:
    """Import `modules` on a daemon thread; returns it, already started."""

    def load() -> None:
        with contextlib.suppress(Exception):
            for name in modules:
                importlib.import_module(name)

    thread = threading.Thread(target=load, name="preload", daemon=True)
    thread.start()
    return thread


# Made once by a warm runner (lib/warm_runner.py) before it forks; None: made by each run.
_DEFINITIONS: Any = None
_INSTANCE: Any = None


def use_prepared(definitions: Any, instance: Any | None) -> None:
    """Runs in this process (and its forks) take these instead of making them."""
    global _DEFINITIONS, _INSTANCE
    _DEFINITIONS, _INSTANCE = definitions, instance


def prepare_pipeline() -> Future[tuple[Any, Any]]:
    """Import, build and open what a run of the pipeline needs, on a daemon thread: the future's
    result is (`defs()`, `DagsterInstance.get()`). DAGSTER_HOME must be set before the call. A
    failure is held in the future; the caller builds them itself then, to report it."""
    prepared: Future[tuple[Any, Any]] = Future()

    def prepare() -> None:
        try:
            for name in pipeline_modules():
                importlib.import_module(name)
            import dagster as dg

            from fabric_pipelines.definitions import defs

            definitions = _DEFINITIONS if _DEFINITIONS is not None else defs()
            instance = _INSTANCE if _INSTANCE is not None else dg.DagsterInstance.get()
            prepared.set_result((definitions, instance))
        except BaseException as exc:  # held for the caller, which builds them again to report it
            prepared.set_exception(exc)

    threading.Thread(target=prepare, name="prepare-pipeline", daemon=True).start()
    return prepared
