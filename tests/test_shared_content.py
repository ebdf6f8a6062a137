"""Two task sets with identical records share their content-addressed hidden-state files, and
each set still has its own shard row per batch: `fabric verify` finds both covered, and
forgetting one set leaves the other's files and rows in place. A replayed batch keeps one row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, insert, select

from fabric_gpu.batching import BatchPlan
from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import COMPLETED, claim_many, register_plan
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.core.files import StoredFile
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.maintenance.verify import verify
from fabric_pipelines.lib.results.writer import BatchRows, write_group
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.store.keys import model_id, set_id_of
from fabric_pipelines.lib.store.models import Batch, BatchPlanRow, HiddenStateShard, TaskSet
from fabric_pipelines.lib.tasks.catalog import forget_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit


@pytest.fixture(autouse=True)
def _reuse_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two sets with identical records, each computing its own batches (with reuse on, the second
    # would link to the first's results instead: tests/test_reuse.py covers that).
    monkeypatch.setenv("FABRIC_REUSE", "off")


SETS = ("first", "second")


def _manifest(model_dir: Path) -> EngineManifest:
    """The CPU engine on the tiny model, hook layer -1, a few items per batch (several batches)."""
    return manifest_for_model(
        str(model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(max_batch_tokens=128, max_batch_items=8, max_seq_len=16,
                                seq_granularity=8),
        hooks=HookSpec((-1,), "mean"),
    )  # fmt: skip


def _source(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"t-{i}", "text": f"item {i} about {i % 7}"}) + "\n"
            for i in range(30)
        )
    )
    return path


def _extract(
    db: Engine, db_url: str, paths: FabricPaths, manifest: EngineManifest, source: Path, name: str
) -> None:
    submit(source, paths.inbox, name)
    ingest_task_set(
        db, paths, name, model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    plan_task_set(db, paths, name, manifest)
    summary = extract_task_set(db, paths, name, manifest, database_url=db_url, workers=0)
    assert summary.batches_done > 1 and summary.batches_failed == 0, summary


def _shards(db: Engine, name: str) -> list[Any]:
    with db.connect() as conn:
        return list(
            conn.execute(
                select(HiddenStateShard)
                .where(HiddenStateShard.task_set_id == set_id_of(name))
                .order_by(HiddenStateShard.batch_no)
            ).all()
        )


def _completed(db: Engine, name: str) -> list[tuple[str, int]]:
    with db.connect() as conn:
        rows = conn.execute(
            select(Batch.plan_id, Batch.batch_no)
            .where(Batch.task_set_id == set_id_of(name), Batch.state == COMPLETED)
            .order_by(Batch.batch_no)
        ).all()
    return [(r.plan_id, r.batch_no) for r in rows]


def test_two_sets_with_identical_content_are_both_covered(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    manifest = _manifest(tiny_model_dir)
    for name in SETS:  # the same records, submitted twice under two names
        _extract(db, db_url, paths, manifest, _source(tmp_path, name), name)

    shards = {name: _shards(db, name) for name in SETS}
    for name in SETS:  # one row per completed batch, each naming its own batch
        assert [(s.plan_id, s.batch_no) for s in shards[name]] == _completed(db, name), name
        assert all(json.loads(s.layers) == [-1] for s in shards[name])
    # The scenario itself: different plans, yet the very same files.
    assert {s.plan_id for s in shards["first"]}.isdisjoint(s.plan_id for s in shards["second"])
    files = {s.sha256 for s in shards["first"]}
    assert files == {s.sha256 for s in shards["second"]}

    report = verify(db, paths)
    assert report.clean, report.findings
    n_tasks = sum(s.n_items for name in SETS for s in shards[name])
    assert report.checked["hidden_state_tasks"] == n_tasks == 60

    # Forgetting one set deletes its rows only: the shared files stay, the other set verifies.
    forget_task_set(db, paths, "first")
    assert _shards(db, "first") == []
    assert all(Path(s.path).is_file() for s in shards["second"])
    report = verify(db, paths)
    assert report.clean, report.findings
    assert report.checked["hidden_state_tasks"] == 30


def test_a_replayed_batch_keeps_one_shard_row_and_batches_sharing_a_file_get_one_each(
    db: Engine,
) -> None:
    """write_group twice (a replay after a lost reply): one row per batch, even where both
    batches of the plan name the same file."""
    plan = BatchPlan(
        order=np.arange(4), seq_len=np.full(2, 8), item_start=np.array([0, 2]),
        item_count=np.full(2, 2), real_tokens=np.full(2, 10), padded_tokens=np.full(2, 16),
    )  # fmt: skip
    with db.begin() as conn:
        set_id = conn.execute(
            insert(TaskSet).returning(TaskSet.id),
            {
                "name": "w", "source_sha256": "s", "content_sha256": "c", "path": "p",
                "model_id": "m", "tokenizer_sha256": "t", "max_seq_len": 8, "n_records": 4,
                "n_tasks": 4, "truncated": 0, "current_plan_id": "plan",
            },
        ).scalar_one()  # fmt: skip
        conn.execute(
            insert(BatchPlanRow).values(
                task_set_id=set_id_of("w"), model_id=model_id(conn, "model")
            ),
            {
                "plan_id": "plan", "profile_json": "{}",
                "n_batches": 2, "n_items": 4, "real_tokens": 20, "padded_tokens": 32,
                "path": "p", "sha256": "x",
            },
        )  # fmt: skip
        model = model_id(conn, "model")
        register_plan(conn, "plan", "w", plan)
    shared = StoredFile(Path("/shards/aa.arrow"), "a" * 64, 100)
    group = [
        BatchRows(
            lease=lease, task_set="w", task_set_id=set_id, model_key="model", model_id=model,
            record_no=np.arange(2) + 2 * lease.batch_no, n_tokens=np.full(2, 5),
            pooled=np.ones((2, 4), dtype=np.float32), shard=shared, layers=(-1,),
        )
        for lease in claim_many(db, "plan", "me", 3600, 2)
    ]  # fmt: skip
    assert len(write_group(db, group).acked) == 2
    assert len(write_group(db, group, upsert=True).acked) == 2  # the replay: acks idempotent
    rows = _shards(db, "w")
    assert [(r.plan_id, r.batch_no, r.sha256) for r in rows] == [
        ("plan", 0, shared.sha256),
        ("plan", 1, shared.sha256),
    ]
