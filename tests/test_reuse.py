"""Results reused by content key (lib/broker/reuse.py), on both databases: a second set that edits 10 %
of a first set's texts and adds 5 % sends only those to the engine (the engine's own count),
the rest get the first set's rows byte for byte, duplicates inside a set run once, both sets
balance and verify clean; with reuse off everything runs; a changed copy is named by verify."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, func, select, text, update

from fabric_gpu.manifest import EngineManifest, HookSpec, manifest_for_model
from fabric_gpu.model import DEFAULT_MODEL_ID
from fabric_gpu.profile import ConsumerProfile
from fabric_pipelines.lib.broker.ledger import accounting
from fabric_pipelines.lib.broker.plans import plan_task_set
from fabric_pipelines.lib.broker.reuse import content_keys, reuse_enabled
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.maintenance.verify import verify
from fabric_pipelines.lib.steps.run_extraction import extract_task_set
from fabric_pipelines.lib.store.models import ContentKey, Embedding, ReusedResult
from fabric_pipelines.lib.tasks.catalog import forget_task_set, ingest_task_set
from fabric_pipelines.lib.tasks.inbox import submit
from tests.pipeline_helpers import stored_embeddings

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


def test_reuse_off_computes_everything_and_a_changed_copy_is_named(
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
    assert c.balanced and c.finished and (c.completed, c.reused) == (0, 300), c
    assert verify(db, paths).clean

    # A copy changed after it was stored no longer equals its source: verify says so.
    with db.begin() as conn:
        set_c = conn.execute(text("SELECT id FROM task_sets WHERE name = 'c'")).scalar_one()
        conn.execute(
            update(Embedding)
            .where(Embedding.task_set_id == set_c, Embedding.record_no == 3)
            .values(vector=b"\0" * 16)
        )
    findings = [f for f in verify(db, paths).findings if "reused rows differ" in f.problem]
    assert len(findings) == 1 and "1 of 300" in findings[0].problem, findings

    # Forgetting the source set leaves the copies whole, and their keys go with their own set.
    forget_task_set(db, paths, "a")
    with db.connect() as conn:
        assert (
            conn.execute(
                select(func.count()).select_from(Embedding).where(Embedding.task_set_id == set_c)
            ).scalar_one()
            == 300
        )
        keys_left = conn.execute(
            select(func.count(func.distinct(ContentKey.task_set_id)))
        ).scalar_one()
        links = conn.execute(select(func.count()).select_from(ReusedResult)).scalar_one()
    assert keys_left == 1 and links == 300  # "b" ran with reuse off: no keys


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
    assert killed.reused == 900 and 0 < killed.completed < 900, killed

    plan = plan_task_set(db, paths, "set", manifest)
    summary = extract_task_set(db, paths, "set", manifest, database_url=db_url, workers=0)
    left = 900 - killed.completed  # edited + new, less what the killed run stored
    # Repeats whose first copy the killed run stored were copied by this planning; the others
    # waited for this run's workers.
    assert plan.outstanding == left and plan.deferred <= 50, plan
    assert summary.rows_inserted == left and summary.copied_after == plan.deferred, summary
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
    stored and computes the rest while the first still writes (some keys both compute)."""
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
    assert counts_x.reused == 0 and counts_y.reused > 0, (counts_x, counts_y)
    with db.connect() as conn:  # by SQL: one row per task, shared texts equal across the sets
        rows = conn.execute(
            text(
                "SELECT s.name, count(*), count(DISTINCT e.record_no) FROM embeddings e "
                "JOIN task_sets s ON s.id = e.task_set_id GROUP BY s.name ORDER BY s.name"
            )
        ).all()
        differing = conn.execute(
            text(
                "SELECT count(*) FROM embeddings a JOIN task_sets sa ON sa.id = a.task_set_id "
                "JOIN embeddings b ON b.record_no = a.record_no AND b.model_id = a.model_id "
                "JOIN task_sets sb ON sb.id = b.task_set_id "
                "WHERE sa.name = 'x' AND sb.name = 'y' AND a.record_no < 800 "
                "AND a.vector <> b.vector"
            )
        ).scalar_one()
        links = conn.execute(select(func.count()).select_from(ReusedResult)).scalar_one()
    assert [tuple(r) for r in rows] == [("x", 900, 900), ("y", 900, 900)], rows
    assert links == counts_y.reused
    # The same text computed by both sets gave the same bytes (one engine, one model).
    assert differing == 0


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


def test_planning_one_set_from_several_threads_at_once_stores_its_keys_and_links_once(
    db: Engine, db_url: str, paths: FabricPaths, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Two runs of one set started together both plan it: each must find the keys the other
    stored (or wait for them), never store them twice; every link is made once."""
    import threading

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
    keys = content_keys(tokens, offsets, manifest.model_key)
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
        stored = conn.execute(
            select(func.count()).select_from(ContentKey).where(ContentKey.task_set_id == ts.id)
        ).scalar_one()
        links = conn.execute(
            select(func.count(), func.count(func.distinct(ReusedResult.record_no))).where(
                ReusedResult.task_set_id == ts.id
            )
        ).one()
        copies = conn.execute(
            select(func.count()).select_from(Embedding).where(Embedding.task_set_id == ts.id)
        ).scalar_one()
    assert stored == record_no.size
    # 200 linked to set a (and copied), 30 repeats waiting for the first of their text.
    assert tuple(links) == (230, 230) and copies == 200, (links, copies)
