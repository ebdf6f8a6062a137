"""Workers started through a Dagster Pipes client (lib/worker/client_launch.py): the seam the
Kubernetes pods use, run here with real worker processes, real Dagster and a real PostgreSQL.

- `PipesSubprocessClient` itself, through `fabric submit --run --launcher pipes-subprocess`: three
  workers, one killed with SIGKILL mid-set and replaced; every task exactly once; each worker's
  lines and counts in the run's event log.
- The Kubernetes launcher (`PipesK8sClient`'s seam) against a stand-in cluster: no cluster can
  run here, so `FakeCluster` plays the kubelet. It builds each pod with dagster-k8s's own
  `build_pod_body` (the API schema), resolves its Secret, and runs the pod's container command as
  a process of this host through `PipesSubprocessClient` with Pipes' env context injection, the
  way `PipesK8sClient` injects it; deleting pods by label ends their process. One worker is
  stopped past its lease: the step deletes its pod and starts another.
- SQLite with workers of other hosts is refused, naming what to set.
"""

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml
from sqlalchemy import func, select

from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.models import Embedding
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.worker.client_launch import alive_pid, runs_worker
from fabric_pipelines.lib.worker.pods import DEFAULT_CONFIG, WORKER_LABEL, WorkerPods
from fabric_testing.fault_drill import worker_pids
from tests.worker_runs import (
    events,
    exactly_once,
    finish,
    start,
    workers_mid_set,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_pipes_subprocess_client_workers_report_and_a_killed_one_is_replaced(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str
) -> None:
    n, home = 3000, tmp_path / "home"
    # The warm pool on, as by default: these workers are the client's, never the pool's.
    process = start(
        tmp_path, tiny_model_dir, own_postgres_database, n, lease_s=2.0,
        extra=["--launcher", "pipes-subprocess"], env_extra={"FABRIC_POOL_IDLE_SECONDS": "60"},
    )  # fmt: skip
    try:
        os.kill(workers_mid_set(home, own_postgres_database)[1], signal.SIGKILL)
    except BaseException:
        process.kill()
        raise
    finish(process, tmp_path)
    exactly_once(own_postgres_database, n)
    messages, observations = events(home)
    assert any(" exited with " in m for m in messages), messages[-40:]
    replaced = [m for m in messages if " started in place of " in m]
    assert replaced, messages[-40:]
    stand_in = replaced[0].split()[1]
    owners = {o["worker"] for o in observations}
    assert stand_in.endswith(".1") and stand_in in owners
    assert len(owners) == 3, owners  # the two that lived and the stand-in, each through Pipes
    for owner in owners:
        assert any(m.startswith(f"worker {owner} started (pid ") for m in messages), owner
        assert ":pool-" not in owner
    assert sum(int(o["rows_inserted"]) for o in observations) <= n
    assert not worker_pids(home)


def test_workers_of_other_hosts_refuse_sqlite_naming_what_to_set(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Refused by `fabric submit --run` before anything is submitted, and by the step itself
    (a run launched from the UI, say) before any pod is asked for."""
    from fabric_pipelines.defs.worker_pipes import worker_launcher
    from fabric_pipelines.lib.worker.client_launch import SharedDatabaseRequired

    process = start(
        tmp_path, tiny_model_dir, f"sqlite:///{tmp_path / 'results.db'}", 20, lease_s=30,
        extra=["--launcher", "kubernetes"],
    )  # fmt: skip
    with pytest.raises(AssertionError) as failed:
        finish(process, tmp_path)
    output = str(failed.value)
    assert "fabric submit: task set 's': workers on other hosts need a results database" in output
    assert "Set FABRIC_DATABASE_URL to a PostgreSQL URL" in output
    assert "submitted" not in output and not worker_pids(tmp_path / "home")
    context = dg.build_asset_context(partition_key="s")
    missing_pods = tmp_path / "no-such-workers.yaml"  # the database is refused first
    with pytest.raises(SharedDatabaseRequired, match="Set FABRIC_DATABASE_URL"):
        worker_launcher(context, "kubernetes", str(missing_pods), tmp_path, "sqlite:///x.db")


def test_a_client_run_is_asked_again_to_end_until_it_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first ask can come before the pod or process exists (and can fail): it is asked
    again while the step waits, and what it returned is kept."""
    from fabric_pipelines.lib.worker import client_launch

    monkeypatch.setattr(client_launch, "CANCEL_AGAIN_S", 0.05)
    exists, ended, asks = threading.Event(), threading.Event(), []

    def run() -> str:
        exists.set()
        ended.wait(30)
        return "completed"

    def cancel(graceful: bool) -> None:
        asks.append(graceful)
        if len(asks) == 1:
            raise ConnectionError("the cluster did not answer")  # logged, asked again
        ended.set()

    worker = client_launch.ClientRun("w0", run, cancel)
    worker.start()
    exists.wait(5)
    worker.stop()  # the first ask fails
    assert worker.wait() == 0 and worker.result == "completed"
    assert asks[:2] == [True, True]
    assert worker.wait() == 0  # at once, however often asked


def test_client_runs_that_never_end_are_given_up_on_together(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Pods a cluster never ends (still pending when deleted, say) cost the step one reap window
    together, however many and however often they are named, not one each."""
    from fabric_pipelines.lib.worker import client_launch, launch

    monkeypatch.setattr(launch, "REMOTE_REAP_S", 0.5)
    monkeypatch.setattr(client_launch, "CANCEL_AGAIN_S", 0.05)
    forever = threading.Event()
    runs = [
        client_launch.ClientRun(f"w{i}", lambda: forever.wait(60), lambda graceful: None)
        for i in range(4)
    ]
    for run in runs:
        run.start()
    workers = [
        launch.WorkerProcess(f"w{i}", run, tmp_path / f"{i}.json", tmp_path / f"{i}.log")
        for i, run in enumerate(runs)
    ]
    started = time.monotonic()
    launch.stop_workers([*workers, *workers], grace_s=0.2)
    assert time.monotonic() - started < 3
    assert all(run.returncode == 137 for run in runs)
    forever.set()


def test_a_pod_that_never_starts_counts_as_silent_after_its_start_grace(tmp_path: Path) -> None:
    """A worker of this host writes its alive file within seconds; a pod may wait for its node
    and image, so its silence counts only from the end of its start grace."""
    from fabric_pipelines.lib.worker.launch import WorkerProcess

    alive = tmp_path / "w0.alive"  # never written
    local = WorkerProcess("w0", None, tmp_path / "r", tmp_path / "l", alive_path=alive)  # type: ignore[arg-type]
    pod = WorkerProcess(
        "w0", None, tmp_path / "r", tmp_path / "l", alive_path=alive,  # type: ignore[arg-type]
        start_grace_s=5.0, started_at=time.time() - 20.0,
    )  # fmt: skip
    assert local.silent_for() == 0.0
    assert 14.0 < pod.silent_for() < 16.0
    alive.write_text("host 1\n")
    assert pod.silent_for() < 2.0  # written: its age from now on


class FakeCluster:
    """A stand-in for a Kubernetes cluster (none can run here): `run` has `PipesK8sClient.run`'s
    signature; the pod is built by dagster-k8s's `build_pod_body` and its container command run
    here; `delete_collection_namespaced_pod` is CoreV1Api's, ending the pods it selects."""

    def __init__(self, secrets: dict[tuple[str, str], str]) -> None:
        self.secrets = secrets
        self.pods: dict[str, Any] = {}  # label value -> the pod body
        self.deleted: list[str] = []
        self._lock = threading.Lock()

    def run(self, *, context: Any, extras: Any, command: list[str], namespace: str,
            image: Any, base_pod_meta: Any, base_pod_spec: Any) -> Any:  # fmt: skip
        from dagster_k8s.pipes import build_pod_body

        label = base_pod_meta["labels"][WORKER_LABEL]
        pod = build_pod_body(
            pod_name=f"fabric-{label}".lower()[:63], image=image, command=command,
            env_vars={}, base_pod_meta=base_pod_meta, base_pod_spec=base_pod_spec,
        )  # fmt: skip
        with self._lock:
            self.pods[label] = pod
        (container,) = pod.spec.containers
        env = {}
        for var in container.env:
            if var.value_from is not None:
                ref = var.value_from.secret_key_ref
                env[var.name] = self.secrets[(ref.name, ref.key)]
            else:
                env[var.name] = var.value
        # The image's Python is this one, and its `python` this venv's.
        command = [sys.executable, *container.command[1:]]
        client = dg.PipesSubprocessClient(context_injector=dg.PipesEnvContextInjector())
        return client.run(context=context, command=command, env=env, extras=extras)

    def delete_collection_namespaced_pod(
        self, namespace: str, label_selector: str, grace_period_seconds: int | None = None
    ) -> None:
        key, value = label_selector.split("=")
        assert key == WORKER_LABEL
        self.deleted.append(value)
        pod = self.pods[value]
        command = pod.spec.containers[0].command
        alive = Path(command[command.index("--alive-file") + 1])
        pid = alive_pid(alive)
        if pid is not None and runs_worker(pid, alive):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGTERM if grace_period_seconds is None else signal.SIGKILL)


@pytest.mark.timeout(300)
def test_kubernetes_workers_run_as_pods_report_through_pipes_and_a_lost_one_is_replaced(
    tmp_path: Path, tiny_model_dir: Path, own_postgres_database: str
) -> None:
    from fabric_pipelines.defs.k8s_workers import kubernetes_launcher
    from fabric_pipelines.defs.worker_pipes import log_counts
    from fabric_pipelines.lib.steps.run_extraction import extract_task_set

    n, lease_s = 2000, 2.0
    url = own_postgres_database
    paths = FabricPaths(tmp_path / "data").ensure()
    db = make_engine(url)
    create_schema(db)
    manifest = manifest_for_model(
        str(tiny_model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(128, 2, 64, 8), hooks=HookSpec((), "mean"),
    )  # fmt: skip
    source = tmp_path / "set.jsonl"
    source.write_text(
        "".join(json.dumps({"id": f"t{i}", "text": f"pod task {i}"}) + "\n" for i in range(n))
    )
    submit(source, paths.inbox, "set")
    ingest_task_set(db, paths, "set", model_id=manifest.model_id, max_seq_len=64)
    plan_task_set(db, paths, "set", manifest)
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["data_volume"]["mount_path"] = str(paths.root)  # the shared volume, here
    pods_file = tmp_path / "workers.yaml"
    pods_file.write_text(yaml.safe_dump(config))
    pods = WorkerPods.load(pods_file)
    cluster = FakeCluster({(pods.secret_name, pods.secret_key): url})
    stopped: list[int] = []

    def stop_one_past_its_lease() -> None:
        pid = workers_mid_set(paths.root, url, workers=2)[0]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    @dg.asset
    def extracted(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        launcher = kubernetes_launcher(
            context, pods, paths.root, url, client=cluster, core_api=lambda: cluster,
            finished=lambda owner, result: log_counts(context, owner, result.get_custom_messages()),
        )  # fmt: skip
        saboteur = threading.Thread(target=stop_one_past_its_lease, daemon=True)
        saboteur.start()
        summary = extract_task_set(
            db, paths, "set", manifest, database_url=url, workers=2, lease_seconds=lease_s,
            heartbeat_seconds=lease_s / 4, launcher=launcher, on_event=context.log.warning,
        )  # fmt: skip
        saboteur.join()
        return dg.MaterializeResult(metadata={"rows_inserted": summary.rows_inserted})

    try:
        with dg.instance_for_test() as instance:
            result = dg.materialize([extracted], instance=instance)
            assert result.success
            entries = instance.all_logs(result.run_id)
    finally:  # the stopped worker, if the step did not end it (and its pid is still its own)
        for pid in set(stopped) & set(worker_pids(paths.root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    exactly_once(url, n)
    with db.connect() as conn:
        counts = accounting(conn, "set")
        assert counts.completed == n and counts.queued == counts.in_flight == 0
        assert conn.execute(select(func.count()).select_from(Embedding)).scalar_one() == n
    db.dispose()
    messages = [e.user_message for e in entries if e.dagster_event is None]
    assert any(" lost: silent for " in m for m in messages), messages[-30:]
    assert any(" started in place of " in m for m in messages), messages[-30:]
    assert len(cluster.deleted) >= 1  # the lost worker's pod, deleted by its label
    assert len(cluster.pods) == 3  # two pods and the stand-in's
    observed = [
        e.dagster_event.asset_observation_data.asset_observation.metadata
        for e in entries
        if e.dagster_event is not None
        and e.dagster_event.event_type == dg.DagsterEventType.ASSET_OBSERVATION
    ]
    assert len({m["worker"].value for m in observed}) >= 2  # the ones that ended well
    for pod in cluster.pods.values():  # what the cluster was given: one GPU, the Secret's URL
        (container,) = pod.spec.containers
        assert container.resources.limits["nvidia.com/gpu"] == "1"
        (url_var,) = [v for v in container.env if v.name == "FABRIC_DATABASE_URL"]
        assert url_var.value is None and url_var.value_from.secret_key_ref.name == pods.secret_name
        assert "--parent-pid" not in container.command
    # The pods' workers are gone (the stopped one was killed by its pod's deletion).
    assert not [p for p in worker_pids(paths.root) if p not in stopped]
