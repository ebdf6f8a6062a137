"""A worker as a Kubernetes pod: what it needs, from deploy/k8s/workers.yaml.

A worker on another host needs three things of the run's: the results database (PostgreSQL; its
URL from a Secret, never in the pod spec), the data root (the task set file, the plan, the
hidden-state shards, the run's worker folder with its Pipes files: a shared volume mounted at the
same path as the orchestrator's FABRIC_HOME) and the image (the product's wheel on a CUDA base,
deploy/docker/Dockerfile). One GPU per pod; a node selector and a toleration put it on a GPU node.
`base_pod_spec` is what `PipesK8sClient` takes as its `base_pod_spec` (camelCase, as the
Kubernetes API writes it); nothing here talks to a cluster.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "workers.yaml"
# The label naming a worker's pod: how the step deletes the pod of a lost worker.
WORKER_LABEL = "inference-fabric/worker"
REQUIRED = ("namespace", "image", "database_url_secret", "data_volume")


class PodConfigError(ValueError):
    """deploy/k8s/workers.yaml (or the file given) is missing a field or has a wrong one."""


@dataclass(frozen=True)
class WorkerPods:
    namespace: str
    image: str
    secret_name: str  # a Secret holding the results database's URL ...
    secret_key: str  # ... under this key
    data_claim: str  # the PersistentVolumeClaim of the shared data root ...
    data_root: str  # ... mounted here: the same path as the orchestrator's FABRIC_HOME
    gpus: int = 1
    python: str = "python"
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path = DEFAULT_CONFIG) -> WorkerPods:
        """Read and check the pods' configuration; PodConfigError names the field to fix."""
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise PodConfigError(f"no worker pod configuration at {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise PodConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise PodConfigError(f"{path}: a mapping of settings expected")
        missing = [key for key in REQUIRED if not raw.get(key)]
        if missing:
            raise PodConfigError(
                f"{path}: missing {', '.join(missing)} (see deploy/k8s/workers.yaml and docs/operating.md)"
            )
        secret, volume = raw["database_url_secret"], raw["data_volume"]
        for name, value, keys in (
            ("database_url_secret", secret, ("name", "key")),
            ("data_volume", volume, ("claim_name", "mount_path")),
        ):
            if not isinstance(value, dict) or any(not value.get(k) for k in keys):
                raise PodConfigError(f"{path}: {name} needs {' and '.join(keys)}")
        gpus = raw.get("gpus_per_worker", 1)
        if not isinstance(gpus, int) or gpus < 0:
            raise PodConfigError(f"{path}: gpus_per_worker {gpus!r} is not a count (0 or more)")
        resources = raw.get("resources") or {}
        return cls(
            namespace=str(raw["namespace"]),
            image=str(raw["image"]),
            secret_name=str(secret["name"]),
            secret_key=str(secret["key"]),
            data_claim=str(volume["claim_name"]),
            data_root=str(volume["mount_path"]),
            gpus=gpus,
            python=str(raw.get("python", "python")),
            requests={k: str(v) for k, v in (resources.get("requests") or {}).items()},
            limits={k: str(v) for k, v in (resources.get("limits") or {}).items()},
            node_selector={k: str(v) for k, v in (raw.get("node_selector") or {}).items()},
            tolerations=list(raw.get("tolerations") or []),
        )

    def base_pod_spec(self) -> dict[str, Any]:
        """The pod spec a worker's pod is built on (image and command are the client's)."""
        limits = dict(self.limits)
        if self.gpus:
            limits["nvidia.com/gpu"] = str(self.gpus)  # GPUs are asked for as limits
        container: dict[str, Any] = {
            "name": "fabric-worker",
            "image": self.image,
            "env": [
                {
                    "name": "FABRIC_DATABASE_URL",
                    "valueFrom": {
                        "secretKeyRef": {"name": self.secret_name, "key": self.secret_key}
                    },
                },
                {"name": "FABRIC_HOME", "value": self.data_root},
                {"name": "HF_HUB_OFFLINE", "value": "1"},
            ],
            "volumeMounts": [{"name": "fabric-data", "mountPath": self.data_root}],
            "resources": {
                **({"requests": self.requests} if self.requests else {}),
                **({"limits": limits} if limits else {}),
            },
        }
        spec: dict[str, Any] = {
            "restartPolicy": "Never",  # a failed worker is replaced by the step, not in place
            "containers": [container],
            "volumes": [
                {"name": "fabric-data", "persistentVolumeClaim": {"claimName": self.data_claim}}
            ],
        }
        if self.node_selector:
            spec["nodeSelector"] = self.node_selector
        if self.tolerations:
            spec["tolerations"] = self.tolerations
        return spec


def worker_label(owner: str) -> str:
    """A worker's owner name as a label value (at most 63 of [A-Za-z0-9-_.], alphanumeric at
    both ends): readable where it fits, else its start and a hash of the whole."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", owner).strip("-_.")
    if len(value) > 63:
        value = f"{value[:50].rstrip('-_.')}-{hashlib.sha256(owner.encode()).hexdigest()[:12]}"
    return value or hashlib.sha256(owner.encode()).hexdigest()[:12]
