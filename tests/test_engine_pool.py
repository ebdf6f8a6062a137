"""The warm engine pool: a run starts it and the next run uses it; a pool worker killed mid-run
loses nothing and is replaced; two runs at once share one slot safely; an idle worker exits; a
bad job gets an error naming its field; `fabric workers start|status|stop`.

The pool workers are real `python -m fabric_pipelines.lib.worker.pool.server` processes running
the CPU engine on a tiny random BERT with the real tokenizer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.worker.pool.client import (
    idle_seconds_setting,
    manifest_sha256,
    pool_states,
    slot_address,
    start_pool_worker,
    stop_pool,
    wait_until_serving,
)
from fabric_pipelines.lib.worker.procs import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _manifest(model_dir: Path, batch_tokens: int = 256) -> EngineManifest:
    return manifest_for_model(
        str(model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(batch_tokens, 4, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip


@pytest.fixture
def sqlite_db(paths: FabricPaths) -> Iterator[tuple[Engine, str]]:
    url = f"sqlite:///{paths.sqlite_path}"
    engine = make_engine(url)
    create_schema(engine)
    yield engine, url
    engine.dispose()


@pytest.fixture(autouse=True)
def no_pool_left(paths: FabricPaths) -> Iterator[None]:
    yield
    stop_pool(paths.root, grace_s=5)


def _ingest_and_plan(
    db: Engine, paths: FabricPaths, manifest: EngineManifest, name: str, n: int
) -> None:
    source = paths.root / f"{name}.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"{name}-{i}", "text": f"task {i} of set {name}, {n} in all"}) + "\n"
            for i in range(n)
        )
    )
    submit(source, paths.inbox, name)
    ingest_task_set(db, paths, name, model_id=manifest.model_id, max_seq_len=64)
    plan_task_set(db, paths, name, manifest)


def _extract(db: Engine, url: str, paths: FabricPaths, manifest: EngineManifest, name: str, **kw):  # type: ignore[no-untyped-def]
    return extract_task_set(
        db, paths, name, manifest, database_url=url, workers=kw.pop("workers", 1),
        pool_idle_seconds=kw.pop("idle", 60.0), **kw,
    )  # fmt: skip


def _exactly_once(db: Engine, name: str, manifest: EngineManifest, n: int) -> None:
    with db.connect() as conn:
        counts = accounting(conn, name, manifest.model_key)
        rows, distinct = conn.execute(
            text(
                "SELECT count(*), count(DISTINCT e.record_no) FROM embeddings e "
                "JOIN task_sets s ON s.id = e.task_set_id WHERE s.name = :name"
            ),
            {"name": name},
        ).one()
    assert counts.finished and counts.completed == n and counts.failed == 0
    assert rows == distinct == n


def test_a_run_starts_the_pool_and_the_next_run_uses_its_loaded_engine(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    _ingest_and_plan(db, paths, manifest, "first", 40)
    first = _extract(db, db_url, paths, manifest, "first")
    states = pool_states(paths.root)
    assert [s.slot for s in states] == ["cpu0"] and states[0].jobs_done == 1
    assert states[0].manifest_sha256 == manifest_sha256(manifest) and not states[0].busy_with
    pid = states[0].pid
    _ingest_and_plan(db, paths, manifest, "second", 40)
    second = _extract(db, db_url, paths, manifest, "second")
    # The same process served both runs: its engine was loaded once.
    assert pool_states(paths.root)[0].pid == pid and pool_states(paths.root)[0].jobs_done == 2
    assert first.rows_inserted == second.rows_inserted == 40
    _exactly_once(db, "first", manifest, 40)
    _exactly_once(db, "second", manifest, 40)
    assert stop_pool(paths.root) == ["cpu0"]
    assert pool_states(paths.root) == []
    assert not pid_alive(pid)  # exited (a zombie here until reaped: this process started it)


def test_a_pool_worker_killed_mid_run_loses_nothing_and_the_next_run_starts_a_new_one(
    sqlite_db: tuple[Engine, str], paths: FabricPaths, tiny_model_dir: Path
) -> None:
    db, url = sqlite_db
    manifest = _manifest(tiny_model_dir, batch_tokens=64)  # many small batches: a long run
    _ingest_and_plan(db, paths, manifest, "warmup", 4)
    _extract(db, url, paths, manifest, "warmup")
    killed = pool_states(paths.root)[0].pid
    n = 1500
    _ingest_and_plan(db, paths, manifest, "big", n)
    result: list[object] = []
    run = threading.Thread(
        target=lambda: result.append(_extract(db, url, paths, manifest, "big", lease_seconds=4)),
        daemon=True,
    )
    run.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # some batches acknowledged, most still to come
        with db.connect() as conn:
            if 0 < accounting(conn, "big").completed < n // 2:
                break
        time.sleep(0.05)
    os.kill(killed, signal.SIGKILL)
    run.join(240)
    assert not run.is_alive() and result, "the run did not finish after its pool worker died"
    _exactly_once(db, "big", manifest, n)
    # A worker of the run's own stood in for the lost one, in its slot.
    assert list(paths.root.glob("workers/big-*/cpu0-0/worker-0.json"))
    # The next run finds no live pool worker and starts a new one by itself.
    _ingest_and_plan(db, paths, manifest, "after", 8)
    _extract(db, url, paths, manifest, "after")
    states = pool_states(paths.root)
    assert len(states) == 1 and states[0].pid != killed and states[0].jobs_done == 1
    _exactly_once(db, "after", manifest, 8)


def test_two_runs_at_once_share_one_pool_slot_without_losing_or_repeating_work(
    sqlite_db: tuple[Engine, str], paths: FabricPaths, tiny_model_dir: Path
) -> None:
    db, url = sqlite_db
    manifest = _manifest(tiny_model_dir)
    for name in ("one", "two"):
        _ingest_and_plan(db, paths, manifest, name, 120)
    _ingest_and_plan(db, paths, manifest, "warmup", 4)
    _extract(db, url, paths, manifest, "warmup")  # the pool worker is up before the race
    barrier = threading.Barrier(2)
    summaries: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            barrier.wait()
            summaries[name] = _extract(db, url, paths, manifest, name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors and set(summaries) == {"one", "two"}
    _exactly_once(db, "one", manifest, 120)
    _exactly_once(db, "two", manifest, 120)
    # One slot, one worker: at most one of the two ran on it, the other on a stand-in.
    assert len(pool_states(paths.root)) == 1 and pool_states(paths.root)[0].jobs_done <= 3


def test_a_run_started_before_its_plan_hands_the_pool_its_job_with_a_go(
    sqlite_db: tuple[Engine, str], paths: FabricPaths, tiny_model_dir: Path
) -> None:
    """`fabric submit --run`'s path: the job goes to the pool (whose worker loads meanwhile)
    before ingest; the extraction step lets it go; a pool that is not taken gives the job up."""
    from fabric_pipelines.lib.worker.prestart import prestart_workers

    db, url = sqlite_db
    manifest = _manifest(tiny_model_dir)

    def warm(name: str):  # type: ignore[no-untyped-def]
        return prestart_workers(
            paths, name, manifest, database_url=url, count=1, visible_gpus=0,
            lease_seconds=30, pool_idle_seconds=60,
        )  # fmt: skip

    with warm("early") as pool:
        assert pool is not None and pool.pool_run is not None and pool.workers == []
        _ingest_and_plan(db, paths, manifest, "early", 40)
        summary = _extract(db, url, paths, manifest, "early", lease_seconds=30)
        assert pool.taken and pool.go_file.exists()
    assert summary.rows_inserted == 40 and pool_states(paths.root)[0].jobs_done == 1
    _exactly_once(db, "early", manifest, 40)
    with warm("never") as pool:  # ingest failed, say: nobody takes the pool
        assert pool is not None
        deadline = time.monotonic() + 30
        while not pool_states(paths.root)[0].busy_with and time.monotonic() < deadline:
            time.sleep(0.05)  # the worker took the job and waits for its go
    deadline = time.monotonic() + 30
    while pool_states(paths.root)[0].busy_with and time.monotonic() < deadline:
        time.sleep(0.05)
    (state,) = pool_states(paths.root)
    assert state.busy_with == "" and state.jobs_done == 2  # gave it up; serves the next run


def _worker(paths: FabricPaths, manifest: EngineManifest, idle: float) -> subprocess.Popen[bytes]:
    manifest_path = paths.root / "engine.json"
    manifest_path.write_text(json.dumps(manifest.to_mapping()))
    process = start_pool_worker(paths.root, "cpu0", manifest_path, idle_seconds=idle, threads=1)
    hello = wait_until_serving(paths.root, "cpu0", process, 120)
    assert hello is not None and hello["manifest_sha256"] == manifest_sha256(manifest)
    return process


def test_a_bad_job_gets_an_error_naming_its_field_and_the_worker_serves_on(
    paths: FabricPaths, tiny_model_dir: Path
) -> None:
    process = _worker(paths, _manifest(tiny_model_dir), idle=60)
    for job, field in (({"task_set": 5}, "task_set"), ("not an object", "job")):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(slot_address(paths.root, "cpu0"))
            conn.settimeout(10)
            reader = conn.makefile("rb")
            assert "hello" in json.loads(reader.readline())
            conn.sendall(json.dumps({"job": job}).encode() + b"\n")
            answer = json.loads(reader.readline())
        assert field in answer["error"]
    assert process.poll() is None and pool_states(paths.root)[0].jobs_done == 0


def test_a_run_knocking_right_after_a_status_probe_is_served_not_told_busy(
    paths: FabricPaths, tiny_model_dir: Path
) -> None:
    """A probe (hello read, connection closed) holds the worker until it notices the probe went
    away; a run that connects in that moment waits for it and is served. Before, it was told
    busy about one time in three and started a worker of its own."""
    process = _worker(paths, _manifest(tiny_model_dir), idle=60)
    for _ in range(300):
        probe = wait_until_serving(paths.root, "cpu0", process, 10)
        assert probe is not None and probe["busy"] == ""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(slot_address(paths.root, "cpu0"))
            conn.settimeout(10)
            hello = json.loads(conn.makefile("rb").readline())["hello"]
        assert hello["busy"] == "", hello
    assert process.poll() is None


def test_an_idle_pool_worker_exits_after_its_idle_time_and_removes_its_state(
    paths: FabricPaths, tiny_model_dir: Path
) -> None:
    process = _worker(paths, _manifest(tiny_model_dir), idle=1.0)
    assert len(pool_states(paths.root)) == 1
    assert process.wait(30) == 0
    assert pool_states(paths.root) == [] and not (paths.root / "pool" / "cpu0.json").exists()


def test_the_idle_time_setting_names_what_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_POOL_IDLE_SECONDS", "soon")
    with pytest.raises(ValueError, match="FABRIC_POOL_IDLE_SECONDS='soon'"):
        idle_seconds_setting()
    monkeypatch.setenv("FABRIC_POOL_IDLE_SECONDS", "")
    assert idle_seconds_setting() == 300.0
    assert idle_seconds_setting(0) == 0.0
    with pytest.raises(ValueError, match="pool_idle_seconds -1"):
        idle_seconds_setting(-1)


def test_fabric_workers_start_status_and_stop(paths: FabricPaths, tiny_model_dir: Path) -> None:
    manifest_path = paths.root / "engine.json"
    manifest_path.write_text(json.dumps(_manifest(tiny_model_dir).to_mapping()))
    env = {**os.environ, "FABRIC_HOME": str(paths.root), "FABRIC_POOL_IDLE_SECONDS": "60"}

    def fabric(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fabric_pipelines.cli", "workers", *args],
            env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    started = fabric("start", "--manifest", str(manifest_path))
    assert started.returncode == 0, started.stderr
    assert "cpu0: pid" in started.stdout and "idle for" in started.stdout
    status = fabric("status", "--json")
    (state,) = json.loads(status.stdout)
    assert state["slot"] == "cpu0" and state["busy_with"] == ""
    again = fabric("start", "--manifest", str(manifest_path))  # already serving: kept
    assert json.loads(fabric("status", "--json").stdout)[0]["pid"] == state["pid"], again.stdout
    stopped = fabric("stop")
    assert "stopped 1 pool worker(s): cpu0" in stopped.stdout
    assert "no pool workers" in fabric("status").stdout
    off = fabric("start", "--manifest", str(manifest_path), "--pool-idle-seconds", "0")
    assert off.returncode == 2 and "--pool-idle-seconds" in off.stderr


def test_the_dagster_sensor_shows_the_pool_state(paths: FabricPaths) -> None:
    import dagster as dg

    from fabric_pipelines.defs.operations import engine_pool_sensor
    from fabric_pipelines.defs.resources import ArtifactStore

    store = ArtifactStore(root=str(paths.root))

    def tick() -> str:
        with dg.instance_for_test() as instance:
            context = dg.build_sensor_context(instance=instance, resources={"store": store})
            result = engine_pool_sensor(context)
        assert isinstance(result, dg.SkipReason)
        return str(result.skip_message)

    assert "no pool workers" in tick()
    (paths.root / "pool").mkdir()
    # A process whose command line names the pool module stands in for a pool worker.
    stand_in = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(120)",
            "fabric_pipelines.lib.worker.pool.server",
        ]
    )
    state = {
        "slot": "gpu0", "pid": stand_in.pid, "manifest_sha256": "ab" * 32,
        "model_key": "m@1:mean", "started_at": time.time() - 60, "idle_seconds": 300.0,
        "busy_with": "nightly", "since": time.time() - 5, "jobs_done": 3,
    }  # fmt: skip
    (paths.root / "pool" / "gpu0.json").write_text(json.dumps(state))
    try:
        shown = tick()
    finally:
        stand_in.kill()
        stand_in.wait()
    assert "gpu0: pid" in shown and "running task set 'nightly'" in shown and "3 job(s)" in shown
    # Its process gone, the state file is stale: not shown, and removed.
    assert "no pool workers" in tick() and not (paths.root / "pool" / "gpu0.json").exists()


def test_a_stale_state_file_naming_another_process_is_never_signalled(paths: FabricPaths) -> None:
    """A killed worker's pid given to another process since: not a pool worker, left alone."""
    (paths.root / "pool").mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        state = {
            "slot": "cpu0", "pid": other.pid, "manifest_sha256": "ab" * 32, "model_key": "m",
            "started_at": 0.0, "idle_seconds": 300.0, "busy_with": "", "since": 0.0,
            "jobs_done": 0,
        }  # fmt: skip
        (paths.root / "pool" / "cpu0.json").write_text(json.dumps(state))
        assert pool_states(paths.root) == [] and stop_pool(paths.root) == []
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_busy_worker_says_so_at_once_however_many_runs_knock(
    sqlite_db: tuple[Engine, str], paths: FabricPaths, tiny_model_dir: Path
) -> None:
    """A worker holding a job (waiting for its go) answers every other connection with a busy
    hello straight away: twenty runs knocking neither wait nor fill the listen backlog."""
    from fabric_pipelines.lib.store.identity import database_identity
    from fabric_pipelines.lib.worker.pool.client import PoolJob

    db, url = sqlite_db
    manifest = _manifest(tiny_model_dir)
    _worker(paths, manifest, idle=60)
    job = {
        "task_set": "never", "database_url": url, "lease_seconds": 30, "owner": "test",
        "max_attempts": 3, "heartbeat_seconds": None, "go_file": str(paths.root / "no-go"),
        "identity": {"root": paths.identity(), "database": database_identity(db)},
    }  # fmt: skip
    holder = PoolJob(paths.root, "cpu0", manifest_sha256(manifest), job).start()
    deadline = time.monotonic() + 30
    while holder.state != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert holder.state == "running"
    started = time.monotonic()
    knocks = [
        PoolJob(paths.root, "cpu0", manifest_sha256(manifest), {**job, "owner": f"k{i}"}).start()
        for i in range(20)
    ]
    for knock in knocks:
        assert knock.done.wait(10)
    answers = [(k.state, k.error) for k in knocks]
    odd = [a for a in answers if a[0] != "refused" or "busy with 'never'" not in a[1]]
    assert odd == [], odd
    assert time.monotonic() - started < 5
    holder.close()  # the run goes away before its go: the worker gives the job up
    assert holder.done.wait(10)
    deadline = time.monotonic() + 10
    while pool_states(paths.root)[0].busy_with and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool_states(paths.root)[0].busy_with == ""


def test_a_worker_whose_run_goes_away_mid_job_stops_and_nothing_is_lost(
    sqlite_db: tuple[Engine, str], paths: FabricPaths, tiny_model_dir: Path
) -> None:
    """The run is cancelled while its pool worker extracts: the worker ends (it never goes on
    for a run that is gone), and the set's next run completes it exactly once."""
    from fabric_pipelines.lib.worker.launch import launch_settings
    from fabric_pipelines.lib.worker.pool.run import open_pool_run

    db, url = sqlite_db
    manifest = _manifest(tiny_model_dir, batch_tokens=64)
    n = 1500
    _ingest_and_plan(db, paths, manifest, "cancelled", n)
    settings = launch_settings(paths, "cancelled", manifest, url, lease_seconds=4)
    run = open_pool_run(settings, manifest, 1, None, idle_seconds=60)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with db.connect() as conn:
            if accounting(conn, "cancelled").completed > 0:
                break
        time.sleep(0.05)
    pid = run.jobs[0].pid
    run.close()  # the run is cancelled
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid) and pool_states(paths.root) == []
    with db.connect() as conn:
        left = accounting(conn, "cancelled")
    assert 0 < left.completed < n  # stopped mid-job
    _extract(db, url, paths, manifest, "cancelled", lease_seconds=4)
    _exactly_once(db, "cancelled", manifest, n)


def test_two_workers_started_for_one_slot_leave_one_serving(
    paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    manifest_path = paths.root / "engine.json"
    manifest_path.write_text(json.dumps(manifest.to_mapping()))
    first, second = (
        start_pool_worker(paths.root, "cpu0", manifest_path, idle_seconds=60, threads=1)
        for _ in range(2)
    )
    # One of them owns the slot; the other sees that and exits cleanly, at once.
    exited = None
    deadline = time.monotonic() + 60
    while exited is None and time.monotonic() < deadline:
        exited = next((p for p in (first, second) if p.poll() is not None), None)
        time.sleep(0.05)
    assert exited is not None and exited.returncode == 0
    serving = second if exited is first else first
    assert wait_until_serving(paths.root, "cpu0", serving, 120) is not None
    (state,) = pool_states(paths.root)
    assert state.pid == serving.pid and state.ready
