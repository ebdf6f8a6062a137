"""`fabric verify`: each kind of damage is found, named with a repair command, and the repair
brings back a clean report (acceptance item 2: a real run, a damaged shard file, its repair)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import Engine, delete, select, update

from fabric_gpu.engines import Engine as ExtractionEngine
from fabric_gpu.manifest import EngineManifest
from fabric_pipelines.cli import main
from fabric_pipelines.defs.extraction import extraction_outputs, shape_batches, tokenised_tasks
from fabric_pipelines.defs.failures import failure_text
from fabric_pipelines.defs.index import vector_index
from fabric_pipelines.defs.resources import ArtifactStore, Database, EngineConfig
from fabric_pipelines.lib.broker.ledger import accounting, report_failure
from fabric_pipelines.lib.broker.plans import load_plan_order, plan_task_set
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.build import IndexSpec
from fabric_pipelines.lib.index.paths import model_index_folder
from fabric_pipelines.lib.index.publish import PublishedIndex, build_and_publish
from fabric_pipelines.lib.maintenance.repair import RepairError, requeue_batches
from fabric_pipelines.lib.maintenance.verify import Finding, VerifyReport, verify, verify_extraction
from fabric_pipelines.lib.store.models import (
    Batch,
    BatchPlanRow,
    Embedding,
    HiddenStateShard,
    TaskFailure,
    TaskSet,
)
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import get_task_set
from fabric_pipelines.lib.worker.loop import ExtractionJob, run_worker
from tests.ledger_helpers import claim
from tests.pipeline_helpers import run_stages

SET = "checked"


def _source(tmp_path: Path, n: int, name: str = "set.jsonl") -> Path:
    rows = [
        {"id": f"t-{i}", "text": f"Item {i} is about subject {i % 11} and detail {i % 5}."}
        for i in range(n)
    ]
    rows.append({"id": "blank", "text": "   "})  # fails at ingest, with a reason
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _extract(
    db: Engine, paths: FabricPaths, engine: ExtractionEngine, manifest: EngineManifest
) -> None:
    """shape_batches + extraction_outputs of the library: plan what is outstanding, run it."""
    plan = plan_task_set(db, paths, SET, manifest)
    ts = get_task_set(db, SET)
    job = ExtractionJob(
        task_set=SET,
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=read_table(Path(ts.path), ts.content_sha256),
        order=load_plan_order(plan.path, plan.sha256),
        shard_folder=paths.shards,
    )
    run_worker(db, engine, job, owner="test")


def _publish(db: Engine, paths: FabricPaths, manifest: EngineManifest) -> PublishedIndex:
    return build_and_publish(
        db,
        model_key=manifest.model_key,
        model={"model_id": manifest.model_id, "weights_sha256": manifest.weights_sha256},
        spec=IndexSpec(factory="Flat", shards=2),
        index_folder=paths.indexes,
        receipt_folder=paths.receipts,
        inputs=[],
    )


@pytest.fixture
def done(
    db: Engine,
    paths: FabricPaths,
    cpu_engine: ExtractionEngine,
    manifest: EngineManifest,
    tmp_path: Path,
) -> PublishedIndex:
    """A task set extracted with hook layers (2, -1) and indexed: verify finds it clean."""
    run_stages(db, paths, cpu_engine, manifest, _source(tmp_path, 150), SET)
    published = _publish(db, paths, manifest)
    report = verify(db, paths)
    assert report.clean, report.findings
    return published


def _only(report: VerifyReport, kind: str) -> Finding:
    assert not report.clean
    found = [f for f in report.findings if f.kind == kind]
    assert len(found) == 1, report.findings
    return found[0]


def _shards(db: Engine) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                select(HiddenStateShard).order_by(
                    HiddenStateShard.plan_id, HiddenStateShard.batch_no
                )
            ).all()
        )


def _cli(db_url: str, paths: FabricPaths, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setenv("FABRIC_DATABASE_URL", db_url)
    monkeypatch.setenv("FABRIC_HOME", str(paths.root))
    return main(list(args))


def _run_repair(
    command: str, db_url: str, paths: FabricPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run a repair command as printed (`a && b`), each `fabric ...` step through the CLI."""
    for step in command.split("#", 1)[0].split("&&"):
        argv = shlex.split(step)
        assert argv[0] == "fabric", command
        assert _cli(db_url, paths, monkeypatch, *argv[1:]) == 0, step


def test_a_clean_run_is_clean_and_says_what_was_checked(
    db: Engine, paths: FabricPaths, done: PublishedIndex, capsys: Any, db_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    report = verify(db, paths, SET)
    with db.connect() as conn:
        batches = conn.execute(select(Batch).where(Batch.state == "completed")).all()
    assert report.checked["task_sets"] == 1 and report.checked["task_set_files"] == 1
    assert report.checked["batches"] == len(batches) == report.checked["shard_files"]
    assert report.checked["embedding_rows"] == 150
    assert report.checked["hidden_state_tasks"] == 150 * 2  # two hook layers
    assert report.checked["index_files"] == 1 + 1  # served index, quantizer (Flat: no layout)
    assert _cli(db_url, paths, monkeypatch, "verify") == 0
    out = capsys.readouterr().out
    assert "clean:" in out and "embedding rows: 150" in out
    assert _cli(db_url, paths, monkeypatch, "verify", SET, "--json") == 0
    assert json.loads(capsys.readouterr().out)["clean"] is True
    assert _cli(db_url, paths, monkeypatch, "verify", "nothing-here") == 2


def test_a_damaged_shard_file_is_named_and_requeueing_its_batch_repairs_it(
    db: Engine, paths: FabricPaths, done: PublishedIndex, cpu_engine: ExtractionEngine,
    manifest: EngineManifest,
) -> None:  # fmt: skip
    first, second = _shards(db)[:2]
    path = Path(first.path)
    path.write_bytes(path.read_bytes()[: first.bytes // 2])  # truncated
    flipped = bytearray(Path(second.path).read_bytes())
    flipped[len(flipped) // 3] ^= 0x10  # one bit, same size
    Path(second.path).write_bytes(bytes(flipped))
    report = verify(db, paths, SET)
    by_path = {f.subject: f for f in report.findings if f.kind == "shard_file"}
    assert set(by_path) == {first.path, second.path}, report.findings
    assert by_path[first.path].problem == f"truncated: {first.bytes // 2} of {first.bytes} bytes"
    assert by_path[second.path].problem.endswith(f"but {second.sha256} recorded")
    # The post-run accounting check does not hash every shard again (the writer hashed each one
    # before its ack): a truncation shows there by size; a same-size bit flip is fabric verify's.
    quick = verify_extraction(db, paths, SET, rehash_shards=False)
    assert {f.subject for f in quick.findings if f.kind == "shard_file"} == {first.path}
    repair = by_path[first.path].repair
    assert repair == (
        f"fabric requeue {SET} --plan {first.plan_id} --batch {first.batch_no} && "
        f"fabric run {SET} --max-seq-len 128 --hook-layers=2,-1"
    )

    # The repair, at the library level (the CLI round trip is the acceptance test below).
    requeued = requeue_batches(db, paths, SET, [first.batch_no, second.batch_no], first.plan_id)
    assert requeued.shards_deleted == 2 and requeued.rows_deleted == first.n_items + second.n_items
    with db.connect() as conn:
        counts = accounting(conn, SET)
    assert counts.balanced and counts.queued == first.n_items + second.n_items
    _extract(db, paths, cpu_engine, manifest)
    report = verify(db, paths, SET)
    assert report.clean, report.findings
    with db.connect() as conn:
        assert accounting(conn, SET).finished


def test_embedding_rows_deleted_by_hand_are_found_per_batch(
    db: Engine, paths: FabricPaths, done: PublishedIndex, cpu_engine: ExtractionEngine,
    manifest: EngineManifest,
) -> None:  # fmt: skip
    shard = _shards(db)[0]
    ts = get_task_set(db, SET)
    order = load_plan_order(Path(_plan(db, shard.plan_id).path), _plan(db, shard.plan_id).sha256)
    with db.connect() as conn:
        start = conn.execute(
            select(Batch.item_start).where(
                Batch.plan_id == shard.plan_id, Batch.batch_no == shard.batch_no
            )
        ).scalar_one()
    record = int(read_table(Path(ts.path), None).column("record_no")[int(order[start])].as_py())
    with db.begin() as conn:
        conn.execute(delete(Embedding).where(Embedding.record_no == record))
    report = verify(db, paths, SET)
    rows = _only(report, "rows")
    assert rows.subject == f"{SET} plan {shard.plan_id} batch {shard.batch_no}"
    assert rows.problem.startswith(f"1 of {shard.n_items} tasks of this completed batch")
    ledger = _only(report, "ledger")
    assert "tasks 151 != completed 149 + reused 0 + failed 1 " in ledger.problem
    assert ledger.repair == rows.repair  # requeue that batch, not just run the set
    assert any("stale (rebuild pending)" in note for note in report.notes)  # a note only

    requeue_batches(db, paths, SET, [shard.batch_no], shard.plan_id)
    _extract(db, paths, cpu_engine, manifest)
    assert verify(db, paths, SET).clean


def test_a_batch_extracted_again_without_the_sets_hook_layers_is_a_coverage_gap(
    db: Engine, paths: FabricPaths, done: PublishedIndex, manifest: EngineManifest
) -> None:
    from fabric_gpu.engines import create_engine
    from fabric_gpu.manifest import HookSpec

    shard = _shards(db)[0]
    requeue_batches(db, paths, SET, [shard.batch_no], shard.plan_id)
    no_hooks = replace(manifest, hooks=HookSpec((), manifest.hooks.pooling))
    assert no_hooks.model_key == manifest.model_key  # the same rows, just no hidden states
    engine = create_engine(no_hooks)
    try:
        _extract(db, paths, engine, no_hooks)
    finally:
        engine.close()
    finding = _only(verify(db, paths, SET), "shard_coverage")
    assert "no hidden-state shard file for layers [2, -1]" in finding.problem
    assert finding.repair.endswith(f"fabric run {SET} --max-seq-len 128 --hook-layers=2,-1")


def test_a_missing_shard_row_and_a_stray_task_are_coverage_findings(
    db: Engine, paths: FabricPaths, done: PublishedIndex
) -> None:
    first, second = _shards(db)[:2]
    with db.begin() as conn:
        conn.execute(delete(HiddenStateShard).where(HiddenStateShard.sha256 == first.sha256))
    finding = _only(verify(db, paths, SET), "shard_coverage")
    assert finding.subject == f"{SET} plan {first.plan_id} batch {first.batch_no}"
    assert "no hidden-state shard file for layers [2, -1]" in finding.problem
    # The engine promised layers the current plan never stored: the accounting check's view.
    assert not verify_extraction(db, paths, SET, hook_layers=[2, -1]).clean
    with db.begin() as conn:  # a shard row that says it belongs to another batch
        conn.execute(
            update(HiddenStateShard)
            .where(HiddenStateShard.sha256 == second.sha256)
            .values(batch_no=first.batch_no)
        )
    problems = [f.problem for f in verify(db, paths, SET).findings if f.kind == "shard_coverage"]
    assert any("task ids are not the batch's" in p or "tasks, its row says" in p for p in problems)


@pytest.mark.slow
def test_a_task_set_file_bit_flip_and_a_lost_plan_file(
    db: Engine, db_url: str, paths: FabricPaths, done: PublishedIndex,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    ts = get_task_set(db, SET)
    plan = _plan(db, ts.current_plan_id)
    original = Path(ts.path).read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    Path(ts.path).write_bytes(bytes(flipped))
    Path(plan.path).unlink()
    report = verify(db, paths, SET)
    task_file = _only(report, "task_set_file")
    assert task_file.subject == ts.path and f"but {ts.content_sha256} recorded" in task_file.problem
    # The inbox file is intact, so ingesting again writes the stored file anew.
    assert task_file.repair == f"fabric run {SET} --max-seq-len 128 --hook-layers=2,-1"
    plan_file = _only(report, "plan_file")
    assert plan_file.problem == "missing"
    assert plan_file.repair == f"fabric restore-plan {SET} {plan.plan_id}"
    # The repairs in the order printed: the plan first, planned again from the task-set file,
    # which ingest writes again from the intact inbox file; then the run finds nothing to do.
    assert report.repairs() == [plan_file.repair, task_file.repair]
    for command in report.repairs():
        _run_repair(command, db_url, paths, monkeypatch)
    assert Path(ts.path).read_bytes() == original and Path(plan.path).is_file()
    assert verify(db, paths, SET).clean


def test_index_and_receipt_files_are_checked_against_receipt_and_name(
    db: Engine, db_url: str, paths: FabricPaths, done: PublishedIndex,
    monkeypatch: pytest.MonkeyPatch, capsys: Any,
) -> None:  # fmt: skip
    receipt = done.receipt
    folder = model_index_folder(paths.indexes, receipt["model"]["model_key"])
    (folder / receipt["training"]["quantizer_file"]).unlink()
    edited = json.loads(done.receipt_path.read_text())
    edited["source"]["rows"] += 1  # a receipt edited after it was written
    done.receipt_path.write_text(json.dumps(edited))
    stray = paths.receipts / f"{'0' * 64}.json"
    stray.write_text("{}")  # named like a receipt, published by nobody
    report = verify(db, paths)
    index = _only(report, "index_file")
    assert index.subject == str(folder / receipt["training"]["quantizer_file"])
    assert index.problem == "missing"
    assert index.repair == (
        f"fabric receipt restore {done.receipt_sha256} && "
        f"fabric index rebuild --receipt {done.receipt_path}"
    )
    receipts = {f.subject: f for f in report.findings if f.kind == "receipt"}
    assert set(receipts) == {str(done.receipt_path), str(stray)}
    assert "edited or corrupt" in receipts[str(done.receipt_path)].problem
    assert receipts[str(stray)].repair.startswith(f"rm {stray}")
    # `fabric index verify` no longer trusts a receipt that is not what its name says.
    assert _cli(db_url, paths, monkeypatch, "index", "verify", "--receipt", str(done.receipt_path)) == 1  # fmt: skip
    assert "edited or corrupt" in capsys.readouterr().err
    # `fabric verify` prints each finding with its repair, and exits 1.
    assert _cli(db_url, paths, monkeypatch, "verify") == 1
    out = capsys.readouterr().out
    assert f"index_file: {index.subject}: missing\n  repair: {index.repair}" in out

    _run_repair(index.repair, db_url, paths, monkeypatch)
    stray.unlink()
    assert verify(db, paths).clean


def test_requeue_refuses_what_it_cannot_requeue_and_retries_failed_batches(
    db: Engine, paths: FabricPaths, done: PublishedIndex, cpu_engine: ExtractionEngine,
    manifest: EngineManifest,
) -> None:  # fmt: skip
    plan_id = get_task_set(db, SET).current_plan_id
    assert plan_id is not None
    with pytest.raises(RepairError, match="has no batch 999"):
        requeue_batches(db, paths, SET, [999])
    with pytest.raises(RepairError, match="no plan whose id starts with 'ffff'"):
        requeue_batches(db, paths, SET, [0], "ffff")
    with db.begin() as conn:
        conn.execute(
            update(Batch)
            .where(Batch.plan_id == plan_id, Batch.batch_no == 0)
            .values(state="leased", lease_owner="elsewhere")
        )
    with pytest.raises(RepairError, match="being extracted"):
        requeue_batches(db, paths, SET, [0])
    # A batch that failed for good is an outcome (its tasks failed, with a reason) ...
    with db.begin() as conn:
        conn.execute(
            update(Batch)
            .where(Batch.plan_id == plan_id, Batch.batch_no == 0)
            .values(state="completed")
        )
    requeue_batches(db, paths, SET, [0])
    lease = claim(db, plan_id, "test", 60.0)
    assert lease is not None and lease.batch_no == 0
    ts = get_task_set(db, SET)
    table = read_table(Path(ts.path), None)
    plan = _plan(db, plan_id)
    rows = load_plan_order(Path(plan.path), plan.sha256)[
        lease.item_start : lease.item_start + lease.item_count
    ]
    items = list(
        zip(
            table.column("record_no").to_numpy()[rows].tolist(),
            table.column("id").take(rows).to_pylist(),
            strict=True,
        )
    )
    assert report_failure(db, lease, "engine fault", 1, items, SET) == "failed"
    assert verify(db, paths, SET).clean
    # ... and requeueing it retries it: its failures go, its tasks run again.
    requeue_batches(db, paths, SET, [0])
    _extract(db, paths, cpu_engine, manifest)
    with db.connect() as conn:
        assert conn.execute(select(TaskFailure.stage)).scalars().all() == ["ingest"]
        superseded = conn.execute(
            select(Batch.state).where(Batch.plan_id == plan_id, Batch.batch_no == 0)
        ).scalar_one()
    assert superseded == "superseded"  # its tasks were planned again, in a plan of their own
    with pytest.raises(RepairError, match="superseded"):
        requeue_batches(db, paths, SET, [0], plan_id)
    assert verify(db, paths, SET).clean


def _plan(db: Engine, plan_id: str | None) -> Any:
    with db.connect() as conn:
        return conn.execute(select(BatchPlanRow).where(BatchPlanRow.plan_id == plan_id)).one()


# ---- acceptance 2: a real run, damaged files, the printed repairs ------------------------------

ACCEPTANCE_TEXTS = 3000  # a few thousand texts, with a hook layer on


def _resources(paths: FabricPaths, db_url: str) -> dict[str, object]:
    store = ArtifactStore(root=str(paths.root))
    return {
        "store": store,
        "database": Database(store=store, url=db_url),
        "engine": EngineConfig(
            max_batch_tokens=4096,
            max_batch_items=64,
            max_seq_len=128,
            hook_layers=[-1],
            workers=0,
        ),
    }


@pytest.mark.slow
def test_acceptance_a_real_run_verifies_and_each_damaged_shard_is_repaired(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("task_set", [SET])
    from fabric_pipelines.lib.tasks.inbox import submit

    submit(_source(tmp_path, ACCEPTANCE_TEXTS), paths.inbox, SET)
    resources = _resources(paths, db_url)
    assert dg.materialize(
        [tokenised_tasks, shape_batches, extraction_outputs], partition_key=SET,
        instance=instance, resources=resources,
    ).success  # fmt: skip
    assert dg.materialize([vector_index], instance=instance, resources=resources).success
    report = verify(db, paths)
    assert report.clean, report.findings
    assert report.checked["hidden_state_tasks"] == ACCEPTANCE_TEXTS  # one layer, every task

    for damage in ("truncate", "flip a bit"):
        shard = _shards(db)[-1]
        path = Path(shard.path)
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[: len(data) - 100]
        else:
            data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
        finding = _only(verify(db, paths), "shard_file")
        assert finding.subject == shard.path
        if damage == "truncate":
            # The blocking accounting check of extraction_outputs verifies the shard files too.
            rerun = dg.materialize(
                [tokenised_tasks, shape_batches, extraction_outputs], partition_key=SET,
                instance=instance, resources=resources, raise_on_error=False,
            )  # fmt: skip
            assert not rerun.success
            [check] = rerun.get_asset_check_evaluations()
            assert check.check_name == "accounting" and not check.passed
            assert f"shard_file {shard.path}: truncated" in str(check.metadata["problems"].value)
            assert f"shard_file {shard.path}: truncated" in failure_text(rerun, "extraction")
        assert finding.repair.startswith(f"fabric requeue {SET} --plan {shard.plan_id} ")
        _run_repair(finding.repair, db_url, paths, monkeypatch)
        after = verify(db, paths)
        assert after.clean, (damage, after.findings)
        with db.connect() as conn:
            assert accounting(conn, SET).finished
            assert conn.execute(select(TaskSet.n_tasks)).scalar_one() == ACCEPTANCE_TEXTS
