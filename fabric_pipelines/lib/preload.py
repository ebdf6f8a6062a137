"""Import what a later step needs while this process waits on something else.

The index build needs torch and FAISS (seconds to import) and, on a GPU machine, a CUDA context
(a second more). The extraction step spends its time waiting for worker processes, so it loads
them then, on a daemon thread, and the index step that follows in the same process (`fabric
run`, `fabric submit --run`) finds them ready. In a process that never builds an index this
costs only idle CPU time; a failure here is left for the step that needs the module to report.
"""

from __future__ import annotations

import contextlib
import importlib
import threading

INDEX_MODULES = ("fabric_pipelines.lib.index.publish",)


def preload(modules: tuple[str, ...], cuda: bool = False) -> threading.Thread:
    """Import `modules` (then create torch's CUDA context, when `cuda` and a GPU is there) on
    a daemon thread; returns it, already started."""

    def load() -> None:
        with contextlib.suppress(Exception):
            for name in modules:
                importlib.import_module(name)
            if cuda:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.init()

    thread = threading.Thread(target=load, name="preload", daemon=True)
    thread.start()
    return thread
