"""The `fabric` argument parser: every command, its options and help."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from fabric_pipelines.cli.index import cmd_index, cmd_receipt
from fabric_pipelines.cli.maintenance import (
    cmd_db,
    cmd_recombine,
    cmd_requeue,
    cmd_restore_plan,
    cmd_verify,
)
from fabric_pipelines.cli.tasks import (
    cmd_demo,
    cmd_export,
    cmd_forget,
    cmd_plan,
    cmd_run,
    cmd_status,
    cmd_submit,
)
from fabric_pipelines.cli.workers import cmd_workers, run_worker_process


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric",
        description="Inference Fabric: bulk embedding and hidden-state extraction, orchestrated by Dagster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_options(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("engine (defaults: CPU engine, all-MiniLM-L6-v2)")
        g.add_argument(
            "--manifest", help="engine manifest (JSON/YAML); overrides the options below"
        )
        g.add_argument(
            "--model-id",
            help="a packaged model (sentence-transformers/all-MiniLM-L6-v2, the default, or "
            "sentence-transformers/all-mpnet-base-v2) or a local model folder",
        )
        g.add_argument(
            "--max-batch-tokens", type=int, help="padded tokens per batch (default 8192)"
        )
        g.add_argument("--max-batch-items", type=int, help="items per batch (default 256)")
        g.add_argument(
            "--max-seq-len",
            type=int,
            help="longest item in tokens (default: the model's own, 256 for all-MiniLM-L6-v2)",
        )
        g.add_argument(
            "--pooling",
            choices=("mean", "cls", "last"),
            help="how an item's vector is made from its tokens (default: the model's own)",
        )
        g.add_argument(
            "--normalize",
            action=argparse.BooleanOptionalAction,
            help="unit-length vectors (default: as the model's configuration says)",
        )
        g.add_argument(
            "--variant",
            dest="store_variant",
            metavar="V[:DIMS]",
            help=(
                "the encoding the engine stores vectors in, made on the GPU before the copy to "
                "the host: float32 (default), float16, int8 (calibrated once per model key) or "
                "binary (sign bits), optionally shortened to the first DIMS dimensions"
            ),
        )
        g.add_argument("--seq-granularity", type=int, help="bucket length step (default 8)")
        g.add_argument(
            "--hook-layers", help="comma-separated layers whose hidden states to keep (default -1)"
        )
        g.add_argument(
            "--workers", type=int, help="worker processes (default 1; 0: in this process)"
        )
        g.add_argument(
            "--launcher",
            choices=("local", "kubernetes", "pipes-subprocess"),
            help="where the workers run: processes of this host (local, the default), a pod "
            "each through Dagster Pipes (kubernetes; needs PostgreSQL), or this host's "
            "processes through PipesSubprocessClient (pipes-subprocess)",
        )
        g.add_argument(
            "--worker-pods",
            metavar="FILE",
            help="kubernetes: the worker pods' settings (default deploy/k8s/workers.yaml)",
        )
        g.add_argument(
            "--long-inputs",
            choices=("chunk", "truncate", "fail"),
            help=(
                "items over max_seq_len: split into overlapping windows of the model's length, "
                "one vector per item from them (chunk, the default); cut to it and counted, as "
                "sentence-transformers does (truncate); or failed with the reason (fail)"
            ),
        )
        g.add_argument(
            "--window-overlap",
            type=int,
            help="chunk: tokens two neighbouring windows share (default 32)",
        )
        g.add_argument(
            "--truncate",
            dest="long_inputs",
            action="store_const",
            const="truncate",
            help=argparse.SUPPRESS,  # the earlier spelling of --long-inputs truncate
        )
        g.add_argument(
            "--reuse",
            dest="reuse_results",
            action=argparse.BooleanOptionalAction,
            help="give tasks whose token ids already have a stored result of this model a copy "
            "of it instead of computing them again (default: on, or FABRIC_REUSE)",
        )
        g.add_argument(
            "--lease-seconds",
            type=float,
            help="a worker's lease on a batch; an expired one is taken over (default 600)",
        )
        g.add_argument(
            "--heartbeat-seconds",
            type=float,
            help="how often a worker renews its leases while it extracts",
        )
        g.add_argument(
            "--pool-idle-seconds",
            type=float,
            help="keep the warm engine pool's workers this long after their last job "
            "(default 300, or FABRIC_POOL_IDLE_SECONDS; 0: no pool, the run's own workers)",
        )
        p.add_argument(
            "--report", metavar="FILE", help="with a run: write its summary here as JSON"
        )

    demo = sub.add_parser(
        "demo", help="run the whole pipeline on the standard library's docstrings"
    )
    demo.add_argument("--items", type=int, default=3000, help="docstrings to take (default 3000)")
    engine_options(demo)
    demo.set_defaults(func=cmd_demo)

    submit = sub.add_parser("submit", help="put a JSONL/Parquet file in the inbox as a task set")
    submit.add_argument("file")
    submit.add_argument(
        "--task-set", required=True, help="name of the task set (its partition key)"
    )
    submit.add_argument("--run", action="store_true", help="run the pipeline now, in this process")
    prompt = submit.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        help='text put before each text of the set before tokenising, e.g. "query: " '
        "(default: the model's default prompt, if it has one)",
    )
    prompt.add_argument(
        "--prompt-name", help="a prompt the model's sentence-transformers config names"
    )
    engine_options(submit)
    submit.set_defaults(func=cmd_submit)

    run = sub.add_parser("run", help="run the pipeline for a submitted task set, in this process")
    run.add_argument("task_set")
    engine_options(run)
    run.set_defaults(func=cmd_run)

    forget = sub.add_parser(
        "forget", help="remove a task set: its results, files, inbox file and partition"
    )
    forget.add_argument("task_set")
    forget.add_argument("--force", action="store_true", help="even while a run is extracting it")
    forget.set_defaults(func=cmd_forget)

    workers = sub.add_parser(
        "workers",
        help="the warm engine pool: start its workers for a manifest, stop them, show them; "
        "pod-spec: print the Kubernetes pod a worker would get (a dry run)",
    )
    workers.add_argument("action", choices=["start", "stop", "status", "pod-spec"])
    workers.add_argument("--json", action="store_true", help="status: machine-readable output")
    workers.add_argument(
        "--pod-config", help="pod-spec: the worker pods' settings (default deploy/k8s/workers.yaml)"
    )
    workers.add_argument("--task-set", default="TASK_SET", help="pod-spec: the set it would run")
    engine_options(workers)
    workers.set_defaults(func=cmd_workers)

    worker = sub.add_parser(
        "worker", help="run one worker process on a task set's current plan", add_help=False
    )
    worker.add_argument("args", nargs=argparse.REMAINDER, help="see fabric worker -h")
    worker.set_defaults(func=lambda a: run_worker_process(a.args))

    db = sub.add_parser("db", help="the results database's schema: upgrade, downgrade, current")
    db.add_argument("action", choices=["upgrade", "downgrade", "current"])
    db.add_argument("revision", nargs="?", help="target revision (upgrade: head; downgrade: -1)")
    db.set_defaults(func=cmd_db)

    index = sub.add_parser(
        "index", help="vector indexes: status, verify files, rebuild from a receipt"
    )
    index.add_argument("action", choices=["status", "verify", "rebuild"])
    index.add_argument("--receipt", help="receipt JSON (dagster_home/receipts/<sha256>.json)")
    index.add_argument(
        "--no-repair", action="store_true", help="rebuild: do not write back missing files"
    )
    index.set_defaults(func=cmd_index)

    receipt = sub.add_parser("receipt", help="an index's lineage, from its receipt")
    receipt.add_argument("action", choices=["show", "restore"])
    receipt.add_argument(
        "index",
        help="show: receipt file, receipt or index sha256 (a prefix will do), or model key; "
        "restore: the receipt sha256 whose file to write again from the database",
    )
    receipt.add_argument("--json", action="store_true", help="machine-readable output")
    receipt.set_defaults(func=cmd_receipt)

    status = sub.add_parser(
        "status", help="accounting per task set: tasks = completed + failed + ..."
    )
    status.add_argument("task_set", nargs="?")
    status.add_argument("--failures", action="store_true", help="list every failed record and why")
    status.add_argument(
        "--json", action="store_true", help="machine-readable: one JSON object on stdout"
    )
    status.set_defaults(func=cmd_status)

    plan = sub.add_parser(
        "plan",
        help="what a file would become: tasks, failures, lengths, batches, padding and the "
        "predicted engine time, without running anything",
    )
    plan.add_argument("file")
    plan.add_argument("--prompt", help="as `fabric submit --prompt` would put before each text")
    plan.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    engine_options(plan)
    plan.set_defaults(func=cmd_plan)

    export = sub.add_parser(
        "export", help="a task set's embeddings as a Parquet file (id, record_no, n_tokens, vector)"
    )
    export.add_argument("task_set")
    export.add_argument("--out", help="the Parquet file to write (default: TASK_SET.parquet)")
    export.add_argument(
        "--model-key", help="whose embeddings (default: the model of the set's current plan)"
    )
    export.add_argument(
        "--layers",
        help="comma-separated hook layers whose hidden states to add, one column each "
        "(layers the run kept: --hook-layers); rows then come batch by batch",
    )
    export.add_argument(
        "--variant",
        help="the vectors as float16, int8 (calibrated on the first 50,000) or binary (sign "
        "bits), optionally shortened to their first N dimensions: e.g. int8:256 (default float32)",
    )
    export.add_argument(
        "--windows",
        action="store_true",
        help="also each window of the chunked documents (column `window`: its place, from 0; "
        "null on document rows)",
    )
    export.add_argument("--force", action="store_true", help="replace --out if it exists")
    export.set_defaults(func=cmd_export)

    verify = sub.add_parser(
        "verify",
        help="hash every stored file again, check the accounting; name each repair",
    )
    verify.add_argument("task_set", nargs="?", help="one task set (default: all, and receipts)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(func=cmd_verify)

    recombine = sub.add_parser(
        "recombine",
        help="combine again the document vectors verify found differing from their windows'",
    )
    recombine.add_argument("task_set")
    recombine.add_argument("--model-key", required=True, help="whose vectors (verify names it)")
    recombine.set_defaults(func=cmd_recombine)

    requeue = sub.add_parser(
        "requeue",
        help="delete batches' results and queue them again (then: fabric run TASK_SET)",
    )
    requeue.add_argument("task_set")
    requeue.add_argument(
        "--batch", type=int, action="append", required=True, help="batch number (repeatable)"
    )
    requeue.add_argument("--plan", help="plan id or prefix (default: the set's current plan)")
    requeue.set_defaults(func=cmd_requeue)

    restore_plan = sub.add_parser(
        "restore-plan", help="write a lost or corrupt plan file again by planning again"
    )
    restore_plan.add_argument("task_set")
    restore_plan.add_argument("plan", help="plan id (or a prefix)")
    restore_plan.set_defaults(func=cmd_restore_plan)
    return parser
