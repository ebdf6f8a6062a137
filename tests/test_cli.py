"""The `fabric` command line, run as a user would: a subprocess with its own DAGSTER_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fabric_pipelines.lib.demo_corpus import BAD_RECORDS, write_demo_set

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
    source = tmp_path / "x.jsonl"
    source.write_text('{"id": 1, "text": "hi"}\n')
    bad = _fabric(home, "submit", str(source), "--task-set", "../escape")
    assert bad.returncode == 2 and "is not allowed" in bad.stderr
    missing = _fabric(home, "status", "nothing")
    assert missing.returncode == 2 and "no task set named 'nothing'" in missing.stderr


@pytest.mark.slow
def test_submit_and_run_then_status(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = tmp_path / "small.jsonl"
    rows = [{"id": f"r{i}", "text": f"row {i} of a small set"} for i in range(40)]
    rows.append({"id": "blank", "text": " "})
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = _fabric(
        home, "submit", str(source), "--task-set", "small", "--run",
        "--max-seq-len", "128", "--max-batch-tokens", "2048", "--hook-layers", "",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tasks submitted  41" in run.stdout
    assert "receipt sha256" in run.stdout and "accounting passed" in run.stdout
    status = _fabric(home, "status", "small", "--failures")
    assert status.returncode == 0
    line = next(ln for ln in status.stdout.splitlines() if ln.strip().startswith("small"))
    assert line.split()[1:7] == ["41", "40", "1", "0", "0", "True"]
    assert "text is only whitespace" in status.stdout
    assert (home / "fabric.db").exists()  # the embedded default: SQLite under DAGSTER_HOME


def test_demo_set_is_real_varied_text_with_bad_records(tmp_path: Path) -> None:
    path = tmp_path / "demo.jsonl"
    n = write_demo_set(path, 2500)
    lines = path.read_text().splitlines()
    assert n == len(lines) >= 2500 + len(BAD_RECORDS)
    texts = [json.loads(ln).get("text") for ln in lines[:2500]]
    lengths = sorted(len(t.split()) for t in texts)
    assert lengths[len(lengths) // 10] < 15 and lengths[-len(lengths) // 10] > 60  # varied
    assert len(set(texts)) > 2000
