"""The shipped deployment configuration loads: PostgreSQL instance storage (a real instance on the
test server, running a real run) and the Kubernetes run launcher and executor (schema-checked;
no cluster here)."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from sqlalchemy.engine import make_url

from tests.pipeline_helpers import validate_workspace

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def _pg_env(url: str) -> dict[str, str]:
    u = make_url(url)
    return {
        "DAGSTER_PG_HOST": u.host or "127.0.0.1",
        "DAGSTER_PG_PORT": str(u.port or 5432),
        "DAGSTER_PG_USER": u.username or "postgres",
        "DAGSTER_PG_PASSWORD": u.password or "trust-auth-ignores-this",
        "DAGSTER_PG_DB": u.database or "postgres",
    }


@dg.op
def hello() -> int:
    return 1


@dg.job
def hello_job() -> None:
    hello()


@pytest.mark.postgres
def test_postgres_instance_storage_runs_a_job(
    own_postgres_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copy(DEPLOY / "postgres" / "dagster.yaml", tmp_path / "dagster.yaml")
    for key, value in _pg_env(own_postgres_database).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with dg.DagsterInstance.get() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        result = hello_job.execute_in_process(instance=instance)
        assert result.success
        stored = instance.get_run_by_id(result.run_id)
        assert stored is not None and stored.status == dg.DagsterRunStatus.SUCCESS


def test_k8s_instance_config_parses_and_the_launcher_config_validates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dagster_k8s import K8sRunLauncher

    shutil.copy(DEPLOY / "k8s" / "dagster.yaml", tmp_path / "dagster.yaml")
    for key, value in _pg_env("postgresql://postgres@db:5432/dagster").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DAGSTER_K8S_NAMESPACE", "fabric")
    monkeypatch.setenv("FABRIC_IMAGE", "registry.example/fabric:0.1.0")
    config, _ = dagster_instance_config(str(tmp_path))
    launcher = config["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    checked = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert checked.success, checked.errors
    assert checked.value["instance_config_map"] == "dagster-instance"


def test_k8s_executor_runs_each_step_in_a_pod_and_the_workers_get_the_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step a pod; the extraction step orchestrates worker pods (the launcher the runs'
    environment names), which ask for the GPUs, so the step's own pod asks for none."""
    from dagster_k8s import k8s_job_executor

    from fabric_pipelines.definitions import defs

    monkeypatch.setenv("FABRIC_EXECUTOR", "k8s")
    definitions = defs()
    for job in ("extract_task_set", "build_vector_index"):
        assert definitions.resolve_job_def(job).executor_def.name == "k8s_gpu_executor"
    config = yaml.safe_load((DEPLOY / "k8s" / "executor.yaml").read_text())
    checked = process_config(k8s_job_executor.config_schema.config_type, config)
    assert checked.success, checked.errors
    step = checked.value["per_step_k8s_config"]["extraction_outputs"]
    assert "nvidia.com/gpu" not in step["container_config"]["resources"]["limits"]
    instance = yaml.safe_load((DEPLOY / "k8s" / "dagster.yaml").read_text())
    assert "FABRIC_WORKER_LAUNCHER=kubernetes" in instance["run_launcher"]["config"]["env_vars"]
    from fabric_pipelines.lib.worker.pods import DEFAULT_CONFIG, WorkerPods

    pods = WorkerPods.load(DEFAULT_CONFIG)
    assert pods.gpus == 1 and pods.node_selector == {"nvidia.com/gpu.present": "true"}


def test_dagster_validates_the_workspace_with_the_k8s_executor(tmp_path: Path) -> None:
    validate_workspace(tmp_path, FABRIC_EXECUTOR="k8s")


def test_an_unknown_executor_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric_pipelines.defs.executor import executor

    monkeypatch.setenv("FABRIC_EXECUTOR", "slurm")
    with pytest.raises(ValueError, match="FABRIC_EXECUTOR='slurm'"):
        executor()
