"""Process helpers shared by the engine pool and the warm runner: is a pid alive and running our
module, start a detached process, abstract socket names and the one-JSON-object-per-line
protocol both speak."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any


def abstract_socket(name: str) -> str:
    """The abstract Unix socket address for `name` (Linux; no file on disk to go stale, and the
    name exists exactly as long as the listening process does)."""
    return f"\0{name}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not serving anything.
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return status.rsplit(")", 1)[-1].split()[0] != "Z"


def runs_module(pid: int, module: str) -> bool:
    """Whether `pid` runs `python -m module`: a dead process's state file may name a pid the
    system has since given to another process, which must never be signalled."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc here: the pid check alone
    return module.encode() in command


def start_detached(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `command` in a session of its own (it outlives its caller), output to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def remove_state_if_pid(path: Path, pid: int) -> None:
    """Remove a state file only if it still names `pid` (a new worker may have replaced it)."""
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def send_message(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def read_message(conn: socket.socket) -> dict[str, Any]:
    """One newline-terminated JSON object; ConnectionError when the peer closed first."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {type(message).__name__}")
    return message
