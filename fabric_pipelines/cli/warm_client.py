"""The warm runner, the command's side: find a runner of this key and forward a command to it,
start one in the background, list and stop them. The runner itself is `warm_server`.

The warm runner: a process with Dagster, the definitions, torch and FAISS already imported,
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
process, as it always could. It is bound to the data root it loaded (`FabricPaths.identity`):
once the root is deleted (a fresh start), the next command's connection is closed before any
fork, the command runs on its own, and the runner exits. A run that ran without a runner starts
one for the next (detached, with the engine pool's idle time; FABRIC_POOL_IDLE_SECONDS=0 or
FABRIC_WARM_RUNNER=0 starts none). The runner never touches a GPU and never starts a thread
before it forks: a forked child inherits only the forking thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fabric_pipelines.lib.worker.procs import (
    abstract_socket,
    pid_alive,
    runs_module,
    start_detached,
)

# The runner's `python -m` target: started by `start_in_background`, recognised by `runner_states`.
RUNNER_MODULE = f"{__package__}.warm_server"
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


def runner_address(key: str) -> str:
    """The runner's abstract socket name (Linux; no file on disk)."""
    return abstract_socket(f"fabric-runner-{key}")


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
        conn.connect(runner_address(runner_key(root)))
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
        probe.connect(runner_address(key))
        return None  # one serves already
    folder = Path(root) / "pool" / "runners"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", RUNNER_MODULE,
               "--root", str(root), "--key", key, "--idle-seconds", str(idle_seconds)]  # fmt: skip
    return start_detached(command, env, folder / f"{key}.log")
