"""Results reused by content key (lib/broker/reuse.py), on both databases: a second set that edits 10 %
of a first set's texts and adds 5 % sends only those to the engine (the engine's own count),
the rest get the first set's rows byte for byte, duplicates inside a set run once, both sets
balance and verify clean; with reuse off everything runs; a changed copy is named by verify."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, delete, func, insert, select, text

from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.broker.reuse import content_keys, reuse_enabled
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.maintenance.verify import verify
from fabric_pipelines.lib.results.export import export_task_set
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.store.models import Embedding, ResultKey, ReusedResult
from fabric_pipelines.lib.tasks.catalog import forget_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from tests.pipeline_helpers import stored_embeddings


def identity_of_cpu(manifest: EngineManifest) -> str:
    from fabric_gpu.engines.identity import engine_identity

    return engine_identity(manifest)


N_FIRST = 20_000


def _manifest(model: str = DEFAULT_MODEL_ID) -> EngineManifest:
    """The CPU engine, pooled vectors only (no hook layers: those runs are not reused)."""
    return manifest_for_model(
        model, backend="cpu", dtype="float32",
        profile=ConsumerProfile(max_batch_tokens=8192, max_batch_items=256, max_seq_len=64,
                                seq_granularity=8),
        hooks=HookSpec((), "mean"),
    )  # fmt: skip


def _text(i: int) -> str:
    return f"record {i} tells of {i % 97} rivers and {i % 89} hills"


def _write(path: Path, records: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in records))
    return path


def _run(db: Engine, db_url: str, paths: FabricPaths, manifest: EngineManifest, source: Path,
         name: str, reuse: bool | None = None) -> tuple[object, object]:  # fmt: skip
    submit(source, paths.inbox, name)
    ingest_task_set(
        db, paths, name, model_id=manifest.model_id, max_seq_len=manifest.profile.max_seq_len
    )
    plan = plan_task_set(db, paths, name, manifest, reuse=reuse)
    summary = extract_task_set(db, paths, name, manifest, database_url=db_url, workers=0)
    return plan, summary


def test_content_keys_follow_tokens_model_and_layers() -> None:
    tokens = np.array([101, 7, 8, 102, 101, 7, 8, 102, 101, 9, 102], dtype=np.int32)
    offsets = np.array([0, 4, 8, 11])
    keys = content_keys(tokens, offsets, "m@abc:mean")
    assert keys.dtype == np.dtype("S32") and keys[0] == keys[1] and keys[0] != keys[2]
    assert content_keys(tokens, offsets, "m@abc:cls")[0] != keys[0]
    assert content_keys(tokens, offsets, "m@abc:mean", (2,))[0] != keys[0]
    # The same ids split differently are other tasks: [7, 8] + [9] is not [7] + [8, 9].
    a = content_keys(np.array([7, 8, 9], np.int32), np.array([0, 2, 3]), "m")
    b = content_keys(np.array([7, 8, 9], np.int32), np.array([0, 1, 3]), "m")
    assert a[0] != b[0] and a[1] != b[1]


def test_planned_keys_of_runs_and_scattered_tasks_arrive_whole(db: Engine) -> None:
    """The planned keys' temporary table holds each task's key under its record number, whether
    it came in a run of consecutive records (one statement cutting a blob) or on its own."""
    from fabric_pipelines.lib.broker.reuse import MIN_RUN, _planned_keys

    rng = np.random.default_rng(3)
    record_no = np.concatenate([
        np.arange(0, MIN_RUN + 36), [200, 202, 204], np.arange(300, 300 + MIN_RUN), [999],
        np.arange(2000, 2000 + 3 * MIN_RUN),
    ]).astype(np.int64)  # fmt: skip
    keys = np.frombuffer(rng.bytes(32 * record_no.size), dtype="S32")
    with db.begin() as conn, _planned_keys(conn, record_no, keys):
        rows = conn.execute(
            text("SELECT record_no, content_key FROM fabric_planned_keys ORDER BY record_no")
        ).all()
    assert [r for r, _ in rows] == record_no.tolist()
    assert [bytes(k) for _, k in rows] == [keys[i : i + 1].tobytes() for i in range(keys.size)]


def test_reuse_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FABRIC_REUSE", raising=False)
    assert reuse_enabled() and not reuse_enabled(False)
    monkeypatch.setenv("FABRIC_REUSE", "off")
    assert not reuse_enabled() and reuse_enabled(True)


def test_an_edited_set_computes_only_its_edits_and_new_texts(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path
) -> None:
    manifest = _manifest()
    first = [(f"t{i}", _text(i)) for i in range(N_FIRST)]
    _, summary = _run(db, db_url, paths, manifest, _write(tmp_path / "a.jsonl", first), "first")
    assert summary.engine_items == N_FIRST, summary  # type: ignore[attr-defined]

    rng = np.random.default_rng(5)
    edited = set(rng.choice(N_FIRST, N_FIRST // 10, replace=False).tolist())
    second = [(i, f"{t} (revised)" if int(i[1:]) in edited else t) for i, t in first]
    new = [(f"n{j}", f"a new record {j} about {j % 13} lakes") for j in range(N_FIRST // 20)]
    # Ten new texts twice more under other ids: computed once, copied to the others.
    repeats = [(f"r{j}-{k}", new[j][1]) for j in range(10) for k in range(2)]
    second += new + repeats
    plan, summary = _run(
        db, db_url, paths, manifest, _write(tmp_path / "b.jsonl", second), "second"
    )

    expected = len(edited) + len(new)
    assert plan.reused == N_FIRST - len(edited), plan  # type: ignore[attr-defined]
    assert plan.deferred == len(repeats), plan  # type: ignore[attr-defined]
    # The engine's own count of rows it returned: the edits and the new texts, nothing else.
    assert summary.engine_items == expected, summary  # type: ignore[attr-defined]

    with db.connect() as conn:
        a = accounting(conn, "second", manifest.model_key)
        first_counts = accounting(conn, "first", manifest.model_key)
    assert a.balanced and a.finished, a
    assert (a.tasks, a.completed, a.reused, a.failed) == (
        len(second),
        expected,
        N_FIRST - len(edited) + len(repeats),
        0,
    ), a
    assert first_counts.balanced and first_counts.finished and first_counts.reused == 0
    # By reference: the second set stores only what it computed, and points at the rest.
    assert a.stored_results == expected + N_FIRST - len(edited), a
    assert first_counts.stored_results == N_FIRST, first_counts

    before = stored_embeddings(db, "first", manifest.model_key)
    after = stored_embeddings(db, "second", manifest.model_key)
    assert len(after) == len(second)
    for task_id, vector in after.items():
        if task_id.startswith("t") and int(task_id[1:]) not in edited:
            assert vector.tobytes() == before[task_id].tobytes(), task_id
    for j in range(10):
        for k in range(2):
            assert after[f"r{j}-{k}"].tobytes() == after[f"n{j}"].tobytes()
    # An edited text got its own vector.
    some_edit = f"t{min(edited)}"
    assert after[some_edit].tobytes() != before[some_edit].tobytes()

    report = verify(db, paths)
    assert report.clean, report.findings
    assert report.checked.get("reused_rows") == a.reused

    # Planning again finds nothing left: no batch, no second copy.
    again = plan_task_set(db, paths, "second", manifest)
    assert again.outstanding == 0 and again.reused == 0


def test_reuse_off_computes_everything_and_a_lost_source_is_named_then_mended(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    manifest = _manifest(str(tiny_model_dir))
    records = [(f"t{i}", _text(i)) for i in range(300)]
    source = _write(tmp_path / "a.jsonl", records)
    _run(db, db_url, paths, manifest, source, "a")
    plan, summary = _run(db, db_url, paths, manifest, source, "b", reuse=False)
    assert plan.reused == 0 and summary.engine_items == 300  # type: ignore[attr-defined]
    plan, summary = _run(db, db_url, paths, manifest, source, "c")
    assert plan.reused == 300 and summary.engine_items == 0  # type: ignore[attr-defined]
    with db.connect() as conn:
        c = accounting(conn, "c", manifest.model_key)
        set_a, set_c = (
            conn.execute(text(f"SELECT id FROM task_sets WHERE name = '{n}'")).scalar_one()
            for n in "ac"
        )
    assert c.balanced and c.finished and (c.completed, c.reused) == (0, 300), c
    # By reference: "c" stores nothing of its own and points at 300 of "a"'s rows.
    assert c.stored_results == 300 and _own_rows(db, set_c) == 0
    assert verify(db, paths).clean
    exported = export_task_set(db, "c", tmp_path / "c.parquet")
    assert exported.rows == 300

    # A source row deleted by hand: verify names the links that lost it; running "c" again
    # drops that link and computes the task ("b" ran with reuse off: it stored no keys).
    with db.begin() as conn:
        conn.execute(
            delete(Embedding).where(Embedding.task_set_id == set_a, Embedding.record_no == 3)
        )
    findings = [f for f in verify(db, paths).findings if "reused results name" in f.problem]
    assert len(findings) == 1 and "1 of 300" in findings[0].problem, findings
    plan, summary = _run(db, db_url, paths, manifest, source, "c")
    assert plan.reused == 0 and summary.engine_items == 1, (plan, summary)  # type: ignore[attr-defined]
    with db.connect() as conn:
        c = accounting(conn, "c", manifest.model_key)
    assert c.balanced and c.finished and (c.completed, c.reused, c.stored_results) == (1, 299, 300)
    left = [f.problem for f in verify(db, paths).findings]
    assert not [p for p in left if "reused results name" in p] and len(left) == 2, left  # "a"'s

    # Forgetting the source set hands its rows over to the tasks that read them: "c" adopts
    # them as its own, every vector unchanged, and owns their keys now.
    before = stored_embeddings(db, "c", manifest.model_key)
    forget_task_set(db, paths, "a")
    with db.connect() as conn:
        owners = conn.execute(
            select(ResultKey.task_set_id, func.count()).group_by(ResultKey.task_set_id)
        ).all()
        c = accounting(conn, "c", manifest.model_key)
    # "c" owns the keys of the 299 rows it adopted. The one it computed had a key "a" still
    # owned then (its row deleted by hand, not its key): that key went with "a". "b" ran with
    # reuse off: it claimed none.
    assert owners == [(set_c, 299)], owners
    assert _own_rows(db, set_c) == 300 and c.balanced and c.finished, c
    after = stored_embeddings(db, "c", manifest.model_key)
    assert {k: v.tobytes() for k, v in after.items()} == {k: v.tobytes() for k, v in before.items()}
    assert verify(db, paths).clean


def _own_rows(db: Engine, set_id: int) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).select_from(Embedding).where(Embedding.task_set_id == set_id)
            ).scalar_one()
        )


# ---- with worker processes: a run killed mid-set, and two sets sharing content at once -------


def _fault_run(paths: FabricPaths, db_url: str, name: str, manifest_path: Path) -> Any:
    from fabric_testing import fault_drill as faults

    settings = faults.RunSettings(name, manifest_path, 2, 2.0, 0.5)
    return faults.Run(paths, db_url, settings, paths.root / f"run-{name}.log")


def _submitted(db: Engine, paths: FabricPaths, manifest: EngineManifest, source: Path,
               name: str) -> None:  # fmt: skip
    submit(source, paths.inbox, name)
    ingest_task_set(db, paths, name, model_id=manifest.model_id, max_seq_len=16)


def _fault_manifest(paths: FabricPaths, model: Path) -> tuple[EngineManifest, Path]:
    """Two items a batch (many batches, so a kill lands mid-set), pooled vectors only."""
    from fabric_pipelines.lib.core.files import write_bytes
    from fabric_testing import fault_drill as faults

    manifest = faults.fault_manifest(str(model), 2, ())
    path = paths.root / "engine.json"
    write_bytes(path, json.dumps(manifest.to_mapping()).encode())
    return manifest, path


def _short(i: int) -> str:
    return f"item {i} of {i % 11}"  # under the fault manifest's 16 tokens


def _exactly_once(db: Engine, paths: FabricPaths, name: str, manifest: EngineManifest) -> Any:
    from fabric_testing import fault_drill as faults

    result = faults.outcome(db, name)
    assert result.clean and result.open_batches == 0, result
    with db.connect() as conn:
        counts = accounting(conn, name, manifest.model_key)
    assert counts.balanced and counts.finished, counts
    assert counts.completed + counts.reused == counts.tasks, counts
    assert faults.verify_findings(db, paths, name) == []
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_killed_mid_set_with_reuse_in_play_still_does_each_task_once(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from fabric_testing import fault_drill as faults

    manifest, manifest_path = _fault_manifest(paths, tiny_model_dir)
    base = [(f"t{i}", _short(i)) for i in range(1500)]
    _run(db, db_url, paths, manifest, _write(tmp_path / "base.jsonl", base), "base")
    # 40 % edited, 300 new and 50 repeats of new ones: ~950 tasks for the engine, 475 batches.
    second = [(i, f"{t} again" if int(i[1:]) % 5 < 2 else t) for i, t in base]
    new = [(f"n{j}", f"new {j} of {j % 7}") for j in range(300)]
    second += new + [(f"r{j}", new[j][1]) for j in range(50)]
    _submitted(db, paths, manifest, _write(tmp_path / "set.jsonl", second), "set")

    run = _fault_run(paths, db_url, "set", manifest_path)
    faults.wait_until(lambda: faults.completed_batches(db, "set") >= 20, 120, "20 batches")
    run.kill()
    assert not run.orphans(5.0)
    with db.connect() as conn:
        killed = accounting(conn, "set", manifest.model_key)
    # Reused: the 900 unedited tasks, and the repeats whose first the killed run stored.
    assert 900 <= killed.reused <= 950 and 0 < killed.completed < 900, killed

    plan = plan_task_set(db, paths, "set", manifest)
    summary = extract_task_set(db, paths, "set", manifest, database_url=db_url, workers=0)
    left = 900 - killed.completed  # edited + new, less what the killed run stored
    # The repeats stay linked to their firsts from the killed run's planning: none is planned;
    # those whose first the killed run did not store wait for this run's workers.
    assert plan.outstanding == left and plan.deferred <= 50, plan
    assert summary.rows_inserted == left and summary.duplicates_after == plan.deferred, summary
    counts = _exactly_once(db, paths, "set", manifest)
    assert (counts.completed, counts.reused) == (900, 950), counts
    before = stored_embeddings(db, "base", manifest.model_key)
    after = stored_embeddings(db, "set", manifest.model_key)
    unedited = [
        task_id for (task_id, t), (_, b) in zip(second[: len(base)], base, strict=True) if t == b
    ]
    assert len(unedited) == 900
    assert all(after[i].tobytes() == before[i].tobytes() for i in unedited)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_sets_sharing_content_extracted_at_once_store_each_task_once(
    db: Engine, db_url: str, paths: FabricPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The second set is planned while the first is mid-run: it links what the first has
    stored, waits for what the first is computing, and computes only its own texts."""
    from fabric_testing import fault_drill as faults

    manifest, manifest_path = _fault_manifest(paths, tiny_model_dir)
    shared = [_short(i) for i in range(800)]
    x = [(f"x{i}", t) for i, t in enumerate(shared)] + [
        (f"xo{j}", f"x own {j}") for j in range(100)
    ]
    y = [(f"y{i}", t) for i, t in enumerate(shared)] + [
        (f"yo{j}", f"y own {j}") for j in range(100)
    ]
    _submitted(db, paths, manifest, _write(tmp_path / "x.jsonl", x), "x")
    _submitted(db, paths, manifest, _write(tmp_path / "y.jsonl", y), "y")

    first = _fault_run(paths, db_url, "x", manifest_path)
    faults.wait_until(lambda: faults.completed_batches(db, "x") >= 30, 120, "30 batches of x")
    second = _fault_run(paths, db_url, "y", manifest_path)
    assert first.wait(240) == 0, first.output()[-3000:]
    assert second.wait(240) == 0, second.output()[-3000:]
    assert not first.orphans(5.0) and not second.orphans(5.0)

    counts_x = _exactly_once(db, paths, "x", manifest)
    counts_y = _exactly_once(db, paths, "y", manifest)
    # Every shared text of y is x's result: stored ones linked at planning, the rest waited
    # for while x computed them (none computed twice).
    assert counts_x.reused == 0 and counts_y.reused == 800, (counts_x, counts_y)
    # By SQL, through the view of a row per task (its own or the one it reused): one row per
    # task, shared texts equal across the sets.
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.name, count(*), count(DISTINCT e.record_no) FROM task_embeddings e "
                "JOIN task_sets s ON s.id = e.task_set_id GROUP BY s.name ORDER BY s.name"
            )
        ).all()
        differing = conn.execute(
            text(
                "SELECT count(*) FROM task_embeddings a JOIN task_sets sa ON sa.id = a.task_set_id "
                "JOIN task_embeddings b ON b.record_no = a.record_no AND b.model_id = a.model_id "
                "JOIN task_sets sb ON sb.id = b.task_set_id "
                "WHERE sa.name = 'x' AND sb.name = 'y' AND a.record_no < 800 "
                "AND a.vector <> b.vector"
            )
        ).scalar_one()
        links = conn.execute(select(func.count()).select_from(ReusedResult)).scalar_one()
        own_y = conn.execute(
            text(
                "SELECT count(*) FROM embeddings e JOIN task_sets s ON s.id = e.task_set_id "
                "WHERE s.name = 'y'"
            )
        ).scalar_one()
    assert [tuple(r) for r in rows] == [("x", 900, 900), ("y", 900, 900)], rows
    assert links == counts_y.reused and own_y == 100  # reused: not stored
    # The same text computed by both sets gave the same bytes (one engine, one model).
    assert differing == 0


def test_a_set_waits_for_a_running_set_and_takes_its_keys_over_when_it_stops(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """x is running (a worker holds a lease on one of its batches) when y is planned: y's tasks
    with x's texts wait for x instead of being planned. Then x stops (the lease runs out, never
    renewed): y takes those keys over and computes them, each task once. When x runs again its
    tasks read y's rows: no text is computed twice."""
    from fabric_pipelines.lib.broker.ledger import claim_many
    from fabric_pipelines.lib.broker.plans import current_plan
    from fabric_pipelines.lib.store.models import AwaitedResult

    manifest = _manifest(str(tiny_model_dir))
    shared = [_text(i) for i in range(60)]
    x = [(f"x{i}", t) for i, t in enumerate(shared)]
    y = [(f"y{i}", t) for i, t in enumerate(shared)] + [(f"yo{j}", f"y own {j}") for j in range(20)]
    _submitted(db, paths, manifest, _write(tmp_path / "x.jsonl", x), "x")
    _submitted(db, paths, manifest, _write(tmp_path / "y.jsonl", y), "y")
    plan_task_set(db, paths, "x", manifest)
    # x's worker: a live lease of 3 s on its first batch, never renewed nor acked.
    assert claim_many(db, current_plan(db, "x").plan_id, "x-worker", 3.0, 1)

    planned = plan_task_set(db, paths, "y", manifest)
    with db.connect() as conn:
        waits = conn.execute(select(func.count()).select_from(AwaitedResult)).scalar_one()
        counts = accounting(conn, "y", manifest.model_key)
    assert waits == 60 and planned.plan.order.size == 20, (waits, planned.plan.order.size)
    assert counts.balanced and counts.queued == 80, counts  # waiting tasks count as queued

    events: list[str] = []
    summary = extract_task_set(
        db, paths, "y", manifest, database_url=db_url, workers=0, lease_seconds=1.0,
        heartbeat_seconds=0.25, on_event=events.append,
    )  # fmt: skip
    assert any("wait for results" in e for e in events), events
    assert any("60 tasks waited for another task set that stopped" in e for e in events), events
    assert summary.engine_items == 80 and summary.rows_inserted == 80, summary
    counts_y = _exactly_once(db, paths, "y", manifest)
    assert counts_y.completed == 80 and counts_y.reused == 0, counts_y

    # x runs again: its texts are y's results now.
    plan_task_set(db, paths, "x", manifest)
    summary_x = extract_task_set(db, paths, "x", manifest, database_url=db_url, workers=0)
    counts_x = _exactly_once(db, paths, "x", manifest)
    assert summary_x.engine_items == 0 and counts_x.reused == 60, (summary_x, counts_x)
    vectors_x = stored_embeddings(db, "x", manifest.model_key)
    vectors_y = stored_embeddings(db, "y", manifest.model_key)
    assert all(vectors_x[f"x{i}"].tobytes() == vectors_y[f"y{i}"].tobytes() for i in range(60))
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(AwaitedResult)).scalar_one() == 0


def test_a_wait_for_a_running_set_becomes_a_link_when_its_row_lands_or_a_failure_when_it_fails(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """x keeps a live lease while y's workers finish; x then stores some of the texts y waits
    for and fails one: y's waits become links to x's rows and one failure naming x's."""
    import threading

    from fabric_pipelines.lib.broker.ledger import claim_many, renew_leases
    from fabric_pipelines.lib.broker.plans import current_plan
    from fabric_pipelines.lib.store.models import TaskFailure

    manifest = _manifest(str(tiny_model_dir))
    shared = [_text(i) for i in range(30)]
    _submitted(db, paths, manifest, _write(tmp_path / "x.jsonl",
               [(f"x{i}", t) for i, t in enumerate(shared)]), "x")  # fmt: skip
    _submitted(db, paths, manifest, _write(tmp_path / "y.jsonl",
               [(f"y{i}", t) for i, t in enumerate(shared)] + [("yo", "y's own")]), "y")  # fmt: skip
    plan_task_set(db, paths, "x", manifest)
    x_plan = current_plan(db, "x").plan_id
    lease = claim_many(db, x_plan, "x-worker", 2.0, 1)
    plan_task_set(db, paths, "y", manifest)

    stop = threading.Event()

    def x_keeps_its_lease_then_finishes() -> None:
        # Renewed while y's run finishes its own batch and starts waiting.
        for _ in range(6):
            renew_leases(db, lease, 2.0)
            time.sleep(0.25)
        with db.begin() as conn:
            set_x = conn.execute(text("SELECT id FROM task_sets WHERE name = 'x'")).scalar_one()
            conn.execute(
                insert(TaskFailure),
                [{"task_set_id": set_x, "record_no": 0, "task_id": "x0", "stage": "extract",
                  "reason": "an injected failure"}],
            )  # fmt: skip
        # x's run goes on: its worker hands its lease back and the run computes the rest.
        from fabric_pipelines.lib.broker.ledger import hand_back

        hand_back(db, lease)
        plan_task_set(db, paths, "x", manifest)
        extract_task_set(db, paths, "x", manifest, database_url=db_url, workers=0)
        stop.set()

    helper = threading.Thread(target=x_keeps_its_lease_then_finishes)
    helper.start()
    summary = extract_task_set(
        db, paths, "y", manifest, database_url=db_url, workers=0, lease_seconds=5.0
    )
    helper.join(60)
    assert stop.is_set()
    assert summary.engine_items == 1, summary  # y's own text only
    with db.connect() as conn:
        counts_y = accounting(conn, "y", manifest.model_key)
        reasons = conn.execute(
            text("SELECT f.record_no, f.reason FROM task_failures f JOIN task_sets s "
                 "ON s.id = f.task_set_id WHERE s.name = 'y'")
        ).all()  # fmt: skip
    assert counts_y.finished and counts_y.balanced, counts_y
    assert (counts_y.completed, counts_y.reused, counts_y.failed) == (1, 29, 1), counts_y
    assert len(reasons) == 1 and reasons[0][0] == 0, reasons
    assert "another task set" in reasons[0][1] and "an injected failure" in reasons[0][1]


def test_hidden_states_are_reused_by_reference_and_their_set_is_not_forgotten_first(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A run keeping hook layer 1 computes 40 texts; a second set with 30 of them (two of those
    repeated) and 10 of its own computes only its own. Its export with layer 1 gives every task
    its states: a reused task's are its source's, read from the source's shard file. The first
    set is not forgotten while the second reads its shards; verify is clean."""
    import pyarrow.parquet as pq

    from fabric_pipelines.lib.maintenance.forget import ForgetRefused, forget

    manifest = manifest_for_model(
        str(tiny_model_dir), backend="cpu", dtype="float32",
        profile=ConsumerProfile(max_batch_tokens=512, max_batch_items=8, max_seq_len=64,
                                seq_granularity=8),
        hooks=HookSpec((1,), "mean"),
    )  # fmt: skip
    first = [(f"a{i}", _text(i)) for i in range(40)]
    second = [(f"b{i}", _text(i)) for i in range(30)] + [("b-again", _text(3)), ("b-too", _text(7))]
    second += [(f"bo{j}", f"b's own text {j}") for j in range(10)]
    _run(db, db_url, paths, manifest, _write(tmp_path / "a.jsonl", first), "a")
    _, summary = _run(db, db_url, paths, manifest, _write(tmp_path / "b.jsonl", second), "b")
    assert summary.engine_items == 10, summary  # type: ignore[attr-defined]
    with db.connect() as conn:
        counts = accounting(conn, "b", manifest.model_key)
    assert (counts.completed, counts.reused, counts.tasks) == (10, 32, 42), counts

    out_a, out_b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    export_task_set(db, "a", out_a, layers=[1])
    done = export_task_set(db, "b", out_b, layers=[1])
    assert done.rows == 42
    table_a, table_b = pq.read_table(out_a), pq.read_table(out_b)
    states_a = dict(zip(table_a.column("id").to_pylist(), table_a.column("layer_1").to_pylist(),
                        strict=True))  # fmt: skip
    states_b = dict(zip(table_b.column("id").to_pylist(), table_b.column("layer_1").to_pylist(),
                        strict=True))  # fmt: skip
    source = {f"b{i}": f"a{i}" for i in range(30)} | {"b-again": "a3", "b-too": "a7"}
    assert sorted(states_b) == sorted([*source, *(f"bo{j}" for j in range(10))])
    for task, from_task in source.items():
        assert states_b[task] == states_a[from_task], task
    assert all(len(states_b[f"bo{j}"]) > 0 for j in range(10))
    assert verify(db, paths).findings == []

    with pytest.raises(ForgetRefused, match=r"hidden states that task sets \['b'\] reuse"):
        forget(db, paths, "a", has_partition=False, force=False)
    forget(db, paths, "b", has_partition=False, force=False)
    forget(db, paths, "a", has_partition=False, force=False)


def test_fabric_plan_counts_reused_tasks_and_repeats_and_plans_only_the_rest(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from fabric_pipelines.lib.broker.preview import preview_plan, render_preview

    manifest = _manifest(str(tiny_model_dir))
    records = [(f"t{i}", _text(i)) for i in range(300)]
    _run(db, db_url, paths, manifest, _write(tmp_path / "a.jsonl", records), "a")
    new = [(f"n{j}", f"fresh text {j}") for j in range(20)]
    job = _write(tmp_path / "job.jsonl", records + new + [(f"r{j}", new[j][1]) for j in range(5)])

    preview = preview_plan(db, job, manifest)
    assert (preview.tasks, preview.reused, preview.repeats) == (325, 300, 5), preview
    assert preview.to_mapping()["to_compute"] == 20
    assert "300 tasks already have a stored result" in render_preview(preview)
    only_new = preview_plan(db, _write(tmp_path / "new.jsonl", new), manifest)
    assert (preview.batches, preview.padded_tokens, preview.real_tokens) == (
        only_new.batches, only_new.padded_tokens, only_new.real_tokens,
    )  # fmt: skip
    off = preview_plan(db, job, manifest, reuse=False)
    assert (off.reused, off.repeats) == (0, 0) and off.padded_tokens > preview.padded_tokens

    # Planning the job for real links and defers exactly what the preview counted.
    _run(db, db_url, paths, manifest, job, "job")
    with db.connect() as conn:
        counts = accounting(conn, "job", manifest.model_key)
    assert (counts.completed, counts.reused) == (20, 305) and counts.finished, counts


def test_keys_ending_in_zero_bytes_keep_all_32_bytes() -> None:
    from fabric_pipelines.lib.broker.reuse import key_bytes

    tokens = np.arange(4000, dtype=np.int32)
    keys = content_keys(tokens, np.arange(4001), "m")
    assert any(k.endswith(b"\0") for k in key_bytes(keys))  # ~1 in 256 digests does
    assert all(len(k) == 32 for k in key_bytes(keys))
    # The documented key: sha256 of the model key and layers as JSON, then the token ids.
    expected = hashlib.sha256(json.dumps({"layers": [], "model_key": "m"}).encode())
    expected.update(np.array([7], dtype="<i4").tobytes())
    assert key_bytes(keys)[7] == expected.digest()


def test_planning_one_set_from_several_threads_at_once_claims_its_keys_and_links_once(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two runs of one set started together both plan it: each must find the keys and links the
    other stored (or wait for them), never store them twice; every link is made once."""
    import threading

    from fabric_gpu.engines.identity import planned_identity
    from fabric_pipelines.lib.broker.reuse import link_before_planning
    from fabric_pipelines.lib.store.keys import model_id
    from fabric_pipelines.lib.tasks.arrow_files import flat_tokens, read_table
    from fabric_pipelines.lib.tasks.catalog import get_task_set

    manifest = _manifest(str(tiny_model_dir))
    shared = [(f"t{i}", _text(i)) for i in range(200)]
    _run(db, db_url, paths, manifest, _write(tmp_path / "a.jsonl", shared), "a")
    repeats = [(f"r{j}", f"repeated text {j % 10}") for j in range(40)]
    submit(_write(tmp_path / "b.jsonl", shared + repeats), paths.inbox, "b")
    ingest_task_set(db, paths, "b", model_id=manifest.model_id, max_seq_len=64)

    ts = get_task_set(db, "b")
    table = read_table(Path(ts.path), ts.content_sha256)
    tokens, offsets = flat_tokens(table)
    record_no = table.column("record_no").to_numpy()
    keys = content_keys(tokens, offsets, manifest.model_key, engine=planned_identity(manifest))
    with db.begin() as conn:
        mid = model_id(conn, manifest.model_key)
    planners = 4
    start = threading.Barrier(planners)
    errors: list[BaseException] = []

    def plan() -> None:
        start.wait()
        try:
            link_before_planning(db, ts.id, mid, record_no, keys, np.arange(record_no.size))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=plan) for _ in range(planners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == [], errors
    with db.connect() as conn:
        claimed = conn.execute(
            select(func.count()).select_from(ResultKey).where(ResultKey.task_set_id == ts.id)
        ).scalar_one()
        links = conn.execute(
            select(func.count(), func.count(func.distinct(ReusedResult.record_no))).where(
                ReusedResult.task_set_id == ts.id
            )
        ).one()
        copies = conn.execute(
            select(func.count()).select_from(Embedding).where(Embedding.task_set_id == ts.id)
        ).scalar_one()
    # The 10 repeated texts' firsts own their keys; the 200 shared ones are owned by "a".
    assert claimed == 10
    # 200 linked to set a (by reference: no row), 30 repeats waiting for the first of their text.
    assert tuple(links) == (230, 230) and copies == 0, (links, copies)


def test_a_set_with_duplicates_stores_each_result_once(
    db: Engine,
    db_url: str,
    paths: FabricPaths,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1,000 texts of which 300 repeat others: 700 results stored, 1,000 rows exported."""
    from fabric_pipelines.cli import main

    manifest = _manifest(str(tiny_model_dir))
    distinct = [(f"d{i}", _text(i)) for i in range(700)]
    rng = np.random.default_rng(3)
    repeats = [(f"again{j}", distinct[k][1]) for j, k in enumerate(rng.integers(0, 700, 300))]
    records = distinct + repeats
    order = rng.permutation(len(records))
    _, summary = _run(
        db, db_url, paths, manifest,
        _write(tmp_path / "dup.jsonl", [records[i] for i in order]), "dup",
    )  # fmt: skip
    assert summary.engine_items == 700, summary  # type: ignore[attr-defined]
    monkeypatch.setenv("FABRIC_HOME", str(paths.root))
    monkeypatch.setenv("FABRIC_DATABASE_URL", db_url)
    capsys.readouterr()
    assert main(["status", "dup", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["task_sets"]
    assert (row["tasks"], row["completed"], row["reused"], row["stored_results"]) == (
        1000, 700, 300, 700,
    ), row  # fmt: skip
    # The rows by the engine that computed them: this run's CPU engine, all 700.
    assert row["engines"] == {identity_of_cpu(manifest): 700}, row
    out = tmp_path / "dup.parquet"
    assert main(["export", "dup", "--out", str(out)]) == 0
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table.num_rows == 1000
    vectors = dict(zip(table.column("id").to_pylist(), table.column("vector").to_pylist(),
                       strict=True))  # fmt: skip
    first_of = {t: i for i, t in distinct}
    for task_id, text_ in repeats:
        assert vectors[task_id] == vectors[first_of[text_]], task_id
    assert verify(db, paths).clean


def test_0016_moves_a_filled_database_to_references_and_every_receipt_stays_valid(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A database in 0015's shape (every reused task a copy of its source's row: made here by
    0016's downgrade, which writes the copies 0015's planning wrote, under an index published
    before) moves to references in place: the copies go, the index's tasks and vectors do not
    change, its receipt is still fresh and rebuilds the same index."""
    from fabric_pipelines.lib.index.build import IndexSpec
    from fabric_pipelines.lib.index.publish import build_and_publish
    from fabric_pipelines.lib.index.rebuild import rebuild_from_receipt
    from fabric_pipelines.lib.index.staleness import staleness
    from fabric_pipelines.lib.index.vectors import load_vectors
    from fabric_pipelines.lib.store.schema import downgrade, upgrade

    manifest = _manifest(str(tiny_model_dir))
    records = [(f"t{i}", _text(i)) for i in range(400)]
    _run(db, db_url, paths, manifest, _write(tmp_path / "a.jsonl", records), "a")
    twice = records[:300] + [(f"u{i}", _text(i + 1000)) for i in range(100)]
    _run(db, db_url, paths, manifest, _write(tmp_path / "b.jsonl", twice), "b")
    published = build_and_publish(
        db, model_key=manifest.model_key, model={"model_id": "tiny", "weights_sha256": "w"},
        spec=IndexSpec(factory="IVF8,Flat", nprobe=8, shards=4), index_folder=paths.indexes,
        receipt_folder=paths.receipts, inputs=[],
    )  # fmt: skip
    with db.connect() as conn:
        before = load_vectors(conn, manifest.model_key)
    downgrade(db, "0015")
    with db.connect() as conn:
        set_b = conn.execute(text("SELECT id FROM task_sets WHERE name = 'b'")).scalar_one()
    assert _own_rows(db, set_b) == 400  # 0015's shape: 300 copies and 100 computed

    upgrade(db)
    assert _own_rows(db, set_b) == 100  # the copies went
    with db.connect() as conn:
        after = load_vectors(conn, manifest.model_key)
        stale = staleness(conn, manifest.model_key, paths.indexes)
        b = accounting(conn, "b", manifest.model_key)
    assert (
        np.array_equal(after.ids, before.ids)
        and after.vectors.tobytes() == before.vectors.tobytes()
    )
    assert stale is not None and not stale.stale, stale
    assert (
        b.balanced and b.finished and (b.completed, b.reused, b.stored_results) == (100, 300, 400)
    )
    rebuilt = rebuild_from_receipt(db, published.receipt, paths.indexes, repair=False)
    assert rebuilt.matches and rebuilt.rebuilt_sha256 == published.receipt["index_sha256"], rebuilt
    assert verify(db, paths).clean
    # The receipt names the engine that computed its rows (recorded with each batch's ack).
    assert published.receipt["model"]["engines"] == [identity_of_cpu(manifest)]
    assert published.receipt["model"]["batch_invariance"].startswith("per-identity: same token ids")


def test_a_result_of_one_engine_is_not_reused_by_another() -> None:
    """The engine identity is part of the content key: the same token ids under the same model
    key give other keys for another backend, dtype, device class or numerics version."""
    from dataclasses import replace

    from fabric_gpu.engines.identity import device_class, engine_identity

    tokens = np.array([101, 7, 8, 102], dtype=np.int32)
    offsets = np.array([0, 4])
    cpu = _manifest()
    gpu = replace(cpu, backend="torch", dtype="float16")
    ids = {
        engine_identity(cpu),
        engine_identity(gpu, "NVIDIA H200"),
        engine_identity(gpu, "NVIDIA H100 80GB HBM3"),
        engine_identity(replace(gpu, dtype="bfloat16"), "NVIDIA H200"),
    }
    assert len(ids) == 4 and engine_identity(cpu).startswith("cpu/float32/cpu/n")
    keys = {content_keys(tokens, offsets, cpu.model_key, engine=e)[0] for e in ids}
    assert len(keys) == 4
    assert device_class("torch", None) == "gpu" and device_class("cpu", "anything") == "cpu"


def test_a_repeated_document_beside_chunked_ones_counts_as_stored(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A set with long documents (split into windows) and repeated short ones: each repeat is
    a stored document through its link, and the set finishes with every document stored."""
    manifest = _manifest(str(tiny_model_dir))
    short = [(f"s{i}", _text(i)) for i in range(50)]
    repeats = [(f"again{i}", _text(i)) for i in range(10)]
    long = [(f"long{j}", " ".join(_text(j * 100 + k) for k in range(12))) for j in range(3)]
    from fabric_pipelines.lib.tasks.windows import LongInputs

    submit(_write(tmp_path / "docs.jsonl", short + repeats + long), paths.inbox, "docs")
    ingest_task_set(
        db, paths, "docs", model_id=manifest.model_id,
        max_seq_len=manifest.profile.max_seq_len, long_inputs=LongInputs.of("chunk"),
    )  # fmt: skip
    plan_task_set(db, paths, "docs", manifest)
    extract_task_set(db, paths, "docs", manifest, database_url=db_url, workers=0)
    with db.connect() as conn:
        a = accounting(conn, "docs", manifest.model_key)
    assert a.documents is not None and a.documents.chunked == 3, a
    assert a.reused == 10 and a.finished, a
    assert a.documents.stored == 63 and a.documents.waiting == 0, a.documents
    assert verify(db, paths).clean
