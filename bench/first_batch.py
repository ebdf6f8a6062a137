"""How long the engine waits for its first batch: `fabric submit FILE --task-set S --run`, from
launch to the first batch leased, with the set ingested and planned ahead while Dagster loads
(the default, lib/steps/ahead.py) against FABRIC_AHEAD=off (the steps make both calls, one after
the other, after Dagster's start), alternating which goes first, in one sitting.

Each run has a fresh data root (SQLite) and the same file of token ids (`reference_lengths()`,
1,000,000 by default); the bench watches the ledger from outside and notes when the plan's
batches are registered and when the first is leased, then stops the run with SIGTERM (what a
user's Ctrl-C does: the workers stop, what they acknowledged is kept) and checks it exited. The
engine is the yardstick's random encoder (`--cpu`: MiniLM-L6's shape on the CPU engine, which
leases its first batch as soon as it is planned; else BERT-base's in fp16 on the GPU).

    python bench/first_batch.py                   # GPU
    python bench/first_batch.py --cpu --repeat 3  # the 2-core machine

`--part` times the part alone, without workers or the CLI: in a fresh process each, Dagster's
definitions and instance made (cli/prepare.py) and then the set ingested and planned, against
the two calls started ahead on their thread while Dagster loads; seconds until both are done.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import write_token_ids
from yardstick import DEFAULT, load_reference, random_model

TASK_SET = "first"
STOP_WAIT_SECONDS = 120.0


def watch_ledger(
    db_file: Path, process: subprocess.Popen[str], launched: float
) -> dict[str, float]:
    """Seconds from launch until the ledger has batches, and until one is leased (or the run
    ended first: then what it printed is raised)."""
    seen: dict[str, float] = {}
    while "first_leased" not in seen:
        if process.poll() is not None:
            out, err = process.communicate()
            raise RuntimeError(f"the run ended before its first lease:\n{out[-2000:]}{err[-2000:]}")
        if db_file.is_file():
            try:
                with sqlite3.connect(f"file:{db_file}?mode=ro", uri=True, timeout=1) as conn:
                    registered, leased = conn.execute(
                        "SELECT count(*), coalesce(sum(state != 'queued'), 0) FROM batches"
                    ).fetchone()
            except sqlite3.Error:  # the schema is still being made
                registered = leased = 0
            now = time.perf_counter() - launched
            if registered:
                seen.setdefault("batches_registered", now)
            if leased:
                seen["first_leased"] = now
        time.sleep(0.02)
    return seen


def one_run(root: Path, tasks_file: Path, manifest_file: Path, ahead: bool) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "dagster_home" / "dagster.yaml", root)
    db_file = root / "fabric.db"
    env = {
        **os.environ, "FABRIC_HOME": str(root), "DAGSTER_HOME": str(root),
        "FABRIC_DATABASE_URL": f"sqlite:///{db_file}", "FABRIC_WARM_RUNNER": "0",
        "FABRIC_AHEAD": "on" if ahead else "off",
    }  # fmt: skip
    command = [
        sys.executable, "-c", "from fabric_pipelines.cli import run_command; run_command()",
        "submit", str(tasks_file), "--task-set", TASK_SET, "--run", "--manifest",
        str(manifest_file), "--workers", "1",
    ]  # fmt: skip
    launched = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        seen = watch_ledger(db_file, process, launched)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=STOP_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise RuntimeError(
                f"the run did not stop within {STOP_WAIT_SECONDS:.0f} s of SIGTERM"
            ) from None
        from fabric_pipelines.lib.worker.pool.client import stop_pool

        stop_pool(root)
    return {"ahead": ahead, **{k: round(v, 3) for k, v in seen.items()}}


def part_child(mode: str, tasks_file: Path, manifest_file: Path, root: Path) -> None:
    """One process: Dagster prepared, then ingest and plan ("serial"), or the two started ahead
    while Dagster loads ("ahead"); prints the seconds until all is done as JSON."""
    os.environ["FABRIC_HOME"] = os.environ["DAGSTER_HOME"] = str(root)
    root.mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "dagster_home" / "dagster.yaml", root)
    from fabric_gpu.engines import input_layout
    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.cli.prepare import prepare_pipeline
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.steps import ahead
    from fabric_pipelines.lib.store.db import create_schema, make_engine
    from fabric_pipelines.lib.tasks.inbox import submit
    from fabric_pipelines.lib.tasks.windows import long_input_policy

    paths = FabricPaths(root).ensure()
    url = database_url(paths)
    db = make_engine(url)
    create_schema(db)
    manifest = EngineManifest.load(manifest_file)
    submit(tasks_file, paths.inbox, TASK_SET)
    ingest = ahead.IngestInputs.of(url, paths, TASK_SET, manifest, long_input_policy(), "")
    plan = ahead.PlanInputs.of(url, paths, TASK_SET, manifest, input_layout(manifest), None)
    started = time.perf_counter()
    if mode == "ahead":
        ahead.start_ahead(paths, ingest, plan, manifest)
    prepare_pipeline().result()
    dagster = time.perf_counter() - started
    ahead.ingested(db, paths, ingest)
    ahead.planned(db, paths, plan, manifest)
    print(json.dumps({"mode": mode, "dagster_ready_s": round(dagster, 3),
                      "planned_s": round(time.perf_counter() - started, 3)}))  # fmt: skip


def run_part(work: Path, tasks_file: Path, manifest_file: Path, repeat: int) -> None:
    runs: list[dict[str, Any]] = []
    for k in range(repeat):
        for mode in ("ahead", "serial") if k % 2 == 0 else ("serial", "ahead"):
            root = work / f"part-{k}-{mode}"
            shutil.rmtree(root, ignore_errors=True)
            done = subprocess.run(
                [sys.executable, __file__, "--child", mode, str(tasks_file), str(manifest_file),
                 str(root)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"pair {k}: {runs[-1]}", flush=True)
    on = float(np.mean([r["planned_s"] for r in runs if r["mode"] == "ahead"]))
    off = float(np.mean([r["planned_s"] for r in runs if r["mode"] == "serial"]))
    print(f"Dagster ready, the set ingested and planned: {on:.2f} s ahead against {off:.2f} s "
          f"one after the other: {on / off:.3f}x")  # fmt: skip
    print(json.dumps({"part": True, "runs": runs, "mean_ahead_s": round(on, 3),
                      "mean_serial_s": round(off, 3), "ratio": round(on / off, 3)}))  # fmt: skip


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        part_child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU engine (MiniLM-L6's shape)")
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=2, help="pairs of runs")
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="folder with all-MiniLM's tokenizer files")
    parser.add_argument("--workdir", help="keep the inputs and data roots here")
    parser.add_argument("--part", action="store_true", help="the calls alone (module doc)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
    from fabric_gpu.profile import ConsumerProfile

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fabric-first-batch-"))
    work.mkdir(parents=True, exist_ok=True)
    reference = load_reference(args.reference)
    tokenizer_from = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    lengths = np.asarray(reference.reference_lengths(args.tasks, max_len=512))
    tasks_file = work / f"tasks-{args.tasks}.parquet"
    if not tasks_file.is_file():
        write_token_ids(tasks_file, lengths)
    size = "minilm_l6" if args.cpu else "bert_base"
    dtype = torch.float32 if args.cpu else torch.float16
    model = random_model(reference, work / f"model-{size}", size, tokenizer_from, dtype)
    manifest = manifest_for_model(
        str(model), backend="cpu" if args.cpu else "torch",
        dtype="float32" if args.cpu else "float16",
        profile=ConsumerProfile(8192, 256, 512, 8) if args.cpu else ConsumerProfile(32768, 1024, 512, 8),
        hooks=HookSpec((), "mean"),
    )  # fmt: skip
    manifest_file = work / f"engine-{size}.json"
    manifest_file.write_text(json.dumps(manifest.to_mapping()))
    print(f"{args.tasks:,} tasks, {int(lengths.sum()):,} tokens, {size}, "
          f"{'CPU engine' if args.cpu else 'GPU'}", flush=True)  # fmt: skip
    if args.part:
        run_part(work, tasks_file, manifest_file, args.repeat)
        return

    runs: list[dict[str, Any]] = []
    for k in range(args.repeat):
        for ahead in (True, False) if k % 2 == 0 else (False, True):
            run = one_run(
                work / f"run-{k}-{'ahead' if ahead else 'off'}", tasks_file, manifest_file, ahead
            )
            runs.append(run)
            print(f"pair {k}, ahead {'on ' if ahead else 'off'}: batches registered at "
                  f"{run['batches_registered']:.2f} s, first batch leased at "
                  f"{run['first_leased']:.2f} s", flush=True)  # fmt: skip
    on = float(np.mean([r["first_leased"] for r in runs if r["ahead"]]))
    off = float(np.mean([r["first_leased"] for r in runs if not r["ahead"]]))
    print(f"first batch leased {on:.2f} s after launch ahead, against {off:.2f} s without: "
          f"{on / off:.3f}x ({off - on:+.2f} s earlier)")  # fmt: skip
    print(json.dumps({"tasks": args.tasks, "model": size, "cpu": args.cpu, "runs": runs,
                      "mean_ahead_s": round(on, 3), "mean_off_s": round(off, 3),
                      "ratio": round(on / off, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
