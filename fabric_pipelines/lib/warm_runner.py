"""The warm runner: a process with Dagster, the definitions, torch and FAISS already imported,
that forks one child per `fabric run` / `fabric submit --run`, so a run starts at once instead of
after the seconds those imports take (4.6 s on a 2-core machine; about 2 s on the GPU machine).

The runner also opens the Dagster instance when its storages are SQLite's (which hold no
connection open between calls, so none is shared across a fork).

The `fabric` command stays the user's process. It connects to the runner's abstract socket and
sends its arguments, environment and folder as one JSON line, with its stdin, stdout and stderr
attached (SCM_RIGHTS). The runner forks; the child makes those descriptors its own 0-2 (so output,
progress bars and colours reach the user's terminal as they would from the command itself),
takes the environment and folder, and runs the CLI's `main` with the same arguments. It answers
{"pid": ...} before anything runs and {"exit": code} at the end; the command exits with that
code. The child dies with its command: a watcher SIGKILLs it if the connection closes before the
exit was sent (as killing the command kills its run), and Ctrl-C in the command reaches it as
SIGINT.

One runner serves one data root, one interpreter, one build of the code and one environment of
the settings read at import (the key below); anything else finds no runner and runs in its own
process, as it always could. A run that ran without a runner starts one for the next (detached,
with the engine pool's idle time; FABRIC_POOL_IDLE_SECONDS=0 or FABRIC_WARM_RUNNER=0 starts
none). The runner never
touches a GPU and never starts a thread before it forks: a forked child inherits only the
forking thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.engine_pool import pid_alive, runs_module, start_detached
from fabric_pipelines.lib.files import write_bytes

RUNNER_MODULE = "fabric_pipelines.lib.warm_runner"
IN_RUNNER = "FABRIC_IN_WARM_RUNNER"  # set in a runner's children: they run, never forward
# Settings read when modules are imported (offline switches, thread counts, devices, paths): a
# runner is only used by a command whose values of these equal the runner's own.
KEYED_PREFIXES = ("FABRIC_", "DAGSTER_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "CUDA_",
                  "NCCL_", "OMP_", "MKL_", "PYTHON", "LD_")  # fmt: skip
KEYED_NAMES = ("PATH", "VIRTUAL_ENV", "HOME")
RUNNER_SETTING = "FABRIC_WARM_RUNNER"  # "0": runs start in their own process, none is left
CONNECT_TIMEOUT_S = 0.5
PID_TIMEOUT_S = 60.0  # a runner that accepted forks at once; longer means it is stuck
MAX_REQUEST_BYTES = 1 << 20


def runner_key(root: Path, env: dict[str, str] | None = None) -> str:
    """What a runner must share with a command to run it: interpreter, data root, the settings
    read at import (from `env`, default this process's), and the code (every module's size and
    mtime, and the compiled runtime's)."""
    env = dict(os.environ) if env is None else env
    digest = hashlib.sha256()
    digest.update(f"{sys.executable}\0{Path(root).resolve()}\0".encode())
    for name in sorted(env):
        if name != IN_RUNNER and (name.startswith(KEYED_PREFIXES) or name in KEYED_NAMES):
            digest.update(f"{name}={env[name]}\0".encode())
    # The code, and the Dagster instance's settings (a runner opened the instance beforehand).
    for path in [*_code_files(), *[p for p in [Path(root) / "dagster.yaml"] if p.is_file()]]:
        stat = path.stat()
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def _code_files() -> list[Path]:
    files: list[Path] = []
    for package in ("fabric_pipelines", "fabric_gpu"):
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            files += sorted(p for p in Path(folder).rglob("*") if p.suffix in (".py", ".so"))
    return files


def enabled() -> bool:
    """Runs go through a warm runner unless FABRIC_WARM_RUNNER=0 (the engine pool's idle time,
    0 also turning it off, is checked by the caller)."""
    return os.environ.get(RUNNER_SETTING, "1").strip() != "0"


def socket_address(key: str) -> str:
    """The runner's abstract socket name (Linux; no file on disk)."""
    return f"\0fabric-runner-{key}"


def state_path(root: Path, key: str, pid: int) -> Path:
    return Path(root) / "pool" / "runners" / f"{key}-{pid}.json"


def runner_states(root: Path) -> list[dict[str, Any]]:
    """The data root's runners whose process lives: {"pid", "key", "started", "serving"} each
    (serving: False while it still imports)."""
    states = []
    for path in sorted((Path(root) / "pool" / "runners").glob("*.json")):
        try:
            state = json.loads(path.read_text())
            pid = int(state["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written at this moment
        if pid_alive(pid) and runs_module(pid, RUNNER_MODULE):
            states.append(state)
    return states


def stop_runners(root: Path) -> list[int]:
    """Ask the data root's runners to exit (runs they started go on); their pids."""
    stopped = []
    for state in runner_states(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(state["pid"]), signal.SIGTERM)
            stopped.append(int(state["pid"]))
    return stopped


# ---- the command's side -------------------------------------------------------------------------


def forward(argv: Sequence[str], root: Path, started_at: float) -> int | None:
    """Run `argv` in a warm runner of this key; its exit code, or None where no runner answered
    before anything ran (the caller then runs the command itself)."""
    if os.environ.get(IN_RUNNER):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        conn.connect(socket_address(runner_key(root)))
    except OSError:
        conn.close()
        return None  # no runner of this key
    # From here a child may run the command: no more falling back on a timeout, which could
    # run it twice. A runner that ends before forking closes the connection (nothing ran).
    conn.settimeout(PID_TIMEOUT_S)
    request = {"argv": list(argv), "env": dict(os.environ), "cwd": os.getcwd(),
               "started_at": started_at}  # fmt: skip
    reader = conn.makefile("rb")
    try:
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        first = reader.readline()  # the child's pid, sent before anything runs
    except TimeoutError:
        conn.close()
        print(f"fabric: the warm runner did not answer within {PID_TIMEOUT_S:.0f} s; "
              "fabric workers stop ends it, FABRIC_WARM_RUNNER=0 runs without it",
              file=sys.stderr)  # fmt: skip
        return 1
    except OSError:
        first = b""
    if not first:
        conn.close()
        return None  # the runner ended before forking: nothing ran
    child = int(json.loads(first)["pid"])
    conn.settimeout(None)

    def pass_on(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        last = reader.readline()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        conn.close()
    if not last:
        print(
            f"fabric: the run's process {child} in the warm runner ended without an exit code "
            "(killed?); see the run in the Dagster UI or `fabric status`",
            file=sys.stderr,
        )
        return 1
    return int(json.loads(last)["exit"])


def start_in_background(
    root: Path, idle_seconds: float, env: dict[str, str]
) -> subprocess.Popen[bytes] | None:
    """Start a runner, detached (it outlives the command), in `env`: the command's environment
    as it started, so that the runner's key is the one the command's next run computes. None
    when the pool is off or a runner of this key already serves."""
    if idle_seconds <= 0 or env.get(IN_RUNNER):
        return None
    key = runner_key(root, env)
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT_S)
        probe.connect(socket_address(key))
        return None  # one serves already
    folder = Path(root) / "pool" / "runners"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", RUNNER_MODULE,
               "--root", str(root), "--key", key, "--idle-seconds", str(idle_seconds)]  # fmt: skip
    return start_detached(command, env, folder / f"{key}.log")


# ---- the runner's side -------------------------------------------------------------------------


def load_everything() -> None:
    """Import what a run needs, build the definitions and open the Dagster instance, on this
    (the only) thread."""
    import dagster as dg

    from fabric_pipelines.lib import preload

    for name in (*preload.pipeline_modules(), *preload.INDEX_MODULES, "fabric_pipelines.cli"):
        importlib.import_module(name)
    from fabric_pipelines.definitions import defs

    instance = dg.DagsterInstance.get()
    # Handed to the children only where its storages hold no connection open between calls
    # (SQLite's open one per call): a pooled connection must never be shared across a fork.
    kept = all(type(storage).__name__.startswith("Sqlite") for storage in _storages(instance))
    preload.use_prepared(defs(), instance if kept else None)


def _storages(instance: Any) -> list[Any]:
    return [instance.run_storage, instance.event_log_storage, instance.schedule_storage]


def serve(root: Path, key: str, idle_seconds: float) -> int:
    """Serve forks of this process until idle for `idle_seconds` with no run in progress."""
    state = state_path(root, key, os.getpid())
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
            listener.bind(socket_address(key))
        except OSError:
            print(f"runner {key}: another runner serves this key; exiting", flush=True)
            return 0
        with listener:
            listener.listen(socket.SOMAXCONN)  # a burst of runs never finds the backlog full
            _write_state(state, key, serving=True)
            print(f"runner {key}: serving (pid {os.getpid()}, idle exit {idle_seconds:g} s)",
                  flush=True)  # fmt: skip
            _serve_forks(listener, key, idle_seconds)
        return 0
    finally:
        with contextlib.suppress(FileNotFoundError):
            state.unlink()


def _write_state(path: Path, key: str, *, serving: bool) -> None:
    state = {"pid": os.getpid(), "key": key, "started": time.time(), "serving": serving}
    write_bytes(path, json.dumps(state).encode())


def _serve_forks(listener: socket.socket, key: str, idle_seconds: float) -> None:
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

    from fabric_pipelines.cli import main
    from fabric_pipelines.lib import run_clock

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

    parser = argparse.ArgumentParser(prog="python -m fabric_pipelines.lib.warm_runner")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--idle-seconds", type=float, required=True)
    return parser.parse_args(argv)


if __name__ == "__main__":
    options = _parse(sys.argv[1:])
    sys.exit(serve(options.root, options.key, options.idle_seconds))
