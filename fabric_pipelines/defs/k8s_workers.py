"""A worker's Kubernetes pod, as `PipesK8sClient` builds it (dagster_k8s's `build_pod_body`):
the base pod spec of deploy/k8s/workers.yaml (lib/worker/pods.py), the worker's command, and its
Pipes variables. `fabric workers pod-spec` prints it; nothing here talks to a cluster."""

from typing import Any

from fabric_pipelines.lib.worker.launch import WorkerInvocation
from fabric_pipelines.lib.worker.pods import WorkerPods


def worker_pod(pods: WorkerPods, invocation: WorkerInvocation, pod_name: str) -> Any:
    """The V1Pod of one worker (kubernetes' model: built field by field from the API schema,
    so a misspelt or misplaced field is refused here, not by a cluster). dagster-k8s is imported
    here, not with the definitions: every run loads those, and it brings the Kubernetes client."""
    from dagster_k8s.pipes import build_pod_body

    return build_pod_body(
        pod_name=pod_name,
        image=None,  # the base spec's container names it
        command=invocation.command,
        env_vars=invocation.env,
        base_pod_meta={
            "namespace": pods.namespace,
            "labels": {"app.kubernetes.io/name": "fabric-worker"},
        },
        base_pod_spec=pods.base_pod_spec(),
    )


def pod_manifest(pod: Any) -> dict[str, Any]:
    """The pod as the Kubernetes API writes it (camelCase, no empty fields)."""
    import kubernetes  # type: ignore[import-untyped]  # dagster-k8s's dependency, untyped

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        **kubernetes.client.ApiClient().sanitize_for_serialization(pod),
    }
