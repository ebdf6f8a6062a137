"""Workers as Kubernetes pods, one per worker, through dagster-k8s's `PipesK8sClient`.

The pod is built on the base pod spec of deploy/k8s/workers.yaml (lib/worker/pods.py: the image,
one GPU, the database URL from its Secret, the shared data volume, node selector, tolerations),
with the worker's command and Pipes' variables; `PipesK8sClient` creates it, streams its log into
the step's (Pipes messages included) and deletes it when it ends. Each runs in a thread of the
step (lib/worker/client_launch.py) so the step watches every worker at once: a pod lost with its
node stops touching its alive file on the shared volume, is deleted by its label and replaced.
`fabric workers pod-spec` prints the pod a worker gets (`worker_pod`) with the same arguments.

dagster-k8s is imported here, not with the definitions: every run loads those, and it brings the
Kubernetes client.
"""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg

from fabric_pipelines.lib.worker.client_launch import PipesClientLauncher, require_shared_database
from fabric_pipelines.lib.worker.launch import LaunchSettings, WorkerInvocation
from fabric_pipelines.lib.worker.pods import WORKER_LABEL, PodConfigError, WorkerPods, worker_label


def pod_arguments(pods: WorkerPods, invocation: WorkerInvocation) -> dict[str, Any]:
    """What `PipesK8sClient.run` is given for one worker (and the dry run builds from)."""
    return {
        "image": None,  # the base spec's container names it
        "command": invocation.command,
        "namespace": pods.namespace,
        "base_pod_meta": {
            "namespace": pods.namespace,
            "labels": {
                "app.kubernetes.io/name": "fabric-worker",
                WORKER_LABEL: worker_label(invocation.owner),  # how a lost one is deleted
            },
        },
        "base_pod_spec": pods.base_pod_spec(),
    }


def kubernetes_launcher(
    context: dg.AssetExecutionContext,
    pods: WorkerPods,
    data_root: Path,
    database_url: str,
    *,
    finished: Callable[[str, Any], None] | None = None,
    client: Any = None,
    core_api: Callable[[], Any] | None = None,
) -> PipesClientLauncher:
    """A pod per worker (see the module's doc), refused for a database other hosts cannot reach
    (SQLite) or a data volume not mounted at `data_root`. `finished(owner, completed
    invocation)` hears each pod that ended well. `client` and `core_api` default to
    `PipesK8sClient()` and the cluster's CoreV1Api, from the in-cluster configuration or the
    kube config as `PipesK8sClient` loads them."""
    task_set = context.partition_key if context.has_partition_key else "(unpartitioned)"
    require_shared_database(database_url, task_set)  # first: the setting most likely missed
    if not same_path(pods.data_root, data_root):
        raise PodConfigError(
            f"data_volume.mount_path ({pods.data_root}) is not this run's data root "
            f"({data_root}): a worker reads and writes the run's files at the paths the step "
            "names. Mount the shared volume at the same path as FABRIC_HOME on both sides."
        )
    if client is None:
        from dagster_k8s import PipesK8sClient

        client = PipesK8sClient(poll_interval=2.0)

    def run(settings: LaunchSettings, invocation: WorkerInvocation, device: int | None) -> Any:
        # `device` is this host's numbering: a pod asks the scheduler for its GPU instead.
        return client.run(
            context=context, extras={"owner": invocation.owner}, **pod_arguments(pods, invocation)
        )

    def cancel(invocation: WorkerInvocation, graceful: bool) -> None:
        api = (core_api or _cluster_api)()
        api.delete_collection_namespaced_pod(
            pods.namespace,
            label_selector=f"{WORKER_LABEL}={worker_label(invocation.owner)}",
            grace_period_seconds=None if graceful else 0,
        )

    return PipesClientLauncher(
        run, cancel, on_this_host=False, python=pods.python, finished=finished
    )  # fmt: skip


def same_path(mount_path: str, data_root: Path) -> bool:
    """The pods' mount path names the run's data root (as given, or resolved: FABRIC_HOME may
    be a link to the volume's mount)."""
    mount = os.path.normpath(mount_path)
    return mount in (os.path.normpath(data_root), os.path.normpath(data_root.resolve()))


def _cluster_api() -> Any:
    import kubernetes  # type: ignore[import-untyped]  # dagster-k8s's dependency, untyped

    if os.getenv("KUBERNETES_SERVICE_HOST"):  # in a cluster, as PipesK8sClient tells it
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config()
    return kubernetes.client.CoreV1Api()


def worker_pod(pods: WorkerPods, invocation: WorkerInvocation, pod_name: str) -> Any:
    """The V1Pod of one worker, as `PipesK8sClient` builds it (kubernetes' model: built field by
    field from the API schema, so a misspelt or misplaced field is refused here, not by a
    cluster). Pipes' variables are the client's to set when the step runs: placeholders here."""
    from dagster_k8s.pipes import build_pod_body
    from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, DAGSTER_PIPES_MESSAGES_ENV_VAR

    arguments = pod_arguments(pods, invocation)
    del arguments["namespace"]  # the client's, not the pod body's
    pipes = "(set by PipesK8sClient when the step runs)"
    return build_pod_body(
        pod_name=pod_name,
        env_vars={DAGSTER_PIPES_CONTEXT_ENV_VAR: pipes, DAGSTER_PIPES_MESSAGES_ENV_VAR: pipes},
        **arguments,
    )


def pod_manifest(pod: Any) -> dict[str, Any]:
    """The pod as the Kubernetes API writes it (camelCase, no empty fields)."""
    import kubernetes

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        **kubernetes.client.ApiClient().sanitize_for_serialization(pod),
    }
