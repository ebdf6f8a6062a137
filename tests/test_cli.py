"""The `fabric` command line, run as a user would: a subprocess with its own DAGSTER_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from sqlalchemy.exc import IntegrityError

from fabric_pipelines.cli.demo_corpus import BAD_RECORDS, write_demo_set
from fabric_pipelines.defs.failures import failure_text
from fabric_pipelines.lib.core.files import CorruptFileError

FABRIC = str(Path(sys.executable).parent / "fabric")


def _fabric(home: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DAGSTER_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("FABRIC_DATABASE_URL", None)
    env.pop("FABRIC_HOME", None)
    return subprocess.run([FABRIC, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_status_of_an_empty_home_and_bad_submissions(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = _fabric(home, "status")
    assert out.returncode == 0 and "no task sets yet" in out.stdout
    machine = _fabric(home, "status", "--json")
    assert machine.returncode == 0 and json.loads(machine.stdout) == {"task_sets": []}
    source = tmp_path / "x.jsonl"
    source.write_text('{"id": 1, "text": "hi"}\n')
    bad = _fabric(home, "submit", str(source), "--task-set", "../escape")
    assert bad.returncode == 2 and "is not allowed" in bad.stderr
    missing = _fabric(home, "status", "nothing")
    assert missing.returncode == 2 and "no task set named 'nothing'" in missing.stderr
    clean = _fabric(home, "verify")
    assert clean.returncode == 0 and "clean:" in clean.stdout


def _partitions(home: Path) -> list[str]:
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        return list(instance.get_dynamic_partitions("task_set"))


def test_run_refuses_a_bad_name_and_leaves_no_partition_for_an_unreadable_set(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    bad = _fabric(home, "run", "../escape")
    assert bad.returncode == 2
    [line] = bad.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("fabric run: task-set name '../escape' is not allowed")
    missing = _fabric(home, "run", "nosuch")
    assert missing.returncode == 1
    last = missing.stderr.strip().splitlines()[-1]
    assert last.startswith("extraction failed in tokenised_tasks: task set 'nosuch' has no file")
    assert "fabric submit FILE --task-set nosuch" in last
    assert "Dagster" not in last and "Traceback" not in missing.stderr
    assert "Stack Trace" not in missing.stderr  # Dagster's console logger, told to leave it out
    assert _partitions(home) == []  # the partition the run registered is gone again
    # A changed inbox file: Dagster's lines say which step failed, one line says why and what to do.
    source = tmp_path / "s.jsonl"
    source.write_text('{"id": "a", "text": "hello"}\n')
    assert _fabric(home, "submit", str(source), "--task-set", "s").returncode == 0
    with open(home / "inbox" / "s.jsonl", "a") as inbox_file:
        inbox_file.write('{"id": "b", "text": "added later"}\n')
    changed = _fabric(home, "run", "s")
    assert changed.returncode == 1
    assert "Stack Trace" not in changed.stderr and "Traceback" not in changed.stderr
    last = changed.stderr.strip().splitlines()[-1]
    assert last.startswith("extraction failed in tokenised_tasks: inbox file s.jsonl of task ")
    assert "changed after it was submitted" in last and "put the submitted file back" in last


def test_status_failures_prints_each_reason_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sqlalchemy import insert

    from fabric_pipelines.cli import main
    from fabric_pipelines.lib.core.settings import FabricPaths, database_url
    from fabric_pipelines.lib.store.db import create_schema, make_engine
    from fabric_pipelines.lib.store.keys import set_id_of
    from fabric_pipelines.lib.store.models import TaskFailure, TaskSet

    paths = FabricPaths(tmp_path / "home").ensure()
    monkeypatch.setenv("FABRIC_HOME", str(paths.root))
    monkeypatch.delenv("FABRIC_DATABASE_URL", raising=False)
    db = make_engine(database_url(paths))
    create_schema(db)
    reason = "line 4: " + "a reason long enough to need every one of its words " * 4 + "END"
    with db.begin() as conn:
        conn.execute(
            insert(TaskSet),
            {"name": "s", "source_sha256": "0" * 64, "content_sha256": "0" * 64, "path": "x",
             "model_id": "m", "tokenizer_sha256": "0" * 64, "max_seq_len": 8, "n_records": 1,
             "n_tasks": 0},
        )  # fmt: skip
        conn.execute(
            insert(TaskFailure).values(task_set_id=set_id_of("s")),
            {"record_no": 3, "task_id": "r3", "stage": "ingest", "reason": reason},
        )
    db.dispose()
    assert main(["status", "s", "--failures"]) == 0
    out = capsys.readouterr().out
    assert len(reason) > 200 and f"s  id r3  ingest: {reason}" in out
    assert main(["status", "s", "--failures", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["task_sets"]
    assert (row["task_set"], row["tasks"], row["failed"], row["balanced"]) == ("s", 1, 1, True)
    assert data["failures"] == [
        {"task_set": "s", "record_no": 3, "id": "r3", "stage": "ingest", "reason": reason}
    ]


def test_engine_options_reach_the_engine_resource() -> None:
    from fabric_pipelines.cli.parser import build_parser
    from fabric_pipelines.cli.pipeline import _run_config
    from fabric_pipelines.defs.resources import EngineConfig
    from fabric_pipelines.lib.tasks.windows import LongInputs

    args = build_parser().parse_args(
        ["run", "s", "--truncate", "--lease-seconds", "30", "--heartbeat-seconds", "5",
         "--hook-layers=2,-1"]
    )  # fmt: skip
    config = _run_config(args)["resources"]["engine"]["config"]
    assert config == {"long_inputs": "truncate", "lease_seconds": 30.0, "heartbeat_seconds": 5.0,
                      "hook_layers": [2, -1]}  # fmt: skip
    engine = EngineConfig(**config)  # every option is a field of the resource
    assert engine.long_input_policy() == LongInputs("truncate")
    assert (engine.lease_seconds, engine.heartbeat_seconds) == (30.0, 5.0)
    chunked = _run_config(
        build_parser().parse_args(["run", "s", "--long-inputs", "chunk", "--window-overlap", "8"])
    )["resources"]["engine"]["config"]
    assert EngineConfig(**chunked).long_input_policy() == LongInputs("chunk", 8)
    assert EngineConfig().long_input_policy() == LongInputs("chunk", 32), "chunk by default"
    assert _run_config(build_parser().parse_args(["run", "s"])) == {}


@pytest.mark.slow
def test_submit_and_run_then_status(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = tmp_path / "small.jsonl"
    rows = [{"id": f"r{i}", "text": f"row {i} of a small set"} for i in range(40)]
    rows.append({"id": "blank", "text": " "})
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "report.json"
    run = _fabric(
        home, "submit", str(source), "--task-set", "small", "--run",
        "--max-seq-len", "128", "--max-batch-tokens", "2048", "--hook-layers", "",
        "--report", str(report),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tasks submitted  41" in run.stdout
    # The index step took the vectors its extraction followed (lib/index/vector_tail.py).
    assert json.loads(report.read_text())["index"]["vector_index"]["vectors_followed"] is True
    # The report's clock: the CLI's milestones in order, and every step's start before its end.
    clock = json.loads(report.read_text())["clock"]
    marks = clock["marks"]
    order = ["cli_started", "submitted", "definitions_loaded", "extraction_job_done"]
    assert [marks[m] for m in order] == sorted(marks[m] for m in order)
    assert marks["index_job_done"] <= marks["report_written"]
    steps = clock["steps"]
    for step in ("tokenised_tasks", "shape_batches", "extraction_outputs", "index:vector_index"):
        assert steps[step]["start"] <= steps[step]["end"], step
    assert steps["extraction_outputs"]["end"] <= steps["index:vector_index"]["start"]
    # The set was ingested and planned while Dagster loaded; its steps took both over.
    extract = json.loads(report.read_text())["extract"]
    assert extract["tokenised_tasks"]["started_ahead"] is True, extract["tokenised_tasks"]
    assert extract["shape_batches"]["started_ahead"] is True, extract["shape_batches"]
    assert marks["submitted"] <= marks["ahead_planned"] <= steps["shape_batches"]["end"]
    assert "receipt sha256" in run.stdout and "accounting passed" in run.stdout
    status = _fabric(home, "status", "small", "--failures")
    assert status.returncode == 0
    line = next(ln for ln in status.stdout.splitlines() if ln.strip().startswith("small"))
    # tasks, completed, reused, failed, in flight, queued, balanced
    assert line.split()[1:8] == ["41", "40", "0", "1", "0", "0", "True"]
    assert "text is only whitespace" in status.stdout
    assert "small, last extraction (" in status.stdout and "real tokens/s" in status.stdout
    assert (home / "fabric.db").exists()  # the embedded default: SQLite under DAGSTER_HOME

    # The same texts again under another name: every row is reused, none reaches the engine,
    # and the index over them is published as any other.
    again = _fabric(
        home, "submit", str(source), "--task-set", "again", "--run",
        "--max-seq-len", "128", "--max-batch-tokens", "2048", "--hook-layers", "",
    )  # fmt: skip
    assert again.returncode == 0 and "accounting passed" in again.stdout, again.stdout
    # The summary says so (the first run, with nothing to reuse, has no such line).
    reused = [ln.split() for ln in again.stdout.splitlines() if ln.strip().startswith("reused")]
    assert [r[:3] for r in reused] == [["reused", "40", "tasks"]], again.stdout
    assert not any(ln.strip().startswith("reused") for ln in run.stdout.splitlines())
    machine = json.loads(_fabric(home, "status", "again", "--json").stdout)["task_sets"][0]
    assert (machine["tasks"], machine["completed"], machine["reused"]) == (41, 0, 40), machine
    assert machine["last_extraction"]["engine_items"] == 0, machine
    assert _fabric(home, "forget", "again").returncode == 0

    # Its results as Parquet, for other tools; an existing file is kept unless --force.
    exported = home / "small.parquet"
    done = _fabric(home, "export", "small", "--out", str(exported))
    assert done.returncode == 0 and "exported 40 vectors" in done.stdout, done.stderr
    assert pq.read_metadata(exported).num_rows == 40
    kept = _fabric(home, "export", "small", "--out", str(exported))
    assert kept.returncode == 2 and "give --force" in kept.stderr

    # Forgetting the set takes its results, files, inbox file and partition; a name it does not
    # know is refused, naming it.
    assert _partitions(home) == ["small"]
    forgot = _fabric(home, "forget", "small")
    assert forgot.returncode == 0 and "forgot task set 'small': 40 result(s)" in forgot.stdout
    assert _partitions(home) == []
    assert not list((home / "inbox").glob("small.*")) and not list(
        (home / "plans").rglob("*.arrow")
    )
    assert "no task sets yet" in _fabric(home, "status").stdout
    again = _fabric(home, "forget", "small")
    assert again.returncode == 2 and "no task set named 'small'" in again.stderr


def test_demo_set_is_real_varied_text_with_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "demo.jsonl"
    n = write_demo_set(path, 2500)
    lines = path.read_text().splitlines()
    assert n == len(lines) >= 2500 + len(BAD_RECORDS)
    texts = [json.loads(ln).get("text") for ln in lines[:2500]]
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[len(lengths) // 10] < 15 and lengths[-len(lengths) // 10] > 60  # varied
    assert len(set(texts)) > 2000


@dg.asset
def reads_a_stored_file() -> None:
    try:
        raise KeyError("inner detail")
    except KeyError as exc:
        raise CorruptFileError(
            "stored file /d/s.arrow is corrupt: sha256 aa but bb was recorded when it was "
            "written; re-materialise the asset that wrote it"
        ) from exc


@dg.asset
def refuses() -> None:
    raise dg.Failure(description="task set 's' is not ingested; submit it first")


@dg.asset
def races() -> None:
    raise IntegrityError("INSERT INTO task_sets ...", {}, Exception("duplicate key value"))


@dg.asset(check_specs=[dg.AssetCheckSpec("accounting", asset="checked", blocking=True)])
def checked() -> dg.MaterializeResult:
    return dg.MaterializeResult(
        check_results=[
            dg.AssetCheckResult(
                check_name="accounting",
                passed=False,
                metadata={"problems": "shard_file /d/x.arrow: missing (repair: fabric ...)"},
            )
        ]
    )


def test_a_failed_run_reports_the_steps_own_error_and_remedy() -> None:
    def text(asset: dg.AssetsDefinition) -> str:
        result = dg.materialize([asset], raise_on_error=False)
        return failure_text(result, "extraction", "s")

    assert text(reads_a_stored_file) == (
        "extraction failed in reads_a_stored_file: stored file /d/s.arrow is corrupt: sha256 aa "
        "but bb was recorded when it was written; re-materialise the asset that wrote it"
    )
    assert text(refuses) == (
        "extraction failed in refuses: task set 's' is not ingested; submit it first"
    )
    raced = text(races)
    assert raced.startswith("extraction failed in races: another run of task set 's' wrote")
    assert "`fabric run s` again" in raced
    assert text(checked) == (
        "extraction failed in checked: check checked:accounting failed: shard_file "
        "/d/x.arrow: missing (repair: fabric ...)"
    )


@pytest.mark.slow
def test_a_set_whose_every_record_fails_runs_to_the_end_with_no_index(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = tmp_path / "bad.jsonl"
    source.write_text('{"id": "a", "text": ""}\n{"id": "b", "text": "   "}\n')
    run = _fabric(
        home, "submit", str(source), "--task-set", "allbad", "--run", "--workers", "0",
        "--max-seq-len", "128", "--max-batch-tokens", "2048",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    index = next(ln for ln in run.stdout.splitlines() if ln.split()[:1] == ["index"])
    assert index.split(None, 1)[1].startswith("none: no index built: model ")
    assert "every task failed" in run.stdout and "accounting passed" in run.stdout
    assert "recall_at_10 passed" in run.stdout
    status = _fabric(home, "status", "allbad")
    line = next(ln for ln in status.stdout.splitlines() if ln.strip().startswith("allbad"))
    assert line.split()[1:8] == ["2", "0", "0", "2", "0", "0", "True"]


def test_a_database_that_does_not_answer_is_one_line_with_the_password_masked(
    tmp_path: Path,
) -> None:
    """Port 9 on the loopback: nothing listens, the connection is refused at once."""
    home = tmp_path / "home"
    env = {**os.environ, "DAGSTER_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env["FABRIC_DATABASE_URL"] = "postgresql://someone:s3cret@127.0.0.1:9/results"
    env.pop("FABRIC_HOME", None)
    source = tmp_path / "x.jsonl"
    source.write_text('{"id": 1, "text": "hi"}\n')
    for args in (["status"], ["submit", str(source), "--task-set", "x", "--run"]):
        out = subprocess.run([FABRIC, *args], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and "s3cret" not in out.stderr + out.stdout
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith(f"fabric {args[0]}: the results database postgresql://someone:***@")
        assert "did not answer" in last and "FABRIC_DATABASE_URL" in last
