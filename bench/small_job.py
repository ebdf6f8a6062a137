"""A small job, the way users run it: 3,000 real texts through the real all-MiniLM-L6-v2.

Each way is timed from launching its command to its vectors stored, tokenisation included:

  encode   `SentenceTransformer(model).encode(texts, batch_size=32)` in a fresh process:
           import, model load and encode (cold); then the same encode again in that process
           (warm: what a user who keeps a notebook open sees).
  fabric   `fabric submit texts.parquet --task-set small --run --manifest engine.json` in a
           fresh process on a fresh data root, to the vectors stored and the index published
           (cold: no engine pool yet; the run starts one, whose worker loads the model while
           the texts are tokenised and planned).
  pool     the same command again on that data root, as a second task set, with the warm
           runner off (FABRIC_WARM_RUNNER=0): the warm engine pool's worker, left by the first
           run, runs it with its model loaded; the command itself imports Dagster and the rest.
  runner   the same again, as a third task set, once the warm runner the first run left serves:
           its forked child runs the command with Dagster, the definitions, torch and FAISS
           loaded, and the pool's worker runs the engine (what a user's next job meets).

Every run passes --no-reuse: the same texts again would otherwise be copied from the first
run's rows, and the warm runs would time reuse, not extraction. Each run is checked (one stored
row per task, and the engine's own item count equal to the texts): when a check fails, the
bench prints no ratio.

The texts are standard-library docstrings (real prose and code comments of varied length; none of
the project's own data). Parity: the cosine of each stored vector against encode()'s vector of
the same text; the smallest is reported. The last line is one JSON object.

    python bench/small_job.py          # GPU: torch engine and encode() on CUDA, both fp16
    python bench/small_job.py --cpu    # CPU engine and encode() on the CPU, both fp32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TASK_SET = "small"
ENCODE_BATCH = 32  # encode()'s default

# Run in a fresh process: the user's script. It prints one JSON line of its own timings and
# leaves its vectors in the .npy file given.
ENCODE_SCRIPT = f"""
import json, sys, time
started = time.perf_counter()
import pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer
texts_file, model_dir, device, half, out = sys.argv[1:6]
texts = pq.read_table(texts_file).column("text").to_pylist()
model = SentenceTransformer(model_dir, device=device)
if half == "1":
    model = model.half()
loaded = time.perf_counter()
vectors = model.encode(texts, batch_size={ENCODE_BATCH})
cold_done = time.perf_counter()
again = model.encode(texts, batch_size={ENCODE_BATCH})
warm_done = time.perf_counter()
import numpy as np
np.save(out, vectors.astype("float32"))
print(json.dumps({{
    "import_and_load_s": loaded - started,
    "encode_s": cold_done - loaded,
    "warm_encode_s": warm_done - cold_done,
}}))
"""


def write_texts(path: Path, n: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fabric_pipelines.cli.demo_corpus import stdlib_docstrings

    texts = [text for _, text in stdlib_docstrings(n)]
    if len(texts) < n:
        raise SystemExit(f"only {len(texts)} docstrings in this Python's standard library")
    ids = [f"d{i}" for i in range(n)]
    pq.write_table(pa.table({"id": ids, "text": texts}), path)
    return texts


def run_encode(texts_file: Path, model_dir: Path, gpu: bool, out: Path) -> dict[str, Any]:
    """encode() in a fresh process: the process's wall time is the cold figure."""
    command = [
        sys.executable, "-c", ENCODE_SCRIPT, str(texts_file), str(model_dir),
        "cuda" if gpu else "cpu", "1" if gpu else "0", str(out),
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_offline_env())
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit(f"encode() failed (exit {done.returncode})")
    inner = json.loads(done.stdout.strip().splitlines()[-1])
    # Cold: the whole process up to the first encode's end (its second encode is not counted).
    return {"cold_s": wall - inner["warm_encode_s"], "warm_s": inner["warm_encode_s"], **inner}


def model_max_seq_len(model_dir: Path) -> int:
    """The length encode() cuts texts to: the model's sentence-transformers setting."""
    config = json.loads((model_dir / "sentence_bert_config.json").read_text())
    return int(config["max_seq_length"])


def write_manifest(path: Path, model_dir: Path, gpu: bool) -> None:
    """The model as encode() runs it: texts cut to its max_seq_length (the run passes
    --truncate, as encode() cuts silently), pooled mean embedding only."""
    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.profile import ConsumerProfile

    seq = model_max_seq_len(model_dir)
    profile = ConsumerProfile(32768, 1024, seq, 8) if gpu else ConsumerProfile(8192, 256, seq, 8)
    manifest = manifest_for_model(
        str(model_dir), backend="torch" if gpu else "cpu",
        dtype="float16" if gpu else "float32", profile=profile, hooks=HookSpec((), "mean"),
    )  # fmt: skip
    path.write_text(json.dumps(manifest.to_mapping(), indent=2))


def run_fabric(
    root: Path, texts_file: Path, manifest_file: Path, task_set: str, runner: bool = True
) -> dict[str, Any]:
    """`fabric submit … --run` in a fresh process on `root` (SQLite, the default), with the warm
    engine pool on (its default idle time), and the warm runner unless `runner` is False."""
    if not root.exists():
        root.mkdir(parents=True)
        shutil.copy(Path(__file__).resolve().parents[1] / "dagster_home" / "dagster.yaml", root)
    env = {**_offline_env(), "FABRIC_HOME": str(root), "DAGSTER_HOME": str(root)}
    env.pop("FABRIC_DATABASE_URL", None)
    env.pop("FABRIC_POOL_IDLE_SECONDS", None)
    env.pop("FABRIC_WARM_RUNNER", None)
    if not runner:
        env["FABRIC_WARM_RUNNER"] = "0"
    report = root / f"report-{task_set}.json"
    command = [
        sys.executable, "-c", "from fabric_pipelines.cli import run_command; run_command()",
        "submit", str(texts_file), "--task-set", task_set, "--run",
        "--manifest", str(manifest_file), "--truncate", "--report", str(report),
        "--no-reuse",  # each run computes its texts: the same texts again would only be copied
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"fabric submit --run failed (exit {done.returncode}) in {root}")
    return {"wall_s": wall, "report": json.loads(report.read_text())}


def stored_vectors(
    root: Path, manifest_file: Path, task_set: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The set's vectors by task id, and its exactly-once check, read back from its database."""
    from sqlalchemy import func, select

    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_pipelines.lib.store.models import Embedding, Task, TaskSet

    manifest = EngineManifest.load(manifest_file)
    db = make_engine(database_url(FabricPaths(root)))
    with db.connect() as conn:
        counts = accounting(conn, task_set, manifest.model_key)
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).scalar_one()
        rows = conn.execute(
            select(func.count()).select_from(Embedding).where(Embedding.task_set_id == set_id)
        ).scalar_one()
        found = conn.execute(
            select(Task.task_id, Embedding.vector)
            .join(
                Task,
                (Task.task_set_id == Embedding.task_set_id)
                & (Task.record_no == Embedding.record_no),
            )
            .where(Embedding.task_set_id == set_id)
        ).all()
    db.dispose()
    vectors = {task_id: np.frombuffer(vector, dtype="<f4") for task_id, vector in found}
    check = {
        "tasks": counts.tasks,
        "completed": counts.completed,
        "reused": counts.reused,
        "failed": counts.failed,
        "rows": int(rows),
        # One row per task done, computed or reused (a reused task's row is a copy).
        "exactly_once": bool(counts.finished and rows == counts.completed + counts.reused),
    }
    return vectors, check


def parity(stored: dict[str, np.ndarray], reference: np.ndarray) -> dict[str, Any]:
    """Cosine of each stored vector against encode()'s for the same text."""
    if not stored:
        return {"compared": 0, "min_cosine": None, "mean_cosine": None}
    order = sorted(stored, key=lambda task_id: int(task_id[1:]))
    ours = np.stack([stored[t] for t in order]).astype(np.float64)
    theirs = reference[[int(t[1:]) for t in order]].astype(np.float64)
    cosine = (ours * theirs).sum(1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    )
    return {
        "compared": len(order),
        "min_cosine": round(float(cosine.min()), 6),
        "mean_cosine": round(float(cosine.mean()), 6),
    }


def count_tokens(model_dir: Path, texts: list[str]) -> int:
    from fabric_gpu.model import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return sum(len(e.ids) for e in tokenizer.encode_batch(texts))


def _offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU engine and encode() on the CPU")
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--workdir", help="keep inputs and data roots here (default: temporary)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir

    gpu = not args.cpu
    if gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu")
    model_dir = resolve_model_dir(DEFAULT_MODEL_ID)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fabric-small-"))
    work.mkdir(parents=True, exist_ok=True)
    texts_file = work / "texts.parquet"
    texts = write_texts(texts_file, args.texts)
    tokens = count_tokens(model_dir, texts)
    print(f"{len(texts):,} docstrings, {tokens:,} tokens, {'GPU' if gpu else 'CPU'}", flush=True)

    encode = run_encode(texts_file, model_dir, gpu, work / "encode.npy")
    print(
        f"encode(): cold {encode['cold_s']:.2f} s (import and load {encode['import_and_load_s']:.2f} s"
        f", encode {encode['encode_s']:.2f} s), warm {encode['warm_s']:.2f} s",
        flush=True,
    )
    manifest_file = work / "engine.json"
    write_manifest(manifest_file, model_dir, gpu)
    root = work / f"fabric-{int(time.time())}"
    from fabric_pipelines.cli.warm_client import runner_states, stop_runners
    from fabric_pipelines.lib.worker.pool.client import pool_states, stop_pool

    try:
        cold = run_fabric(root, texts_file, manifest_file, TASK_SET)
        pooled = pool_states(root)
        warm = run_fabric(root, texts_file, manifest_file, f"{TASK_SET}-again", runner=False)
        served = [s.jobs_done for s in pool_states(root)]
        deadline = time.monotonic() + 120
        while not any(r["serving"] for r in runner_states(root)) and time.monotonic() < deadline:
            time.sleep(0.5)  # the runner the first run left is still importing
        runner = run_fabric(root, texts_file, manifest_file, f"{TASK_SET}-runner")
    finally:
        stop_pool(root)  # the pool worker would otherwise idle on for its idle time
        stop_runners(root)
    if not pooled or served != [2]:
        print(f"warning: the second run was not served by the first run's pool worker ({served})")
    by_runner = runner["report"].get("process", {}).get("warm_runner") is True
    if not by_runner:
        print("warning: the third run was not served by the warm runner")
    reference = np.load(work / "encode.npy")
    checks = {}
    runs = {"cold": (cold, TASK_SET), "warm pool": (warm, f"{TASK_SET}-again"),
            "warm runner": (runner, f"{TASK_SET}-runner")}  # fmt: skip
    failed_checks = []
    for name, (run, task_set) in runs.items():
        stored, check = stored_vectors(root, manifest_file, task_set)
        match = parity(stored, reference)
        # The engine's own count: every text computed, none of them copied from an earlier run.
        step = run["report"].get("extract", {}).get("extraction_outputs", {})
        check["engine_items"] = step.get("engine_items")
        check["computed_all"] = check["engine_items"] == check["tasks"] - check["failed"]
        checks[name] = {**check, **{f"parity_{k}": v for k, v in match.items()}}
        failed_checks += [f"{name}: {k}" for k in ("exactly_once", "computed_all") if not check[k]]
        print(
            f"fabric submit --run, {name}: {run['wall_s']:.2f} s; parity: "
            f"{match['compared']:,} vectors, min cosine {match['min_cosine']}, mean "
            f"{match['mean_cosine']}; rows {check['rows']:,} = completed {check['completed']:,} "
            f"+ reused {check['reused']:,} of {check['tasks']:,} (failed {check['failed']}); "
            f"exactly once: {check['exactly_once']}; the engine computed "
            f"{check['engine_items']} items",
            flush=True,
        )
        print(f"  clock: {_clock(run['report'])}", flush=True)
    if failed_checks:  # a ratio over runs that did not do the work measures nothing
        print(f"checks failed, no ratios: {', '.join(failed_checks)}", flush=True)
    else:
        for name, (run, _) in runs.items():
            print(
                f"{name}: {run['wall_s'] / encode['cold_s']:.2f}x encode() cold, "
                f"{run['wall_s'] / encode['warm_s']:.2f}x encode() warm "
                f"(encode() warm {run['wall_s'] - encode['warm_s']:+.2f} s)",
                flush=True,
            )
    ok = not failed_checks
    result = {
        "device": "gpu" if gpu else "cpu",
        "texts": len(texts),
        "tokens": tokens,
        "encode_cold_s": round(encode["cold_s"], 3),
        "encode_warm_s": round(encode["warm_s"], 3),
        "fabric_cold_s": round(cold["wall_s"], 3),
        "fabric_warm_pool_s": round(warm["wall_s"], 3),
        "fabric_cold_vs_encode_cold": round(cold["wall_s"] / encode["cold_s"], 3) if ok else None,
        "fabric_warm_pool_minus_encode_warm_s": (
            round(warm["wall_s"] - encode["warm_s"], 3) if ok else None
        ),
        "fabric_warm_runner_s": round(runner["wall_s"], 3),
        "fabric_warm_runner_minus_encode_warm_s": (
            round(runner["wall_s"] - encode["warm_s"], 3) if ok else None
        ),
        "checks_failed": failed_checks,
        "served_by_pool": served == [2],
        "served_by_runner": by_runner,
        "cold": checks["cold"],
        "warm_pool": checks["warm pool"],
        "warm_runner": checks["warm runner"],
    }
    print(json.dumps(result))


def _clock(report: dict[str, Any]) -> str:
    """The run's CLI marks and Dagster steps, in seconds from the CLI's start."""
    clock = report.get("clock", {})
    marks = clock.get("marks", {})
    start = marks.get("cli_started", 0.0)
    events = dict(marks)
    for step, ends in clock.get("steps", {}).items():
        events.update({f"{step}:{end}": at for end, at in ends.items()})
    extraction = report.get("extract", {}).get("extraction_outputs", {})
    for i, timeline in enumerate(extraction.get("worker_timelines", [])):
        began = timeline.get("started_at", 0.0)
        events.update(
            {f"worker{i}:{k}": began + v for k, v in timeline.items() if k != "started_at"}
        )
    ordered = sorted(events.items(), key=lambda item: item[1])
    stages = {
        k: extraction.get(k) for k in ("extract_seconds", "pulling_seconds", "verify_seconds")
    }
    return ", ".join(f"{name} {at - start:.2f}" for name, at in ordered) + f"; extraction {stages}"


if __name__ == "__main__":
    main()
