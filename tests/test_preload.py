"""Preloading a later step's modules on a thread: they end up imported, and a module that
cannot load is left for the step that needs it to report (the thread does not raise)."""

from __future__ import annotations

import subprocess
import sys
import threading

from fabric_pipelines.cli.prepare import pipeline_modules
from fabric_pipelines.lib.core.preload import preload


def test_preload_imports_the_modules_on_a_thread() -> None:
    sys.modules.pop("fabric_pipelines.lib.core.charts", None)
    thread = preload(("fabric_pipelines.lib.core.charts",))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "fabric_pipelines.lib.core.charts" in sys.modules


def test_a_module_that_cannot_load_stops_the_preload_quietly() -> None:
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        thread = preload(("fabric_pipelines.no_such_module", "fabric_pipelines.lib.core.names"))
        thread.join(timeout=60)
    finally:
        threading.excepthook = previous
    assert errors == []
    assert "fabric_pipelines.no_such_module" not in sys.modules


def test_pipeline_modules_are_what_loading_the_definitions_imports() -> None:
    # A fresh process: the modules `defs()` imports under fabric_pipelines.defs are all named
    # by pipeline_modules(), so `fabric submit --run` preloads everything the run then needs.
    code = (
        "import sys; from fabric_pipelines.definitions import defs; defs(); "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('fabric_pipelines.defs.'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert loaded
    assert set(loaded) <= set(pipeline_modules())
