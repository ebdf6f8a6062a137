"""A `fabric` run stops on SIGTERM whatever signal dispositions it inherited, and loses nothing.

A background job of a non-interactive shell starts with SIGINT ignored; Dagster gives SIGTERM
SIGINT's disposition, so before `lib/core/signals.py` such a run ignored `kill` and finished
anyway. Here the run is started with SIGINT ignored, as `nohup fabric ... &` starts it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.worker import MAIN_MODULE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FABRIC = str(Path(sys.executable).parent / "fabric")
TASKS = 20000


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "DAGSTER_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env["FABRIC_POOL_IDLE_SECONDS"] = "0"  # no pool or runner outlives the run: only its own
    env.pop("FABRIC_DATABASE_URL", None)
    env.pop("FABRIC_HOME", None)
    return env


def _workers_of(home: Path) -> list[int]:
    """Worker processes running for this data root (their manifest lies under it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if MAIN_MODULE.encode() in command and str(home).encode() in command:
            found.append(int(proc.name))
    return found


def _workers_gone_then_the_next_run_does_the_rest(
    home: Path, engine: Path, tasks: int, *options: str
) -> None:
    """A stopped run of set "s": its workers end within 15 s, then `fabric run` (with
    `options`) finishes the set, every task once and none failed."""
    deadline = time.monotonic() + 15
    while _workers_of(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workers_of(home) == [], "the run's workers outlived it"
    again = subprocess.run(
        [FABRIC, "run", "s", "--manifest", str(engine), *options],
        env=_env(home), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    status = subprocess.run(
        [FABRIC, "status", "s", "--json"], env=_env(home), capture_output=True, text=True
    )
    (row,) = json.loads(status.stdout)["task_sets"]
    assert row["balanced"] and row["failed"] == 0, row
    assert row["completed"] + row.get("reused", 0) == tasks, row


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_run_started_with_sigint_ignored_stops_on_sigterm_and_the_next_run_finishes_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    home = tmp_path / "home"
    manifest = manifest_for_model(
        str(tiny_model_dir),
        backend="cpu",
        dtype="float32",
        profile=ConsumerProfile(64, 4, 64, 8),
        hooks=HookSpec((), "mean"),
    )  # fmt: skip  (many small batches: a run long enough to stop in the middle)
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(manifest.to_mapping()))
    tasks = tmp_path / "tasks.jsonl"
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    tasks.write_text(
        "".join(
            json.dumps({"id": i, "text": f"{i} " + " ".join(words[: 3 + i % 6] * (1 + i % 4))})
            + "\n"
            for i in range(TASKS)
        )
    )
    run = subprocess.Popen(
        [FABRIC, "submit", str(tasks), "--task-set", "s", "--run", "--manifest", str(engine),
         "--workers", "2"],
        env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=_ignore_sigint,
    )  # fmt: skip
    output = bytearray()

    def read() -> None:
        assert run.stdout is not None
        for chunk in iter(lambda: run.stdout.read1(65536), b""):  # type: ignore[union-attr]
            output.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # Stop it in the middle of extraction: Dagster runs the step (its interrupt handling in
    # place), the workers have done some batches, others are in flight or queued.
    deadline = time.monotonic() + 300
    while b" completed, " not in output and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run.poll() is None and _workers_of(home), (
        "no extraction in progress:\n" + output.decode()
    )
    run.send_signal(signal.SIGTERM)
    try:
        run.wait(timeout=30)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        reader.join()
        pytest.fail("the run went on for 30 s after SIGTERM:\n" + output.decode()[-3000:])
    reader.join()
    text = output.decode()
    assert run.returncode != 0, text[-3000:]
    assert "completed        20,000" not in text, "it finished the set regardless"
    _workers_gone_then_the_next_run_does_the_rest(home, engine, TASKS, "--workers", "2")
    verify = subprocess.run(
        [FABRIC, "verify", "s"], env=_env(home), capture_output=True, text=True, timeout=300
    )
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]


def test_a_run_stopped_while_its_set_is_ingested_and_planned_ahead_stops_at_once(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """SIGTERM as soon as the set is submitted: the ingest and plan started ahead
    (lib/steps/ahead.py) are not waited for, the command ends within seconds with its workers,
    and the next run of the set does it all, exactly once."""
    home = tmp_path / "home"
    manifest = manifest_for_model(
        str(tiny_model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(512, 16, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(manifest.to_mapping()))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": i, "text": f"text {i} of a set stopped early"}) + "\n"
                for i in range(3000))
    )  # fmt: skip
    run = subprocess.Popen(
        [FABRIC, "submit", str(tasks), "--task-set", "s", "--run", "--manifest", str(engine)],
        env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=_ignore_sigint,
    )  # fmt: skip
    assert run.stdout is not None
    seen = b""
    while b"submitted " not in seen:
        line = run.stdout.readline()
        assert line, "the run ended before it submitted the set:\n" + seen.decode()
        seen += line
    run.send_signal(signal.SIGTERM)
    try:
        rest, _ = run.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()
        pytest.fail("the run went on for 30 s after SIGTERM")
    text = (seen + rest).decode()
    assert run.returncode != 0, text[-3000:]
    _workers_gone_then_the_next_run_does_the_rest(home, engine, 3000)


CHILD = """
import signal, sys, time
from fabric_pipelines.lib.core.signals import stop_on_signals
if sys.argv[1] == "fixed":
    stop_on_signals()
from dagster._utils.interrupts import setup_interrupt_handlers
setup_interrupt_handlers()  # what Dagster does: SIGTERM takes SIGINT's disposition
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["inherited", "fixed"])
def test_a_process_that_inherited_ignored_signals_stops_on_sigterm_once_it_asks(mode: str) -> None:
    """Started with SIGINT and SIGTERM ignored (a background job, or a child of a process that
    Dagster made ignore SIGTERM): as it inherited them, SIGTERM does nothing; after
    `stop_on_signals()` it ends the process, Dagster's mapping of SIGTERM to SIGINT included."""

    def ignore_both() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, preexec_fn=ignore_both
    )
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=10)
        stopped = True
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        stopped = False
    assert stopped == (mode == "fixed")
