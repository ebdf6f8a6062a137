"""Running the Dagster jobs in-process for `fabric run`, `submit --run` and `demo`: run config from the command line, prestarted workers, and the summary printed at the end."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from concurrent.futures import Future

from fabric_pipelines.cli.environment import open_database, prepare_environment
from fabric_pipelines.cli.prepare import dagster_instance

DEMO_TASK_SET = "demo"


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name in (
        "model_id",
        "max_batch_tokens",
        "max_batch_items",
        "max_seq_len",
        "seq_granularity",
    ):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    if getattr(args, "hook_layers", None) is not None:
        config["hook_layers"] = [int(x) for x in args.hook_layers.split(",") if x.strip()]
    if getattr(args, "manifest", None):
        config["manifest_path"] = str(Path(args.manifest).resolve())
    for name in (
        "workers", "lease_seconds", "heartbeat_seconds", "pool_idle_seconds", "launcher",
        "worker_pods",
    ):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value
    if getattr(args, "long_inputs", None) is not None:
        config["long_inputs"] = args.long_inputs
    if getattr(args, "window_overlap", None) is not None:
        config["window_overlap"] = args.window_overlap
    for name in ("pooling", "normalize"):
        if getattr(args, name, None) is not None:
            config[name] = getattr(args, name)
    if getattr(args, "store_variant", None) is not None:
        config["variant"] = args.store_variant
    if getattr(args, "reuse_results", None) is not None:
        config["reuse_results"] = args.reuse_results
    return config


def _run_config(args: argparse.Namespace) -> dict[str, Any]:
    engine = engine_config(args)
    return {"resources": {"engine": {"config": engine}}} if engine else {}


def quiet_dagster() -> None:
    logging.getLogger("dagster").setLevel(logging.WARNING)


def run_pipeline(
    task_set: str, args: argparse.Namespace, prepared: Future[tuple[Any, Any]] | None = None
) -> dict[str, Any]:
    """Materialise the three partitioned assets for `task_set`, then the index; return a summary.

    `prepared`: the definitions and Dagster instance made meanwhile (prepare.prepare_pipeline).
    The name is checked before it becomes a partition; a partition this call registered is
    removed again when the set could not even be ingested, so a typo leaves nothing behind."""

    from fabric_pipelines.cli.run_clock import mark, marks, steps_of
    from fabric_pipelines.definitions import defs
    from fabric_pipelines.defs.failures import failure_text
    from fabric_pipelines.defs.index import IndexConfig
    from fabric_pipelines.defs.partitions import TASK_SET_PARTITIONS
    from fabric_pipelines.lib.core.names import validate_task_set_name
    from fabric_pipelines.lib.index import vector_tail
    from fabric_pipelines.lib.steps.ahead import forget_ahead
    from fabric_pipelines.lib.steps.progress import run_progress

    validate_task_set_name(task_set)  # InvalidNameError: main() prints it, exit 2
    # Both jobs run here, the index right after extraction, with the index's default settings
    # (the CLI sets none): its vectors are followed and its index made ready as they arrive.
    defaults = IndexConfig()
    vector_tail.follow_in_this_process(defaults.spec_settings(), defaults.min_recall)
    mark("dagster_imported")
    try:
        if prepared is None:
            raise LookupError("nothing prepared")
        definitions, instance = prepared.result()
    except Exception:  # not prepared, or it failed there: made here, where a failure is reported
        definitions, instance = defs(), dagster_instance()
    mark("definitions_loaded")
    registered = _register_partition(instance, TASK_SET_PARTITIONS, task_set)
    run_config = _run_config(args)
    # The failure is printed once, in one line, when the run ends (defs/failures.py).
    log_config = {"loggers": {"console": {"config": {"log_level": "INFO", "tracebacks": False}}}}
    started = time.perf_counter()
    with run_progress():  # one bar for the run: stage, tasks done, tokens/s, ETA
        extract = definitions.resolve_job_def("extract_task_set").execute_in_process(
            partition_key=task_set,
            instance=instance,
            run_config={**run_config, **log_config},
            raise_on_error=False,
        )
        mark("extraction_job_done")
        if not extract.success:
            # Calls made ahead that no step took are not waited for: the command ends now (a
            # stop must be prompt), and a call cut off mid-transaction leaves nothing behind.
            forget_ahead(task_set)
            if registered and not _ingested(task_set):
                instance.delete_dynamic_partition(TASK_SET_PARTITIONS, task_set)
            raise SystemExit(failure_text(extract, "extraction", task_set))
        index = definitions.resolve_job_def("build_vector_index").execute_in_process(
            instance=instance, run_config={**run_config, **log_config}, raise_on_error=False
        )
        mark("index_job_done")
    if not index.success:
        raise SystemExit(failure_text(index, "index build", task_set))
    materialized = {**_materializations(extract), **_materializations(index)}
    return {
        "extract": _materializations(extract),
        "index": _materializations(index),
        "checks": _checks(extract) + _checks(index),
        "seconds": time.perf_counter() - started,
        "stage_seconds": {
            name: meta["seconds"] for name, meta in materialized.items() if "seconds" in meta
        },
        "run_ids": (extract.run_id, index.run_id),
        # Wall-clock marks and every step's start and end, for `--report` readers (bench/e2e.py).
        "clock": {
            "marks": marks(),
            "steps": {
                **steps_of(instance, extract.run_id),
                **{f"index:{k}": v for k, v in steps_of(instance, index.run_id).items()},
            },
        },
    }


def prestart_for_run(task_set: str, args: argparse.Namespace) -> Any:
    """Start the run's extraction workers first thing (lib/worker/prestart.py), so that Python,
    torch, the CUDA context and the weights load while the CLI imports Dagster and the set is
    submitted, ingested and planned. A no-op when the engine settings cannot be read here (the
    run's own step reports why) or the workers are not this host's; the step takes the workers
    over only if its settings match."""
    from fabric_pipelines.cli.run_clock import mark
    from fabric_pipelines.lib.broker.ledger import DEFAULT_LEASE_SECONDS
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.worker.devices import visible_gpus
    from fabric_pipelines.lib.worker.pool.client import idle_seconds_setting
    from fabric_pipelines.lib.worker.prestart import prestart_workers

    if getattr(args, "launcher", None) not in (None, "local"):  # other hosts' workers: the step's
        return contextlib.nullcontext()
    try:
        manifest = engine_manifest(args)
        pool_idle_seconds = idle_seconds_setting(getattr(args, "pool_idle_seconds", None))
    except Exception:  # the extraction step reports the same error, in the run
        return contextlib.nullcontext()
    mark("manifest_read")
    paths = FabricPaths(prepare_environment()).ensure()
    gpus = visible_gpus() if manifest.backend != "cpu" else 0
    mark("gpus_counted")
    return prestart_workers(
        paths,
        task_set,
        manifest,
        database_url=database_url(paths),
        count=1 if args.workers is None else args.workers,  # EngineConfig's default: 1
        visible_gpus=gpus,
        lease_seconds=args.lease_seconds or DEFAULT_LEASE_SECONDS,
        heartbeat_seconds=args.heartbeat_seconds,
        pool_idle_seconds=pool_idle_seconds,
    )


def start_ahead_for_run(task_set: str, args: argparse.Namespace) -> None:
    """Ingest and plan the set on a thread now, while Dagster loads (lib/steps/ahead.py); its
    steps in this process take the results over. Where the settings cannot be read here,
    nothing starts and the steps report why. FABRIC_AHEAD=off: the steps make both calls
    themselves, one after the other, as a run launched from the UI does."""
    from fabric_pipelines.cli.run_clock import mark
    from fabric_pipelines.lib.core.settings import switched_on
    from fabric_pipelines.lib.steps.ahead import start_ahead

    if not switched_on("FABRIC_AHEAD"):
        return
    try:
        paths, manifest, ingest, plan = ahead_inputs(task_set, args)
        start_ahead(paths, ingest, plan, manifest, on_mark=mark)
    except Exception:  # the steps read the same settings, and report what is wrong with them
        return


def ahead_inputs(task_set: str, args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The data root, manifest, and the ingest's and plan's inputs as the run's steps will have
    them: the manifest, the long-input policy and reuse from the same options and defaults as
    the engine resource (`engine_config`), the database and root from the same environment."""
    from fabric_gpu.engines import input_layout
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.steps.ahead import IngestInputs, PlanInputs
    from fabric_pipelines.lib.tasks.prompts import set_prompt
    from fabric_pipelines.lib.tasks.windows import long_input_policy

    manifest = engine_manifest(args)
    paths = FabricPaths(prepare_environment()).ensure()
    url = database_url(paths)
    policy = long_input_policy(
        getattr(args, "long_inputs", None), getattr(args, "window_overlap", None)
    )
    prompt = set_prompt(paths.inbox, task_set, manifest.model_id)
    ingest = IngestInputs.of(url, paths, task_set, manifest, policy, prompt)
    plan = PlanInputs.of(
        url, paths, task_set, manifest, input_layout(manifest),
        getattr(args, "reuse_results", None),
    )  # fmt: skip
    return paths, manifest, ingest, plan


def engine_manifest(args: argparse.Namespace) -> Any:
    """The run's engine manifest: a manifest file is read directly (no Dagster import, which
    takes seconds); the options' defaults come from the engine resource."""
    from fabric_gpu.manifest import EngineManifest

    path = getattr(args, "manifest", None) or os.environ.get("FABRIC_ENGINE_MANIFEST", "")
    if path:
        return EngineManifest.load(Path(path))
    from fabric_pipelines.defs.resources import EngineConfig

    return EngineConfig(**engine_config(args)).manifest()


def write_report(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """The run's summary as JSON, for scripts (`--report FILE`)."""
    if not getattr(args, "report", None):
        return
    from fabric_pipelines.cli.run_clock import mark, marks
    from fabric_pipelines.cli.warm_client import IN_RUNNER
    from fabric_pipelines.lib.core.files import write_bytes

    mark("report_written")
    plain = {key: value for key, value in summary.items() if key != "run_ids"}
    plain.setdefault("clock", {})["marks"] = marks()
    plain["run_ids"] = list(summary["run_ids"])
    # Whether a warm runner's child ran it (cli/warm_client.py, cli/warm_server.py), and which process.
    plain["process"] = {"pid": os.getpid(), "warm_runner": bool(os.environ.get(IN_RUNNER))}
    write_bytes(Path(args.report), json.dumps(plain, default=str, indent=1).encode())


def _register_partition(instance: Any, partitions: str, task_set: str) -> bool:
    """Add the set's partition; True when this call added it. Two first runs of one set may
    race to add it: whichever loses finds it there, which is all it needs."""
    if instance.has_dynamic_partition(partitions, task_set):
        return False
    try:
        instance.add_dynamic_partitions(partitions, [task_set])
    except Exception:
        if not instance.has_dynamic_partition(partitions, task_set):
            raise
        return False
    return True


def _ingested(task_set: str) -> bool:
    from sqlalchemy import select

    from fabric_pipelines.lib.store.models import TaskSet

    _, db = open_database()
    try:
        with db.connect() as conn:
            return (
                conn.execute(select(TaskSet.id).where(TaskSet.name == task_set)).first() is not None
            )
    finally:
        db.dispose()


def _materializations(result: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for materialization in result.get_asset_materialization_events():
        m = materialization.materialization
        out[m.asset_key.to_user_string()] = {k: v.value for k, v in m.metadata.items()}
    return out


def _checks(result: Any) -> list[tuple[str, bool]]:
    return [
        (f"{e.asset_key.to_user_string()}:{e.check_name}", e.passed)
        for e in result.get_asset_check_evaluations()
    ]


def _reused_rows(reused: int) -> list[tuple[str, str]]:
    """Tasks given a copy of a stored result instead of being computed (lib/broker/reuse.py)."""
    if not reused:
        return []
    return [("reused", f"{reused:,} tasks (linked to a stored result of the same content)")]


def print_summary(summary: dict[str, Any]) -> None:
    tasks = summary["extract"].get("tokenised_tasks", {})
    extraction = summary["extract"].get("extraction_outputs", {})
    index = summary["index"].get("vector_index", {})
    rows = [
        ("tasks submitted", f"{tasks.get('records', 0):,}"),
        ("completed", f"{extraction.get('completed', 0):,} tasks"),
        *_reused_rows(extraction.get("reused", 0)),
        *_document_rows(extraction.get("documents")),
        (
            "failed",
            f"{extraction.get('failed', 0):,} (each with a reason: fabric status --failures)",
        ),
        (
            "real tokens/s",
            f"{extraction.get('real_tokens_per_s', 0):,.0f} (delivered: written and acked)",
        ),
        *([("extraction", str(extraction["efficiency"]))] if extraction.get("efficiency") else []),
        *_index_rows(index),
        (
            "checks",
            ", ".join(f"{name} {'passed' if ok else 'FAILED'}" for name, ok in summary["checks"]),
        ),
        ("wall time", f"{summary['seconds']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _document_rows(documents: dict[str, int] | None) -> list[tuple[str, str]]:
    """A set with chunked documents: its documents stored, and into how many windows (tasks)
    its long ones were split."""
    if not documents:
        return []
    return [
        (
            "documents",
            f"{documents['stored']:,} stored of {documents['documents']:,}; "
            f"{documents['chunked']:,} longer than the model's length, split into "
            f"{documents['windows']:,} windows",
        )
    ]


def _index_rows(index: dict[str, Any]) -> list[tuple[str, str]]:
    if not index.get("vectors"):
        return [("index", f"none: {index.get('note', 'no vectors to index')}")]
    return [
        (
            "index",
            f"{index.get('index_path', '')}  ({index.get('factory', '')}, "
            f"{index.get('vectors', 0):,} vectors)",
        ),
        ("recall@10", f"{index.get('recall_at_10', 0):.4f}"),
        ("receipt sha256", f"{index.get('receipt_sha256', '')}"),
    ]


def refuse_unreachable_database(args: argparse.Namespace, command: str) -> bool:
    """Workers on other hosts with the SQLite default: say what to set before any work is done
    (the extraction step would refuse it too, after ingest and planning). True: refused."""
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.worker.client_launch import (
        SharedDatabaseRequired,
        require_shared_database,
    )

    launcher = getattr(args, "launcher", None) or os.environ.get("FABRIC_WORKER_LAUNCHER")
    if launcher != "kubernetes":
        return False
    try:
        require_shared_database(database_url(FabricPaths(prepare_environment())), args.task_set)
    except SharedDatabaseRequired as exc:
        print(f"fabric {command}: {exc}", file=sys.stderr)
        return True
    return False
