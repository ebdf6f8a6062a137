"""Worker commands: the worker process itself, and `fabric workers` (the engine pool and warm runners: status, start, stop)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from fabric_pipelines.cli.environment import prepare_environment
from fabric_pipelines.cli.pipeline import engine_manifest


def run_worker_process(argv: list[str]) -> int:
    """`fabric worker ...`: one worker process (what `python -m fabric_pipelines.lib.worker.main` runs)."""
    from fabric_pipelines.lib.worker.main import main as worker_main

    prepare_environment()
    return worker_main(argv)


def cmd_workers(args: argparse.Namespace) -> int:
    """The warm engine pool: start its workers for a manifest, stop them, or show them."""
    from fabric_pipelines.cli.warm_client import runner_states, stop_runners
    from fabric_pipelines.lib.worker.pool.client import describe, pool_states, stop_pool

    if args.action == "pod-spec":
        return _print_pod_spec(args)
    root = prepare_environment()
    if args.action == "status":
        states = pool_states(root)
        runners = runner_states(root)
        if args.json:  # the pool workers (a list, as before); runners are shown as text
            print(json.dumps([state.__dict__ for state in states], indent=1))
            return 0
        if not states:
            print("no pool workers (a run starts them; or: fabric workers start --manifest FILE)")
        for state in states:
            print(describe(state))
        for runner in runners:
            doing = "serves the next fabric run" if runner["serving"] else "loading"
            print(f"warm runner {runner['key']}: pid {runner['pid']}, {doing}")
        return 0
    if args.action == "stop":
        stopped = stop_pool(root)
        runner_pids = stop_runners(root)
        print(
            f"stopped {len(stopped)} pool worker(s){': ' + ', '.join(stopped) if stopped else ''}"
            f" and {len(runner_pids)} warm runner(s)"
        )
        return 0
    return _start_pool(root, args)


def _start_pool(root: Path, args: argparse.Namespace) -> int:
    from fabric_pipelines.lib.core.files import write_bytes
    from fabric_pipelines.lib.worker.devices import visible_gpus
    from fabric_pipelines.lib.worker.pool.client import (
        START_TIMEOUT_S,
        describe,
        idle_seconds_setting,
        manifest_sha256,
        pool_folder,
        pool_states,
        slots_for,
        start_pool_worker,
        stop_pool,
        wait_until_serving,
        worker_threads,
    )
    from fabric_pipelines.lib.worker.pool.run import device_of

    try:
        manifest = engine_manifest(args)
        idle = idle_seconds_setting(args.pool_idle_seconds)
    except (OSError, ValueError) as exc:
        print(f"fabric workers start: {exc}", file=sys.stderr)
        return 2
    if idle <= 0:
        print(
            "fabric workers start: the pool is off (idle time 0): give --pool-idle-seconds "
            "or set FABRIC_POOL_IDLE_SECONDS above 0",
            file=sys.stderr,
        )
        return 2
    gpus = visible_gpus() if manifest.backend != "cpu" else 0
    count = args.workers if args.workers is not None else max(1, gpus)
    if manifest.backend != "cpu" and count > gpus:
        print(f"fabric workers start: {count} worker(s) but {gpus} GPU(s) visible", file=sys.stderr)
        return 2
    sha = manifest_sha256(manifest)
    manifest_path = pool_folder(root) / f"engine-{sha[:16]}.json"
    write_bytes(manifest_path, json.dumps(manifest.to_mapping()).encode())
    slots = slots_for(manifest, list(range(count)) if gpus else None, count)
    live = {state.slot: state for state in pool_states(root)}
    busy = [s for s in slots if s in live and live[s].manifest_sha256 != sha and live[s].busy_with]
    for slot in busy:  # never stopped mid-job: started again once it is free
        print(f"{slot}: busy with task set {live[slot].busy_with!r} for another model; left as is")
    replace = [s for s in slots if s in live and live[s].manifest_sha256 != sha and s not in busy]
    if replace:
        stop_pool(root, replace)  # a slot serves one manifest: the newest start wins
    threads = worker_threads(manifest, count)
    started = {}
    for slot in slots:
        if (slot not in live or slot in replace) and slot not in busy:
            started[slot] = start_pool_worker(
                root, slot, manifest_path, idle_seconds=idle, device=device_of(slot),
                threads=threads,
            )  # fmt: skip
    for slot, process in started.items():
        print(f"{slot}: loading {manifest.model_key} (pid {process.pid}) ...", flush=True)
        if wait_until_serving(root, slot, process, START_TIMEOUT_S) is None:
            log = pool_folder(root) / f"{slot}.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            print(
                f"fabric workers start: {slot} did not come up; its log:\n{tail}", file=sys.stderr
            )
            return 1
    for state in pool_states(root):
        print(describe(state))
    return 0


def _print_pod_spec(args: argparse.Namespace) -> int:
    """The pod worker 0 of a set would get on Kubernetes, as YAML; nothing is sent anywhere."""
    import yaml

    from fabric_pipelines.defs.k8s_workers import pod_manifest, worker_pod
    from fabric_pipelines.lib.worker.launch import LaunchSettings, worker_invocation
    from fabric_pipelines.lib.worker.pods import DEFAULT_CONFIG, PodConfigError, WorkerPods

    try:
        pods = WorkerPods.load(Path(args.pod_config) if args.pod_config else DEFAULT_CONFIG)
    except PodConfigError as exc:
        print(f"fabric workers pod-spec: {exc}", file=sys.stderr)
        return 2
    root = Path(pods.data_root)
    folder = root / "workers" / f"{args.task_set}-RUN"  # a run's folder, named when it starts
    settings = LaunchSettings(args.task_set, folder / "engine.json", root, "(from the Secret)")
    invocation = worker_invocation(settings, 0, folder, threads=0, python=pods.python)
    pod = worker_pod(pods, invocation, f"fabric-worker-{args.task_set}-0".lower())
    print(yaml.safe_dump(pod_manifest(pod), sort_keys=False), end="")
    return 0
