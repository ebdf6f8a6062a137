"""Import what a later step needs while this process waits on something else.

The index build needs torch and FAISS (seconds to import). The extraction step spends its time
waiting for worker processes, so it imports them then, on a daemon thread, and the index step
that follows in the same process (`fabric run`, `fabric submit --run`) finds them loaded.

(Dagster and the definitions are prepared the same way by the CLI: `fabric_pipelines.cli.prepare`.
Importing the index step's modules there too makes a run's start wait longer for the interpreter:
about 1.2 s on the H200, and a small job on a warm pool gained nothing.)

The CUDA context is left to the index step. Made here, it is made while the workers make
theirs: on an H200 (with the workers also opening theirs early) their engines came up about 4 s
later. In a process that never builds an index, preloading costs only idle CPU time; a failure
here is left for the step that needs the module to report.
"""

from __future__ import annotations

import contextlib
import importlib
import threading


def preload(modules: tuple[str, ...]) -> threading.Thread:
    """Import `modules` on a daemon thread; returns it, already started."""

    def load() -> None:
        with contextlib.suppress(Exception):
            for name in modules:
                importlib.import_module(name)

    thread = threading.Thread(target=load, name="preload", daemon=True)
    thread.start()
    return thread
