"""The real `dagster dev` from a fresh DAGSTER_HOME, driven the way a user drives it: drop task
sets in the inbox and wait, then click Materialize (the UI's own GraphQL call). The inbox sensor
(RUNNING by default) starts each set's run, the automation sensor the index build. What the UI
shows is read over GraphQL and in headless Chromium (screenshots kept under build/ui/): a bad set
beside a good one marks only its own partition, a rebuild under its recall floor never becomes
the latest index, shape_batches again on a finished set shows the same plan, and the index's
inputs are links to their runs.

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

from fabric_pipelines.cli.demo_corpus import write_demo_set
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
        # What the community dialog's "Skip" sends: seen once per instance, so the screenshots
        # show the pages, not the dialog over them.
        dagster.query("mutation { setNuxSeen }")
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
    ... on Runs { results { runId status tags { key value } } }
  }
}"""

ASSET = """
query ($path: [String!]!) {
  assetNodes(assetKeys: [{path: $path}]) {
    assetChecksOrError {
      ... on AssetChecks {
        checks {
          name
          executionForLatestMaterialization { status }
          partitionStatuses {
            ... on AssetCheckDefaultPartitionStatuses {
              succeededPartitions failedPartitions executionFailedPartitions
            }
          }
        }
      }
    }
    assetPartitionStatuses {
      ... on DefaultPartitionStatuses { materializedPartitions failedPartitions }
    }
    assetMaterializations(limit: 1) {
      runId
      metadataEntries {
        label
        ... on PathMetadataEntry { path }
        ... on JsonMetadataEntry { jsonString }
        ... on FloatMetadataEntry { floatValue }
        ... on BoolMetadataEntry { boolValue }
        ... on TextMetadataEntry { text }
        ... on MarkdownMetadataEntry { mdStr }
        ... on PipelineRunMetadataEntry { runId }
      }
    }
  }
}"""

PARTITION_MATERIALIZATION = """
query ($path: [String!]!, $partition: String!) {
  assetNodes(assetKeys: [{path: $path}]) {
    assetMaterializations(partitions: [$partition], limit: 1) {
      runId
      metadataEntries { label ... on TextMetadataEntry { text } ... on IntMetadataEntry { intValue } }
    }
  }
}"""

REPOSITORIES = """
{ repositoriesOrError { ... on RepositoryConnection { nodes { name location { name } } } } }"""

LAUNCH = """
mutation ($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
  }
}"""

RUN = """
query ($id: ID!) { runOrError(runId: $id) { ... on Run { runId status } } }"""


def _wait(what: str, timeout: float, probe: Any) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(3)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _run_of(dagster: Dagster, job: str, partition: str, status: str) -> dict[str, Any] | None:
    """The run of `job` for `partition` once it ended; an AssertionError if it ended otherwise
    than `status`."""
    runs = dagster.query(RUNS, {"job": job})["runsOrError"]["results"]
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["tags"]}
        if tags.get("dagster/partition") != partition:
            continue
        if run["status"] in ("SUCCESS", "FAILURE", "CANCELED"):
            if run["status"] != status:
                raise AssertionError(f"{job} run {run['runId']} ended {run['status']}")
            return run
    return None


def _launch(
    dagster: Dagster, asset: str, config: dict[str, Any] | None = None, partition: str = ""
) -> str:
    """What the UI's Materialize button sends: a run of the asset job for one asset."""
    repo = dagster.query(REPOSITORIES)["repositoriesOrError"]["nodes"][0]
    params: dict[str, Any] = {
        "selector": {
            "repositoryLocationName": repo["location"]["name"],
            "repositoryName": repo["name"],
            "jobName": "__ASSET_JOB",
            "assetSelection": [{"path": [asset]}],
        },
        "runConfigData": {"ops": {asset: {"config": config}}} if config else {},
        "executionMetadata": {
            "tags": [{"key": "dagster/partition", "value": partition}] if partition else []
        },
    }
    launched = dagster.query(LAUNCH, {"params": params})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id: str = launched["run"]["runId"]
    return run_id


def _ended(dagster: Dagster, run_id: str) -> str | None:
    status: str = dagster.query(RUN, {"id": run_id})["runOrError"]["status"]
    return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None


def _node(dagster: Dagster, asset: str) -> dict[str, Any]:
    node: dict[str, Any] = dagster.query(ASSET, {"path": [asset]})["assetNodes"][0]
    return node


def _entries(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["label"]: e for e in node["assetMaterializations"][0]["metadataEntries"]}


def _checks(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in node["assetChecksOrError"]["checks"]}


class Browser:
    """Headless Chromium: a page's screenshot (kept under build/ui/) and its rendered DOM."""

    def __init__(self, chromium: str, base: str) -> None:
        self.base = base
        self.command = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                        "--disable-dev-shm-usage", "--window-size=1600,1000",
                        "--virtual-time-budget=20000"]  # fmt: skip
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def page(self, path: str, shot_name: str) -> str:
        shot = SCREENSHOTS / shot_name
        shot.unlink(missing_ok=True)
        url = f"{self.base}{path}"
        subprocess.run([*self.command, f"--screenshot={shot}", url], check=True, timeout=180,
                       capture_output=True)  # fmt: skip
        assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert shot.stat().st_size > 20_000, f"{path}: a blank page"  # a rendered page
        dom: str = subprocess.run([*self.command, "--dump-dom", url], check=True, timeout=180,
                                  capture_output=True, text=True).stdout  # fmt: skip
        return dom


def _bad_parquet(path: Path) -> None:
    """A Parquet file the inbox accepts (name and type) whose columns ingest refuses."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"name": ["a", "b"], "body": ["x", "y"]}), path)


def test_the_ui_tells_the_truth_about_sets_plans_and_indexes(
    dagster_dev: tuple[Dagster, Path], tmp_path: Path
) -> None:
    """A good set and a bad one dropped together; then, as a user would from the UI, a rebuild
    whose recall misses its floor and a re-materialisation of a finished set's shape_batches."""
    browser = Browser(_chromium(), dagster_dev[0].base)
    dagster, home = dagster_dev
    source = tmp_path / "ui-set.jsonl"
    write_demo_set(source, 300)  # real docstrings, plus the demo's bad records
    bad = tmp_path / "ui-bad.parquet"
    _bad_parquet(bad)
    submit(source, home / "inbox", "ui-set")  # what a user's copy into the inbox amounts to
    submit(bad, home / "inbox", "ui-bad")

    extraction = _wait(
        "the inbox sensor's run of the good set",
        420,
        lambda: _run_of(dagster, "extract_task_set", "ui-set", "SUCCESS"),
    )
    _wait(
        "the bad set's run to fail",
        420,
        lambda: _run_of(dagster, "extract_task_set", "ui-bad", "FAILURE"),
    )
    node = _wait(
        "the automation sensor's index build",
        420,
        lambda: (n := _node(dagster, "vector_index"))["assetMaterializations"] and n,
    )
    entries = _entries(node)
    receipt = json.loads(Path(entries["receipt_path"]["path"]).read_text())
    assert receipt["source"]["rows"] > 250
    assert [(i["partition"], i["run_id"]) for i in receipt["inputs"]] == [
        ("ui-set", extraction["runId"])
    ]
    # The receipt's input is a run link (PipelineRunMetadataEntry), not text.
    assert entries["input ui-set"]["runId"] == extraction["runId"]
    assert receipt["index_sha256"] in entries["receipt"]["mdStr"]  # the summary, hash in full
    assert _checks(node)["recall_at_10"]["executionForLatestMaterialization"]["status"] == (
        "SUCCEEDED"
    )
    served_run = node["assetMaterializations"][0]["runId"]
    receipt_sha = Path(entries["receipt_path"]["path"]).stem

    # One bad set next to a good one: only its partition is red, everywhere.
    for family in ("tokenised_tasks", "shape_batches", "extraction_outputs"):
        statuses = _node(dagster, family)["assetPartitionStatuses"]
        assert statuses["failedPartitions"] == ["ui-bad"], (family, statuses)
        assert statuses["materializedPartitions"] == ["ui-set"], (family, statuses)
    accounting = _checks(_node(dagster, "extraction_outputs"))["accounting"]["partitionStatuses"]
    assert accounting["succeededPartitions"] == ["ui-set"], accounting  # per set, visible
    assert "ui-bad" not in accounting["succeededPartitions"]

    # The obvious clicks: shape_batches again on the finished set, and a rebuild whose recall
    # cannot reach its floor (4-bit product codes, and a floor of 0.99).
    plan_before = _partition_plan(dagster, "ui-set")
    replan = _launch(dagster, "shape_batches", partition="ui-set")
    refused = _launch(
        dagster,
        "vector_index",
        {"factory": "PQ4x4", "nprobe": 1, "min_recall": 0.99, "shards": 1, "full_rebuild": True},
    )
    assert _wait("the shape_batches run", 300, lambda: _ended(dagster, replan)) == "SUCCESS"
    assert _wait("the refused index build", 300, lambda: _ended(dagster, refused)) == "FAILURE"
    plan_after = _partition_plan(dagster, "ui-set")
    assert plan_after["run"] == replan and plan_after["plan_id"] == plan_before["plan_id"]
    assert plan_after["batches"] == plan_before["batches"] > 0  # the same plan, never an empty one
    node = _node(dagster, "vector_index")
    # The refused build recorded no materialisation: the page's latest is the served index.
    assert node["assetMaterializations"][0]["runId"] == served_run
    assert _entries(node)["published"]["boolValue"] is True

    graph = browser.page("/assets", "assets.png")
    for family in FAMILIES:
        assert family in graph, f"{family} not on the asset page"
    index_page = browser.page("/assets/vector_index", "vector_index.png")
    assert f"/runs/{extraction['runId']}" in index_page  # the input, rendered as a run link
    assert receipt_sha in index_page  # the metadata shown is the served index's
    run_page = browser.page(f"/runs/{extraction['runId']}", "input_run.png")
    assert extraction["runId"][:8] in run_page and "extract_task_set" in run_page
    browser.page("/assets/tokenised_tasks?view=partitions", "partitions.png")


def _partition_plan(dagster: Dagster, partition: str) -> dict[str, Any]:
    """The latest shape_batches materialisation of `partition`: its run, plan id and batches."""
    found = dagster.query(
        PARTITION_MATERIALIZATION, {"path": ["shape_batches"], "partition": partition}
    )
    latest = found["assetNodes"][0]["assetMaterializations"][0]
    entries = {e["label"]: e for e in latest["metadataEntries"]}
    return {
        "run": latest["runId"],
        "plan_id": entries["plan_id"]["text"],
        "batches": entries["batches"]["intValue"],
    }
