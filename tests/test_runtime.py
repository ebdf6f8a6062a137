"""The compiled runtime: it imports without a GPU, says why there is none, and builds from pip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import fabric_gpu
from fabric_gpu import _runtime, probe_gpu

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
