"""Where steps run: in the run's own process by default; with FABRIC_EXECUTOR=k8s each step in
its own Kubernetes pod, configured from deploy/k8s/executor.yaml (FABRIC_K8S_EXECUTOR_CONFIG to
use another file), which puts the extraction step on a GPU node."""

import os
from pathlib import Path

import dagster as dg
import yaml

DEFAULT_K8S_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "executor.yaml"


def k8s_executor_config() -> dict[str, object]:
    path = Path(os.environ.get("FABRIC_K8S_EXECUTOR_CONFIG") or DEFAULT_K8S_CONFIG)
    if not path.is_file():
        raise FileNotFoundError(
            f"FABRIC_EXECUTOR=k8s needs the executor configuration {path}; "
            "set FABRIC_K8S_EXECUTOR_CONFIG to its path"
        )
    config: dict[str, object] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return config


@dg.definitions
def executor() -> dg.Definitions:
    choice = os.environ.get("FABRIC_EXECUTOR", "")
    if choice == "":
        return dg.Definitions()
    if choice != "k8s":
        raise ValueError(f"FABRIC_EXECUTOR={choice!r}: the only choice is 'k8s' (or unset)")
    from dagster_k8s import k8s_job_executor

    return dg.Definitions(
        executor=k8s_job_executor.configured(k8s_executor_config(), name="k8s_gpu_executor")
    )
