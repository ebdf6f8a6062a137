"""Where a model's indexes live under the data root's index folder; light (no torch, no FAISS), so
that staleness checks and verify can find an index without loading either."""

from __future__ import annotations

import re
from pathlib import Path


def model_index_folder(index_folder: Path, model_key: str) -> Path:
    """The folder of `model_key`'s indexes: the key with anything but [A-Za-z0-9._-] made `_`."""
    return index_folder / re.sub(r"[^A-Za-z0-9._-]", "_", model_key)
