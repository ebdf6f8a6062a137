"""The real `dagster dev` from a fresh DAGSTER_HOME, driven the way a user drives it: drop a task
set in the inbox and wait. The inbox sensor (RUNNING by default) starts the extraction run, the
automation sensor the index build; the receipt and the check statuses are read over GraphQL and
the asset catalog is opened in headless Chromium (screenshot kept under build/ui/).

Marked `slow`; needs Debian's `chromium` (`.ci/run` installs it) — skipped with the reason where
it is missing, except under CI=true where a missing browser fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric_pipelines.lib.tasks.inbox import submit

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "build" / "ui"
FAMILIES = ("tokenised_tasks", "shape_batches", "extraction_outputs", "vector_index")
IN_CI = os.environ.get("CI", "").lower() == "true"

pytestmark = pytest.mark.slow


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    if IN_CI:
        pytest.fail("chromium is required in CI (.ci/run installs Debian's package)")
    pytest.skip("no chromium on PATH: apt-get install chromium")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dagster:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, text: str, variables: dict[str, Any] | None = None) -> dict[str, Any]:
        body = json.dumps({"query": text, "variables": variables or {}}).encode()
        request = urllib.request.Request(
            f"{self.base}/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            reply: dict[str, Any] = json.load(response)
        if reply.get("errors"):
            raise AssertionError(f"GraphQL errors: {reply['errors']}")
        data: dict[str, Any] = reply["data"]
        return data


@pytest.fixture
def dagster_dev(tmp_path: Path) -> Iterator[tuple[Dagster, Path]]:
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    port = _free_port()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("FABRIC_HOME", None)
    env.pop("FABRIC_DATABASE_URL", None)
    log = (tmp_path / "dagster-dev.log").open("wb")
    process = subprocess.Popen(
        [Path(sys.executable).parent / "dagster", "dev", "-w", "workspace.yaml",
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    dagster = Dagster(port)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                dagster.query("{ version }")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        "dagster dev did not come up:\n"
                        + (tmp_path / "dagster-dev.log").read_text()
                    ) from None
                time.sleep(1)
        yield dagster, home
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


RUNS = """
query ($job: String!) {
  runsOrError(filter: {pipelineName: $job}) {
    ... on Runs { results { runId status } }
  }
}"""

ASSET = """
query ($path: [String!]!) {
  assetNodes(assetKeys: [{path: $path}]) {
    assetChecksOrError {
      ... on AssetChecks { checks { name executionForLatestMaterialization { status } } }
    }
    assetMaterializations(limit: 1) {
      runId
      metadataEntries {
        label
        ... on PathMetadataEntry { path }
        ... on JsonMetadataEntry { jsonString }
        ... on FloatMetadataEntry { floatValue }
      }
    }
  }
}"""


def _wait(what: str, timeout: float, probe: Any) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _run_of(dagster: Dagster, job: str) -> dict[str, Any] | None:
    runs = dagster.query(RUNS, {"job": job})["runsOrError"]["results"]
    for run in runs:
        if run["status"] in ("FAILURE", "CANCELED"):
            raise AssertionError(f"{job} run {run['runId']} ended {run['status']}")
    done = [r for r in runs if r["status"] == "SUCCESS"]
    return done[0] if done else None


def test_a_dropped_task_set_runs_to_an_index_in_the_real_ui(
    dagster_dev: tuple[Dagster, Path], tmp_path: Path
) -> None:
    chromium = _chromium()
    dagster, home = dagster_dev
    source = tmp_path / "ui-set.jsonl"
    rows = [{"id": f"d{i}", "text": f"Note {i} is about subject {i % 5}."} for i in range(40)]
    rows.append({"id": "blank", "text": " "})
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    submit(source, home / "inbox", "ui-set")  # what a user's copy into the inbox amounts to

    extraction = _wait("the inbox sensor's run", 420, lambda: _run_of(dagster, "extract_task_set"))

    def index_materialized() -> dict[str, Any] | None:
        node = dagster.query(ASSET, {"path": ["vector_index"]})["assetNodes"][0]
        return node if node["assetMaterializations"] else None

    node = _wait("the automation sensor's index build", 420, index_materialized)
    entries = {e["label"]: e for e in node["assetMaterializations"][0]["metadataEntries"]}
    receipt_file = Path(entries["receipt_path"]["path"])
    receipt = json.loads(receipt_file.read_text())
    assert receipt["source"]["rows"] == 40
    assert receipt["inputs"][0]["run_id"] == extraction["runId"]
    checks = {c["name"]: c for c in node["assetChecksOrError"]["checks"]}
    assert checks["recall_at_10"]["executionForLatestMaterialization"]["status"] == "SUCCEEDED"
    extract_node = dagster.query(ASSET, {"path": ["extraction_outputs"]})["assetNodes"][0]
    extract_checks = {c["name"]: c for c in extract_node["assetChecksOrError"]["checks"]}
    assert (
        extract_checks["accounting"]["executionForLatestMaterialization"]["status"] == "SUCCEEDED"
    )

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "assets.png"
    shot.unlink(missing_ok=True)
    browser = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--window-size=1600,1000",
               "--virtual-time-budget=20000"]  # fmt: skip
    url = f"{dagster.base}/assets"
    subprocess.run([*browser, f"--screenshot={shot}", url], check=True, timeout=180,
                   capture_output=True)  # fmt: skip
    dom = subprocess.run([*browser, "--dump-dom", url], check=True, timeout=180,
                         capture_output=True, text=True).stdout  # fmt: skip
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
    for family in FAMILIES:
        assert family in dom, f"{family} not on the asset page"
