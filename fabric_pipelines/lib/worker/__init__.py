"""The extraction worker: `launch` (the parent side: start, supervise, stop), `main` (the child
process), `loop` (claim, submit, write), prestarted workers, devices, process helpers and the warm
engine pool (`pool`). Imports the floors below it, never `steps`."""

# The worker process's `python -m` target: `launch` starts it and recognises its processes by it.
MAIN_MODULE = f"{__name__}.main"
