"""The warm runner, the runner's side: a process with Dagster, the definitions, torch and FAISS
imported that forks one child per forwarded `fabric` command (see `warm_client` for the whole
story). Run as `python -m fabric_pipelines.cli.warm_server`; nothing imports it."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fabric_pipelines.cli import prepare
from fabric_pipelines.cli.warm_client import (
    IN_RUNNER,
    MAX_REQUEST_BYTES,
    RUNNER_MODULE,
    runner_address,
    runner_key,
    state_path,
)
from fabric_pipelines.lib.core.files import write_bytes
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import INDEX_MODULES


def load_everything() -> None:
    """Import what a run needs, build the definitions and open the Dagster instance, on this
    (the only) thread."""

    for name in (*prepare.pipeline_modules(), *INDEX_MODULES, __package__):
        importlib.import_module(name)
    from fabric_pipelines.definitions import defs

    instance = prepare.dagster_instance()
    # Handed to the children only where its storages hold no connection open between calls
    # (SQLite's open one per call): a pooled connection must never be shared across a fork.
    kept = all(type(storage).__name__.startswith("Sqlite") for storage in _storages(instance))
    prepare.use_prepared(defs(), instance if kept else None)


def _storages(instance: Any) -> list[Any]:
    return [instance.run_storage, instance.event_log_storage, instance.schedule_storage]


def serve(root: Path, key: str, idle_seconds: float) -> int:
    """Serve forks of this process until idle for `idle_seconds` with no run in progress, or
    until its data root is no longer the one it loaded (deleted, perhaps made again)."""
    state = state_path(root, key, os.getpid())
    identity = FabricPaths(root).identity()  # the data root this runner is bound to
    # `fabric workers stop`, loading or serving: exit at once. (An exception raised from the
    # handler could land inside an import and come out as another error.)
    signal.signal(signal.SIGTERM, lambda *_: _exit_now(state))
    try:
        # Said before loading, so that `fabric workers stop` finds a runner still importing.
        _write_state(state, key, serving=False)
        load_everything()
        if key != runner_key(root):  # the code or settings changed while it loaded
            print(f"runner {key}: the code or settings changed while loading; exiting", flush=True)
            return 0
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(runner_address(key))
        except OSError:
            print(f"runner {key}: another runner serves this key; exiting", flush=True)
            return 0
        with listener:
            listener.listen(socket.SOMAXCONN)  # a burst of runs never finds the backlog full
            _write_state(state, key, serving=True)
            print(f"runner {key}: serving (pid {os.getpid()}, idle exit {idle_seconds:g} s)",
                  flush=True)  # fmt: skip
            _serve_forks(listener, key, idle_seconds, FabricPaths(root), identity)
        return 0
    finally:
        with contextlib.suppress(FileNotFoundError):
            state.unlink()


def _write_state(path: Path, key: str, *, serving: bool) -> None:
    state = {"pid": os.getpid(), "key": key, "started": time.time(), "serving": serving}
    write_bytes(path, json.dumps(state).encode())


def _serve_forks(
    listener: socket.socket, key: str, idle_seconds: float, paths: FabricPaths, identity: str
) -> None:
    children: set[int] = set()
    last_active = time.monotonic()
    while True:
        children -= _reaped(children)
        if children:
            last_active = time.monotonic()
        elif time.monotonic() - last_active > idle_seconds:
            print(f"runner {key}: idle {idle_seconds:g} s; exiting", flush=True)
            return
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            continue
        conn, _ = listener.accept()
        if paths.existing_identity() != identity:
            # The root was deleted since this runner loaded (its Dagster instance, the runs'
            # files): the command runs on its own, nothing having run here, and leaves a new
            # runner. The listener goes first, so that the new runner can take the name.
            print(f"runner {key}: its data root {paths.root} is gone or made again; exiting",
                  flush=True)  # fmt: skip
            listener.close()
            conn.close()
            return
        last_active = time.monotonic()
        pid = _fork_for(conn, listener)
        if pid:
            children.add(pid)


def _exit_now(state: Path) -> None:
    """Its state goes, then the process (the socket goes with it; the runs it forked go on)."""
    with contextlib.suppress(FileNotFoundError):
        state.unlink()
    os._exit(0)


def _reaped(children: set[int]) -> set[int]:
    done = set()
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                done.add(pid)
    return done


def _fork_for(conn: socket.socket, listener: socket.socket) -> int | None:
    """Read one request and fork its child; the child's pid (None if the request was bad)."""
    conn.settimeout(5.0)
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 3)
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST_BYTES:
            more = conn.recv(MAX_REQUEST_BYTES)
            if not more:
                break
            data += more
        request = json.loads(data)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors attached, not 3")
    except (OSError, ValueError) as exc:
        print(f"refused a request: {exc}", flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:  # the child: never returns
        listener.close()
        _run_child(conn, request, fds)
    for fd in fds:
        os.close(fd)
    conn.close()
    return pid


def _run_child(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """Become the command: its descriptors, environment and folder; run main(argv); exit."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        # New text streams over the new descriptors (line-buffered on a terminal, as at start).
        old_streams = (sys.stdout, sys.stderr)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        _log_handlers_to(old_streams, sys.stdout, sys.stderr)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[IN_RUNNER] = "1"
        os.chdir(request["cwd"])
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        conn.settimeout(None)
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        finished = threading.Event()
        threading.Thread(
            target=_die_with_the_command, args=(conn, finished), name="command-watch", daemon=True
        ).start()
        code = _main(request["argv"], float(request["started_at"]))
        finished.set()
    except BaseException:  # whatever happened, the command gets an exit code
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        os._exit(code)


def _log_handlers_to(old: tuple[Any, Any], stdout: Any, stderr: Any) -> None:
    """Logging handlers made at import (in the runner) write to the runner's streams: point
    them at the command's."""
    import logging

    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and handler.stream in old:
                handler.setStream(stdout if handler.stream is old[0] else stderr)


def _main(argv: list[str], started_at: float) -> int:
    """The CLI's main, with its exits turned into codes the way the interpreter would."""
    import logging

    from fabric_pipelines.cli import main, run_clock

    try:
        code = main(argv, started_at=started_at)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    run_clock.mark("exited")
    logging.shutdown()
    return code


def _die_with_the_command(conn: socket.socket, finished: threading.Event) -> None:
    """The command's end of the connection closed (it was killed): end this run as its death
    would have."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    if not finished.is_set():
        os.kill(os.getpid(), signal.SIGKILL)


def _parse(argv: Sequence[str]) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {RUNNER_MODULE}")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--idle-seconds", type=float, required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = _parse(sys.argv[1:])
    sys.exit(serve(options.root, options.key, options.idle_seconds))
