"""The warm runner: a run started without one leaves one; the next `fabric` run is served by it
(its output on the command's own stdout, its exit code the command's), also two at once; a
command killed mid-run takes its run with it and the set then completes exactly once; a failing
command fails the same through the runner; `fabric workers stop` ends it; its key follows the
settings and the code.

Real `fabric` commands in subprocesses, on the embedded default (SQLite, CPU engine, the real
all-MiniLM-L6-v2), against a real runner process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef
from sqlalchemy import func, select

from fabric_pipelines.cli import warm_client
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.core.settings import FabricPaths, database_url
from fabric_pipelines.lib.store.db import make_engine
from fabric_pipelines.lib.store.models import Embedding

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _write_set(path: Path, name: str, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"id": f"{name}-{i}", "text": f"Note {i} of {name} is about topic {i % 9}."})
            + "\n"
            for i in range(n)
        )
    )
    return path


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "home"
    yield root
    warm_client.stop_runners(root)
    subprocess.run([sys.executable, "-m", "fabric_pipelines.cli", "workers", "stop"],
                   env=_env(root), capture_output=True, timeout=60)  # fmt: skip


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "FABRIC_HOME": str(root), "HF_HUB_OFFLINE": "1"}
    env.pop("FABRIC_DATABASE_URL", None)
    env.pop("DAGSTER_HOME", None)
    env["FABRIC_POOL_IDLE_SECONDS"] = "300"  # the pool and the runner on (tests default to off)
    return {**env, **extra}


def _fabric(root: Path, *args: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fabric_pipelines.cli", *args],
        env=_env(root, **extra), cwd=root.parent, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _finish(command: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = command.communicate(timeout=600)
    return command.returncode, out, err


def _serving_runner(root: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        serving = [state for state in warm_client.runner_states(root) if state["serving"]]
        if serving:
            return int(serving[0]["pid"])
        time.sleep(0.5)
    logs = "".join(p.read_text() for p in (root / "pool" / "runners").glob("*.log"))
    raise AssertionError(f"no warm runner served within {timeout:.0f} s; its log:\n{logs}")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _report(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_runs_after_the_first_are_served_by_a_warm_runner(home: Path, tmp_path: Path) -> None:
    first = _fabric(home, "submit", str(_write_set(tmp_path / "a.jsonl", "a", 40)),
                    "--task-set", "a", "--run", "--report", str(tmp_path / "a.json"))  # fmt: skip
    code, out, err = _finish(first)
    assert code == 0, out + err
    assert _report(tmp_path / "a.json")["process"]["warm_runner"] is False
    runner = _serving_runner(home)

    # Served: the run is the runner's child, its output is on the command's stdout.
    second = _fabric(home, "submit", str(_write_set(tmp_path / "b.jsonl", "b", 40)),
                     "--task-set", "b", "--run", "--report", str(tmp_path / "b.json"))  # fmt: skip
    code, out, err = _finish(second)
    assert code == 0, out + err
    report = _report(tmp_path / "b.json")
    assert report["process"]["warm_runner"] is True and report["process"]["pid"] != second.pid
    assert "wall time" in out and "receipt sha256" in out
    assert report["clock"]["marks"]["cli_started"] < report["clock"]["marks"]["submitted"]
    # Its runs are recorded in the data root's Dagster instance (the runner opened it once).
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        for run_id in report["run_ids"]:
            run = instance.get_run_by_id(run_id)
            assert run is not None and run.is_success, run_id

    # Two at once through one runner: each set done exactly once.
    sets = {n: str(_write_set(tmp_path / f"{n}.jsonl", n, 60)) for n in ("c", "d")}
    both = [_fabric(home, "submit", sets[n], "--task-set", n, "--run") for n in sets]
    for command in both:
        code, out, err = _finish(command)
        assert code == 0, out + err
    db = make_engine(database_url(FabricPaths(home)))
    with db.connect() as conn:
        for name, n in (("a", 40), ("b", 40), ("c", 60), ("d", 60)):
            counts = accounting(conn, name)
            assert counts.finished and counts.completed == n, (name, counts)
        rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
        distinct = conn.execute(
            select(func.count()).select_from(
                select(Embedding.task_set_id, Embedding.record_no).distinct().subquery()
            )
        ).scalar_one()
    db.dispose()
    assert rows == distinct == 200

    # A failing command fails the same way through the runner as on its own.
    alone = _fabric(home, "run", "never-submitted", FABRIC_WARM_RUNNER="0")
    served = _fabric(home, "run", "never-submitted")
    (code_alone, _, err_alone), (code_served, _, err_served) = _finish(alone), _finish(served)
    assert code_alone == code_served != 0
    assert err_alone.strip().splitlines()[-1] == err_served.strip().splitlines()[-1]
    assert _children(runner) == []  # every run's process has ended

    stopped = subprocess.run([sys.executable, "-m", "fabric_pipelines.cli", "workers", "stop"],
                             env=_env(home), capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "and 1 warm runner(s)" in stopped.stdout
    deadline = time.monotonic() + 30
    while warm_client.runner_states(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert warm_client.runner_states(home) == []


def test_a_command_killed_mid_run_takes_its_run_with_it(home: Path, tmp_path: Path) -> None:
    small = str(_write_set(tmp_path / "w.jsonl", "w", 20))
    code, out, err = _finish(_fabric(home, "submit", small, "--task-set", "w", "--run"))
    assert code == 0, out + err
    runner = _serving_runner(home)
    big = _write_set(tmp_path / "big.jsonl", "big", 3000)
    command = _fabric(home, "submit", str(big), "--task-set", "big", "--run")
    deadline = time.monotonic() + 120
    db = make_engine(database_url(FabricPaths(home)))
    while time.monotonic() < deadline:  # until its run extracts
        try:
            with db.connect() as conn:
                if accounting(conn, "big").completed > 0:
                    break
        except LookupError:
            pass
        time.sleep(0.2)
    else:
        raise AssertionError(f"the run never started extracting:\n{command.stderr}")
    (child,) = _children(runner)
    command.send_signal(signal.SIGKILL)
    command.wait(timeout=30)
    deadline = time.monotonic() + 30
    while child in _children(runner) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert child not in _children(runner), "the run outlived its command"

    code, out, err = _finish(_fabric(home, "run", "big"))  # served again, and finishes the set
    assert code == 0, out + err
    with db.connect() as conn:
        counts = accounting(conn, "big")
        rows = conn.execute(select(func.count()).select_from(Embedding)).scalar_one()
    db.dispose()
    assert counts.finished and counts.completed == 3000 and rows == 3020


def test_the_key_follows_the_settings_and_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    monkeypatch.setattr(warm_client, "_code_files", lambda: [module])
    env = {"FABRIC_HOME": "/data", "PATH": "/bin", "TERM": "xterm"}
    key = warm_client.runner_key(tmp_path, env)
    assert warm_client.runner_key(tmp_path, {**env, "TERM": "screen"}) == key  # not a setting
    assert warm_client.runner_key(tmp_path, {**env, "HF_HUB_OFFLINE": "0"}) != key
    assert warm_client.runner_key(tmp_path / "other", env) != key
    module.write_text("x = 22\n")  # the code changed: a runner of the old code is not used
    assert warm_client.runner_key(tmp_path, env) != key


@pytest.mark.gpu
def test_on_a_gpu_runs_served_by_the_runner_use_the_torch_engine(
    home: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The runner never touches CUDA, so its forked children can: a torch-engine run through
    it works like one on its own (on a machine without a GPU this is skipped)."""
    import torch

    from fabric_gpu import probe_gpu
    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.profile import ConsumerProfile

    status = probe_gpu()
    if not (status.available and torch.cuda.is_available()):
        pytest.skip("no GPU: " + (status.reason or "torch sees no CUDA device"))
    manifest = manifest_for_model(
        str(tiny_model_dir), backend="torch", dtype="float16",
        profile=ConsumerProfile(4096, 64, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip
    manifest_file = tmp_path / "engine.json"
    manifest_file.write_text(json.dumps(manifest.to_mapping()))
    for name in ("g1", "g2"):
        source = str(_write_set(tmp_path / f"{name}.jsonl", name, 200))
        report = tmp_path / f"{name}.json"
        command = _fabric(home, "submit", source, "--task-set", name, "--run", "--manifest",
                          str(manifest_file), "--truncate", "--report", str(report))  # fmt: skip
        code, out, err = _finish(command)
        assert code == 0, out + err
        if name == "g1":
            _serving_runner(home)
        else:
            assert _report(report)["process"]["warm_runner"] is True


def test_a_runner_still_loading_is_stopped_too(tmp_path: Path) -> None:
    root = tmp_path / "home"
    root.mkdir()
    process = warm_client.start_in_background(root, 60, _env(root))
    assert process is not None
    deadline = time.monotonic() + 30
    while not warm_client.runner_states(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    (state,) = warm_client.runner_states(root)
    assert state["pid"] == process.pid and state["serving"] is False  # still importing
    assert warm_client.stop_runners(root) == [process.pid]
    assert process.wait(timeout=30) == 0
    assert warm_client.runner_states(root) == []
    assert not list((root / "pool" / "runners").glob("*.json"))  # its state went with it
