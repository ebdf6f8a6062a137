"""The warm engine pool: the client runs use, the server process that keeps an engine loaded
between runs, and a run's hand-off to it."""

# The server's `python -m` target: the client starts it and recognises its processes by it.
SERVER_MODULE = f"{__name__}.server"
