"""The product end to end, as users run it, against its own engine measured in the same run.

For each model, input mode and database asked for, this makes a fresh data root and runs the
command a user runs, in a process of its own:

    fabric submit tasks.parquet --task-set e2e --run --manifest engine.json --workers G

and times it from launch to exit (submit, ingest/tokenise, plan, engine warm-up, extraction,
writes, the index build and its quality check, all inside). The task set has N tasks with the
yardstick's `reference_lengths()` (../shared/bench/reference_extract.py), either as token ids
(Parquet `token_ids`) or as text (Parquet `text` of real vocabulary words whose token count
follows the same lengths). The model is the yardstick's `random_encoder` of that size, saved as
a model folder with all-MiniLM's tokenizer (random fp16 weights on the GPU; fp32 on the CPU).

The peer is the engine alone on the same lengths in the same run: on a GPU `bench/extract.py`'s
path (planner batches through the runtime, outputs drained to pinned host memory, no database);
on the CPU (`--cpu`) the CPU engine's forward over the planner's padded batches.

After each run the bench checks what was promised: one embedding row per completed task, no
batch left queued or in flight, and the ledger's accounting balanced (printed as exactly_once).

    python bench/e2e.py                      # one GPU: BERT-base, 1,000,000 token-id tasks, SQLite
    python bench/e2e.py --models minilm_l6 --modes ids,text --dbs sqlite,postgresql
    python bench/e2e.py --gpus 2 --tasks 2000000   # one GPU and two, same run: the ratio
    python bench/e2e.py --variants float32,int8,binary  # the engine storing each variant
    python bench/e2e.py --cpu                # CPU engine, a few thousand tasks: minutes on 2 cores
    python bench/e2e.py --cpu --workers 2    # and with two worker processes: the ratio

PostgreSQL: `--pg-url` (a server URL; each run gets a scratch database), else the `pgserver`
wheel's own server when installed. The last line is one JSON object keyed by
"model/mode/database[/gpus=N or /workers=N]".
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # fabric_testing, beside the product
from yardstick import DEFAULT, load_reference, random_model

TASK_SET = "e2e"
CLS, SEP = 101, 102  # the BERT vocabulary's [CLS] and [SEP]


# ---- inputs ----------------------------------------------------------------------------------


def write_token_ids(path: Path, lengths: np.ndarray, seed: int = 0) -> None:
    """Parquet of `id` and `token_ids` ([CLS] random ids [SEP]), built from flat buffers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(1000, 30000, int(offsets[-1]), dtype=np.int32)
    tokens[offsets[:-1]] = CLS
    tokens[offsets[1:] - 1] = SEP
    ids = pa.array([f"t{i}" for i in range(len(lengths))], pa.string())
    values = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))
    pq.write_table(pa.table({"id": ids, "token_ids": values}), path)


def document_lengths(n_tasks: int, seed: int = 0) -> np.ndarray:
    """`--modes docs`: n_tasks / 200 long documents of 600 to 20,000 tokens (log-uniform), each
    split into 512-token windows by the product's default `--long-inputs chunk`."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(600), np.log(20_000), max(n_tasks // 200, 1))).astype(np.int64)


def window_lengths(lengths: np.ndarray, max_seq_len: int, overlap: int) -> np.ndarray:
    """The tasks the product makes of documents of `lengths` (tasks/windows.py): the engine-alone
    peer runs the same."""
    from fabric_pipelines.lib.tasks.windows import window_starts

    counts = [
        len(window_starts(int(n), max_seq_len, overlap)) if n > max_seq_len else 1 for n in lengths
    ]
    return np.concatenate(
        [
            np.full(c, max_seq_len) if n > max_seq_len else [n]
            for c, n in zip(counts, lengths, strict=True)
        ]
    ).astype(np.int64)


def vocabulary_words(tokenizer_dir: Path) -> list[str]:
    """Whole lower-case ASCII words of the vocabulary: each one token, alone or before a '.'."""
    words = (tokenizer_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return [w for w in words if len(w) > 1 and w.isascii() and w.isalpha() and w.islower()]


def write_texts(path: Path, lengths: np.ndarray, words: list[str], seed: int = 0) -> None:
    """Parquet of `id` and `text`: word sentences, frequent words more often (Zipf-like), each
    text as many tokens as its length once [CLS] and [SEP] are added."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    vocab = np.array(words, dtype=object)
    weights = 1.0 / (np.arange(len(vocab)) + 20.0)
    slots = np.maximum(lengths - 2, 1)
    picks = vocab[rng.choice(len(vocab), int(slots.sum()), p=weights / weights.sum())]
    stops = rng.random(int(slots.sum())) < 0.08  # a '.' takes a word's slot: one token too
    picks[stops] = "."
    texts, start = [], 0
    for n in slots.tolist():
        texts.append(" ".join(picks[start : start + n].tolist()).replace(" .", "."))
        start += n
    ids = pa.array([f"t{i}" for i in range(len(lengths))], pa.string())
    pq.write_table(pa.table({"id": ids, "text": pa.array(texts, pa.string())}), path)


# ---- the engine alone ------------------------------------------------------------------------


def engine_only_gpu(reference: Any, size: str, lengths: np.ndarray) -> dict[str, Any]:
    """bench/extract.py's path: planner batches through the runtime, drained to host memory."""
    import torch
    from extract import run_ours

    from fabric_gpu.engines.torch_engine import TorchEngine
    from fabric_gpu.manifest import EngineManifest, HookSpec

    manifest = EngineManifest.from_mapping(
        {
            "model_id": f"random:{size}", "weights_sha256": "0" * 64, "backend": "torch",
            "dtype": "float16", "max_batch_tokens": 32768, "max_batch_items": 1024,
            "max_seq_len": 512, "seq_granularity": 8, "hooks": HookSpec((), "mean").to_mapping(),
        }
    )  # fmt: skip
    model = reference.random_encoder(size)
    engine = TorchEngine(manifest, model=model)
    tokens = np.random.default_rng(0).integers(1000, 30000, int(lengths.sum())).astype(np.int32)
    # One timed pass once a set is large (tens of seconds); graphs are captured before timing.
    passes = 1 if lengths.sum() > 20_000_000 else 2
    result = run_ours(engine, tokens, lengths, passes=passes)
    del engine, model
    torch.cuda.empty_cache()
    return {
        "tokens_per_s": result["tokens_per_s"],
        "gpu_idle_fraction": result["gpu_idle_fraction"],
    }


def engine_only_cpu(model_dir: Path, lengths: np.ndarray, profile: Any) -> dict[str, Any]:
    """The CPU engine's forward over the planner's padded batches (best of two passes)."""
    from fabric_gpu.batching import plan_batches
    from fabric_gpu.engines import create_engine
    from fabric_gpu.engines.base import gather_padded
    from fabric_gpu.manifest import HookSpec, manifest_for_model

    manifest = manifest_for_model(
        str(model_dir), backend="cpu", dtype="float32", profile=profile, hooks=HookSpec((), "mean")
    )
    engine = create_engine(manifest)
    tokens = np.random.default_rng(0).integers(1000, 30000, int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    plan = plan_batches(lengths, profile)
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        for b in range(plan.n_batches):
            rows = plan.order[plan.item_start[b] : plan.item_start[b] + plan.item_count[b]]
            engine.forward(gather_padded(tokens, offsets, rows, int(plan.seq_len[b]), 0))
        best = min(best, time.perf_counter() - start)
    engine.close()
    return {"tokens_per_s": float(lengths.sum()) / best}


# ---- databases -------------------------------------------------------------------------------


@contextlib.contextmanager
def postgres_server(url: str | None, folder: Path) -> Iterator[str]:
    """A PostgreSQL server URL: the one given, else pgserver's own (started here)."""
    if url:
        yield url
        return
    try:
        import pgserver
    except ImportError as exc:
        raise SystemExit(f"--dbs postgresql needs --pg-url or the pgserver wheel: {exc}") from exc
    server = pgserver.get_server(folder / "pg", cleanup_mode="delete")
    socket_dir = server.get_uri().split("host=", 1)[1]
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={socket_dir}"
    finally:
        server.cleanup()


@contextlib.contextmanager
def database_for(db: str, root: Path, pg_server: str | None) -> Iterator[str]:
    if db == "sqlite":
        yield f"sqlite:///{root}/fabric.db"
        return
    from fabric_testing.scratch_db import scratch_database

    assert pg_server is not None
    with scratch_database(pg_server, "fabric_e2e") as url:
        yield url


# ---- one product run -------------------------------------------------------------------------


def run_product(
    root: Path,
    tasks_file: Path,
    manifest_file: Path,
    db_url: str,
    gpus: int,
    task_set: str = TASK_SET,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`fabric submit FILE --task-set e2e --run` in a fresh process; wall time from launch to
    exit, the run's own report, and the exactly-once check read back from the database."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "dagster_home" / "dagster.yaml", root)
    report_file = root / "report.json"
    env = {**os.environ, "FABRIC_HOME": str(root), "DAGSTER_HOME": str(root)}
    env["FABRIC_DATABASE_URL"] = db_url
    # Each run has a fresh data root, which no warm runner can serve: leave none behind, whose
    # imports would share the next run's CPUs.
    env["FABRIC_WARM_RUNNER"] = "0"
    command = [
        sys.executable, "-c", "from fabric_pipelines.cli import run_command; run_command()",
        "submit", str(tasks_file), "--task-set", task_set, "--run",
        "--manifest", str(manifest_file), "--workers", str(gpus), "--report", str(report_file),
        *extra,
    ]  # fmt: skip
    launched_at, start = time.time(), time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    from fabric_pipelines.lib.worker.pool.client import stop_pool

    stop_pool(root)  # the run's pool workers, idle now: their GPUs free for the next run
    if done.returncode != 0 or not report_file.is_file():
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise ProductRunFailed(f"the product run failed (exit {done.returncode}) in {root}")
    report = json.loads(report_file.read_text())
    return {
        "wall_seconds": wall,
        "report": report,
        "clock": run_clock(report, launched_at, launched_at + wall),
        **exactly_once(db_url, manifest_file, task_set),
    }


def run_clock(report: dict[str, Any], launched_at: float, exited_at: float) -> dict[str, float]:
    """Every milestone of the run in seconds from launch, in order: the CLI's marks, each
    Dagster step's start and end, and each worker's timeline."""
    clock = report.get("clock", {})
    events = {f"cli:{name}": at for name, at in clock.get("marks", {}).items()}
    for step, ends in clock.get("steps", {}).items():
        events.update({f"{step}:{end}": at for end, at in ends.items()})
    timelines = report["extract"].get("extraction_outputs", {}).get("worker_timelines", [])
    for i, timeline in enumerate(timelines):
        started = timeline.get("started_at")
        if started is None:
            continue
        events[f"worker{i}:started"] = started
        for name, offset in timeline.items():
            if name != "started_at":
                events[f"worker{i}:{name}"] = started + offset
    events["exit"] = exited_at
    return {k: round(v - launched_at, 2) for k, v in sorted(events.items(), key=lambda kv: kv[1])}


class ProductRunFailed(RuntimeError):
    pass


def rebuild_index(root: Path, db_url: str, receipt_path: str, cpu: bool) -> dict[str, Any]:
    """`fabric index rebuild --receipt` in the run's data root: on this machine as it is, or
    with no GPU visible (CUDA_VISIBLE_DEVICES empty) as a CPU-only machine would."""
    env = {**os.environ, "FABRIC_HOME": str(root), "DAGSTER_HOME": str(root)}
    env["FABRIC_DATABASE_URL"] = db_url
    # Each run has a fresh data root, which no warm runner can serve: leave none behind, whose
    # imports would share the next run's CPUs.
    env["FABRIC_WARM_RUNNER"] = "0"
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [
        sys.executable, "-c", "from fabric_pipelines.cli import run_command; run_command()",
        "index", "rebuild", "--receipt", receipt_path, "--no-repair",
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {
        "on": "cpu" if cpu else "this machine",
        "matches": done.returncode == 0 and "MATCH" in lines,
        "seconds": round(time.perf_counter() - start, 2),
        "output": lines[-4:] or done.stderr.splitlines()[-3:],
    }


def exactly_once(db_url: str, manifest_file: Path, task_set: str = TASK_SET) -> dict[str, Any]:
    """The set's rows = its completed tasks (the primary key rules out duplicates), a row per
    completed or reused task through the links, nothing queued or in flight, and tasks =
    completed + reused + failed."""
    from sqlalchemy import func, select

    from fabric_gpu.manifest import EngineManifest
    from fabric_pipelines.lib.broker.ledger import accounting
    from fabric_pipelines.lib.store.db import make_engine
    from fabric_pipelines.lib.store.models import Embedding, TaskSet, task_embeddings

    manifest = EngineManifest.load(manifest_file)
    db = make_engine(db_url)
    with db.connect() as conn:
        counts = accounting(conn, task_set, manifest.model_key)
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).scalar_one()
        rows = conn.execute(  # the rows the set computed
            select(func.count()).select_from(Embedding).where(Embedding.task_set_id == set_id)
        ).scalar_one()
        per_task = conn.execute(  # a row per task: its own or the one it reused
            select(func.count())
            .select_from(task_embeddings)
            .where(task_embeddings.c.task_set_id == set_id)
        ).scalar_one()
    db.dispose()
    stored = counts.completed + counts.reused  # reused: links to stored rows (lib/broker/reuse.py)
    balanced = counts.finished and counts.tasks == stored + counts.failed
    # A chunked document's own row comes beside its windows' (lib/results/documents.py).
    documents = counts.documents
    combined = 0 if documents is None else documents.stored - (stored - documents.windows_stored)
    return {
        "tasks": counts.tasks,
        "completed": counts.completed,
        "failed": counts.failed,
        "reused": counts.reused,
        "rows": int(rows),
        "exactly_once": bool(
            balanced and rows == counts.completed + combined and per_task == stored + combined
        ),
        **({"documents": documents.to_mapping()} if documents is not None else {}),
    }


def stage_seconds(report: dict[str, Any]) -> dict[str, float]:
    extract, index = report["extract"], report["index"]
    tasks = extract.get("tokenised_tasks", {})
    plan = extract.get("shape_batches", {})
    out = extract.get("extraction_outputs", {})
    built = index.get("vector_index", {})
    stages = {
        "ingest_tokenise": tasks.get("seconds", 0.0),
        "plan": plan.get("seconds", 0.0),
        "extraction": out.get("seconds", 0.0),
        "extraction_workers": out.get("extract_seconds", 0.0),
        "extraction_pulling": out.get("pulling_seconds", 0.0),
        "extraction_settle": out.get("settle_seconds", 0.0),
        "extraction_verify": out.get("verify_seconds", 0.0),
        "index": built.get("seconds", 0.0),
    }
    phases = built.get("phase_seconds") or {}
    stages.update({f"index_{name}": value for name, value in phases.items()})
    parts = built.get("quality_seconds") or {}  # a breakdown of index_quality
    stages.update({f"index_quality_{name}": value for name, value in parts.items()})
    stages["pipeline_total"] = report.get("seconds", 0.0)
    return {k: round(float(v), 3) for k, v in stages.items()}


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU engine on a small set")
    parser.add_argument("--tasks", type=int, help="tasks per set (default 1,000,000; --cpu 3,000)")
    parser.add_argument("--models", help="yardstick sizes (default bert_base; --cpu minilm_l6)")
    parser.add_argument(
        "--modes", default="ids",
        help="ids, text, docs (long token-id documents, chunked into windows) (comma-separated)",
    )  # fmt: skip
    parser.add_argument("--dbs", default="sqlite", help="sqlite, postgresql or both")
    parser.add_argument(
        "--variants", default="float32",
        help="output variants the engine stores, each a run of its own (e.g. float32,int8,binary)",
    )  # fmt: skip
    parser.add_argument("--gpus", type=int, default=1, help="also run on this many GPUs")
    parser.add_argument(
        "--workers", type=int, default=1,
        help="with --cpu: also run with this many worker processes (the ratio against one)",
    )  # fmt: skip
    parser.add_argument("--pg-url", default=os.environ.get("FABRIC_BENCH_PG_URL"))
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="folder with all-MiniLM's tokenizer files")
    parser.add_argument("--workdir", help="keep inputs and data roots here (default: temporary)")
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="after each run, rebuild its index from the receipt here and with no GPU visible",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from fabric_gpu.manifest import HookSpec, manifest_for_model
    from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
    from fabric_gpu.profile import ConsumerProfile

    n_tasks = args.tasks or (3000 if args.cpu else 1_000_000)
    models = (args.models or ("minilm_l6" if args.cpu else "bert_base")).split(",")
    modes, dbs = args.modes.split(","), args.dbs.split(",")
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: torch sees {torch.cuda.device_count()} GPU(s)")
    reference = load_reference(args.reference)
    tokenizer_from = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    lengths = np.asarray(reference.reference_lengths(n_tasks, max_len=512))
    profile = (
        ConsumerProfile(8192, 256, 512, 8) if args.cpu else ConsumerProfile(32768, 1024, 512, 8)
    )
    # Runs of 1 and of N worker processes: N GPUs, or with --cpu N CPU workers.
    many_of, many_n = ("workers", args.workers) if args.cpu else ("gpus", args.gpus)
    gpu_counts = [1] if many_n == 1 else [1, many_n]
    print(f"python bytecode: {bytecode_state()}", flush=True)
    print(
        f"{n_tasks:,} tasks, {int(lengths.sum()):,} tokens (reference_lengths), models {models}, "
        f"modes {modes}, databases {dbs}, {'CPU engine' if args.cpu else f'GPUs {gpu_counts}'}",
        flush=True,
    )
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        work = Path(args.workdir) if args.workdir else None
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fabric-e2e-")))
        work.mkdir(parents=True, exist_ok=True)
        pg = None
        if "postgresql" in dbs:
            pg = stack.enter_context(postgres_server(args.pg_url, work))
        inputs = {}
        for mode in modes:
            path = work / f"tasks-{mode}-{n_tasks}.parquet"
            if not path.is_file():
                started = time.perf_counter()
                if mode == "ids":
                    write_token_ids(path, lengths)
                elif mode == "docs":
                    write_token_ids(path, document_lengths(n_tasks))
                else:
                    write_texts(path, lengths, vocabulary_words(tokenizer_from))
                print(f"wrote {path.name} in {time.perf_counter() - started:.1f} s", flush=True)
            inputs[mode] = path
        for size in models:
            dtype = torch.float32 if args.cpu else torch.float16
            model = random_model(reference, work / f"model-{size}", size, tokenizer_from, dtype)
            manifest_files = {}
            for variant in args.variants.split(","):
                manifest = manifest_for_model(
                    str(model), backend="cpu" if args.cpu else "torch",
                    dtype="float32" if args.cpu else "float16", profile=profile,
                    hooks=HookSpec((), "mean", variant=variant),
                )  # fmt: skip
                manifest_files[variant] = work / f"engine-{size}-{variant.replace(':', '_')}.json"
                manifest_files[variant].write_text(json.dumps(manifest.to_mapping()))
            engine = (
                engine_only_cpu(model, lengths, profile)
                if args.cpu
                else engine_only_gpu(reference, size, lengths)
            )
            print(f"{size}: engine alone {engine['tokens_per_s'] / 1e6:.3f} M tok/s", flush=True)
            engines = {mode: engine for mode in modes}
            if "docs" in modes:  # the peer on the windows the product makes of the documents
                windows = window_lengths(document_lengths(n_tasks), 512, 32)
                engines["docs"] = (
                    engine_only_cpu(model, windows, profile)
                    if args.cpu
                    else engine_only_gpu(reference, size, windows)
                )
                print(
                    f"{size}: engine alone on {len(windows):,} windows "
                    f"{engines['docs']['tokens_per_s'] / 1e6:.3f} M tok/s",
                    flush=True,
                )
            for mode, db, variant in itertools.product(modes, dbs, manifest_files):
                manifest_file = manifest_files[variant]
                named = "" if variant == "float32" else f"/{variant}"
                label = named.replace(":", "_").replace("/", "-")
                by_gpus = {}
                for gpus in gpu_counts:
                    key = f"{size}/{mode}/{db}{named}" + (f"/{many_of}={gpus}" if gpus > 1 else "")
                    root = work / f"run-{size}-{mode}-{db}-{gpus}{label}"
                    shutil.rmtree(root, ignore_errors=True)
                    with database_for(db, root, pg) as url:
                        try:
                            run = run_product(root, inputs[mode], manifest_file, url, gpus)
                        except ProductRunFailed as failed:
                            print(f"{key}: {failed}", flush=True)
                            results[key] = {"error": str(failed)}
                            continue
                        submitted = windows if mode == "docs" else lengths
                        results[key] = summarise(run, engines[mode], int(submitted.sum()))
                        receipt = run["report"]["index"].get("vector_index", {})
                        if args.rebuild and receipt.get("receipt_path"):
                            results[key]["rebuilds"] = [
                                rebuild_index(root, url, receipt["receipt_path"], cpu)
                                for cpu in ((True,) if args.cpu else (False, True))
                            ]
                    by_gpus[gpus] = results[key]
                    show(key, results[key])
                checked = all("error" not in r and r.get("exactly_once") for r in by_gpus.values())
                if len(by_gpus) > 1 and checked:  # no ratio where a run failed its own checks
                    many, ratio = by_gpus[many_n], f"ratio_vs_one_{many_of.rstrip('s')}"
                    many[ratio] = round(
                        many["e2e_tokens_per_s"] / by_gpus[1]["e2e_tokens_per_s"], 3
                    )
                    print(f"  {many_n} {many_of} vs 1, end to end: {many[ratio]}x")
    print(json.dumps(results))


def bytecode_state() -> str:
    """Whether processes here reuse compiled bytecode. Start-up is mostly imports; where packages
    were installed without .pyc files and writing them is off (PYTHONDONTWRITEBYTECODE, as on
    the GPU machine's image), every process compiles torch's and Dagster's sources again
    (seconds each), which a normal `pip install` does once. Printed so that each figure says
    which it measured."""
    if sys.dont_write_bytecode:
        return (
            "not written (PYTHONDONTWRITEBYTECODE): modules without .pyc compile in every process"
        )
    where = f" under {sys.pycache_prefix}" if sys.pycache_prefix else " beside the sources"
    return f"cached{where}"


def summarise(run: dict[str, Any], engine: dict[str, Any], submitted_tokens: int) -> dict[str, Any]:
    report = run["report"]
    extraction = report["extract"].get("extraction_outputs", {})
    real_tokens = int(extraction.get("real_tokens", 0)) or submitted_tokens
    e2e = real_tokens / run["wall_seconds"]
    stages = stage_seconds(report)
    # Process start, imports, submit, Dagster's own run bookkeeping: the wall no asset accounts for.
    assets = ("ingest_tokenise", "plan", "extraction", "index")
    stages["outside_assets"] = round(run["wall_seconds"] - sum(stages[a] for a in assets), 3)
    pulling = stages["extraction_pulling"] or stages["extraction"]
    index = report["index"].get("vector_index", {})
    return {
        "e2e_tokens_per_s": round(e2e),
        "engine_tokens_per_s": round(engine["tokens_per_s"]),
        "ratio_e2e_vs_engine": round(e2e / engine["tokens_per_s"], 3),
        # The extraction stage (its wall, worker start-up included) against the engine alone.
        "extraction_stage_ratio": round(
            real_tokens / max(stages["extraction"], 1e-9) / engine["tokens_per_s"], 3
        ),
        "pulling_ratio": round(real_tokens / max(pulling, 1e-9) / engine["tokens_per_s"], 3),
        "exactly_once": run["exactly_once"],
        "tasks": run["tasks"],
        "completed": run["completed"],
        "failed": run["failed"],
        "rows": run["rows"],
        "real_tokens": real_tokens,
        "wall_seconds": round(run["wall_seconds"], 2),
        "recall_at_10": index.get("recall_at_10"),
        # The step's own record: the GPU's batch time over its span (None on the CPU engine).
        "gpu_busy_fraction": (extraction.get("efficiency_record") or {}).get("gpu_busy_fraction"),
        "index_factory": index.get("factory"),
        # The index step took the vectors a tail followed during extraction (vector_tail).
        "vectors_followed": index.get("vectors_followed"),
        # The quantizer trained and rows assigned during extraction (index/prebuild.py).
        "index_prebuilt_seconds": index.get("prebuilt_seconds") or None,
        # From the last batch acknowledged by any worker to the index step's end (the receipt
        # recorded): what the user waits for after the GPU is done.
        "index_after_last_ack_s": after_last_ack(run["clock"]),
        "stage_seconds": stages,
        "bytecode": bytecode_state(),
        "clock": run["clock"],
        "worker_timelines": report["extract"]
        .get("extraction_outputs", {})
        .get("worker_timelines", []),
    }


def after_last_ack(clock: dict[str, float]) -> float | None:
    acks = [
        at for name, at in clock.items() if name.startswith("worker") and name.endswith(":last_ack")
    ]
    published = clock.get("index:vector_index:end")
    return round(published - max(acks), 2) if acks and published is not None else None


def show(key: str, r: dict[str, Any]) -> None:
    for rebuild in r.get("rebuilds", []):
        print(f"  index rebuilt on {rebuild['on']} in {rebuild['seconds']} s: {rebuild['output']}")
    s = r["stage_seconds"]
    print(
        f"{key}: end to end {r['e2e_tokens_per_s'] / 1e6:.3f} M tok/s in {r['wall_seconds']} s "
        f"= {r['ratio_e2e_vs_engine']:.2f}x the engine ({r['engine_tokens_per_s'] / 1e6:.3f} M); "
        f"extraction stage {r['extraction_stage_ratio']:.2f}x, pulling {r['pulling_ratio']:.2f}x\n"
        f"  stages: {', '.join(f'{k} {v:.2f}' for k, v in s.items())}\n"
        f"  rows {r['rows']:,} = completed {r['completed']:,} of {r['tasks']:,} "
        f"(failed {r['failed']}); exactly once: {r['exactly_once']}; "
        f"GPU busy fraction (the run's record): {r.get('gpu_busy_fraction')}; "
        f"index {r['index_factory']} recall@10 {r['recall_at_10']}, vectors followed during "
        f"extraction: {r.get('vectors_followed')}, made ready during it: "
        f"{r.get('index_prebuilt_seconds')}; last ack to index published "
        f"{r.get('index_after_last_ack_s')} s\n"
        f"  clock (s from launch): {', '.join(f'{k} {v}' for k, v in r.get('clock', {}).items())}",
        flush=True,
    )


if __name__ == "__main__":
    main()
