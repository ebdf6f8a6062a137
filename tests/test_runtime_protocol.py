"""The runtime's protocol on the emulated GPU: ring accounting, descriptors, backpressure,
the full filler -> doorbell -> stage -> payload ring -> drain path, shutdown, and the rules of
the hot loop. The same C++ runs on a GPU (tests/test_runtime_gpu.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_gpu import _runtime
from fabric_gpu._runtime import testing
from fabric_gpu.runtime import selftest
from tests.runtime_helpers import DESCRIPTOR_DTYPE, Slot

# ---- ring accounting ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    capacity_units=st.integers(1, 64),
    alignment=st.sampled_from([1, 8, 64, 256]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5000)), max_size=300),
)
def test_ring_never_splits_never_overlaps_and_accounts_every_byte(capacity_units, alignment, ops):  # type: ignore[no-untyped-def]
    capacity = capacity_units * 256
    ring = testing.ByteRing(capacity, alignment)
    live: list[tuple[int, int, int, int]] = []
    for reserve, length in ops:
        if reserve:
            rounded = -(-max(length, 1) // alignment) * alignment
            if rounded > capacity:
                with pytest.raises(ValueError, match="can never fit"):
                    ring.try_reserve(length)
                continue
            r = ring.try_reserve(length)
            if r is None:
                # Refused only when it truly does not fit, wrap padding included.
                pos = ring.head % capacity
                pad = capacity - pos if pos + rounded > capacity else 0
                assert ring.used + pad + rounded > capacity
                continue
            begin, _, offset, got = r
            assert got == length
            assert offset + length <= capacity, "a reservation never splits across the end"
            assert offset % alignment == 0
            assert begin == (live[-1][0] + live[-1][1] if live else ring.tail)
            for _, _, o, n in live:  # no overlap with live reservations, in ring positions
                assert o + n <= offset or offset + length <= o or n == 0 or length == 0
            live.append(r)
        elif live:
            ring.release(*live.pop(0))
        assert ring.used == sum(s for _, s, _, _ in live), "no ghost bytes"
        assert 0 <= ring.used <= capacity


def test_ring_release_out_of_order_is_refused() -> None:
    ring = testing.ByteRing(4096, 256)
    a = ring.try_reserve(100)
    b = ring.try_reserve(100)
    assert a is not None and b is not None
    with pytest.raises(RuntimeError, match="out of order"):
        ring.release(*b)


def test_wrap_padding_is_charged_to_the_batch_that_wrapped() -> None:
    ring = testing.ByteRing(1024, 256)
    first = ring.try_reserve(700)  # 768 bytes: 256 left at the end
    assert first is not None
    ring.release(*first)
    wrapped = ring.try_reserve(300)  # needs 512: skips the 256 at the end
    assert wrapped is not None
    begin, span, offset, _ = wrapped
    assert (begin, span, offset) == (768, 256 + 512, 0)
    ring.release(*wrapped)
    assert ring.used == 0


# ---- descriptors ------------------------------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({
    "batch_id": u64, "publish_seq": u64, "real_tokens": u64, "padded_tokens": u64,
    "output_limit": u64, "offsets_at": u32, "tokens_at": u32, "lane": u32, "batch_class": u32,
    "bucket_max": u32, "item_count": u32, "shape_epoch": u32, "payload_bytes": u32,
}))  # fmt: skip
def test_descriptor_round_trip(fields: dict[str, int]) -> None:
    packed = testing.pack_descriptor(fields)
    assert len(packed) == _runtime.DESCRIPTOR_BYTES == 128
    assert testing.unpack_descriptor(packed) == fields
    parsed = np.frombuffer(packed, dtype=DESCRIPTOR_DTYPE)[0]
    assert {k: int(parsed[k]) for k in fields} == fields


def test_slot_parse_reads_offsets_and_tokens() -> None:
    fields = dict.fromkeys(
        ("batch_id", "publish_seq", "padded_tokens", "output_limit", "lane", "batch_class",
         "shape_epoch", "payload_bytes"), 0,
    )  # fmt: skip
    fields.update(real_tokens=5, item_count=2, bucket_max=4, offsets_at=128, tokens_at=152)
    slot = np.zeros(_runtime.slot_bytes(2, 5), np.uint8)
    slot[:128] = np.frombuffer(testing.pack_descriptor(fields), np.uint8)
    slot[128:152] = np.array([0, 3, 5], np.int64).view(np.uint8)
    slot[152:172] = np.array([7, 8, 9, 10, 11], np.int32).view(np.uint8)
    batch = Slot.parse(slot).padded(pad_id=0)
    assert batch.input_ids.tolist() == [[7, 8, 9, 0], [10, 11, 0, 0]]


# ---- the whole protocol, end to end ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_million_batches_none_lost_reordered_or_torn() -> None:
    r = selftest(
        emulated=True, batches=1_000_000, seed=7, max_tokens=300, max_items=64,
        max_output_bytes=2048, max_hooks=4,
        runtime_config=_runtime.RuntimeConfig(ring_bytes=1 << 16, payload_ring_bytes=1 << 16, max_output_bytes=2048, max_in_flight=32),
    )  # fmt: skip
    assert r["verified"] == r["drained"] == r["submitted"] == 1_000_000, r
    assert r["checksum_mismatches"] == r["output_mismatches"] == r["order_errors"] == 0, r
    assert r["device_allocations"] == r["device_allocations_at_start"], (
        "no allocation after warm-up"
    )


def test_large_batches_through_a_small_ring_with_a_slow_drain() -> None:
    r = selftest(
        emulated=True, batches=3000, seed=3, max_tokens=4000, max_items=200,
        max_output_bytes=1 << 16, max_hooks=16, slow_drain_every=5, slow_drain_us=500,
        runtime_config=_runtime.RuntimeConfig(ring_bytes=1 << 16, payload_ring_bytes=1 << 18, max_output_bytes=1 << 16, publish_every=3),
    )  # fmt: skip
    assert r["verified"] == 3000 and r["first_error"] == "", r
    assert r["checksum_mismatches"] == r["output_mismatches"] == r["order_errors"] == 0
    assert r["payload_waits"] > 0, "the slow drain should have pushed back on the decode loop"
    assert r["publications"] < 3000 * 9, "publications are batched: not one per hook"


# ---- backpressure and shutdown, with a stage we can hold -----------------------------------


class HeldRuntime:
    """A runtime whose (emulated) GPU stage waits until released."""

    def __init__(self, ring_bytes: int = 4096, max_in_flight: int = 64) -> None:
        self.gate = threading.Event()
        self.results: list[int] = []
        tokens = np.arange(10_000, dtype=np.int32)
        offsets = np.arange(0, 10_001, 100, dtype=np.int64)  # rows of 100 tokens
        self.rt = _runtime.Runtime(
            emulated=True, device=0,
            config=_runtime.RuntimeConfig(ring_bytes=ring_bytes, payload_ring_bytes=1 << 16, max_output_bytes=1024, max_in_flight=max_in_flight, input_location="host", write_combined=False),
        )  # fmt: skip
        self.rt.set_token_table(tokens, offsets)
        testing.set_python_stage(self.rt, self.stage)
        self.rt.set_sink(lambda seq, batch_id, data, error: self.results.append(batch_id))
        self.rt.start()

    def stage(self, seq: int, batch_id: int, slot: np.ndarray, out: np.ndarray) -> None:
        self.gate.wait()
        out[:] = batch_id % 256

    def submit(self, batch_id: int) -> None:
        self.rt.submit(batch_id, np.array([batch_id % 100], np.int64), 104, 100, 64)


def test_a_full_ring_retries_ten_times_then_blocks_and_drops_nothing() -> None:
    held = HeldRuntime(ring_bytes=4096)  # 768-byte slots: 5 fit
    blocked_in = threading.Thread(target=lambda: [held.submit(i) for i in range(1, 21)])
    blocked_in.start()
    time.sleep(0.5)
    assert blocked_in.is_alive(), "the producer must block on a full ring, not drop"
    stats = held.rt.stats()
    assert stats.submitted < 20
    assert stats.ring_retries == 10 and stats.ring_blocked == 1
    held.gate.set()
    blocked_in.join(timeout=30)
    held.rt.finish()
    assert held.results == list(range(1, 21)), "every batch, once, in order"
    held.rt.shutdown()


def test_shutdown_wakes_a_producer_blocked_on_a_full_ring() -> None:
    held = HeldRuntime(ring_bytes=4096)
    outcome: list[BaseException | None] = []

    def produce() -> None:
        try:
            for i in range(1, 50):
                held.submit(i)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(0.3)
    assert producer.is_alive()
    started = time.monotonic()
    held.gate.set()  # let the stage return so the emulated stream can stop
    held.rt.shutdown()
    producer.join(timeout=10)
    assert not producer.is_alive() and time.monotonic() - started < 10
    assert outcome and isinstance(outcome[0], RuntimeError)
    assert "shut down" in str(outcome[0])


def test_synchronising_the_compute_stream_in_the_hot_loop_is_an_error() -> None:
    held = HeldRuntime()
    held.gate.set()
    held.submit(1)
    with pytest.raises(RuntimeError, match="inside the hot loop"):
        held.rt.synchronize_compute()
    held.rt.finish()
    held.rt.shutdown()


def test_write_combined_memory_is_refused_for_engines_reading_on_the_cpu() -> None:
    rt = _runtime.Runtime(
        emulated=True,
        device=0,
        config=_runtime.RuntimeConfig(input_location="host", write_combined=True),
    )
    testing.set_selftest_source(rt, 1)
    testing.set_selftest_stage(rt)
    rt.set_sink(lambda *a: None)
    with pytest.raises(ValueError, match="write-combined"):
        rt.start()


def test_engine_failures_come_back_with_their_batch() -> None:
    errors: list[tuple[int, str]] = []
    rt = _runtime.Runtime(
        emulated=True, device=0,
        config=_runtime.RuntimeConfig(input_location="host", write_combined=False, max_output_bytes=1024),
    )  # fmt: skip
    rt.set_token_table(np.arange(100, dtype=np.int32), np.array([0, 50, 100], np.int64))

    def stage(seq: int, batch_id: int, slot: np.ndarray, out: np.ndarray) -> None:
        if batch_id == 2:
            raise ValueError("engine exploded")

    testing.set_python_stage(rt, stage)
    rt.set_sink(lambda seq, batch_id, data, error: errors.append((batch_id, error)))
    rt.start()
    for b in (1, 2, 3):
        rt.submit(b, np.array([0, 1], np.int64), 56, 100, 64)
    rt.finish()
    rt.shutdown()
    assert [b for b, _ in errors] == [1, 2, 3]
    assert errors[0][1] == "" and errors[2][1] == ""
    assert "engine exploded" in errors[1][1]


def test_rows_outside_the_task_set_fail_the_runtime_with_the_batch_named() -> None:
    rt = _runtime.Runtime(
        emulated=True,
        device=0,
        config=_runtime.RuntimeConfig(input_location="host", write_combined=False),
    )
    rt.set_token_table(np.arange(10, dtype=np.int32), np.array([0, 5, 10], np.int64))
    testing.set_python_stage(rt, lambda *a: None)
    rt.set_sink(lambda *a: None)
    rt.start()
    rt.submit(41, np.array([5], np.int64), 8, 5, 64)
    with pytest.raises(RuntimeError, match="batch 41: row 5 is outside the task set"):
        rt.finish()
    rt.shutdown()


def test_sizes_resolved_on_the_gpu_are_drained_exactly() -> None:
    r = selftest(
        emulated=True, batches=5000, seed=9, max_tokens=500, max_output_bytes=1 << 14,
        gpu_sized=True, runtime_config=_runtime.RuntimeConfig(ring_bytes=1 << 18, payload_ring_bytes=1 << 18, max_output_bytes=1 << 14),
    )  # fmt: skip
    assert r["verified"] == 5000 and r["first_error"] == "", r
    assert r["output_mismatches"] == r["checksum_mismatches"] == r["order_errors"] == 0
    assert r["bytes_out"] < 5000 * (1 << 14)  # sized batches copied less than they reserved


def test_a_size_beyond_the_reservation_is_refused_naming_the_batch() -> None:
    with pytest.raises(
        RuntimeError, match=r"batch 143: the stage reported \d+ output bytes, more than"
    ):
        selftest(emulated=True, batches=100, gpu_sized=True, oversize_batch=20 * 7 + 3)


def test_a_misspelt_runtime_config_key_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="unknown runtime config key 'max_inflight'"):
        _runtime.Runtime(emulated=True, device=0, config=_runtime.RuntimeConfig(max_inflight=4))
    config = _runtime.RuntimeConfig(max_in_flight=4)
    with pytest.raises(AttributeError, match="max_inflight"):
        config.max_inflight = 8  # type: ignore[attr-defined]
    assert config.max_in_flight == 4


def test_a_batch_the_stage_refuses_leaves_nothing_for_finish_to_wait_for() -> None:
    """The graph stage refuses a batch that does not fit its shape; submit() checks it before it
    reserves a sequence number, so the runtime goes on and finish() returns."""
    items, seq_len, hidden = 4, 8, 4
    ids = np.zeros(items * seq_len, np.int64)
    mask = np.zeros(items * seq_len, np.int64)
    pooled = np.zeros((items, hidden), np.float32)
    drained: list[int] = []
    rt = _runtime.Runtime(
        emulated=True, device=0,
        config=_runtime.RuntimeConfig(input_location="host", write_combined=False, max_output_bytes=1024),
    )  # fmt: skip
    rt.set_token_table(np.arange(40, dtype=np.int32), np.arange(0, 41, 4, dtype=np.int64))
    rt.set_graph_stage()
    inputs = _runtime.PaddedInputs(input_ids=ids.ctypes.data, attention_mask=mask.ctypes.data)
    shape = _runtime.ShapeGraph(
        epoch=seq_len, items=items, seq_len=seq_len, inputs=inputs, pooled=pooled.ctypes.data,
        pooled_row_bytes=hidden * 4, hooks=[], hook_row_bytes=0,
    )  # fmt: skip
    rt.add_shape(shape, host_fn=lambda seq, n: None)
    rt.set_sink(lambda seq, batch_id, data, error: drained.append(batch_id))
    rt.start()
    rows = np.array([0, 1], np.int64)
    with pytest.raises(ValueError, match="batch 1: output_bytes does not match"):
        rt.submit(1, rows, 4, 8, 999, seq_len, 0, 0, 0)
    with pytest.raises(ValueError, match="batch 2 does not fit shape epoch 8"):
        rt.submit(2, np.arange(5, dtype=np.int64), 4, 20, 5 * hidden * 4, seq_len, 0, 0, 0)
    rt.submit(3, rows, 4, 8, 2 * hidden * 4, seq_len, 0, 0, 0)
    finished = threading.Thread(target=rt.finish, daemon=True)
    finished.start()
    finished.join(timeout=30)
    assert not finished.is_alive(), "finish() waited for a batch that was refused"
    rt.shutdown()
    assert drained == [3]


@pytest.mark.heap_count
def test_the_hot_loop_allocates_nothing_per_batch_after_warm_up() -> None:
    result = selftest(
        emulated=True, batches=3000, seed=9, max_tokens=300, max_items=32, max_hooks=4,
        max_output_bytes=1 << 12,
    )  # fmt: skip
    assert result["verified"] == 3000 and not result["first_error"]
    assert result["batches"] - result["warmup_batches"] >= 1000
    # The counter sees the runtime's own allocations (rings, queues, threads) ...
    assert result["heap_allocations_warming_up"] > 0
    # ... and none across the thousands of batches after the warm-up.
    assert result["heap_allocations_after_warmup"] == 0


def test_a_shape_names_its_input_buffers_by_layout() -> None:
    packed = _runtime.PackedInputs(input_ids=16, positions=32, seq_ids=48, cu_seqlens=64)
    shape = _runtime.ShapeGraph(
        epoch=256, items=8, seq_len=256, inputs=packed, pooled=80, pooled_row_bytes=1536,
        hooks=[96, 112], hook_row_bytes=768, pad_id=0, graph_exec=7,
    )  # fmt: skip
    assert isinstance(shape.inputs, _runtime.PackedInputs)
    assert (shape.inputs.positions, shape.inputs.cu_seqlens) == (32, 64)
    assert shape.hooks == [96, 112] and shape.graph_exec == 7
    padded = _runtime.ShapeGraph(
        epoch=8, items=4, seq_len=8, inputs=_runtime.PaddedInputs(input_ids=1, attention_mask=2),
        pooled=3, pooled_row_bytes=16, hooks=[], hook_row_bytes=0,
    )  # fmt: skip
    assert isinstance(padded.inputs, _runtime.PaddedInputs) and padded.inputs.attention_mask == 2
