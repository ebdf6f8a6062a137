"""An index's life after its first build: rebuilt from its receipt, repaired when its files are
damaged, and partly rebuilt when the database says some of its shards went stale."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from typing import Any

import dagster as dg
import faiss
import numpy as np
import pytest
from sqlalchemy import Engine, delete, func, insert, select, update

from fabric_pipelines.defs.index import index_staleness_sensor
from fabric_pipelines.defs.resources import ArtifactStore, Database
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.index import publish
from fabric_pipelines.lib.index.build import (
    IndexSpec,
    deserialize,
    fill,
    merge,
    serialize,
    tolerance,
)
from fabric_pipelines.lib.index.index_file import store_index
from fabric_pipelines.lib.index.layout import cut_shards, read_layout
from fabric_pipelines.lib.index.paths import model_index_folder
from fabric_pipelines.lib.index.publish import (
    PublishedIndex,
    build_and_publish,
    split_shards,
    unchanged_index,
)
from fabric_pipelines.lib.index.rebuild import check_files, rebuild_from_receipt
from fabric_pipelines.lib.index.recall import doublings
from fabric_pipelines.lib.index.receipt import RECEIPT_SCHEMA, Receipt, ReceiptError
from fabric_pipelines.lib.index.shards import shard_of
from fabric_pipelines.lib.index.staleness import staleness
from fabric_pipelines.lib.index.vectors import ID_STRIDE, load_vectors
from fabric_pipelines.lib.results.writer import BatchRows, insert_rows
from fabric_pipelines.lib.store.keys import model_id
from fabric_pipelines.lib.store.models import Embedding, IndexReceipt, ShardWatermark

SHARDS = 8
SPEC = IndexSpec(factory="IVF32,Flat", nprobe=4, shards=SHARDS)


def _clustered(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(20, dim))
    return (centres[rng.integers(0, 20, n)] + 0.3 * rng.normal(size=(n, dim))).astype(np.float32)


def _seed_rows(db: Engine, n: int = 3000) -> int:
    """n embeddings of model "m" in task sets 1 and 2; returns the model id."""
    x = _clustered(n)
    with db.begin() as conn:
        model = model_id(conn, "m")
        conn.execute(
            insert(Embedding),
            [
                {
                    "model_id": model, "task_set_id": 1 + i % 2, "record_no": i // 2,
                    "n_tokens": 5, "vector": v.astype("<f4").tobytes(),
                }
                for i, v in enumerate(x)
            ],
        )  # fmt: skip
    return model


def _publish(db: Engine, paths: FabricPaths, **kwargs: Any) -> PublishedIndex:
    return build_and_publish(
        db,
        model_key="m",
        model={"model_id": "test", "weights_sha256": "w"},
        spec=kwargs.pop("spec", SPEC),
        index_folder=paths.indexes,
        receipt_folder=paths.receipts,
        inputs=kwargs.pop("inputs", []),
        **kwargs,
    )


def _rows_of_shard(db: Engine, model: int, shard: int) -> list[tuple[int, int]]:
    with db.connect() as conn:
        keys = conn.execute(
            select(Embedding.task_set_id, Embedding.record_no).where(Embedding.model_id == model)
        ).all()
    ids = np.array([t * ID_STRIDE + r for t, r in keys], dtype=np.int64)
    mine = shard_of(ids, SHARDS) == shard
    return [k for k, m in zip(keys, mine, strict=True) if m]


def _delete_a_row_of_shard(db: Engine, model: int, shard: int) -> None:
    """Delete one row of `shard` (its watermark moves: the shard is stale)."""
    task_set_id, record_no = _rows_of_shard(db, model, shard)[0]
    with db.begin() as conn:
        conn.execute(
            delete(Embedding).where(
                Embedding.model_id == model,
                Embedding.task_set_id == task_set_id,
                Embedding.record_no == record_no,
            )
        )


def test_rebuild_from_receipt_is_bitwise_and_repairs_lost_files(
    db: Engine, paths: FabricPaths
) -> None:
    _seed_rows(db)
    published = _publish(db, paths)
    receipt = published.receipt
    assert receipt["schema"] == RECEIPT_SCHEMA
    assert receipt["tolerance"]["kind"] == "bitwise" and receipt["build_device"] == "cpu"
    assert "faiss_compile_options" in receipt["libraries"]
    assert len(receipt["shards"]) == SHARDS and sum(s["rows"] for s in receipt["shards"]) == 3000
    # The lists are stored once: the served index and the layout, no shard files.
    assert not any("index_file" in s for s in receipt["shards"])
    assert [f for f, _ in check_files_named(receipt)] == [
        receipt["index_file"], receipt["training"]["quantizer_file"], receipt["layout_file"],
    ]  # fmt: skip
    assert check_files(receipt, paths.indexes) == []

    folder = model_index_folder(paths.indexes, "m")
    (folder / receipt["index_file"]).unlink()  # the served index, lost
    layout_file = folder / receipt["layout_file"]
    layout_file.write_bytes(layout_file.read_bytes()[:-7] + b"garbage")  # the layout, corrupted
    problems = {(p.file, p.problem) for p in check_files(receipt, paths.indexes)}
    assert problems == {
        (receipt["index_file"], "missing"),
        (receipt["layout_file"], "corrupt"),
    }

    report = rebuild_from_receipt(db, receipt, paths.indexes)
    assert report.matches, report.detail
    assert report.rebuilt_sha256 == receipt["index_sha256"]
    assert sorted(report.repaired) == sorted(f for f, _ in problems)
    assert check_files(receipt, paths.indexes) == []


def check_files_named(receipt: dict[str, Any]) -> list[tuple[str, str]]:
    return Receipt.parse(receipt).files()


def _bump_watermark(db: Engine, model: int, shard: int) -> None:
    """Mark `shard` stale without changing a row (as a row written and put back would)."""
    with db.begin() as conn:
        conn.execute(
            update(ShardWatermark)
            .where(ShardWatermark.model_id == model, ShardWatermark.shard == shard)
            .values(version=ShardWatermark.version + 1)
        )


def test_a_schema_2_receipt_still_verifies_and_rebuilds(db: Engine, paths: FabricPaths) -> None:
    """Receipts written before the layout (schema 2) name each shard's own index file: they
    still check and rebuild bitwise, shard files included; a build after one starts afresh
    (its quantizer is not reused), and publishes schema 3."""
    model = _seed_rows(db)
    spec = IndexSpec(factory="IVF32,Flat", nprobe=4, shards=SHARDS, kmeans="torch", device="cpu")
    published = _publish(db, paths, spec=spec)
    receipt = json.loads(json.dumps(published.receipt))
    folder = model_index_folder(paths.indexes, "m")
    quantizer = deserialize((folder / receipt["training"]["quantizer_file"]).read_bytes())
    served = deserialize(published.index_path.read_bytes())
    counts = read_layout(folder / receipt["layout_file"], receipt["layout_sha256"])
    parts = cut_shards(served, counts, list(range(SHARDS)), quantizer, spec.nprobe)
    (folder / "shards").mkdir(exist_ok=True)
    for entry in receipt["shards"]:  # as a schema 2 build stored them
        sha, path = store_index(folder / "shards", parts[entry["shard"]])
        entry["index_sha256"], entry["index_file"] = sha, f"shards/{path.name}"
    del receipt["layout_file"], receipt["layout_sha256"]
    receipt["schema"] = "fabric.index_receipt/2"
    assert check_files(receipt, paths.indexes) == []
    shard_file = folder / receipt["shards"][3]["index_file"]
    shard_file.unlink()
    assert [(p.file, p.problem) for p in check_files(receipt, paths.indexes)] == [
        (receipt["shards"][3]["index_file"], "missing")
    ]
    report = rebuild_from_receipt(db, receipt, paths.indexes)
    assert report.matches and report.detail == "bitwise identical", report.detail
    assert report.repaired == [receipt["shards"][3]["index_file"]] and shard_file.is_file()
    with pytest.raises(ReceiptError, match="layout_file"):  # schema 2 names shard files
        Receipt.parse({**receipt, "layout_file": "x", "layout_sha256": "y"})

    _bump_watermark(db, model, 5)
    after = _publish(db, paths, spec=spec, previous=receipt)
    assert after.receipt["schema"] == RECEIPT_SCHEMA
    assert after.rebuilt_shards == list(range(SHARDS))
    assert after.receipt["index_sha256"] == published.receipt["index_sha256"]


def test_rebuild_refuses_rows_the_receipt_does_not_describe(db: Engine, paths: FabricPaths) -> None:
    model = _seed_rows(db)
    receipt = _publish(db, paths).receipt
    with db.begin() as conn:
        conn.execute(delete(Embedding).where(Embedding.model_id == model, Embedding.record_no == 7))
    with pytest.raises(ReceiptError, match="2998 rows now, 3000 recorded"):
        rebuild_from_receipt(db, receipt, paths.indexes)


def test_a_gpu_build_is_rebuilt_on_the_cpu_within_its_recall_tolerance(
    db: Engine, paths: FabricPaths
) -> None:
    """No GPU here, so a torch-cuda build is stood in for by its receipt: a torch build whose
    receipt names the torch-cuda builder, its recall tolerance and a sha256 this machine
    cannot reproduce. The rebuild runs the same algorithm on the CPU and is held to recall."""
    _seed_rows(db)
    spec = IndexSpec(factory="IVF32,Flat", nprobe=4, shards=SHARDS, kmeans="torch", device="cpu")
    receipt = json.loads(json.dumps(_publish(db, paths, spec=spec).receipt))
    assert receipt["training"]["builder"] == "torch-cpu"
    receipt["training"]["builder"] = "torch-cuda"
    receipt["build_device"] = receipt["training"]["device"] = "gpu"
    receipt["tolerance"] = tolerance("torch-cuda")
    receipt["index_sha256"] = "0" * 64
    report = rebuild_from_receipt(db, receipt, paths.indexes, repair=False)
    assert report.device == "torch-cpu"
    assert report.matches and "allowed drop 0.01" in report.detail, report.detail
    receipt["quality"]["recall_at_k"] = 1.5  # a recall no rebuild can come within 0.01 of
    assert not rebuild_from_receipt(db, receipt, paths.indexes, repair=False).matches


def test_a_torch_build_rebuilds_bitwise_and_partly(db: Engine, paths: FabricPaths) -> None:
    """Torch on the CPU is deterministic: its receipt promises bitwise rebuilds, and keeps it,
    whole or shard by shard."""
    model = _seed_rows(db)
    spec = IndexSpec(factory="IVF32,Flat", nprobe=4, shards=SHARDS, kmeans="torch", device="cpu")
    first = _publish(db, paths, spec=spec)
    assert first.receipt["tolerance"]["kind"] == "bitwise"
    assert first.receipt["training"]["iterations"] == 10
    report = rebuild_from_receipt(db, first.receipt, paths.indexes)
    assert report.matches and report.detail == "bitwise identical"
    _bump_watermark(db, model, 6)
    second = _publish(db, paths, spec=spec, previous=first.receipt)
    assert second.rebuilt_shards == [6]
    assert second.receipt["index_sha256"] == first.receipt["index_sha256"]
    assert second.receipt["layout_sha256"] == first.receipt["layout_sha256"]


def test_only_the_changed_shard_is_rebuilt_and_search_equals_a_full_rebuild(
    db: Engine, paths: FabricPaths
) -> None:
    model = _seed_rows(db)
    first = _publish(db, paths)
    assert first.rebuilt_shards == list(range(SHARDS))
    with db.connect() as conn:
        assert staleness(conn, "m", paths.indexes).stale_shards == []  # type: ignore[union-attr]

    # Insert, update and delete rows of shard 3 only: the triggers must notice all three.
    target = 3
    rows = _rows_of_shard(db, model, target)
    new_record = next(r for r in range(10_000, 20_000) if (1 * 7919 + r) % SHARDS == target)
    with db.begin() as conn:
        conn.execute(
            update(Embedding)
            .where(Embedding.model_id == model)
            .where(Embedding.task_set_id == rows[0][0], Embedding.record_no == rows[0][1])
            .values(vector=_clustered(1, seed=9)[0].astype("<f4").tobytes())
        )
        conn.execute(
            delete(Embedding).where(
                Embedding.model_id == model,
                Embedding.task_set_id == rows[1][0],
                Embedding.record_no == rows[1][1],
            )
        )
        insert_rows(  # as the extraction's writer adds a row
            conn,
            [BatchRows(
                lease=None,  # type: ignore[arg-type]  # only the rows are written here
                task_set="", task_set_id=1, model_key="m", model_id=model,
                record_no=np.array([new_record]), n_tokens=np.array([3]),
                pooled=_clustered(1, seed=10),
            )],
        )  # fmt: skip
    with db.connect() as conn:
        found = staleness(conn, "m", paths.indexes)
    assert found is not None and found.stale_shards == [target] and not found.index_missing

    second = _publish(db, paths, previous=first.receipt)
    assert second.rebuilt_shards == [target]
    assert second.receipt["training"] == first.receipt["training"]  # the same quantizer
    for before, after in zip(first.receipt["shards"], second.receipt["shards"], strict=True):
        assert (before == after) == (before["shard"] != target)
    with db.connect() as conn:
        assert staleness(conn, "m", paths.indexes).stale_shards == []  # type: ignore[union-attr]

    # A full rebuild from the same quantizer over today's rows: same bytes, same answers.
    folder = model_index_folder(paths.indexes, "m")
    quantizer = deserialize((folder / first.receipt["training"]["quantizer_file"]).read_bytes())
    with db.connect() as conn:
        source = load_vectors(conn, "m")
    full = merge([fill(quantizer, v, i, SPEC) for i, v in split_shards(source, SHARDS)], SPEC)
    partial = deserialize(second.index_path.read_bytes())
    assert serialize(full) == serialize(partial)
    queries = _clustered(200, seed=11)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    d_full, i_full = full.search(queries, 10)
    d_part, i_part = partial.search(queries, 10)
    assert np.array_equal(i_full, i_part) and np.array_equal(d_full, d_part)
    # And the partial build's receipt rebuilds bitwise, its quantizer coming from the file.
    assert rebuild_from_receipt(db, second.receipt, paths.indexes).matches


def test_the_served_index_appended_beside_the_gathering_is_a_serial_build(
    db: Engine, paths: FabricPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served index takes each shard's rows on a thread of its own while the next shard is
    gathered and assigned: however those threads interleave (here made to by random delays),
    every list holds its rows in shard order, then id order, as a serial build's; and the
    layout cuts each shard back out as filling it alone gives."""
    _seed_rows(db)
    delays = random.Random(0)

    def delayed(work: Any) -> Any:
        def run(*args: Any) -> Any:
            time.sleep(delays.random() / 50)
            return work(*args)

        return run

    monkeypatch.setattr(publish, "add_rows", delayed(publish.add_rows))
    published = _publish(db, paths)
    folder = model_index_folder(paths.indexes, "m")
    quantizer = deserialize((folder / published.receipt["training"]["quantizer_file"]).read_bytes())
    with db.connect() as conn:
        source = load_vectors(conn, "m")
    parts = [fill(quantizer, v, i, SPEC) for i, v in split_shards(source, SHARDS)]
    served = deserialize(published.index_path.read_bytes())
    counts = read_layout(
        folder / published.receipt["layout_file"], published.receipt["layout_sha256"]
    )
    assert counts.shape == (SHARDS, 32) and counts.sum() == 3000
    cut = cut_shards(served, counts, list(range(SHARDS)), quantizer, SPEC.nprobe)
    for shard, part in enumerate(parts):
        assert serialize(cut[shard]) == serialize(part), shard
    assert published.index_path.read_bytes() == serialize(merge(parts, SPEC))
    with pytest.raises(ValueError, match="does not describe the served index"):
        cut_shards(served, counts[::-1, ::-1].copy(), [0], quantizer, SPEC.nprobe)


def test_after_an_in_place_update_the_receipt_rebuilds_from_its_stored_quantizer(
    db: Engine, paths: FabricPaths
) -> None:
    """Same ids, one vector changed: the partial build reuses the quantizer trained on the old
    vectors, so a rebuild must load it rather than train on today's vectors."""
    model = _seed_rows(db)
    first = _publish(db, paths)
    set_id, record_no = _rows_of_shard(db, model, 0)[0]
    with db.begin() as conn:
        conn.execute(
            update(Embedding)
            .where(Embedding.model_id == model)
            .where(Embedding.task_set_id == set_id, Embedding.record_no == record_no)
            .values(vector=_clustered(1, seed=9)[0].astype("<f4").tobytes())
        )
    second = _publish(db, paths, previous=first.receipt)
    assert second.receipt["ids_sha256"] == first.receipt["ids_sha256"]
    assert second.receipt["vectors_sha256"] != first.receipt["vectors_sha256"]
    assert second.receipt["training"] == first.receipt["training"]
    report = rebuild_from_receipt(db, second.receipt, paths.indexes)
    assert report.matches, report.detail


@pytest.mark.parametrize("lost", ["layout", "served index"])
def test_a_stale_shard_with_its_layout_or_served_index_lost_rebuilds_every_shard(
    db: Engine, paths: FabricPaths, lost: str
) -> None:
    """Kept shards are cut from the previous served index by its layout: with either file gone
    there is nothing to cut them from, so every shard is filled again, to the same bytes."""
    model = _seed_rows(db)
    first = _publish(db, paths)
    folder = model_index_folder(paths.indexes, "m")
    name = first.receipt["layout_file"] if lost == "layout" else first.receipt["index_file"]
    (folder / name).unlink()
    _bump_watermark(db, model, 2)
    second = _publish(db, paths, previous=first.receipt)
    assert second.rebuilt_shards == list(range(SHARDS))
    assert second.receipt["index_sha256"] == first.receipt["index_sha256"]
    assert check_files(second.receipt, paths.indexes) == []


def test_nprobe_is_raised_until_recall_meets_the_target(db: Engine, paths: FabricPaths) -> None:
    """Gaussian rows have no clusters to find: one list of 64 holds few neighbours, so the
    build searches more lists until recall@10 reaches 0.9 and the served index keeps that."""
    rows = np.random.default_rng(4).standard_normal((3000, 16)).astype("<f4")
    with db.begin() as conn:
        model = model_id(conn, "m")
        conn.execute(
            insert(Embedding),
            [
                {"model_id": model, "task_set_id": 1, "record_no": i, "n_tokens": 5,
                 "vector": v.tobytes()}
                for i, v in enumerate(rows)
            ],
        )  # fmt: skip
    spec = IndexSpec(factory="IVF64,Flat", nprobe=1, shards=2)
    published = _publish(db, paths, spec=spec, min_recall=0.9)
    params = published.receipt["index"]["params"]
    tried = {int(k): v for k, v in params["nprobe_tried"].items()}
    chosen = params["nprobe"]
    assert params["nprobe_requested"] == 1 and params["min_recall"] == 0.9
    assert 1 < chosen < 64 and list(tried) == doublings(1, chosen)
    assert tried[chosen] >= 0.9 > max(v for k, v in tried.items() if k < chosen)
    assert published.accepted and not published.shortfall
    assert published.recall_at_k == tried[chosen]
    served = faiss.extract_index_ivf(deserialize(published.index_path.read_bytes()))
    assert served.nprobe == chosen
    # The curve over every nprobe agrees with what was searched.
    assert published.receipt["quality"]["nprobe_curve"][str(chosen)] == tried[chosen]
    assert rebuild_from_receipt(db, published.receipt, paths.indexes).matches


def test_an_index_no_nprobe_can_save_is_not_recorded(db: Engine, paths: FabricPaths) -> None:
    """Four bytes of PQ code per row lose neighbours that no nprobe finds again: even every
    list misses the target, so the build is refused and says what to change."""
    _seed_rows(db)
    poor = IndexSpec(factory="IVF32,PQ4x4", nprobe=1, shards=2)
    published = _publish(db, paths, spec=poor, min_recall=0.9)
    assert not published.accepted and published.recall_at_k < 0.9
    params = published.receipt["index"]["params"]
    assert params["nprobe"] == 32 and list(params["nprobe_tried"]) == [
        str(p) for p in doublings(1, 32)
    ]
    assert "at nprobe=32 (all 32 lists)" in published.shortfall
    assert "'IVF32,Flat'" in published.shortfall and "lower min_recall" in published.shortfall
    assert published.receipt_path.is_file()  # kept for inspection
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(IndexReceipt)).scalar_one() == 0


def test_a_recall_target_above_one_is_refused_and_phases_are_timed(
    db: Engine, paths: FabricPaths
) -> None:
    _seed_rows(db)
    with pytest.raises(ValueError, match=r"within \[0, 1\]"):
        _publish(db, paths, min_recall=1.01)
    published = _publish(db, paths, min_recall=0.5)
    assert set(published.seconds) == {"load", "prepare", "train", "add", "quality", "write"}
    assert all(v >= 0 for v in published.seconds.values())


def test_the_staleness_sensor_asks_for_a_rebuild_of_the_stale_shards(
    db: Engine, db_url: str, paths: FabricPaths
) -> None:
    model = _seed_rows(db)
    _publish(db, paths)
    store = ArtifactStore(root=str(paths.root))
    resources = {"store": store, "database": Database(store=store, url=db_url)}
    instance = dg.DagsterInstance.ephemeral()

    def evaluate() -> dg.SensorResult:
        with dg.build_sensor_context(instance=instance, resources=resources) as context:
            result = index_staleness_sensor(context)
        assert isinstance(result, dg.SensorResult)
        return result

    assert evaluate().run_requests == []
    _delete_a_row_of_shard(db, model, 6)
    requests = evaluate().run_requests or []
    assert len(requests) == 1
    assert requests[0].tags["fabric/stale_shards"] == "6"
    assert requests[0].tags["fabric/model_key"] == "m"


def test_an_index_no_row_moved_since_is_not_built_again(db: Engine, paths: FabricPaths) -> None:
    """Building again with no row changed (after a set whose every task failed, say) would make
    the same index: the served one stands. A moved row, a lost file or another setting builds."""
    model = _seed_rows(db)
    first = _publish(db, paths)

    def unchanged(spec: IndexSpec = SPEC, min_recall: float = 0.0) -> PublishedIndex | None:
        return unchanged_index(
            db, model_key="m", spec=spec, min_recall=min_recall,
            index_folder=paths.indexes, receipt_folder=paths.receipts,
        )  # fmt: skip

    same = unchanged()
    assert same is not None and same.unchanged and same.accepted
    assert (same.receipt_sha256, same.index_path) == (first.receipt_sha256, first.index_path)
    assert same.receipt == first.receipt and same.rebuilt_shards == []
    # Other settings: another index.
    assert unchanged(dataclasses.replace(SPEC, nprobe=8)) is None
    assert unchanged(dataclasses.replace(SPEC, metric="l2")) is None
    assert unchanged(dataclasses.replace(SPEC, factory="IVF16,Flat")) is None
    assert unchanged(min_recall=0.5) is None
    # The served file gone: build it again.
    first.index_path.rename(first.index_path.with_suffix(".away"))
    assert unchanged() is None
    first.index_path.with_suffix(".away").rename(first.index_path)
    assert unchanged() is not None
    # A row deleted moves its shard's watermark.
    _delete_a_row_of_shard(db, model, 3)
    assert unchanged() is None
    assert _publish(db, paths, previous=first.receipt).rebuilt_shards == [3]


def test_fabric_index_cli_verifies_and_rebuilds(
    db: Engine, db_url: str, paths: FabricPaths, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from fabric_pipelines.cli import main

    monkeypatch.setenv("FABRIC_DATABASE_URL", db_url)
    monkeypatch.setenv("FABRIC_HOME", str(paths.root))
    _seed_rows(db)
    published = _publish(db, paths)
    receipt = str(published.receipt_path)
    assert main(["index", "verify", "--receipt", receipt]) == 0
    published.index_path.unlink()
    assert main(["index", "verify", "--receipt", receipt]) == 1
    assert "missing" in capsys.readouterr().out
    assert main(["index", "rebuild", "--receipt", receipt]) == 0
    out = capsys.readouterr().out
    assert "MATCH" in out and f"repaired {published.index_path.name}" in out
    assert main(["index", "status"]) == 0
    assert "stale shards none, files intact" in capsys.readouterr().out
    assert main(["receipt", "show", published.receipt_sha256[:10], "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["receipt_sha256"] == published.receipt_sha256
    assert shown["index"]["index_sha256"] == published.receipt["index_sha256"]
    assert main(["receipt", "show", "m"]) == 0  # by model key: its newest index
    assert f"receipt   {published.receipt_sha256}" in capsys.readouterr().out
    assert main(["receipt", "show", "no-such-index"]) == 2
    assert "no index matches 'no-such-index'" in capsys.readouterr().err


@pytest.mark.parametrize("factory", ["Flat", "IVF32,PQ4x4"])
def test_flat_and_ivf_pq_shard_merge_and_rebuild_bitwise(
    factory: str, db: Engine, paths: FabricPaths
) -> None:
    _seed_rows(db)
    spec = IndexSpec(factory=factory, metric="l2", nprobe=8, shards=4)
    published = _publish(db, paths, spec=spec)
    assert published.receipt["index"]["factory"] == factory
    assert deserialize(published.index_path.read_bytes()).ntotal == 3000
    assert published.recall_at_k > (0.99 if factory == "Flat" else 0.3)
    assert rebuild_from_receipt(db, published.receipt, paths.indexes).matches


def test_a_whole_sha256_names_its_receipt_even_when_it_prefixes_others(
    db: Engine, db_url: str, paths: FabricPaths, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A re-run of a finished set records the same index bytes under a second receipt (its
    inputs name the new run): the full index sha256 then picks the newest receipt, a full
    receipt sha256 its own; only a short prefix can be ambiguous."""
    from fabric_pipelines.cli import main
    from fabric_pipelines.lib.index.lineage import find_receipt

    _seed_rows(db)
    first = _publish(db, paths)
    second = _publish(db, paths, inputs=[{"partition": "s", "run_id": "r2", "data_version": "v"}])
    index_sha = first.receipt["index_sha256"]
    assert second.receipt["index_sha256"] == index_sha != second.receipt_sha256
    with db.connect() as conn:
        assert find_receipt(conn, index_sha)[0] == second.receipt_sha256  # the newest
        assert find_receipt(conn, first.receipt_sha256)[0] == first.receipt_sha256
        with pytest.raises(LookupError, match="matches 2 receipts"):
            find_receipt(conn, index_sha[:8])
    monkeypatch.setenv("FABRIC_DATABASE_URL", db_url)
    monkeypatch.setenv("FABRIC_HOME", str(paths.root))
    assert main(["receipt", "show", index_sha]) == 0
    assert f"receipt   {second.receipt_sha256}" in capsys.readouterr().out

    # A lost receipt file is written again from its database row, byte for byte.
    original = first.receipt_path.read_bytes()
    first.receipt_path.unlink()
    assert main(["receipt", "restore", first.receipt_sha256]) == 0
    assert first.receipt_path.read_bytes() == original
    assert main(["receipt", "restore", "0" * 64]) == 2
    assert "no index receipt" in capsys.readouterr().err
