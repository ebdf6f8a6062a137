"""The code location loads with the four asset families, and the inbox sensor works."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg

from fabric_pipelines.definitions import defs
from fabric_pipelines.defs.extraction import inbox_sensor
from fabric_pipelines.defs.resources import ArtifactStore
from fabric_pipelines.lib.core.settings import FabricPaths
from tests.pipeline_helpers import validate_workspace

# One group: the UI collapses each group of a graph of several, hiding a lone asset's name.
FAMILIES = {
    "tokenised_tasks": "inference_fabric",
    "shape_batches": "inference_fabric",
    "extraction_outputs": "inference_fabric",
    "vector_index": "inference_fabric",
}


def test_definitions_have_the_four_asset_families() -> None:
    definitions = defs()
    dg.Definitions.validate_loadable(definitions)
    graph = definitions.resolve_asset_graph()
    specs = {key.to_user_string(): graph.get(key) for key in graph.get_all_asset_keys()}
    assert set(FAMILIES) <= set(specs)
    for key, group in FAMILIES.items():
        node = specs[key]
        assert node.group_name == group
        assert node.code_version and node.description and node.kinds
    assert graph.get(dg.AssetKey("extraction_outputs")).pools == {"gpu"}
    checks = {c.name for c in graph.asset_check_keys}
    assert {"accounting", "recall_at_10"} <= checks
    assert (
        definitions.resolve_sensor_def("inbox_sensor").default_status
        == dg.DefaultSensorStatus.RUNNING
    )
    verify_job = definitions.resolve_job_def("verify_job")
    assert [node.name for node in verify_job.nodes] == ["verify_everything"]
    assert verify_job.description and "fabric verify" in verify_job.description
    forget_job = definitions.resolve_job_def("forget_job")  # fabric forget, from the launchpad
    assert [node.name for node in forget_job.nodes] == ["forget_task_set_op"]


def test_dagster_cli_validates_the_workspace(tmp_path: Path) -> None:
    validate_workspace(tmp_path)


def test_inbox_sensor_registers_new_sets_once(tmp_path: Path) -> None:
    paths = FabricPaths(tmp_path / "root").ensure()
    store = ArtifactStore(root=str(paths.root))
    (paths.inbox / "alpha.jsonl").write_text(json.dumps({"id": 1, "text": "x"}) + "\n")
    (paths.inbox / "bad name.jsonl").write_text("{}\n")
    instance = dg.DagsterInstance.ephemeral()
    context = dg.build_sensor_context(instance=instance, resources={"store": store})
    result = inbox_sensor(context)
    assert [r.partition_key for r in result.run_requests] == ["alpha"]
    assert result.run_requests[0].run_key.startswith("alpha:")
    assert [list(r.partition_keys) for r in result.dynamic_partitions_requests] == [["alpha"]]
    # Once the partition exists, the sensor asks for no new partition, and the run key repeats
    # (Dagster launches a run key once).
    instance.add_dynamic_partitions("task_set", ["alpha"])
    again = inbox_sensor(dg.build_sensor_context(instance=instance, resources={"store": store}))
    assert again.dynamic_partitions_requests == []
    assert again.run_requests[0].run_key == result.run_requests[0].run_key


def test_a_refused_inbox_file_is_alerted_once_per_version(tmp_path: Path) -> None:
    from fabric_pipelines.lib.core.alerts import rejections_file

    store = ArtifactStore(root=str(tmp_path / "root"))
    inbox = store.paths().inbox
    (inbox / "notes.txt").write_text("not a task set")
    instance = dg.DagsterInstance.ephemeral()

    def tick() -> None:
        inbox_sensor(dg.build_sensor_context(instance=instance, resources={"store": store}))

    tick()
    tick()  # the sensor looks every 15 s: the same file is not alerted again
    lines = rejections_file(store.paths().root).read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["file"] == "notes.txt" and "unsupported type" in record["reason"]
    (inbox / "notes.txt").write_text("replaced, longer content")  # a new version: said again
    tick()
    assert len(rejections_file(store.paths().root).read_text().splitlines()) == 2
