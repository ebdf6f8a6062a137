"""Import the fixed yardstick module (../shared/bench/reference_extract.py) by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "bench" / "reference_extract.py"


def load_reference(path: str | Path = DEFAULT) -> Any:
    spec = importlib.util.spec_from_file_location("reference_extract", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"cannot import the yardstick from {path} (pass --reference)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
