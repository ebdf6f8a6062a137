"""A warm engine pool worker killed in the middle of a run, on the product's own path.

    fabric submit tasks.parquet --task-set killed --run --manifest engine.json --lease-seconds 5

runs with the pool on (a fresh data root: the run starts the pool worker). Once the run has
acknowledged some batches, the pool worker is killed (SIGKILL). The run must still end with
every task done exactly once (a worker of the run's own takes over the dead worker's batches
when their leases run out), and the next run on that data root must start a new pool worker by
itself and be served by it. The bench prints what it saw; the last line is one JSON object.

    python bench/pool_fault.py                # GPU: MiniLM-L6's shapes, random fp16 weights
    python bench/pool_fault.py --cpu          # CPU engine, a smaller set
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import exactly_once, write_token_ids
from yardstick import DEFAULT, load_reference, random_model


def fabric(root: Path, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ, "FABRIC_HOME": str(root), "DAGSTER_HOME": str(root),
        "FABRIC_POOL_IDLE_SECONDS": "120", "HF_HUB_OFFLINE": "1",
    }  # fmt: skip
    env.pop("FABRIC_DATABASE_URL", None)
    command = [sys.executable, "-c", "from fabric_pipelines.cli import run_command; run_command()"]
    return subprocess.Popen(
        [*command, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def completed(db_url: str, task_set: str) -> int:
    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.store.db import make_engine

    db = make_engine(db_url)
    try:
        with db.connect() as conn:
            return accounting(conn, task_set).completed
    except LookupError:  # not ingested yet
        return 0
    finally:
        db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--tasks", type=int, help="default 300,000 (GPU), 3,000 (--cpu)")
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="folder with all-MiniLM's tokenizer files")
    args = parser.parse_args()

    import torch

    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
    from fabric_gpu.profile import ConsumerProfile
    from fabric_pipelines.cli.warm_client import stop_runners
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.worker.pool.client import pool_states, stop_pool

    n = args.tasks or (3000 if args.cpu else 300_000)
    reference = load_reference(args.reference)
    tokenizer = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    work = Path(tempfile.mkdtemp(prefix="fabric-pool-fault-"))
    lengths = np.asarray(reference.reference_lengths(n, max_len=512))
    write_token_ids(work / "tasks.parquet", lengths)
    write_token_ids(work / "after.parquet", lengths[:2000], seed=1)
    dtype = torch.float32 if args.cpu else torch.float16
    model = random_model(reference, work / "model", "minilm_l6", tokenizer, dtype)
    profile = (
        ConsumerProfile(8192, 256, 512, 8) if args.cpu else ConsumerProfile(32768, 1024, 512, 8)
    )
    manifest = manifest_for_model(
        str(model), backend="cpu" if args.cpu else "torch",
        dtype="float32" if args.cpu else "float16", profile=profile, hooks=HookSpec((), "mean"),
    )  # fmt: skip
    manifest_file = work / "engine.json"
    manifest_file.write_text(json.dumps(manifest.to_mapping()))
    root = work / "root"
    root.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "dagster_home" / "dagster.yaml", root)
    db_url = database_url(FabricPaths(root))
    result: dict[str, Any] = {"tasks": n, "device": "cpu" if args.cpu else "gpu"}
    try:
        run = fabric(
            root, "submit", str(work / "tasks.parquet"), "--task-set", "killed", "--run",
            "--manifest", str(manifest_file), "--lease-seconds", "5",
        )  # fmt: skip
        killed_pid, done_at_kill = 0, 0
        deadline = time.monotonic() + 300
        while run.poll() is None and time.monotonic() < deadline:
            states = pool_states(root)
            done = completed(db_url, "killed") if states else 0
            if states and states[0].busy_with == "killed" and 0 < done < n // 2:
                killed_pid, done_at_kill = states[0].pid, done
                os.kill(killed_pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        started = time.monotonic()
        output, _ = run.communicate(timeout=600)
        result.update(
            killed_pid=killed_pid,
            completed_when_killed=done_at_kill,
            seconds_after_kill=round(time.monotonic() - started, 2),
            run_exit=run.returncode,
            **exactly_once(db_url, manifest_file, "killed"),
        )
        if run.returncode != 0:
            print(output[-3000:])
        after = fabric(
            root, "submit", str(work / "after.parquet"), "--task-set", "after", "--run",
            "--manifest", str(manifest_file),
        )  # fmt: skip
        after.communicate(timeout=600)
        states = pool_states(root)
        result.update(
            next_run_exit=after.returncode,
            next_run_pool_pid=states[0].pid if states else None,
            next_run_served_by_new_worker=bool(
                states and states[0].pid != killed_pid and states[0].jobs_done == 1
            ),
            next_run=exactly_once(db_url, manifest_file, "after"),
        )
    finally:
        stop_pool(root)
        stop_runners(root)
    print(
        f"killed pool worker {result['killed_pid']} with {result['completed_when_killed']:,} of "
        f"{n:,} tasks done; the run exited {result['run_exit']} {result['seconds_after_kill']} s "
        f"later; exactly once: {result['exactly_once']} (rows {result['rows']:,}, completed "
        f"{result['completed']:,}); next run: exit {result['next_run_exit']}, a new pool worker "
        f"served it: {result['next_run_served_by_new_worker']}, exactly once: "
        f"{result['next_run']['exactly_once']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
