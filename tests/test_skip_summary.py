"""The test run's summary names the real parts it skipped and how to bring each in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import real_parts_skipped


def test_skip_reasons_map_to_the_part_and_its_command() -> None:
    found = real_parts_skipped(
        [
            "no chromium on PATH: apt-get install chromium",
            "no GPU: dlopen(libcuda.so.1) failed",
            "no GPU: dlopen(libcuda.so.1) failed",
            "something else entirely",
        ]
    )
    assert found["the UI test (real `dagster dev`, headless chromium)"][0] == 1
    assert found["the GPU tests"] == (2, "on a machine with an NVIDIA GPU: pytest -m gpu")
    assert len(found) == 2


def test_a_run_that_skips_the_ui_test_says_so_at_its_end(tmp_path: Path) -> None:
    """A pytest run of a test that skips as the UI test does without chromium."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from tests.conftest import pytest_unconfigure  # noqa: F401\n"
    )
    (tmp_path / "test_fake_ui.py").write_text(
        "import pytest\n\ndef test_ui():\n"
        "    pytest.skip('no chromium on PATH: apt-get install chromium')\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    # The very end of the run, after pytest's own summary line ("1 skipped in ...").
    assert "real parts this run did without" in lines[-2], done.stdout
    assert "headless chromium): 1 test(s) skipped" in lines[-1], done.stdout
    assert "1 skipped" in lines[-3], done.stdout
