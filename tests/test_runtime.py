"""The compiled runtime: it imports without a GPU, says why there is none, and builds from pip;
and the engine runner around it on the emulated GPU (the CPU engine through the graph stage)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fabric_gpu
from fabric_gpu import _runtime, probe_gpu
from fabric_gpu._runtime import testing
from fabric_gpu.runtime import BatchResult, EngineRunner

REPO = Path(__file__).resolve().parents[1]


def _driver_present() -> bool:
    return probe_gpu().available


def test_probe_never_raises_and_gives_a_reason_or_devices() -> None:
    status = probe_gpu()
    if status.available:
        assert status.devices and status.reason == ""
    else:
        assert status.reason, "an absent GPU must come with the reason"
        assert status.describe().startswith("no GPU: ")


@pytest.mark.skipif(_driver_present(), reason="a GPU driver is present on this machine")
def test_without_a_driver_the_reason_names_the_library() -> None:
    status = probe_gpu()
    assert not status.available
    assert "libcuda.so.1" in status.reason


@pytest.mark.gpu
@pytest.mark.skipif(not _driver_present(), reason="no GPU: " + probe_gpu().reason)
def test_on_a_gpu_the_runtime_sees_devices_that_support_the_doorbell() -> None:
    status = probe_gpu()
    assert status.devices
    for device in status.devices:
        assert device.compute_capability >= (8, 0)
        assert device.stream_mem_ops_64, "cuStreamWaitValue64 is needed for the doorbell"
        assert device.can_map_host_memory


def test_kernels_are_embedded_when_nvcc_was_available() -> None:
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("nvcc is not installed here, so the build carries no kernels")
    assert _runtime.kernel_image_size() > 1000
    assert _runtime.kernel_archs().split(",") == ["sm_80", "sm_90", "compute_90"]
    assert "sm_90" in fabric_gpu.runtime_summary()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_builds_the_extension_and_it_imports_without_a_gpu(tmp_path: Path) -> None:
    """Build a wheel with pip from a copy of the sources, without nvcc, into a fresh target."""
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", "build", "dagster_home", ".git", "*.so", "__pycache__"
        ),
    )
    wheels = tmp_path / "wheels"
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvcc on PATH: the no-kernel build path
    subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--quiet", "-w", str(wheels),
            "-C", "cmake.define.FABRIC_WITH_KERNELS=OFF", str(source),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
    )  # fmt: skip
    wheel = next(wheels.glob("inference_fabric-*.whl"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )  # fmt: skip
    probe = (
        "import fabric_gpu._runtime as r, sys; p = r.probe_driver();"
        "print(r.__file__); print(p.available); print(p.reason); print(r.kernel_image_size())"
    )
    venv_dir = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(venv_dir)  # a Python with nothing installed
    out = subprocess.run(
        [str(venv_dir / "bin" / "python"), "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
    ).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert out[3] == "0"  # built without kernels
    if not _driver_present():
        assert out[1] == "False" and "libcuda.so.1" in out[2]


# ---- the engine runner on the emulated GPU (the CPU engine, through the graph stage) -----------


def _token_table(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`rows` short items (3..8 tokens: every batch fits shape epoch 8)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 9, size=rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.integers(1000, 30000, int(offsets[-1])).astype(np.int32), offsets


@pytest.mark.heap_count
def test_the_graph_stage_allocates_nothing_per_batch_after_warm_up(cpu_engine: Any) -> None:
    """The product's path on the emulated GPU: the runner's graph stage queues the engine as a
    host function per batch. After warm-up the module's heap count does not move."""
    tokens, offsets = _token_table(64)
    results: list[int] = []
    with EngineRunner(cpu_engine, tokens, offsets, lambda r: results.append(r.batch_id)) as run:
        batch = 0

        def submit(batches: int) -> _runtime.RuntimeStats:
            nonlocal batch
            for _ in range(batches):
                start = batch * 4 % 64
                run.submit(batch, np.arange(start, start + 4), 8)
                batch += 1
            return run.finish()

        warm = submit(20)
        assert warm.heap_allocations > 0, "the counter sees the runtime's start"
        after = submit(300)
    assert results == list(range(320))
    assert after.heap_allocations == warm.heap_allocations, (
        f"{after.heap_allocations - warm.heap_allocations} heap allocations in 300 batches"
    )
    assert after.device_allocations == after.device_allocations_at_start


def test_a_batch_the_runtime_refuses_leaves_nothing_in_the_runner(cpu_engine: Any) -> None:
    tokens, offsets = _token_table(16)
    results: dict[int, BatchResult] = {}
    with EngineRunner(
        cpu_engine, tokens, offsets, lambda r: results.__setitem__(r.batch_id, r)
    ) as run:
        with pytest.raises(ValueError, match="no graph registered for shape epoch 7"):
            run.submit(1, np.arange(4), 7)  # shapes are multiples of the granularity, 8
        assert run._pending == {} and run._lengths == {}
        run.submit(2, np.arange(4), 8)
        run.finish()
        assert sorted(results) == [2] and run._pending == {} and run._lengths == {}


def test_a_gpu_error_inside_submit_leaves_nothing_in_the_runner(cpu_engine: Any) -> None:
    tokens, offsets = _token_table(16)
    with EngineRunner(cpu_engine, tokens, offsets, lambda r: None) as run:
        assert run._rt is not None
        testing.inject_gpu_fault(run._rt, "host_call", 2)
        run.submit(1, np.arange(4), 8)
        with pytest.raises(RuntimeError, match="host_call failed"):
            run.submit(2, np.arange(4, 8), 8)
        assert 2 not in run._pending and 2 not in run._lengths  # batch 1 may be drained or not
        with pytest.raises(RuntimeError, match="runtime failed: submit: batch 2"):
            run.finish()
