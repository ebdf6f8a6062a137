"""The whole chain in Dagster, in-process, for one task-set partition, on both databases."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from fabric_pipelines.defs.extraction import extraction_outputs, shape_batches, tokenised_tasks
from fabric_pipelines.defs.index import vector_index
from fabric_pipelines.defs.resources import ArtifactStore, Database, EngineConfig
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index.lineage import find_receipt, render_lineage, trace
from fabric_pipelines.lib.index.receipt import canonical_json, receipt_sha256
from fabric_pipelines.lib.store.db import create_schema, make_engine
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding, IndexReceipt
from fabric_pipelines.lib.tasks.inbox import submit

PARTITIONED = [tokenised_tasks, shape_batches, extraction_outputs]


def _resources(paths: FabricPaths, db_url: str) -> dict[str, object]:
    store = ArtifactStore(root=str(paths.root))
    return {
        "store": store,
        "database": Database(store=store, url=db_url),
        "engine": EngineConfig(
            max_batch_tokens=4096,
            max_batch_items=64,
            max_seq_len=128,
            hook_layers=[2, -1],
            truncate=False,  # over-long items fail here, with their reason
        ),
    }


def _task_set(tmp_path: Path) -> Path:
    rows = [
        {"id": f"doc-{i}", "text": f"Document number {i} talks about topic {i % 7}."}
        for i in range(60)
    ]
    rows += [
        {"id": "empty", "text": ""},
        {"id": "spaces", "text": "    "},
        {"id": "overlong", "text": "many words " * 200},
        {"id": "doc-1", "text": "a duplicate id"},
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _metadata(result: dg.ExecuteInProcessResult, key: str) -> dict[str, object]:
    for event in result.get_asset_materialization_events():
        m = event.materialization
        if m.asset_key.to_user_string() == key:
            return {k: v.value for k, v in m.metadata.items()}
    raise AssertionError(f"no materialization of {key}")


@pytest.mark.slow
def test_materialize_the_chain_then_again(paths: FabricPaths, db_url: str, tmp_path: Path) -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("task_set", ["mixed"])
    submit(_task_set(tmp_path), paths.inbox, "mixed")
    resources = _resources(paths, db_url)

    first = dg.materialize(
        PARTITIONED, partition_key="mixed", instance=instance, resources=resources
    )
    assert first.success
    tasks = _metadata(first, "tokenised_tasks")
    assert (tasks["records"], tasks["tasks"], tasks["failed"]) == (64, 60, 4)
    assert "| tokens | tasks |" in str(tasks["length_histogram"])
    assert "tokens |" in str(_metadata(first, "shape_batches")["padding_by_bucket"])
    failures = str(tasks["failures"])
    for reason in ("empty text", "only whitespace", "over-long", "duplicate id 'doc-1'"):
        assert reason in failures
    checks = {e.check_name: e for e in first.get_asset_check_evaluations()}
    assert checks["accounting"].passed
    assert checks["accounting"].metadata["completed"].value == 60
    assert checks["accounting"].metadata["failed"].value == 4
    extracted = _metadata(first, "extraction_outputs")
    planned = _metadata(first, "shape_batches")
    assert extracted["plan_id"] == planned["plan_id"]  # names the plan it ran, and its file
    assert extracted["task_file_sha256"] == _metadata(first, "tokenised_tasks")["sha256"]
    # Where the step's time went: the engine's window and the rest add up to the step.
    seconds = extracted["efficiency_record"]["seconds"]
    assert seconds["engine"] > 0 and seconds["before_engine"] >= 0
    # The CPU engine has no GPU timing: no busy fraction, and no GPU seconds in the sum.
    assert extracted["efficiency_record"]["gpu_busy_fraction"] is None
    assert extracted["efficiency_record"]["gpu_seconds"] == {"busy": 0, "span": 0}
    parts = sum(v for k, v in seconds.items() if k != "step")
    assert parts == pytest.approx(seconds["step"], abs=0.01)
    assert "engine pulled batches for" in str(extracted["efficiency"])
    # The run recorded what its engine did, for `fabric plan`'s predictions.
    from sqlalchemy import select

    from fabric_pipelines.lib.store.models import EngineSpeed

    with Session(make_engine(db_url)) as session:
        speeds = session.scalars(select(EngineSpeed)).all()
    assert [(s.source, s.real_tokens > 0, s.padded_tokens >= s.real_tokens) for s in speeds] == [
        ("extraction of task set mixed", True, True)
    ]

    index = dg.materialize([vector_index], instance=instance, resources=resources)
    assert index.success
    meta = _metadata(index, "vector_index")
    receipt_path = Path(str(meta["receipt_path"]))
    receipt = json.loads(receipt_path.read_text())
    assert receipt_path.read_bytes() == canonical_json(receipt)
    assert meta["receipt_sha256"] == receipt_sha256(receipt) == receipt_path.stem
    assert receipt["source"]["rows"] == 60
    # The essentials, hashes in full; the whole receipt is the file.
    assert f"`{meta['receipt_sha256']}`" in str(meta["receipt"])
    assert f"`{receipt['index_sha256']}`" in str(meta["receipt"])
    assert meta["input mixed"] == dg.MetadataValue.dagster_run(first.run_id).value  # a run link
    assert "nprobe" in str(meta["recall_curve"]) or "recall@10" in str(meta["recall_curve"])
    assert "data:image/png;base64," in str(meta["recall_curve"])  # a plot beside the numbers
    assert "| vectors_nan | 0 |" in str(meta["cluster_health"])
    assert receipt["inputs"][0]["partition"] == "mixed"
    assert receipt["inputs"][0]["run_id"] == first.run_id
    assert receipt["model"]["weights_sha256"] == EngineConfig().manifest().weights_sha256
    event = instance.get_latest_materialization_event(dg.AssetKey("vector_index"))
    assert event is not None and event.asset_materialization is not None
    assert event.asset_materialization.tags["dagster/data_version"] == meta["receipt_sha256"]
    index_checks = {e.check_name: e for e in index.get_asset_check_evaluations()}
    assert index_checks["recall_at_10"].passed

    # Lineage: from the index back to its task set, plan and ledger, model and code versions.
    engine = make_engine(db_url)
    with engine.connect() as conn:
        sha, found = find_receipt(conn, str(meta["index_sha256"])[:12])
        lineage = trace(conn, sha, found)
    assert sha == meta["receipt_sha256"]
    [mixed] = lineage.task_sets
    assert (mixed.name, mixed.records, mixed.tasks, mixed.embeddings) == ("mixed", 64, 60, 60)
    assert mixed.run_id == first.run_id
    [plan] = mixed.plans
    assert plan.current and plan.states == {"completed": plan.batches}
    assert lineage.code["extraction_outputs"].startswith("extract-")
    assert lineage.model["weights_sha256"] == receipt["model"]["weights_sha256"]
    assert f"plan {plan.plan_id[:16]} (current)" in render_lineage(lineage)
    engine.dispose()

    # The same set again: nothing is extracted twice, no row is duplicated.
    second = dg.materialize(
        PARTITIONED, partition_key="mixed", instance=instance, resources=resources
    )
    assert second.success
    assert _metadata(second, "tokenised_tasks")["reused"] is True
    # Planning the finished set again shows the plan that did the work, as it was made.
    again, before = _metadata(second, "shape_batches"), _metadata(first, "shape_batches")
    assert again["new_ledger_rows"] == 0 and again["plan_id"] == before["plan_id"]
    assert again["batches"] == before["batches"] > 0 and again["items"] == before["items"]
    assert _metadata(second, "extraction_outputs")["rows_inserted"] == 0
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Embedding)).scalar_one() == 60
        assert conn.execute(select(func.count()).select_from(IndexReceipt)).scalar_one() == 1
    engine.dispose()


def test_the_recall_check_blocks_a_bad_index(paths: FabricPaths) -> None:
    """An index under its recall floor fails its blocking check: the run fails, the receipt is
    not recorded as current, and the good index that follows is recorded with a file link."""
    db_url = f"sqlite:///{paths.sqlite_path}"
    resources = _resources(paths, db_url)
    engine = make_engine(db_url)
    create_schema(engine)
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(30, 32))
    x = (centres[rng.integers(0, 30, 4000)] + 0.3 * rng.normal(size=(4000, 32))).astype("<f4")
    with engine.begin() as conn:
        model = model_id(conn, resources["engine"].manifest().model_key)  # type: ignore[attr-defined]
        conn.execute(
            insert(Embedding),
            [
                {"model_id": model, "task_set_id": 1, "record_no": i, "n_tokens": 4,
                 "vector": v.tobytes()}
                for i, v in enumerate(x)
            ],
        )  # fmt: skip
    instance = dg.DagsterInstance.ephemeral()
    # Compressed lists: no nprobe reaches the floor, so the raise cannot save it.
    bad_config = {"factory": "IVF64,PQ4x4", "nprobe": 1, "min_recall": 0.99, "shards": 2}
    bad = dg.materialize(
        [vector_index],
        instance=instance,
        resources=resources,
        run_config={"ops": {"vector_index": {"config": bad_config}}},
        raise_on_error=False,
    )
    assert not bad.success
    # Refused before any materialisation is recorded: the UI's latest stays the served index.
    assert bad.get_asset_materialization_events() == []
    failure = next(e for e in bad.all_events if e.is_step_failure)
    data = failure.step_failure_data
    assert "index not published: recall@10" in str(data.error.message if data.error else "")
    assert data.user_failure_data is not None
    meta = data.user_failure_data.metadata
    assert meta["recall_at_10"].value < 0.99 and meta["floor"].value == 0.99
    assert meta["served_index"].value == "none yet" and meta["published"].value is False
    assert Path(meta["refused_receipt_path"].value).is_file()  # kept for inspection
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IndexReceipt)).scalar_one() == 0

    good = dg.materialize([vector_index], instance=instance, resources=resources)
    assert good.success
    event = good.get_asset_materialization_events()[0].materialization
    link = event.metadata["receipt_path"]
    assert isinstance(link, dg.PathMetadataValue) and Path(link.path).is_file()
    receipt = json.loads(Path(link.path).read_text())
    assert receipt_sha256(receipt) == event.metadata["receipt_sha256"].value
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IndexReceipt)).scalar_one() == 1

    # No row moved since: materialising again builds nothing; the served index is recorded
    # again under its own receipt, with its recall check.
    again = dg.materialize([vector_index], instance=instance, resources=resources)
    assert again.success
    same = again.get_asset_materialization_events()[0].materialization
    assert same.metadata["receipt_sha256"] == event.metadata["receipt_sha256"]
    assert "nothing was built" in str(same.metadata["note"].value)
    assert same.tags is not None
    assert same.tags["dagster/data_version"] == event.metadata["receipt_sha256"].value
    assert [e.passed for e in again.get_asset_check_evaluations()] == [True]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IndexReceipt)).scalar_one() == 1
    engine.dispose()


def test_a_replaced_inbox_file_fails_without_retries(paths: FabricPaths, tmp_path: Path) -> None:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("task_set", ["s"])
    source = _task_set(tmp_path)
    submit(source, paths.inbox, "s")
    resources = _resources(paths, f"sqlite:///{paths.sqlite_path}")
    assert dg.materialize(
        [tokenised_tasks], partition_key="s", instance=instance, resources=resources
    ).success
    (paths.inbox / "s.jsonl").write_text('{"id": "x", "text": "other content"}\n')
    result = dg.materialize(
        [tokenised_tasks],
        partition_key="s",
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert "immutable" in str(failure.event_specific_data)


def test_forget_job_removes_a_set_and_a_partition_added_without_a_file(
    paths: FabricPaths, db_url: str, tmp_path: Path
) -> None:
    from fabric_pipelines.defs.forget import forget_job

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("task_set", ["kept", "doomed", "no-file"])
    resources = _resources(paths, db_url)
    for name in ("kept", "doomed"):
        submit(_task_set(tmp_path), paths.inbox, name)
        result = dg.materialize(
            [tokenised_tasks], partition_key=name, instance=instance, resources=resources
        )
        assert result.success

    def forget(name: str, **config: object) -> dg.ExecuteInProcessResult:
        return forget_job.execute_in_process(
            run_config={"ops": {"forget_task_set_op": {"config": {"task_set": name, **config}}}},
            instance=instance,
            resources={k: v for k, v in resources.items() if k != "engine"},
            raise_on_error=False,
        )

    assert forget("doomed").success
    assert forget("no-file").success  # the UI's "Add a partition" with no file behind it
    assert instance.get_dynamic_partitions("task_set") == ["kept"]
    assert not list(paths.inbox.glob("doomed.*")) and not (paths.task_sets / "doomed").exists()
    missing = forget("doomed")  # nothing left by that name: refused, naming it
    assert not missing.success
    failure = next(e for e in missing.all_events if e.is_step_failure)
    assert "no task set named 'doomed'" in str(failure.step_failure_data.error)
    engine = make_engine(db_url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Embedding)).scalar_one() == 0
    from fabric_pipelines.lib.tasks.catalog import list_task_sets

    assert list_task_sets(engine) == ["kept"]
    engine.dispose()
