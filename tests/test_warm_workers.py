"""Workers started before their plan: taken over by the extraction of the same settings, let go
by a go file, stopped when nobody takes them; GPU pools hold their devices' leases meanwhile.

The workers are real `python -m fabric_pipelines.lib.worker.launch` processes running the CPU engine on
a tiny random BERT with the real tokenizer.
"""

from __future__ import annotations

import json
import threading
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from sqlalchemy import Engine

from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.worker.devices import DevicesBusy, lease_devices
from fabric_pipelines.lib.worker.prestart import (
    PrestartedWorkers,
    prestart_workers,
    prestarted_devices,
    take_prestarted,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _manifest(model_dir: Path, backend: str = "cpu") -> EngineManifest:
    return manifest_for_model(
        str(model_dir), backend=backend, dtype="float32",
        profile=ConsumerProfile(256, 4, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip


def _warm(
    paths: FabricPaths,
    db_url: str,
    manifest: EngineManifest,
    task_set: str = "set",
    count: int = 1,
    visible_gpus: int = 0,
) -> AbstractContextManager[PrestartedWorkers | None]:
    """A warm pool with a 30 s lease, the settings the steps below run with unless they say."""
    return prestart_workers(
        paths, task_set, manifest, database_url=db_url, count=count,
        visible_gpus=visible_gpus, lease_seconds=30,
    )  # fmt: skip


def _ingest_and_plan(db: Engine, paths: FabricPaths, manifest: EngineManifest, n: int) -> None:
    source = paths.root / "set.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": f"task {i} of {n}"}) + "\n" for i in range(n))
    )
    submit(source, paths.inbox, "set")
    ingest_task_set(db, paths, "set", model_id=manifest.model_id, max_seq_len=64)
    plan_task_set(db, paths, "set", manifest)


def test_a_warm_pool_started_before_ingest_runs_the_plan_made_after_it(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    with _warm(paths, db_url, manifest, count=2) as pool:
        assert pool is not None and len(pool.workers) == 2
        # The workers load their engine and wait: no plan exists yet.
        _ingest_and_plan(db, paths, manifest, 120)
        assert not pool.go_file.exists()
        assert all(w.process.poll() is None for w in pool.workers)
        summary = extract_task_set(db, paths, "set", manifest, database_url=db_url, workers=2)
        assert pool.taken and pool.go_file.exists()
        assert all(w.process.returncode == 0 for w in pool.workers)
    assert summary.batches_done == 30 and summary.rows_inserted == 120
    # Each worker's timeline: loaded its engine, then waited for go, then ran the plan.
    points = ("engine_ready", "go", "job_loaded", "ready", "last_ack", "done", "closed")
    for timeline in summary.timelines:  # a worker that acked nothing has no last_ack
        present = [timeline[p] for p in points if p in timeline]
        assert present == sorted(present) and "go" in timeline and "closed" in timeline
    assert len(summary.timelines) == 2
    assert any("last_ack" in timeline for timeline in summary.timelines)
    with db.connect() as conn:
        counts = accounting(conn, "set", manifest.model_key)
    assert counts.finished and counts.completed == 120


def test_a_pool_whose_settings_differ_is_stopped_and_the_step_launches_its_own(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    with _warm(paths, db_url, manifest) as pool:
        assert pool is not None
        _ingest_and_plan(db, paths, manifest, 40)
        # Another lease length: not the run this pool was started for.
        summary = extract_task_set(
            db, paths, "set", manifest, database_url=db_url, workers=1, lease_seconds=45
        )
        assert pool.taken and not pool.go_file.exists()
        assert all(w.process.poll() is not None for w in pool.workers)
    assert summary.rows_inserted == 40


def test_a_pool_nobody_takes_is_stopped_when_its_block_ends(
    db_url: str, paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    with _warm(paths, db_url, manifest) as pool:
        assert pool is not None
        workers = list(pool.workers)
    assert all(w.process.returncode is not None for w in workers)
    assert take_prestarted(
        "set", manifest, 1, database_url=db_url, lease_seconds=30, heartbeat_seconds=None
    ) is None  # fmt: skip


def test_a_gpu_pool_holds_its_devices_until_its_block_ends(
    db_url: str, paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir, backend="torch")  # its workers fail here: no CUDA
    with _warm(paths, db_url, manifest, visible_gpus=1) as pool:
        assert pool is not None and pool.devices == [0] and prestarted_devices("set") == [0]
        with pytest.raises(DevicesBusy), lease_devices(paths.device_leases, 1, 1, wait=False):
            pass
        # A second run's pool finds the device taken: it starts nothing (its step waits).
        with _warm(paths, db_url, manifest, "set2", visible_gpus=1) as second:
            assert second is None
    assert prestarted_devices("set") is None
    with lease_devices(paths.device_leases, 1, 1, wait=False) as devices:
        assert devices == [0]


def test_two_threads_taking_one_pool_get_it_once(
    db_url: str, paths: FabricPaths, tiny_model_dir: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    taken: list[object] = []
    with _warm(paths, db_url, manifest):
        barrier = threading.Barrier(4)

        def take() -> None:
            barrier.wait()
            pool = take_prestarted(
                "set", manifest, 1, database_url=db_url, lease_seconds=30, heartbeat_seconds=None
            )
            if pool is not None:
                taken.append(pool)

        threads = [threading.Thread(target=take) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(taken) == 1


def test_a_waiting_worker_reads_its_task_set_once_ingested_before_the_go(
    db: Engine, paths: FabricPaths, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ingest commits on another thread while the worker waits: the worker reads the stored
    table before any go, and the job made after the go uses that table."""
    from fabric_pipelines.lib.tasks import arrow_files as store
    from fabric_pipelines.lib.tasks.catalog import get_task_set
    from fabric_pipelines.lib.worker.main import load_job, read_task_set_before_go

    read_before_go = threading.Event()
    read_table = store.read_table

    def noting_read(path: Path, sha256: str | None) -> object:
        table = read_table(path, sha256)
        read_before_go.set()
        return table

    monkeypatch.setattr(store, "read_table", noting_read)
    manifest = _manifest(tiny_model_dir)
    go = paths.root / "go"
    result: list[object] = []
    waiter = threading.Thread(
        target=lambda: result.append(read_task_set_before_go(db, "set", go)), daemon=True
    )
    waiter.start()
    _ingest_and_plan(db, paths, manifest, 40)  # meanwhile, on this thread
    assert read_before_go.wait(10) and waiter.is_alive()  # read, and still waiting for the go
    go.write_bytes(b"go\n")
    waiter.join(10)
    row = get_task_set(db, "set")
    early = result[0]
    assert early is not None and early.content_sha256 == row.content_sha256  # type: ignore[attr-defined]
    assert early.table.equals(read_table(Path(row.path), row.content_sha256))  # type: ignore[attr-defined]
    monkeypatch.undo()
    job = load_job(db, paths, "set", manifest, early)  # type: ignore[arg-type]
    assert job.tasks is early.table  # type: ignore[attr-defined]


def test_a_damaged_task_set_is_left_to_the_job_which_says_so(
    db: Engine, paths: FabricPaths, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fabric_pipelines.lib.core.files import CorruptFileError
    from fabric_pipelines.lib.tasks import arrow_files as store
    from fabric_pipelines.lib.tasks.catalog import get_task_set
    from fabric_pipelines.lib.worker.main import load_job, read_task_set_before_go

    manifest = _manifest(tiny_model_dir)
    _ingest_and_plan(db, paths, manifest, 20)
    stored = Path(get_task_set(db, "set").path)
    stored.write_bytes(stored.read_bytes()[:-8] + b"damaged!")
    go = paths.root / "go"
    tried = threading.Event()
    read_table = store.read_table

    def noting_read(path: Path, sha256: str | None) -> object:
        tried.set()
        return read_table(path, sha256)

    monkeypatch.setattr(store, "read_table", noting_read)
    threading.Timer(0.3, lambda: go.write_bytes(b"go\n")).start()
    assert read_task_set_before_go(db, "set", go) is None
    assert tried.is_set()  # it read the file early, found it damaged, and kept nothing
    monkeypatch.undo()
    with pytest.raises(CorruptFileError):
        load_job(db, paths, "set", manifest, None)


def test_a_go_that_is_there_already_returns_at_once_without_reading(
    db: Engine, paths: FabricPaths
) -> None:
    from fabric_pipelines.lib.worker.main import read_task_set_before_go

    go = paths.root / "go"
    go.write_bytes(b"go\n")
    assert read_task_set_before_go(db, "never-ingested", go) is None
