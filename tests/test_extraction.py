"""Extraction through the ledger with the real model: hooks, idempotency, failures, accounting."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import Engine, exc, select
from transformers import AutoModel

from fabric_gpu.engines.base import gather_padded
from fabric_gpu.manifest import EngineManifest
from fabric_gpu.model import resolve_model_dir
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import load_plan_order, plan_task_set
from fabric_pipelines.lib.core.files import CorruptFileError
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.results.hidden_states import read_shard
from fabric_pipelines.lib.store.keys import set_id_of
from fabric_pipelines.lib.store.models import Batch, HiddenStateShard
from fabric_pipelines.lib.tasks.arrow_files import read_table
from fabric_pipelines.lib.tasks.catalog import ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from fabric_pipelines.lib.worker import loop as extraction
from fabric_pipelines.lib.worker.loop import ExtractionJob, LeaseHeartbeat, run_worker
from tests.flaky_db import FlakyDatabase, lost_connection, undefined_table
from tests.ledger_helpers import claim
from tests.pipeline_helpers import embedding_counts, run_stages, stored_embeddings


@pytest.fixture(autouse=True)
def _reuse_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests count what the engine computes for TEXTS, which repeats five texts six times:
    # with reuse on, the repeats would be linked, not computed. Reuse has its own tests
    # (tests/test_reuse.py); the test that counts the repeats turns it on again.
    monkeypatch.setenv("FABRIC_REUSE", "off")


TEXTS = {
    f"t{i}": text
    for i, text in enumerate(
        [
            "The quick brown fox jumps over the lazy dog.",
            "Return the number of items in a container.",
            "Open a file and return a stream; raise OSError upon failure.",
            "hello",
            "A much longer sentence that goes on for a while, describing in some detail how "
            "a ring buffer of pinned memory hands batches to a GPU without any host thread.",
        ]
        * 6
    )
}


def _source(tmp_path: Path, extra: list[dict] | None = None) -> Path:
    rows = [{"id": k, "text": v} for k, v in TEXTS.items()] + (extra or [])
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gather_padded_places_tokens_and_padding() -> None:
    tokens = np.arange(10, dtype=np.int32)
    offsets = np.array([0, 3, 4, 10], dtype=np.int64)
    batch = gather_padded(tokens, offsets, np.array([2, 0]), 8, pad_id=-7)
    assert batch.input_ids.tolist() == [
        [4, 5, 6, 7, 8, 9, -7, -7],
        [0, 1, 2, -7, -7, -7, -7, -7],
    ]
    assert batch.lengths.tolist() == [6, 3]


@pytest.mark.slow
def test_hook_states_and_pooling_match_the_model_run_item_by_item(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    _, report = run_stages(db, paths, cpu_engine, manifest, _source(tmp_path), "hooks")
    assert report.batches_done > 1 and report.items_done == len(TEXTS)
    model = AutoModel.from_pretrained(str(resolve_model_dir(manifest.model_id))).eval()
    from fabric_gpu.model import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(manifest.model_id))
    pooled = stored_embeddings(db, "hooks", manifest.model_key)
    with db.connect() as conn:
        shards = conn.execute(select(HiddenStateShard)).all()
    assert sum(s.n_items for s in shards) == len(TEXTS)
    checked = 0
    for shard in shards:
        content = read_shard(Path(shard.path), shard.sha256)
        for i, task_id in enumerate(content["task_id"]):
            ids = torch.tensor([tokenizer.encode(TEXTS[task_id]).ids])
            with torch.inference_mode():
                out = model(input_ids=ids, output_hidden_states=True)
            for layer in (2, -1):
                expected = out.hidden_states[layer][0].numpy()
                got = content[f"layer_{layer}"][i].astype(np.float32)
                assert got.shape == expected.shape  # real tokens only, no padding
                np.testing.assert_allclose(got, expected, atol=2e-2, rtol=1e-2)  # stored as fp16
            np.testing.assert_allclose(
                pooled[task_id], out.last_hidden_state[0].mean(0).numpy(), atol=1e-4
            )
            checked += 1
    assert checked == len(TEXTS)


@pytest.mark.slow
def test_running_twice_writes_no_duplicates_and_accounting_balances(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    bad = [
        {"id": "empty", "text": ""},
        {"id": "t0", "text": "duplicate"},
        {"id": "long", "text": "x " * 400},
    ]
    source = _source(tmp_path, bad)
    summary, _ = run_stages(db, paths, cpu_engine, manifest, source, "twice")
    assert summary.n_failed == 3
    _, second = run_stages(db, paths, cpu_engine, manifest, source, "twice")
    assert second.batches_done == 0 and second.rows_inserted == 0
    # Planning again after everything is done plans nothing new: no outstanding item, no ledger
    # row (the summary describes the plan that did the work).
    again = plan_task_set(db, paths, "twice", manifest)
    assert (again.outstanding, again.new_batches) == (0, 0)
    rows, distinct = embedding_counts(db)
    with db.connect() as conn:
        a = accounting(conn, "twice")
    assert rows == distinct == len(TEXTS)
    assert a.finished and (a.tasks, a.completed, a.failed) == (len(TEXTS) + 3, len(TEXTS), 3)


class FlakyEngine:
    """Wraps the real engine; fails every batch that holds a given item, always."""

    def __init__(self, inner, poison_length: int) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.poison_length = inner, poison_length
        self.manifest, self.input_location = inner.manifest, inner.input_location
        self.hidden_size, self.num_layers = inner.hidden_size, inner.num_layers
        self.profile = inner.profile
        self.calls = 0

    def forward_hidden(self, ids: np.ndarray, lengths: np.ndarray):  # type: ignore[no-untyped-def]
        self.calls += 1
        if (lengths == self.poison_length).any():
            raise RuntimeError("simulated device fault")
        return self.inner.forward_hidden(ids, lengths)

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_a_batch_that_keeps_failing_fails_its_items_with_the_reason(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    poison = len(cpu_engine_tokens("hello"))
    flaky = FlakyEngine(cpu_engine, poison)
    _, report = run_stages(db, paths, flaky, manifest, _source(tmp_path), "flaky")
    assert report.batches_failed >= 1 and report.batches_requeued >= 2  # tried 3 times
    with db.connect() as conn:
        a = accounting(conn, "flaky")
    assert a.finished and a.failed >= 6 and a.completed + a.failed == len(TEXTS)
    assert any("simulated device fault" in e for e in report.errors)


def cpu_engine_tokens(text: str) -> list[int]:
    from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer

    return list(load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID)).encode(text).ids)


def test_a_corrupted_shard_is_detected_naming_the_file(tmp_path: Path) -> None:
    from fabric_pipelines.lib.results.hidden_states import write_shard

    shard = write_shard(
        tmp_path, ["a", "b"], np.array([2, 1]), {-1: np.ones((3, 4), np.float16)}, hidden_size=4
    )
    content = read_shard(shard.path, shard.sha256)
    assert [x.shape for x in content["layer_-1"]] == [(2, 4), (1, 4)]
    data = bytearray(shard.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.path.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=shard.path.name):
        read_shard(shard.path, shard.sha256)


def _planned_job(
    db: Engine, paths: FabricPaths, manifest: EngineManifest, source: Path, name: str
) -> ExtractionJob:
    """Submit, ingest and plan `source`; the job a worker runs for it."""
    submit(source, paths.inbox, name)
    summary = ingest_task_set(
        db, paths, name, model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    plan = plan_task_set(db, paths, name, manifest)
    return ExtractionJob(
        task_set=name,
        plan_id=plan.plan_id,
        model_key=manifest.model_key,
        tasks=read_table(summary.path, summary.content_sha256),
        order=load_plan_order(plan.path, plan.sha256),
        shard_folder=paths.shards,
    )


def test_batches_finished_by_another_run_while_a_plan_is_computed_are_not_planned_again(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fabric_pipelines.lib.broker import plans

    first = _planned_job(db, paths, manifest, _source(tmp_path), "race")
    real_plan_batches = plans.plan_batches
    calls = []

    def another_run_finishes_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        # The first run drains its plan between the second's read of the outstanding items
        # and the second's store of its plan (the window two concurrent runs can hit).
        if not calls:
            run_worker(db, cpu_engine, first, owner="first run")
        calls.append(1)
        return real_plan_batches(*args, **kwargs)

    monkeypatch.setattr(plans, "plan_batches", another_run_finishes_meanwhile)
    # Another layout, so another plan id: before the fix its batches held every item again.
    second = plan_task_set(db, paths, "race", manifest, layout="packed")
    # Nothing is left once the store looks again: the plan that did the work stays current.
    assert (second.plan_id, second.outstanding, second.new_batches) == (first.plan_id, 0, 0)
    with db.connect() as conn:
        queued = conn.scalars(
            select(Batch.batch_no).where(
                Batch.task_set_id == set_id_of("race"), Batch.state == "queued"
            )
        ).all()
        a = accounting(conn, "race")
    assert queued == [] and a.finished and a.completed == len(TEXTS)
    rows, distinct = embedding_counts(db)
    assert rows == distinct == len(TEXTS)


@pytest.mark.slow
def test_every_database_call_of_a_worker_rides_out_transient_errors(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    job = _planned_job(db, paths, manifest, _source(tmp_path), "blips")
    flaky = FlakyDatabase(db, lost_connection, times=2)  # each call site fails twice first
    poisoned = FlakyEngine(cpu_engine, len(cpu_engine_tokens("hello")))  # failure reports too
    report = run_worker(flaky, poisoned, job, owner="w", lease_seconds=3.0)  # type: ignore[arg-type]
    sites = {"_keys", "_shapes", "claim_many", "write_group", "report_failure", "_leased"}
    assert sites | {"_superseded_by"} <= set(flaky.injected), flaky.injected
    assert all(n == 2 for n in flaky.injected.values())
    with db.connect() as conn:
        a = accounting(conn, "blips")
    assert a.finished and a.failed >= 6 and a.completed + a.failed == len(TEXTS)
    assert report.stale_acks == 0 and report.batches_failed >= 1
    rows, distinct = embedding_counts(db)
    assert rows == distinct == a.completed


@pytest.mark.slow
def test_a_programming_error_is_raised_at_once_not_retried(
    db: Engine, paths: FabricPaths, tmp_path: Path, cpu_engine, manifest: EngineManifest
) -> None:
    job = _planned_job(db, paths, manifest, _source(tmp_path), "bug")
    flaky = FlakyDatabase(db, undefined_table, times=5, sites={"claim_many"})
    with pytest.raises(exc.ProgrammingError, match="nowhere"):
        run_worker(flaky, cpu_engine, job, owner="w")  # type: ignore[arg-type]
    assert flaky.injected["claim_many"] == 1


def test_the_heartbeat_renews_held_leases_through_transient_errors(db: Engine) -> None:
    from tests.test_ledger import _deadline, _setup

    plan, _ = _setup(db)
    lease = claim(db, plan, "w", 2.0)
    assert lease is not None
    before = _deadline(db, lease.batch_no)
    flaky = FlakyDatabase(db, lost_connection, times=2)
    with LeaseHeartbeat(flaky, 2.0, 0.2) as heartbeat:  # type: ignore[arg-type]
        heartbeat.hold([lease])
        deadline = time.monotonic() + 30
        while heartbeat.renewals == 0:
            assert time.monotonic() < deadline, "the heartbeat never renewed"
            time.sleep(0.05)
        heartbeat.release(lease)
    assert flaky.injected["renew_leases"] == 2 and heartbeat.error is None
    after = _deadline(db, lease.batch_no)
    assert before is not None and after is not None and after > before


@pytest.mark.slow
def test_a_shard_that_does_not_verify_is_not_acked_and_its_batch_runs_again(
    db: Engine,
    paths: FabricPaths,
    tmp_path: Path,
    cpu_engine,
    manifest: EngineManifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corrupted: list[Path] = []

    def write_then_corrupt(*args, **kwargs):  # type: ignore[no-untyped-def]
        shard = write_shard(*args, **kwargs)
        if not corrupted:  # the first shard: its bytes change after they were hashed
            data = bytearray(shard.path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.path.write_bytes(bytes(data))
            corrupted.append(shard.path)
        return shard

    write_shard = extraction.write_shard
    monkeypatch.setattr(extraction, "write_shard", write_then_corrupt)
    _, report = run_stages(db, paths, cpu_engine, manifest, _source(tmp_path), "torn")
    assert corrupted and report.batches_requeued == 1
    assert any("is corrupt" in e and "its batch runs again" in e for e in report.errors)
    with db.connect() as conn:
        a = accounting(conn, "torn")
        shards = conn.execute(select(HiddenStateShard)).all()
        retried = conn.execute(select(Batch.batch_no).where(Batch.attempts == 2)).all()
    assert a.finished and a.completed == len(TEXTS) and a.failed == 0
    assert len(retried) == 1 and len(shards) == report.batches_done
    assert sum(s.n_items for s in shards) == len(TEXTS)
    for shard in shards:  # every shard a row points at verifies
        read_shard(Path(shard.path), shard.sha256)
    assert embedding_counts(db) == (len(TEXTS), len(TEXTS))


@pytest.mark.slow
def test_by_default_no_hook_layers_no_shard_files_and_the_set_completes(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FABRIC_REUSE", "on")  # it counts the repeats linked
    from fabric_pipelines.defs.resources import EngineConfig
    from fabric_pipelines.lib.steps.run_extraction import extract_task_set

    manifest = EngineConfig(max_batch_tokens=4096, max_batch_items=64, max_seq_len=128).manifest()
    assert manifest.hooks.layers == ()
    _planned_job(db, paths, manifest, _source(tmp_path), "pooled")
    summary = extract_task_set(
        db, paths, "pooled", manifest, database_url=db_url, workers=0, lease_seconds=5.0
    )
    assert summary.batches_done >= 1 and summary.superseded_by == ""
    with db.connect() as conn:
        a = accounting(conn, "pooled")
        shards = conn.execute(select(HiddenStateShard)).all()
    # TEXTS repeats five texts six times: each is computed once, the repeats are copies of it.
    distinct = len(set(TEXTS.values()))
    assert a.finished and (a.completed, a.reused) == (distinct, len(TEXTS) - distinct)
    assert summary.engine_items == distinct
    assert shards == [] and not any(p.is_file() for p in paths.shards.rglob("*"))
