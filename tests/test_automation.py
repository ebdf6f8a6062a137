"""Automation that must work on a fresh DAGSTER_HOME without clicks: every sensor and schedule
starts RUNNING; the nightly schedule asks for an index build, the weekly one for verify_job; a
failed run (a verify finding included) is written down."""

from __future__ import annotations

from datetime import UTC, datetime

import dagster as dg
import pytest

from fabric_pipelines.definitions import defs
from fabric_pipelines.defs.extraction import inbox_sensor
from fabric_pipelines.defs.gpu_pool import GPU_POOL, gpu_slots, sync_gpu_pool
from fabric_pipelines.defs.operations import run_failure_alerts
from fabric_pipelines.defs.resources import ArtifactStore, Database
from fabric_pipelines.defs.schedules import index_refresh, weekly_verify
from fabric_pipelines.defs.verify import verify_job
from fabric_pipelines.lib.core.alerts import read_run_failures
from fabric_pipelines.lib.core.settings import FabricPaths
from fabric_pipelines.lib.worker.devices import visible_gpus


def test_every_sensor_and_schedule_starts_running() -> None:
    definitions = defs()
    sensors = {s.name: s.default_status for s in definitions.sensors or []}
    assert sensors == {
        "engine_pool_sensor": dg.DefaultSensorStatus.RUNNING,
        "inbox_sensor": dg.DefaultSensorStatus.RUNNING,
        "index_automation": dg.DefaultSensorStatus.RUNNING,
        "index_staleness_sensor": dg.DefaultSensorStatus.RUNNING,
        "run_failure_alerts": dg.DefaultSensorStatus.RUNNING,
    }
    schedules = {s.name: s.default_status for s in definitions.schedules or []}
    assert schedules == {
        "nightly_index_refresh": dg.DefaultScheduleStatus.RUNNING,
        "weekly_verify": dg.DefaultScheduleStatus.RUNNING,
    }


def test_the_nightly_schedule_requests_an_index_build() -> None:
    context = dg.build_schedule_context(
        scheduled_execution_time=datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
    )
    result = index_refresh.evaluate_tick(context)
    assert result.run_requests is not None and len(result.run_requests) == 1
    assert index_refresh.job_name == "build_vector_index"
    assert index_refresh.cron_schedule == "0 3 * * *"


def test_the_weekly_schedule_runs_verify_job() -> None:
    context = dg.build_schedule_context(
        scheduled_execution_time=datetime(2026, 11, 29, 4, 0, tzinfo=UTC)
    )
    result = weekly_verify.evaluate_tick(context)
    assert result.run_requests is not None and len(result.run_requests) == 1
    assert weekly_verify.job_name == "verify_job"
    assert weekly_verify.cron_schedule == "0 4 * * 0"


def test_verify_job_fails_on_a_finding_and_the_failure_is_alerted(paths: FabricPaths) -> None:
    """A damaged file makes verify_job fail with the finding and its repair; the run-failure
    sensor writes that to the alerts file. A clean data root passes."""
    store = ArtifactStore(root=str(paths.root))
    resources = {
        "store": store,
        "database": Database(store=store, url=f"sqlite:///{paths.sqlite_path}"),
    }
    instance = dg.DagsterInstance.ephemeral()
    assert verify_job.execute_in_process(instance=instance, resources=resources).success
    damaged = paths.receipts / f"{'ab' * 32}.json"
    damaged.write_text('{"schema": "edited"}')
    result = verify_job.execute_in_process(
        instance=instance, resources=resources, raise_on_error=False
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.RUN_FAILURE)
    run = instance.get_run_by_id(result.run_id)
    assert run is not None
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alerts",
        dagster_event=failure,
        dagster_instance=instance,
        dagster_run=run,
        resources={"store": store},
    ).for_run_failure()
    run_failure_alerts(context)
    [alert] = read_run_failures(paths.root)
    assert alert.job == "verify_job"
    assert f"fabric verify: 1 finding(s): receipt {damaged}" in alert.reason
    assert f"repair: rm {damaged}" in alert.reason


@dg.op
def refuses_its_input() -> None:
    raise ValueError("record 17: token id 99999 outside the vocabulary")


@dg.job
def failing_job() -> None:
    refuses_its_input()


def _alert_failed_run(
    instance: dg.DagsterInstance, result: dg.ExecuteInProcessResult, paths: FabricPaths
) -> None:
    """Call the run-failure sensor on `result`'s failed run, as the daemon would."""
    failure = next(e for e in result.all_events if e.event_type == dg.DagsterEventType.RUN_FAILURE)
    run = instance.get_run_by_id(result.run_id)
    assert run is not None
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_alerts",
        dagster_event=failure,
        dagster_instance=instance,
        dagster_run=run,
        resources={"store": ArtifactStore(root=str(paths.root))},
    ).for_run_failure()
    run_failure_alerts(context)


def test_a_failed_run_is_written_to_the_alerts_file(paths: FabricPaths) -> None:
    instance = dg.DagsterInstance.ephemeral()
    result = failing_job.execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    _alert_failed_run(instance, result, paths)
    [alert] = read_run_failures(paths.root)
    assert alert.run_id == result.run_id and alert.job == "failing_job"
    assert "refuses_its_input" in alert.reason
    assert "token id 99999 outside the vocabulary" in alert.reason  # the step's own error


@dg.asset(check_specs=[dg.AssetCheckSpec("recall_at_10", asset="index_like", blocking=True)])
def index_like() -> dg.MaterializeResult:
    return dg.MaterializeResult(
        check_results=[
            dg.AssetCheckResult(
                check_name="recall_at_10",
                passed=False,
                metadata={"recall_at_10": 0.488, "floor": 0.9, "what_to_change": "raise nprobe"},
            )
        ]
    )


def test_an_alert_names_what_ran_and_the_failed_checks_numbers(paths: FabricPaths) -> None:
    """A run of assets (as the UI launches them: a hidden asset job) whose blocking check fails:
    the alert names the asset, the check's value and floor, with no doubled punctuation."""
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([index_like], instance=instance, raise_on_error=False)
    assert not result.success
    run = instance.get_run_by_id(result.run_id)
    assert run is not None and run.job_name.startswith("__")
    _alert_failed_run(instance, result, paths)
    [alert] = read_run_failures(paths.root)
    assert alert.job == "materialise index_like"
    assert "check recall_at_10 of index_like failed" in alert.reason
    assert "recall_at_10 0.488" in alert.reason and "floor 0.9" in alert.reason
    assert ".;" not in alert.reason and ".." not in alert.reason


def test_the_gpu_pool_is_sized_from_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    instance = dg.DagsterInstance.ephemeral()
    assert sync_gpu_pool(instance, visible=2) == 2
    assert instance.event_log_storage.get_concurrency_info(GPU_POOL).slot_count == 2
    assert sync_gpu_pool(instance, visible=2) is None  # already right: left alone
    assert sync_gpu_pool(instance, visible=0) == 1  # a CPU machine still runs one step
    monkeypatch.setenv("FABRIC_GPU_POOL_AUTO", "0")
    assert sync_gpu_pool(instance, visible=8) is None
    assert instance.event_log_storage.get_concurrency_info(GPU_POOL).slot_count == 1


def test_the_inbox_sensor_sizes_the_gpu_pool(paths: FabricPaths) -> None:
    instance = dg.DagsterInstance.ephemeral()
    with dg.build_sensor_context(
        instance=instance, resources={"store": ArtifactStore(root=str(paths.root))}
    ) as context:
        inbox_sensor(context)
    expected = gpu_slots(visible_gpus())
    assert instance.event_log_storage.get_concurrency_info(GPU_POOL).slot_count == expected


def test_the_index_follows_a_good_set_while_a_bad_set_has_no_output() -> None:
    """A set whose run failed (no extraction_outputs partition) must not hold back the index
    build that a good set's new output asks for."""
    from fabric_pipelines.definitions import defs

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("task_set", ["good", "bad"])
    assets = defs()
    before = dg.evaluate_automation_conditions(defs=assets, instance=instance)
    assert before.get_num_requested(dg.AssetKey("vector_index")) == 0  # nothing to index yet
    instance.report_runless_asset_event(
        dg.AssetMaterialization("extraction_outputs", partition="good")
    )
    after = dg.evaluate_automation_conditions(defs=assets, instance=instance, cursor=before.cursor)
    assert after.get_num_requested(dg.AssetKey("vector_index")) == 1
