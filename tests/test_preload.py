"""Preloading a later step's modules on a thread: they end up imported, and a module that
cannot load is left for the step that needs it to report (the thread does not raise)."""

from __future__ import annotations

import sys
import threading

from fabric_pipelines.lib.preload import preload


def test_preload_imports_the_modules_on_a_thread() -> None:
    sys.modules.pop("fabric_pipelines.lib.charts", None)
    thread = preload(("fabric_pipelines.lib.charts",))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert "fabric_pipelines.lib.charts" in sys.modules


def test_a_module_that_cannot_load_stops_the_preload_quietly() -> None:
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        thread = preload(("fabric_pipelines.no_such_module", "fabric_pipelines.lib.names"))
        thread.join(timeout=60)
    finally:
        threading.excepthook = previous
    assert errors == []
    assert "fabric_pipelines.no_such_module" not in sys.modules
