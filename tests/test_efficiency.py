"""The extraction step's efficiency record: where its wall time went, from the workers' own
timelines on the wall clock."""

from __future__ import annotations

import pytest

from fabric_pipelines.lib.records.efficiency import extraction_efficiency


def test_the_step_splits_into_before_engine_after_and_the_steps_own_work() -> None:
    # Two workers: the first ready at 3.0 s into the step, the last acknowledgement at 13.0 s.
    timelines = (
        {"started_at": 100.0, "engine_ready": 2.0, "ready": 3.5, "last_ack": 12.0},
        {"started_at": 101.0, "ready": 2.0, "last_ack": 12.5},
    )
    e = extraction_efficiency(
        real_tokens=9_000, padded_tokens=10_000, timelines=timelines, step_started_at=100.5,
        workers_done_at=114.0, step_ended_at=116.0, settle_seconds=0.5, verify_seconds=1.0,
    )  # fmt: skip
    assert e.step_seconds == pytest.approx(15.5)
    assert e.before_engine_seconds == pytest.approx(2.5)  # 103.0 (second worker) - 100.5
    assert e.engine_seconds == pytest.approx(10.5)  # 103.0 to 113.5
    assert e.after_engine_seconds == pytest.approx(0.5)  # 113.5 to 114.0
    assert e.other_seconds == pytest.approx(15.5 - 2.5 - 10.5 - 0.5 - 0.5 - 1.0)
    assert e.padding_fraction == pytest.approx(0.1)
    assert e.engine_share == pytest.approx(10.5 / 15.5)
    assert e.engine_real_tokens_per_s == pytest.approx(9_000 / 10.5)
    record = e.as_mapping()
    assert record["seconds"]["engine"] == 10.5 and record["gpu_busy_fraction"] is None
    sentence = e.sentence()
    assert "engine pulled batches for 10.50 s (68%" in sentence
    assert "10.0% padding" in sentence and "before its first batch 2.50 s" in sentence


def test_a_step_with_no_batch_says_so() -> None:
    e = extraction_efficiency(
        real_tokens=0, padded_tokens=0, timelines=({"started_at": 10.0, "engine_ready": 1.0},),
        step_started_at=10.0, workers_done_at=11.5, step_ended_at=12.0, settle_seconds=0.0,
        verify_seconds=0.2,
    )  # fmt: skip
    assert e.engine_seconds == 0.0 and e.before_engine_seconds == pytest.approx(1.5)
    assert e.sentence().startswith("no batch ran in this step (2.00 s")


def test_the_gpu_busy_fraction_is_the_batches_time_over_the_gpus_span() -> None:
    timelines = ({"started_at": 0.0, "ready": 1.0, "last_ack": 11.0},)
    e = extraction_efficiency(
        real_tokens=1, padded_tokens=1, timelines=timelines, step_started_at=0.0,
        workers_done_at=11.0, step_ended_at=12.0, settle_seconds=0.0, verify_seconds=0.0,
        gpu_busy_seconds=7.5, gpu_span_seconds=9.6,
    )  # fmt: skip
    assert e.gpu_busy_fraction == pytest.approx(7.5 / 9.6)
    record = e.as_mapping()
    assert record["gpu_busy_fraction"] == round(7.5 / 9.6, 4)
    assert record["gpu_seconds"] == {"busy": 7.5, "span": 9.6}
    # GPU seconds are not step seconds: they overlap the engine's window, "other" is unchanged.
    assert e.other_seconds == pytest.approx(1.0)
    assert "the GPU busy 78.1% of its 9.60 s span" in e.sentence()
