"""Scaling across GPUs on one host: one worker per GPU pulling one task set off the ledger,
against one worker on one GPU, same data, same run.

The product's path end to end below Dagster: a task set of token ids (lengths from the
yardstick's `reference_lengths`) is ingested, planned and extracted by `extract_task_set` with
worker processes (`python -m fabric_pipelines.lib.worker.launch`), each owning one GPU through
CUDA_VISIBLE_DEVICES, writing pooled embeddings to the database (SQLite here) with their acks.
The model is the yardstick's `random_encoder` of the chosen size (random fp16 weights; saved with
all-MiniLM's tokenizer: the same vocabulary), so each GPU has real work per token and the database is not the limit.

Throughput is real tokens over the pulling window — from the first worker's engine ready (its
CUDA graphs captured) to the last batch acknowledged by any worker — and also over the stage's
wall time (worker start-up, model load and graph capture included). After each run
the ledger and the table are checked: every batch completed, every task one row.

    python bench/multi_gpu.py [--items 300000] [--model bert_large] [--gpus 2]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from yardstick import DEFAULT, load_reference, random_model

from fabric_gpu.manifest import HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID, resolve_model_dir
from fabric_gpu.profile import ConsumerProfile


def run(
    root: Path, name: str, manifest: Any, tokens_file: Path, gpus: int, db_url: str
) -> dict[str, Any]:
    from sqlalchemy import func, select

    from fabric_gpu.engines import input_layout
    from fabric_pipelines.lib.broker.plans import plan_task_set
    from fabric_pipelines.lib.core.settings import FabricPaths
    from fabric_pipelines.lib.steps.run_extraction import extract_task_set
    from fabric_pipelines.lib.store.db import create_schema, make_engine
    from fabric_pipelines.lib.store.models import Batch, Embedding, TaskSet
    from fabric_pipelines.lib.tasks.catalog import ingest_task_set
    from fabric_pipelines.lib.tasks.inbox import submit

    paths = FabricPaths(root).ensure()
    db = make_engine(db_url)
    create_schema(db)
    submit(tokens_file, paths.inbox, name)
    summary = ingest_task_set(
        db, paths, name, model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    plan = plan_task_set(db, paths, name, manifest, input_layout(manifest))
    devices = list(range(gpus)) if manifest.backend != "cpu" else None
    result = extract_task_set(
        db, paths, name, manifest, database_url=db_url, workers=gpus, devices=devices
    )
    with db.connect() as conn:
        set_id = conn.execute(select(TaskSet.id).where(TaskSet.name == name)).scalar_one()
        rows = conn.execute(
            select(func.count()).select_from(Embedding).where(Embedding.task_set_id == set_id)
        ).scalar_one()
        states = dict(
            conn.execute(
                select(Batch.state, func.count())
                .where(Batch.plan_id == plan.plan_id)
                .group_by(Batch.state)
            ).all()
        )
    db.dispose()
    pulling = result.pulling_seconds
    return {
        "gpus": gpus,
        "tasks": summary.n_tasks,
        "rows": int(rows),
        "batches": plan.plan.n_batches,
        "batch_states": states,
        "exactly_once": rows == summary.n_tasks and states == {"completed": plan.plan.n_batches},
        "real_tokens": result.real_tokens,
        "worker_seconds": [round(s, 2) for s in result.worker_seconds],
        "pulling_seconds": round(pulling, 2),
        "wall_seconds": round(result.seconds, 2),
        "tokens_per_s": result.real_tokens / pulling,
        "tokens_per_s_wall": result.real_tokens / result.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=300_000)
    parser.add_argument(
        "--model",
        default="bert_large",
        help="a yardstick CONFIGS size (minilm_l6 for a CPU smoke run)",
    )
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--reference", default=str(DEFAULT))
    parser.add_argument("--tokenizer", help="model folder whose tokenizer to use")
    parser.add_argument("--backend", choices=["torch", "cpu"], default="torch")
    args = parser.parse_args()

    import torch

    if args.backend == "torch" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs; torch sees {torch.cuda.device_count()}")
    reference = load_reference(args.reference)
    if args.model not in reference.CONFIGS:
        parser.error(f"--model {args.model!r}: the yardstick has {sorted(reference.CONFIGS)}")
    lengths = np.asarray(reference.reference_lengths(args.items, max_len=512))
    tokenizer_from = Path(args.tokenizer) if args.tokenizer else resolve_model_dir(DEFAULT_MODEL_ID)
    with tempfile.TemporaryDirectory(prefix="fabric-multi-gpu-") as tmp:
        root = Path(tmp)
        model = random_model(reference, root / "model", args.model, tokenizer_from)
        manifest = manifest_for_model(
            str(model), backend=args.backend,
            dtype="float16" if args.backend == "torch" else "float32",
            profile=ConsumerProfile(32768, 1024, 512, 8), hooks=HookSpec((), "mean"),
        )  # fmt: skip
        rng = np.random.default_rng(0)
        tokens_file = root / "tasks.jsonl"
        with tokens_file.open("w") as out:
            for i, n in enumerate(lengths):
                ids = [101, *rng.integers(1000, 30000, int(n) - 2).tolist(), 102]
                out.write(json.dumps({"id": i, "token_ids": ids}) + "\n")
        print(f"{args.items:,} tasks, {int(lengths.sum()):,} tokens, random {args.model}")
        results = {}
        for gpus in (1, args.gpus):
            data = root / f"data-{gpus}"
            url = f"sqlite:///{data}/fabric.db"
            data.mkdir()
            r = run(data, f"set-{gpus}", manifest, tokens_file, gpus, url)
            results[gpus] = r
            print(
                f"{gpus} GPU(s): {r['tokens_per_s'] / 1e6:.3f} M tokens/s pulling "
                f"({r['tokens_per_s_wall'] / 1e6:.3f} M over the wall, start-up included); "
                f"pulling {r['pulling_seconds']} s, workers {r['worker_seconds']} s; {r['rows']:,} rows for {r['tasks']:,} tasks; "
                f"batches {r['batch_states']}; exactly once: {r['exactly_once']}"
            )
    one, many = results[1], results[args.gpus]
    summary = {
        "gpus": args.gpus,
        "model": args.model,
        "tokens_per_s_1": round(one["tokens_per_s"]),
        f"tokens_per_s_{args.gpus}": round(many["tokens_per_s"]),
        "ratio": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
        "ratio_wall": round(many["tokens_per_s_wall"] / one["tokens_per_s_wall"], 3),
        "exactly_once": one["exactly_once"] and many["exactly_once"],
    }
    print(f"{args.gpus} GPUs vs 1: {summary['ratio']}x pulling, {summary['ratio_wall']}x wall")
    print(json.dumps(summary))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
