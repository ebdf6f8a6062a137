"""The runtime on a real GPU: the same protocol as tests/test_runtime_protocol.py, on the
device, plus what only a device can show (the lazy-loading deadlock, mapped memory, D2H).

Every test here is marked `gpu` and skips, with the reason, where no GPU is present.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fabric_gpu import _runtime, probe_gpu
from fabric_gpu._runtime import testing

STATUS = probe_gpu()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not STATUS.available, reason="no GPU: " + STATUS.reason),
]


@pytest.mark.timeout(900)
def test_payload_integrity_over_100k_batches_of_random_size() -> None:
    r = _runtime.selftest(
        emulated=False, batches=100_000, seed=11, max_tokens=8192, max_items=256,
        max_output_bytes=1 << 16, max_hooks=8,
        runtime_config=_runtime.RuntimeConfig(ring_bytes=8 << 20, payload_ring_bytes=16 << 20, max_output_bytes=1 << 16, max_in_flight=64),
    )  # fmt: skip
    assert r["verified"] == r["drained"] == 100_000, r
    assert r["checksum_mismatches"] == 0, r["first_error"]
    assert r["output_mismatches"] == 0 and r["order_errors"] == 0, r["first_error"]
    assert r["device_allocations"] == r["device_allocations_at_start"], (
        "no GPU memory allocated after warm-up"
    )
    assert r["heap_allocations_warming_up"] > 0, "the heap counter sees the runtime"
    assert r["heap_allocations_after_warmup"] == 0, "no heap allocation per batch after warm-up"


@pytest.mark.timeout(900)
def test_payload_ring_with_random_hook_sizes_and_a_slow_drain() -> None:
    r = _runtime.selftest(
        emulated=False, batches=20_000, seed=5, max_tokens=2048, max_items=64,
        max_output_bytes=1 << 20, max_hooks=24, slow_drain_every=3, slow_drain_us=300,
        runtime_config=_runtime.RuntimeConfig(ring_bytes=1 << 20, payload_ring_bytes=4 << 20, max_output_bytes=1 << 20, publish_every=4),
    )  # fmt: skip
    assert r["verified"] == 20_000, r
    assert r["checksum_mismatches"] == r["output_mismatches"] == r["order_errors"] == 0, r
    assert r["payload_waits"] > 0, "the slow drain must have pushed back"
    assert r["device_allocations"] == r["device_allocations_at_start"]


def _self_test_in_subprocess(
    eager: bool, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    env = {**os.environ, "CUDA_MODULE_LOADING": "LAZY"}
    code = f"from fabric_gpu import _runtime; print(_runtime.cuda_self_test(0, {eager}))"
    try:
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None  # hung


@pytest.mark.timeout(300)
def test_the_lazy_loading_deadlock_cannot_happen() -> None:
    """With lazy module loading forced on, a kernel launched for the first time behind a pending
    doorbell wait deadlocks (docs/runtime.md explains why). The runtime's warm-up launches every
    kernel first, so its self test (a kernel queued behind a wait, then the doorbell) completes."""
    done = _self_test_in_subprocess(eager=True, timeout=120)
    assert done is not None, "the eager path hung"
    assert done.returncode == 0, done.stderr
    assert "H200" in done.stdout or "cuda:0" in done.stdout


@pytest.mark.timeout(300)
def test_without_the_warm_up_the_same_self_test_deadlocks() -> None:
    """The counterfactual: skip the warm-up and the first launch sits behind the wait. The
    self test then times out (its own 10 s limit) or the process hangs: either is the deadlock."""
    outcome = _self_test_in_subprocess(eager=False, timeout=60)
    assert outcome is None or outcome.returncode != 0, (
        "without the warm-up the kernel queued behind the doorbell still ran: the deadlock did "
        "not reproduce on this driver"
    )
    assert outcome is None or "lazy-loading deadlock" in outcome.stderr, outcome.stderr


def test_the_compute_stream_cannot_be_synchronised_in_the_hot_loop() -> None:
    rt = _runtime.Runtime(
        emulated=False, device=0, config=_runtime.RuntimeConfig(max_output_bytes=4096)
    )
    testing.set_selftest_source(rt, 3)
    testing.set_selftest_stage(rt)
    rt.set_sink(lambda *a: None)
    rt.start()
    with pytest.raises(RuntimeError, match="inside the hot loop"):
        rt.synchronize_compute()
    rt.shutdown()


def test_drain_copies_of_large_payloads_run_near_pcie_speed() -> None:
    """Correctness here; the figure itself is bench/handoff.py's."""
    r = _runtime.selftest(
        emulated=False, batches=64, seed=2, max_tokens=64, max_items=8,
        max_output_bytes=32 << 20, max_hooks=4, verify_every=16,
        runtime_config=_runtime.RuntimeConfig(payload_ring_bytes=256 << 20, max_output_bytes=32 << 20, staging_buffers=3),
    )  # fmt: skip
    assert r["verified"] == 64 and r["output_mismatches"] == r["checksum_mismatches"] == 0, r


def test_sizes_resolved_on_the_gpu_respect_the_reservation() -> None:
    r = _runtime.selftest(
        emulated=False, batches=20_000, seed=4, max_tokens=1024, max_output_bytes=1 << 16,
        gpu_sized=True, runtime_config=_runtime.RuntimeConfig(max_output_bytes=1 << 16),
    )  # fmt: skip
    assert r["verified"] == 20_000 and r["first_error"] == "", r
    with pytest.raises(RuntimeError, match="more than the"):
        _runtime.selftest(emulated=False, batches=100, gpu_sized=True, oversize_batch=20 * 7 + 3)
