"""A driver error in the middle of submit(): the runtime fails, so finish() raises instead of
waiting for a batch that was half enqueued. The error is injected on the emulated GPU
(fabric_gpu._runtime.testing.inject_gpu_fault), in each call of submit's commit phase."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from fabric_gpu import _runtime
from fabric_gpu._runtime import testing

ITEMS, SEQ_LEN, HIDDEN = 4, 8, 4


def _graph_runtime() -> tuple[_runtime.Runtime, list[int], list[np.ndarray]]:
    """A started runtime with the product's graph stage on the emulated GPU (one shape), timing
    marks on so that record_mark is among submit's calls. Returns it, the drained batch ids and
    the buffers it points into (kept alive by the caller)."""
    buffers = [
        np.zeros(ITEMS * SEQ_LEN, np.int64),
        np.zeros(ITEMS * SEQ_LEN, np.int64),
        np.zeros((ITEMS, HIDDEN), np.float32),
    ]
    ids, mask, pooled = buffers
    drained: list[int] = []
    rt = _runtime.Runtime(
        emulated=True, device=0,
        config=_runtime.RuntimeConfig(input_location="host", write_combined=False, max_output_bytes=1024, max_in_flight=8, measure_gpu_time=True),
    )  # fmt: skip
    rt.set_token_table(np.arange(40, dtype=np.int32), np.arange(0, 41, 4, dtype=np.int64))
    rt.set_graph_stage()
    shape = _runtime.ShapeGraph(
        epoch=SEQ_LEN, items=ITEMS, seq_len=SEQ_LEN,
        inputs=_runtime.PaddedInputs(input_ids=ids.ctypes.data, attention_mask=mask.ctypes.data),
        pooled=pooled.ctypes.data, pooled_row_bytes=HIDDEN * 4, hooks=[], hook_row_bytes=0,
    )  # fmt: skip
    rt.add_shape(shape, host_fn=lambda seq, n: None)
    rt.set_sink(lambda seq, batch_id, data, error: drained.append(batch_id))
    rt.start()
    return rt, drained, buffers


def _submit(rt: _runtime.Runtime, batch_id: int) -> None:
    rows = np.array([batch_id % 10, (batch_id + 1) % 10], np.int64)
    rt.submit(batch_id, rows, 4, 8, 2 * HIDDEN * 4, SEQ_LEN, 0, 0, 0)


def _finish_within(rt: _runtime.Runtime, seconds: float) -> BaseException | None:
    """finish() on another thread: what it raised, or an assertion failure if it still waits."""
    outcome: list[BaseException | None] = []

    def finish() -> None:
        try:
            rt.finish()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=finish, daemon=True)
    waiter.start()
    waiter.join(timeout=seconds)
    assert not waiter.is_alive(), "finish() waits forever for the batch whose submit failed"
    return outcome[0]


# Each call of submit's commit phase, failing in a batch after the first few.
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("call", "nth"),
    [("wait_geq", 3), ("record_mark", 5), ("launch", 6), ("host_call", 3), ("write_value", 7)],
)
def test_a_gpu_error_inside_submit_fails_the_runtime_and_finish_raises(call: str, nth: int) -> None:
    rt, drained, _buffers = _graph_runtime()
    try:
        testing.inject_gpu_fault(rt, call, nth)
        failed_at = None
        for batch_id in range(1, 21):
            try:
                _submit(rt, batch_id)
            except RuntimeError as exc:
                failed_at = batch_id
                assert f"emulated GPU: {call} failed" in str(exc), "the error names the call"
                break
        assert failed_at is not None and failed_at > 1, f"the fault in {call} never fired"
        error = _finish_within(rt, 20)
        assert isinstance(error, RuntimeError)
        assert f"runtime failed: submit: batch {failed_at}: emulated GPU: {call} failed" in str(
            error
        )
        assert failed_at not in drained
        with pytest.raises(RuntimeError, match=f"submit: batch {failed_at}"):
            _submit(rt, 99)  # the runtime stays failed
    finally:
        rt.shutdown()


def test_a_fault_names_the_calls_it_can_inject() -> None:
    rt, _, _buffers = _graph_runtime()
    try:
        with pytest.raises(
            ValueError, match="no emulated GPU call 'launch_kernel'; the calls are: wait_geq"
        ):
            testing.inject_gpu_fault(rt, "launch_kernel", 1)
        _submit(rt, 1)
        assert _finish_within(rt, 20) is None
    finally:
        rt.shutdown()
